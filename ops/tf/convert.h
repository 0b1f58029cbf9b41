// Conversions between TensorFlow's types and the core's, shared by the kernels.
#ifndef PROPHET_OPS_TF_CONVERT_H_
#define PROPHET_OPS_TF_CONVERT_H_

#include <string>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/common.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"

namespace tensorflow {
namespace prophet_adapter {

// The core's status codes are TensorFlow's canonical codes, so they map one to one.
inline absl::Status ToTfStatus(const ::prophet::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.code())), s.message());
}

inline ::prophet::Status FromTfStatus(const absl::Status& s) {
  if (s.ok()) return ::prophet::Status::OK();
  return ::prophet::Status(static_cast<::prophet::Code>(static_cast<int>(s.code())), std::string(s.message()));
}

inline bool ToCoreType(DataType dtype, ::prophet::DataType* out) {
  switch (dtype) {
    case DT_HALF: *out = ::prophet::DataType::kFloat16; return true;
    case DT_BFLOAT16: *out = ::prophet::DataType::kBFloat16; return true;
    case DT_FLOAT: *out = ::prophet::DataType::kFloat32; return true;
    case DT_DOUBLE: *out = ::prophet::DataType::kFloat64; return true;
    case DT_INT32: *out = ::prophet::DataType::kInt32; return true;
    case DT_INT64: *out = ::prophet::DataType::kInt64; return true;
    case DT_UINT8: *out = ::prophet::DataType::kUInt8; return true;
    case DT_BOOL: *out = ::prophet::DataType::kBool; return true;
    default: return false;
  }
}

// The attribute every op that may compress declares, with the same values everywhere.
constexpr char kCompressionAttr[] = "compression: {'none', 'fp16', 'bf16'} = 'none'";

// Reads the `compression` attribute of a kernel's node.
inline absl::Status GetCompression(OpKernelConstruction* ctx, ::prophet::Encoding* out) {
  std::string name;
  TF_RETURN_IF_ERROR(ctx->GetAttr("compression", &name));
  if (!::prophet::ParseEncoding(name, out))
    return absl::InvalidArgumentError("compression must be 'none', 'fp16' or 'bf16', got '" + name + "'");
  return absl::OkStatus();
}

inline std::vector<int64_t> ShapeOf(const Tensor& t) {
  std::vector<int64_t> dims;
  for (int i = 0; i < t.dims(); ++i) dims.push_back(t.dim_size(i));
  return dims;
}

}  // namespace prophet_adapter
}  // namespace tensorflow

#endif  // PROPHET_OPS_TF_CONVERT_H_
