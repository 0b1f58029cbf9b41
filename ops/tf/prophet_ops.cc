// TensorFlow adapter: op definitions and asynchronous CPU kernels that hand tensors to the
// framework-free engine (ops/core) and finish when it calls back.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ops/core/engine.h"
#include "ops/core/output_pool.h"
#include "ops/core/step_meter.h"
#include "ops/tf/convert.h"
#include "ops/tf/recycled_outputs.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using ::prophet::Engine;
using ::prophet::OpKind;
using ::prophet::OpRequest;

using prophet_adapter::GetCompression;
using prophet_adapter::kCompressionAttr;
using prophet_adapter::ShapeOf;
using prophet_adapter::ToCoreType;
using prophet_adapter::ToTfStatus;

constexpr char kNotInitialised[] =
    "the prophet_tf runtime is not initialised in this process: create a prophet_tf.ProphetStrategy() or "
    "call prophet_tf.runtime.init() before running prophet_tf ops";

// Output 0 with the input's shape: the input's own buffer when nothing else holds it (in place),
// else, from kRecycleMinBytes on, a recycled buffer, else TensorFlow's allocator.
absl::Status ForwardOrRecycleOutput(OpKernelContext* ctx, Tensor** output) {
  const Tensor& input = ctx->input(0);
  if (ctx->forward_input_to_output_with_shape(0, 0, input.shape(), output)) return absl::OkStatus();
  if (input.TotalBytes() < ::prophet::kRecycleMinBytes) return ctx->allocate_output(0, input.shape(), output);
  Tensor recycled;
  TF_RETURN_IF_ERROR(prophet_adapter::AllocateReceiveBuffer(ctx, input.dtype(), input.shape(), &recycled));
  ctx->set_output(0, std::move(recycled));
  *output = ctx->mutable_output(0);
  return absl::OkStatus();
}

// Common part of the three kernels: the engine, the tensor name and the dtype.
class ProphetOpBase : public AsyncOpKernel {
 public:
  explicit ProphetOpBase(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    OP_REQUIRES(ctx, !tensor_name_.empty(),
                absl::InvalidArgumentError(absl::StrCat(type_string(), ": tensor_name must not be empty; give every "
                                                       "communicated tensor a name that is the same on all workers")));
  }

 protected:
  // Fills the fields every request shares; returns false (status set) when the input cannot go.
  bool Prepare(OpKernelContext* ctx, OpKind kind, Engine** engine, OpRequest* req) {
    *engine = ::prophet::GlobalEngine();
    if (*engine == nullptr) {
      ctx->SetStatus(absl::FailedPreconditionError(kNotInitialised));
      return false;
    }
    const Tensor& input = ctx->input(0);
    req->kind = kind;
    req->name = tensor_name_;
    if (!ToCoreType(input.dtype(), &req->dtype)) {
      ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat(type_string(), " '", tensor_name_, "': unsupported dtype ",
                                             DataTypeString(input.dtype()))));
      return false;
    }
    req->shape = ShapeOf(input);
    req->input = input.tensor_data().data();
    req->bytes = input.TotalBytes();
    return true;
  }

  // Submits `req`, whose completion the step waits for: the step report (step_meter.h) learns when
  // it was handed over and how long it took, before `req.done` lets the kernel finish.
  static void SubmitAwaited(Engine* engine, OpRequest req) {
    ::prophet::StepMeter& meter = ::prophet::GlobalStepMeter();
    if (!meter.step_open()) return engine->Submit(std::move(req));  // not in a measured step
    const int64_t submitted = ::prophet::NowNs();
    meter.OnHandOff(req.priority, submitted);
    auto done = std::move(req.done);
    req.done = [&meter, submitted, done = std::move(done)](const ::prophet::Status& s,
                                                           const ::prophet::GatherResult* g) {
      meter.OnAwaitedDone(submitted, ::prophet::NowNs());
      done(s, g);
    };
    engine->Submit(std::move(req));
  }

  std::string tensor_name_;
};

class PushPullOp : public ProphetOpBase {
 public:
  explicit PushPullOp(OpKernelConstruction* ctx) : ProphetOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("priority", &priority_));
    std::string reduce_op;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduce_op", &reduce_op));
    average_ = reduce_op == "mean";
    OP_REQUIRES_OK(ctx, GetCompression(ctx, &compression_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Engine* engine = nullptr;
    OpRequest req;
    if (!Prepare(ctx, OpKind::kPushPull, &engine, &req)) return done();
    Tensor* output = nullptr;
    // Reusing the input buffer saves a copy; the engine sends a partition before its sum lands.
    OP_REQUIRES_OK_ASYNC(ctx, ForwardOrRecycleOutput(ctx, &output), done);
    req.output = const_cast<char*>(output->tensor_data().data());
    req.priority = priority_;
    req.average = average_;
    req.compression = compression_;
    req.done = [ctx, done](const ::prophet::Status& s, const ::prophet::GatherResult*) {
      if (!s.ok()) ctx->SetStatus(ToTfStatus(s));
      done();
    };
    SubmitAwaited(engine, std::move(req));
  }

 private:
  int64_t priority_ = 0;
  bool average_ = false;
  ::prophet::Encoding compression_ = ::prophet::Encoding::kNone;
};

class BroadcastOp : public ProphetOpBase {
 public:
  explicit BroadcastOp(OpKernelConstruction* ctx) : ProphetOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root_rank", &root_rank_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    Engine* engine = nullptr;
    OpRequest req;
    if (!Prepare(ctx, OpKind::kBroadcast, &engine, &req)) return done();
    Tensor* output = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ForwardOrRecycleOutput(ctx, &output), done);
    req.output = const_cast<char*>(output->tensor_data().data());
    req.root_rank = static_cast<int>(root_rank_);
    req.done = [ctx, done](const ::prophet::Status& s, const ::prophet::GatherResult*) {
      if (!s.ok()) ctx->SetStatus(ToTfStatus(s));
      done();
    };
    SubmitAwaited(engine, std::move(req));
  }

 private:
  int64_t root_rank_ = 0;
};

class AllgatherOp : public ProphetOpBase {
 public:
  explicit AllgatherOp(OpKernelConstruction* ctx) : ProphetOpBase(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(ctx, GetCompression(ctx, &compression_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, ctx->input(0).dims() >= 1,
                      absl::InvalidArgumentError(absl::StrCat("ProphetAllgather '", tensor_name_,
                                              "' needs a tensor of rank >= 1 (it concatenates along dimension 0); "
                                              "got a scalar")),
                      done);
    Engine* engine = nullptr;
    OpRequest req;
    if (!Prepare(ctx, OpKind::kAllgather, &engine, &req)) return done();
    req.priority = priority_;
    req.compression = compression_;
    req.done = [ctx, done](const ::prophet::Status& s, const ::prophet::GatherResult* g) {
      if (!s.ok()) {
        ctx->SetStatus(ToTfStatus(s));
        return done();
      }
      TensorShape shape = ctx->input(0).shape();
      int64_t rows = 0;
      for (const auto& dims : g->shapes) rows += dims[0];
      shape.set_dim(0, rows);
      Tensor* output = nullptr;
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, shape, &output), done);
      char* dst = const_cast<char*>(output->tensor_data().data());
      for (size_t r = 0; r < g->data.size(); ++r) {
        g->CopyOut(r, dst);
        dst += g->bytes[r];
      }
      done();
    };
    SubmitAwaited(engine, std::move(req));
  }

 private:
  int64_t priority_ = 0;
  ::prophet::Encoding compression_ = ::prophet::Encoding::kNone;
};

}  // namespace

REGISTER_OP("ProphetPushPull")
    .Input("tensor: T")
    .Output("summed: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("tensor_name: string")
    .Attr("priority: int = 0")
    .Attr("reduce_op: {'sum', 'mean'} = 'sum'")
    .Attr(kCompressionAttr)
    // Stateful: never constant-folded, merged or pruned. Automatic control dependencies do not
    // chain stateful ops without resource inputs, so hundreds can be in flight at once.
    .SetIsStateful()
    // A distributed-communication op: inside a graph (tf.function, model.fit) TensorFlow keeps an
    // UnavailableError from it as it is; from any other op it turns it into an InternalError.
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Sums (or averages) `tensor` over all workers. Matched across workers by `tensor_name` and the
number of times this worker used that name before. Larger `priority` is sent first. With
`compression` 'fp16' or 'bf16', float32 values travel in 16 bits (other dtypes as they are).
)doc");

REGISTER_OP("ProphetBroadcast")
    .Input("tensor: T")
    .Output("broadcast: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64, uint8, bool}")
    .Attr("tensor_name: string")
    .Attr("root_rank: int = 0")
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc("Returns `root_rank`'s `tensor` on every worker.");

REGISTER_OP("ProphetAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64, uint8, bool}")
    .Attr("tensor_name: string")
    .Attr("priority: int = 0")
    .Attr(kCompressionAttr)
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle input = c->input(0);
      if (!c->RankKnown(input)) {
        c->set_output(0, c->UnknownShape());
        return absl::OkStatus();
      }
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(input, 1, &input));
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(input, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc("Concatenates every worker's `tensor` along dimension 0, in rank order.");

REGISTER_KERNEL_BUILDER(Name("ProphetPushPull").Device(DEVICE_CPU), PushPullOp);
REGISTER_KERNEL_BUILDER(Name("ProphetBroadcast").Device(DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("ProphetAllgather").Device(DEVICE_CPU), AllgatherOp);

}  // namespace tensorflow
