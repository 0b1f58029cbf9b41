// Element-wise summation kernels used by the owner of a partition.
#ifndef PROPHET_OPS_CORE_REDUCE_H_
#define PROPHET_OPS_CORE_REDUCE_H_

#include <cstddef>
#include <cstdint>

#include "ops/core/common.h"

namespace prophet {

// dst[i] += src[i] for `count` elements of `dtype`. float16 and bfloat16 are added in float32 and
// rounded to nearest-even, as TensorFlow does. Returns false for a dtype that cannot be summed.
bool SumInto(DataType dtype, void* dst, const void* src, size_t count);
// dst[i] = a[i] + b[i] (dst may alias a or b): the first contribution to a partition, in one pass.
bool SumTo(DataType dtype, void* dst, const void* a, const void* b, size_t count);
// dst[i] /= divisor (used for averaging; integer types use truncating division as tf.math does).
bool DivideBy(DataType dtype, void* dst, size_t count, int divisor);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_REDUCE_H_
