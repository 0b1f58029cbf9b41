// Crossing the global barrier: asynchronous variable updates and the gates that order reads
// after them. Both are native async kernels; no Python runs in the graph.
//
// ProphetAsyncApply hands a local gradient to the engine and returns at once, so the training
// step can finish while the gradient is still being summed. When the sum arrives it runs `f` (the
// optimizer's update of one variable, traced with snapshots of the learning rate and iteration
// count) on TensorFlow's thread pool. Every variable `f` touches is gated from hand-off until `f`
// has finished; ProphetGate, inserted before every read or write of those variables, waits for
// that. Results are the same as synchronous training: each update sees exactly the inputs it
// would have seen, and every access to a variable is ordered after its pending update.
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ops/core/engine.h"
#include "ops/core/gate.h"
#include "ops/tf/convert.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_handle.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace {

using ::prophet::GlobalGates;

using prophet_adapter::FromTfStatus;
using prophet_adapter::ToCoreType;
using prophet_adapter::ToTfStatus;

std::string GateKey(const ResourceHandle& h) { return absl::StrCat(h.container(), "/", h.name()); }

// The trace of this worker, or nullptr when no timeline is written.
::prophet::Timeline* ActiveTimeline() {
  ::prophet::Engine* engine = ::prophet::GlobalEngine();
  return engine != nullptr && engine->timeline().enabled() ? &engine->timeline() : nullptr;
}

class GateOp : public AsyncOpKernel {
 public:
  explicit GateOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("var_name", &var_name_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& handle = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, handle.dtype() == DT_RESOURCE && handle.NumElements() == 1,
                      absl::InvalidArgumentError("ProphetGate expects one resource handle"), done);
    ctx->set_output(0, handle);
    ::prophet::Timeline* timeline = ActiveTimeline();
    const int64_t start = timeline ? ::prophet::NowNs() : 0;
    GlobalGates().Wait(GateKey(handle.scalar<ResourceHandle>()()),
                       [this, ctx, done, timeline, start](const ::prophet::Status& s) {
                         // "gate" spans end when the variable may be used: for a layer's weights
                         // in the forward pass, when that layer can start.
                         if (timeline) timeline->Complete("gate", var_name_, start, ::prophet::NowNs());
                         if (!s.ok())
                           ctx->SetStatus(absl::Status(ToTfStatus(s).code(), absl::StrCat("a pending update of this variable failed: ",
                                                                                    s.message())));
                         done();
                       });
  }

 private:
  std::string var_name_;
};

class WaitAllOp : public AsyncOpKernel {
 public:
  explicit WaitAllOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}
  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    GlobalGates().WaitAll([done](const ::prophet::Status&) { done(); });
  }
};

class AsyncApplyOp : public AsyncOpKernel {
 public:
  explicit AsyncApplyOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("f", &func_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("priority", &priority_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ::prophet::Engine* engine = ::prophet::GlobalEngine();
    OP_REQUIRES_ASYNC(ctx, engine != nullptr,
                      absl::FailedPreconditionError("the prophet_tf runtime is not initialised in this process"), done);
    FunctionLibraryRuntime* flr = ctx->function_library();
    OP_REQUIRES_ASYNC(ctx, flr != nullptr, absl::InternalError("ProphetAsyncApply: no function library"), done);
    FunctionLibraryRuntime::Handle fhandle;
    OP_REQUIRES_OK_ASYNC(ctx, Instantiate(flr, &fhandle), done);

    const Tensor& grad = ctx->input(0);
    ::prophet::DataType dtype;
    OP_REQUIRES_ASYNC(ctx, ToCoreType(grad.dtype(), &dtype),
                      absl::InvalidArgumentError(absl::StrCat("ProphetAsyncApply '", tensor_name_,
                                                              "': unsupported gradient dtype ", DataTypeString(grad.dtype()))),
                      done);
    // Everything the update needs outlives this kernel call: tensors are reference counted.
    auto state = std::make_shared<State>();
    state->grad = grad;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_temp(grad.dtype(), grad.shape(), &state->summed), done);
    state->args.push_back(state->summed);
    for (int i = 1; i < ctx->num_inputs(); ++i) {
      const Tensor& t = ctx->input(i);
      state->args.push_back(t);
      if (t.dtype() == DT_RESOURCE)
        for (int64_t j = 0; j < t.NumElements(); ++j) state->keys.push_back(GateKey(t.flat<ResourceHandle>()(j)));
    }
    state->flr = flr;
    state->name = tensor_name_;
    state->fhandle = fhandle;
    state->pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    for (const std::string& key : state->keys) GlobalGates().Arm(key);

    ::prophet::OpRequest req;
    req.kind = ::prophet::OpKind::kPushPull;
    req.name = tensor_name_;
    req.dtype = dtype;
    for (int i = 0; i < grad.dims(); ++i) req.shape.push_back(grad.dim_size(i));
    req.input = grad.tensor_data().data();
    req.output = const_cast<char*>(state->summed.tensor_data().data());
    req.bytes = grad.TotalBytes();
    req.priority = priority_;
    req.done = [state](const ::prophet::Status& s, const ::prophet::GatherResult*) {
      if (!s.ok()) return Release(*state, s);
      // Never run the update on the engine's network thread.
      state->pool->Schedule([state] { RunUpdate(state); });
    };
    engine->Submit(std::move(req));
    done();  // the step goes on; the gates hold back whoever reads these variables
  }

 private:
  struct State {
    Tensor grad, summed;
    std::vector<Tensor> args;
    std::vector<std::string> keys;
    FunctionLibraryRuntime* flr = nullptr;
    FunctionLibraryRuntime::Handle fhandle = 0;
    thread::ThreadPool* pool = nullptr;
    std::vector<Tensor> rets;
    std::string name;
  };

  static void Release(const State& state, const ::prophet::Status& s) {
    for (const std::string& key : state.keys) GlobalGates().Release(key, s);
  }

  static void RunUpdate(std::shared_ptr<State> state) {
    FunctionLibraryRuntime::Options opts;
    opts.runner = nullptr;  // the library's default runner (TensorFlow's inter-op pool)
    const int64_t start = ::prophet::NowNs();
    state->flr->Run(opts, state->fhandle, state->args, &state->rets, [state, start](const absl::Status& s) {
      if (::prophet::Timeline* timeline = ActiveTimeline()) timeline->Complete("apply", state->name, start, ::prophet::NowNs());
      Release(*state, FromTfStatus(s));
    });
  }

  absl::Status Instantiate(FunctionLibraryRuntime* flr, FunctionLibraryRuntime::Handle* handle) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : handles_)
      if (entry.first == flr) {
        *handle = entry.second;
        return absl::OkStatus();
      }
    TF_RETURN_IF_ERROR(flr->Instantiate(func_.name(), AttrSlice(&func_.attr()), handle));
    handles_.emplace_back(flr, *handle);
    return absl::OkStatus();
  }

  NameAttrList func_;
  std::string tensor_name_;
  int64_t priority_ = 0;
  std::mutex mu_;
  std::vector<std::pair<FunctionLibraryRuntime*, FunctionLibraryRuntime::Handle>> handles_;
};

}  // namespace

REGISTER_OP("ProphetGate")
    .Input("handle: resource")
    .Output("gated: resource")
    .Attr("var_name: string = ''")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      const auto* handle_data = c->input_handle_shapes_and_types(0);
      if (handle_data != nullptr) c->set_output_handle_shapes_and_types(0, *handle_data);
      return absl::OkStatus();
    })
    .Doc("Waits until the variable's pending asynchronous update has been applied.");

REGISTER_OP("ProphetWaitAll")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc("Waits until no asynchronous update is pending.");

REGISTER_OP("ProphetAsyncApply")
    .Input("grad: T")
    .Input("args: Targs")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Targs: list(type) >= 0")
    .Attr("f: func")
    .Attr("tensor_name: string")
    .Attr("priority: int = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sums `grad` over all workers in the background, then runs f(summed, *args). Returns at once; the
resource handles among `args` are gated until f has finished.
)doc");

REGISTER_KERNEL_BUILDER(Name("ProphetGate").Device(DEVICE_CPU), GateOp);
REGISTER_KERNEL_BUILDER(Name("ProphetWaitAll").Device(DEVICE_CPU), WaitAllOp);
REGISTER_KERNEL_BUILDER(Name("ProphetAsyncApply").Device(DEVICE_CPU), AsyncApplyOp);

}  // namespace tensorflow
