#include "ops/core/reduce.h"

#include <cstring>
#include <utility>

#include "ops/core/codec.h"

namespace prophet {

namespace {

// Plain loops over restrict pointers: gcc -O2/-O3 vectorises them.
template <typename T>
void SumLoop(T* __restrict dst, const T* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

void SumHalf(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  _Float16* d = reinterpret_cast<_Float16*>(dst);
  const _Float16* s = reinterpret_cast<const _Float16*>(src);
  for (size_t i = 0; i < n; ++i) d[i] = static_cast<_Float16>(static_cast<float>(d[i]) + static_cast<float>(s[i]));
}

void SumBFloat16(uint16_t* __restrict dst, const uint16_t* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = FloatToBFloat16(BFloat16ToFloat(dst[i]) + BFloat16ToFloat(src[i]));
}

template <typename T>
void SumToLoop(T* dst, const T* a, const T* b, size_t n) {
  // Distinct restrict pointers let the compiler vectorise without run-time alias checks.
  if (dst == a) return SumLoop(dst, b, n);
  T* __restrict d = dst;
  const T* __restrict x = a;
  const T* __restrict y = b;
  for (size_t i = 0; i < n; ++i) d[i] = x[i] + y[i];
}

template <typename T>
void DivLoop(T* dst, size_t n, T divisor) {
  for (size_t i = 0; i < n; ++i) dst[i] /= divisor;
}

}  // namespace

bool SumInto(DataType dtype, void* dst, const void* src, size_t count) {
  switch (dtype) {
    case DataType::kFloat32:
      SumLoop(static_cast<float*>(dst), static_cast<const float*>(src), count);
      return true;
    case DataType::kFloat64:
      SumLoop(static_cast<double*>(dst), static_cast<const double*>(src), count);
      return true;
    case DataType::kInt32:
      SumLoop(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), count);
      return true;
    case DataType::kInt64:
      SumLoop(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), count);
      return true;
    case DataType::kFloat16:
      SumHalf(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
      return true;
    case DataType::kBFloat16:
      SumBFloat16(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), count);
      return true;
    default:
      return false;
  }
}

bool SumTo(DataType dtype, void* dst, const void* a, const void* b, size_t count) {
  if (dst == b) std::swap(a, b);  // addition commutes, also in floating point
  switch (dtype) {
    case DataType::kFloat32:
      SumToLoop(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b), count);
      return true;
    case DataType::kFloat64:
      SumToLoop(static_cast<double*>(dst), static_cast<const double*>(a), static_cast<const double*>(b), count);
      return true;
    case DataType::kInt32:
      SumToLoop(static_cast<int32_t*>(dst), static_cast<const int32_t*>(a), static_cast<const int32_t*>(b), count);
      return true;
    case DataType::kInt64:
      SumToLoop(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a), static_cast<const int64_t*>(b), count);
      return true;
    default:
      // Half types: copy, then add in float (they are not on the fast path).
      if (!IsSummable(dtype)) return false;
      if (dst != a) std::memcpy(dst, a, count * DataTypeSize(dtype));
      return SumInto(dtype, dst, b, count);
  }
}

bool DivideBy(DataType dtype, void* dst, size_t count, int divisor) {
  switch (dtype) {
    case DataType::kFloat32:
      DivLoop(static_cast<float*>(dst), count, static_cast<float>(divisor));
      return true;
    case DataType::kFloat64:
      DivLoop(static_cast<double*>(dst), count, static_cast<double>(divisor));
      return true;
    case DataType::kInt32:
      DivLoop(static_cast<int32_t*>(dst), count, static_cast<int32_t>(divisor));
      return true;
    case DataType::kInt64:
      DivLoop(static_cast<int64_t*>(dst), count, static_cast<int64_t>(divisor));
      return true;
    case DataType::kFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToHalf(HalfToFloat(d[i]) / divisor);
      return true;
    }
    case DataType::kBFloat16: {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToBFloat16(BFloat16ToFloat(d[i]) / divisor);
      return true;
    }
    default:
      return false;
  }
}

}  // namespace prophet
