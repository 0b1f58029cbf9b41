#include "ops/tf/recycled_outputs.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/allocator.h"
#include "ops/core/common.h"
#include "ops/core/output_pool.h"

namespace tensorflow {
namespace prophet_adapter {
namespace {

class RecycledOutputAllocator : public Allocator {
 public:
  std::string Name() override { return "prophet_recycled_output"; }
  void* AllocateRaw(size_t /*alignment*/, size_t num_bytes) override {
    return ::prophet::GlobalOutputPool().Take(num_bytes, ::prophet::NowNs());
  }
  void DeallocateRaw(void* ptr) override { ::prophet::GlobalOutputPool().Give(ptr, ::prophet::NowNs()); }
  AllocatorMemoryType GetMemoryType() const override { return AllocatorMemoryType::kHostPageable; }
};

// The allocator over the process-wide pool (never destroyed: it outlives every tensor it made).
Allocator* RecycledOutputs() {
  static Allocator* allocator = new RecycledOutputAllocator();
  return allocator;
}

}  // namespace

absl::Status AllocateReceiveBuffer(OpKernelContext* ctx, DataType dtype, const TensorShape& shape, Tensor* out) {
  const int64_t bytes = shape.num_elements() * DataTypeSize(dtype);
  if (bytes < static_cast<int64_t>(::prophet::kRecycleMinBytes)) return ctx->allocate_temp(dtype, shape, out);
  Tensor recycled(RecycledOutputs(), dtype, shape);
  if (!recycled.IsInitialized())
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes for ",
                                                     ctx->op_kernel().type_string(), " '", ctx->op_kernel().name(), "'"));
  *out = std::move(recycled);
  return absl::OkStatus();
}

}  // namespace prophet_adapter
}  // namespace tensorflow
