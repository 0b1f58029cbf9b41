// Large tensors the engine receives into, from the recycled pool (ops/core/output_pool.h): a
// fresh one faults on every page while the engine's I/O thread receives into it. Shared by the
// collective kernels' outputs and the crossing updates' summed gradients.
#ifndef PROPHET_OPS_TF_RECYCLED_OUTPUTS_H_
#define PROPHET_OPS_TF_RECYCLED_OUTPUTS_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"

namespace tensorflow {
namespace prophet_adapter {

// A tensor of `dtype` and `shape` for the engine to write whole: from the pool from
// kRecycleMinBytes on, else TensorFlow's temporary allocation.
absl::Status AllocateReceiveBuffer(OpKernelContext* ctx, DataType dtype, const TensorShape& shape, Tensor* out);

}  // namespace prophet_adapter
}  // namespace tensorflow

#endif  // PROPHET_OPS_TF_RECYCLED_OUTPUTS_H_
