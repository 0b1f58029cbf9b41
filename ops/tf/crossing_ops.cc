// Crossing the global barrier: asynchronous variable updates and the gates that order reads
// after them. Both are native async kernels; no Python runs in the graph.
//
// ProphetAsyncApply hands a local gradient to the engine and returns at once, so the training
// step can finish while the gradient is still being summed. When the sum arrives it runs `f` (the
// optimizer's update of one variable, traced with snapshots of the learning rate and iteration
// count) on TensorFlow's inter-op pool. Every variable `f` touches is gated from hand-off until `f`
// has finished; ProphetGate, inserted before every read or write of those variables, waits for
// that. Results are the same as synchronous training: each update sees exactly the inputs it
// would have seen, and every access to a variable is ordered after its pending update.
//
// Lifetime: a pending update outlives the step that emitted it, and may outlive the whole train
// function: Keras drops it on compile(), clear_session() or when the model is deleted, and
// TensorFlow then deletes the function's kernels, the FunctionLibraryRuntime they were created
// with (an overlay owned by the instantiated function) and that overlay's function library, while
// the update waits for its sum. A pending update therefore never refers to the kernel, its
// OpKernelContext or the kernel's FunctionLibraryRuntime: it holds an UpdateFunction, a runtime of
// its own with a private copy of `f`, shared by the kernel and every update it has in flight.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ops/core/engine.h"
#include "ops/core/gate.h"
#include "ops/core/step_meter.h"
#include "ops/tf/convert.h"
#include "ops/tf/recycled_outputs.h"
#include "tensorflow/core/common_runtime/process_function_library_runtime.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/function.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_handle.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tensorflow {
namespace {

using ::prophet::GlobalGates;

using prophet_adapter::FromTfStatus;
using prophet_adapter::GetCompression;
using prophet_adapter::kCompressionAttr;
using prophet_adapter::ToCoreType;
using prophet_adapter::ToTfStatus;

std::string GateKey(const ResourceHandle& h) { return absl::StrCat(h.container(), "/", h.name()); }

// The trace of this worker, or nullptr when no timeline is written.
::prophet::Timeline* ActiveTimeline() {
  ::prophet::Engine* engine = ::prophet::GlobalEngine();
  return engine != nullptr && engine->timeline().enabled() ? &engine->timeline() : nullptr;
}

// Test hook: PROPHET_TEST_APPLY_DELAY_MS=n holds every deferred update n ms after its sum has
// arrived, so that tests can end train functions while updates are still pending.
std::chrono::milliseconds ApplyDelayForTests() {
  static const std::chrono::milliseconds delay = [] {
    const char* value = std::getenv("PROPHET_TEST_APPLY_DELAY_MS");
    return std::chrono::milliseconds(value != nullptr ? std::atoll(value) : 0);
  }();
  return delay;
}

class GateOp : public AsyncOpKernel {
 public:
  explicit GateOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("var_name", &var_name_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& handle = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, handle.dtype() == DT_RESOURCE && handle.NumElements() == 1,
                      absl::InvalidArgumentError(absl::StrCat("ProphetGate expects one resource handle, got ",
                                                              handle.NumElements(), " of type ",
                                                              DataTypeString(handle.dtype()))),
                      done);
    ctx->set_output(0, handle);
    const int64_t start = ::prophet::NowNs();
    // The kernel and its context live until done() (the step waits for this op), so the
    // callback may use them.
    GlobalGates().Wait(GateKey(handle.scalar<ResourceHandle>()()),
                       [this, ctx, done, start](const ::prophet::Status& s, const ::prophet::UpdateGates::Waited& w) {
                         const int64_t end = ::prophet::NowNs();
                         // Before done(): the step that waited here must see it when it ends.
                         if (w.waited) ::prophet::GlobalStepMeter().OnGateWaited(w.priority, start, end);
                         // "gate" spans end when the variable may be used: for a layer's weights
                         // in the forward pass, when that layer can start.
                         if (::prophet::Timeline* timeline = ActiveTimeline())
                           timeline->Complete("gate", var_name_, start, end);
                         if (!s.ok())
                           ctx->SetStatus(absl::Status(ToTfStatus(s).code(),
                                                       absl::StrCat("a pending update of variable '", var_name_,
                                                                    "' failed: ", s.message())));
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

// Test hook: PROPHET_TEST_MULTI_DEVICE_UPDATE=1 runs every update as a multi-device function even
// when its variables live on the kernel's own device (the path a GPU's variables take).
bool ForceMultiDeviceForTests() {
  static const bool force = [] {
    const char* value = std::getenv("PROPHET_TEST_MULTI_DEVICE_UPDATE");
    return value != nullptr && std::string(value) == "1";
  }();
  return force;
}

// `f` of one ProphetAsyncApply node, instantiated in a function library runtime of its own: a
// clone of the kernel's (same devices, thread pools and options) holding only `f` and the
// functions it calls. Destroyed with the last of the kernel and its pending updates.
//
// Where `f` runs: the kernel is on the host CPU (its only kernel), and so is a single-device
// function, every node of it. When a variable `f` updates lives on another device (a GPU), `f` is
// instantiated again as a multi-device function: its nodes run on the devices they were traced on
// (the variables'), and the summed gradient, in host memory, is copied there once.
class UpdateFunction {
 public:
  static absl::Status Create(FunctionLibraryRuntime* kernel_flr, const NameAttrList& func,
                             std::shared_ptr<UpdateFunction>* out) {
    if (kernel_flr == nullptr) return absl::InternalError("ProphetAsyncApply: no function library runtime");
    const FunctionLibraryDefinition* source = kernel_flr->GetFunctionLibraryDefinition();
    const FunctionDef* fdef = source != nullptr ? source->Find(func.name()) : nullptr;
    if (fdef == nullptr)
      return absl::NotFoundError(absl::StrCat("ProphetAsyncApply: update function '", func.name(),
                                              "' is not in the function library of the train function"));
    auto fn = std::shared_ptr<UpdateFunction>(new UpdateFunction());
    TF_RETURN_IF_ERROR(kernel_flr->Clone(&fn->lib_def_, &fn->pflr_, &fn->flr_, /*skip_flib_def=*/true));
    TF_RETURN_IF_ERROR(fn->lib_def_->AddLibrary(source->ReachableDefinitions(*fdef)));
    if (!fn->lib_def_->Contains(func.name())) TF_RETURN_IF_ERROR(fn->lib_def_->AddFunctionDef(*fdef));
    TF_RETURN_IF_ERROR(fn->flr_->Instantiate(func.name(), AttrSlice(&func.attr()), &fn->handle_));
    fn->func_ = func;
    *out = std::move(fn);
    return absl::OkStatus();
  }

  // Called with the devices of `f`'s arguments (the summed gradient's, then those of args:
  // resource arguments on the devices of their variables) before an update is handed off.
  absl::Status UseDevices(const std::vector<std::string>& input_devices, const std::string& host) {
    const bool elsewhere =
        std::any_of(input_devices.begin(), input_devices.end(), [&](const std::string& d) { return d != host; });
    if (!elsewhere && !ForceMultiDeviceForTests()) return absl::OkStatus();
    std::lock_guard<std::mutex> lock(mu_);
    if (multi_device_ && input_devices == input_devices_) return absl::OkStatus();
    FunctionLibraryRuntime::InstantiateOptions options;
    options.target = host;
    options.is_multi_device_function = true;
    options.input_devices = input_devices;
    FunctionLibraryRuntime::Handle handle = kInvalidHandle;
    TF_RETURN_IF_ERROR(flr_->Instantiate(func_.name(), AttrSlice(&func_.attr()), options, &handle));
    multi_device_handle_ = handle;
    input_devices_ = input_devices;
    multi_device_ = true;
    return absl::OkStatus();
  }

  // Schedules `f(args)` on TensorFlow's inter-op pool; `done` runs there too.
  void Schedule(std::function<void()> closure) { (*flr_->runner())(std::move(closure)); }

  void Run(const std::vector<Tensor>& args, std::vector<Tensor>* rets, FunctionLibraryRuntime::DoneCallback done) {
    FunctionLibraryRuntime::Options opts;  // default runner: the inter-op pool
    FunctionLibraryRuntime::Handle handle = handle_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (multi_device_) {
        handle = multi_device_handle_;
        opts.create_rendezvous = true;  // the copies between the devices of `f`'s partitions
      }
    }
    flr_->Run(opts, handle, args, rets, std::move(done));
  }

 private:
  UpdateFunction() = default;

  // Declaration order = reverse destruction order: the runtime borrows the library.
  std::unique_ptr<FunctionLibraryDefinition> lib_def_;
  std::unique_ptr<ProcessFunctionLibraryRuntime> pflr_;
  FunctionLibraryRuntime* flr_ = nullptr;  // owned by pflr_
  FunctionLibraryRuntime::Handle handle_ = kInvalidHandle;
  NameAttrList func_;
  std::mutex mu_;
  bool multi_device_ = false;  // guarded by mu_
  FunctionLibraryRuntime::Handle multi_device_handle_ = kInvalidHandle;
  std::vector<std::string> input_devices_;
};

class AsyncApplyOp : public AsyncOpKernel {
 public:
  explicit AsyncApplyOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    NameAttrList func;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("f", &func));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("tensor_name", &tensor_name_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("priority", &priority_));
    OP_REQUIRES_OK(ctx, GetCompression(ctx, &compression_));
    OP_REQUIRES_OK(ctx, UpdateFunction::Create(ctx->function_library(), func, &function_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    ::prophet::Engine* engine = ::prophet::GlobalEngine();
    OP_REQUIRES_ASYNC(ctx, engine != nullptr,
                      absl::FailedPreconditionError("the prophet_tf runtime is not initialised in this process"), done);
    const Tensor& grad = ctx->input(0);
    ::prophet::DataType dtype;
    OP_REQUIRES_ASYNC(ctx, ToCoreType(grad.dtype(), &dtype),
                      absl::InvalidArgumentError(absl::StrCat("ProphetAsyncApply '", tensor_name_,
                                                              "': unsupported gradient dtype ", DataTypeString(grad.dtype()))),
                      done);
    // Everything the update needs is owned by `update`: tensors are reference counted, the
    // function and its runtime are shared with this kernel.
    auto update = std::make_shared<PendingUpdate>();
    update->function = function_;
    update->name = tensor_name_;
    update->grad = grad;
    // The engine receives the sum into it (warm from the pool when large: see recycled_outputs.h).
    OP_REQUIRES_OK_ASYNC(ctx, prophet_adapter::AllocateReceiveBuffer(ctx, grad.dtype(), grad.shape(), &update->summed),
                         done);
    update->args.push_back(update->summed);
    for (int i = 1; i < ctx->num_inputs(); ++i) {
      const Tensor& t = ctx->input(i);
      update->args.push_back(t);
      if (t.dtype() == DT_RESOURCE)
        for (int64_t j = 0; j < t.NumElements(); ++j) update->keys.push_back(GateKey(t.flat<ResourceHandle>()(j)));
    }
    std::vector<std::string> devices{ctx->device()->name()};  // the summed gradient: host memory
    for (int i = 1; i < ctx->num_inputs(); ++i) {
      const Tensor& t = ctx->input(i);
      devices.push_back(t.dtype() == DT_RESOURCE && t.NumElements() == 1 ? t.flat<ResourceHandle>()(0).device()
                                                                          : ctx->device()->name());
    }
    OP_REQUIRES_OK_ASYNC(ctx, function_->UseDevices(devices, ctx->device()->name()), done);
    for (const std::string& key : update->keys) GlobalGates().Arm(key, priority_);

    ::prophet::OpRequest req;
    req.kind = ::prophet::OpKind::kPushPull;
    req.name = tensor_name_;
    req.dtype = dtype;
    for (int i = 0; i < grad.dims(); ++i) req.shape.push_back(grad.dim_size(i));
    req.input = grad.tensor_data().data();
    req.output = const_cast<char*>(update->summed.tensor_data().data());
    req.bytes = grad.TotalBytes();
    req.priority = priority_;
    req.compression = compression_;
    req.done = [update](const ::prophet::Status& s, const ::prophet::GatherResult*) {
      // Leave the engine's network thread at once: releasing a gate resumes the steps waiting on
      // it, and TensorFlow may run their kernels inline.
      update->function->Schedule([update, s] {
        if (!s.ok()) return Release(*update, s);
        const std::chrono::milliseconds delay = ApplyDelayForTests();
        if (delay.count() > 0) {
          std::thread([update, delay] {
            std::this_thread::sleep_for(delay);
            update->function->Schedule([update] { Apply(update); });
          }).detach();
          return;
        }
        Apply(update);
      });
    };
    ::prophet::GlobalStepMeter().OnHandOff(priority_, ::prophet::NowNs());
    engine->Submit(std::move(req));
    done();  // the step goes on; the gates hold back whoever reads these variables
  }

 private:
  struct PendingUpdate {
    std::shared_ptr<UpdateFunction> function;
    std::string name;
    Tensor grad, summed;
    std::vector<Tensor> args, rets;
    std::vector<std::string> keys;
  };

  static void Release(const PendingUpdate& update, const ::prophet::Status& s) {
    for (const std::string& key : update.keys) GlobalGates().Release(key, s);
  }

  static void Apply(std::shared_ptr<PendingUpdate> update) {
    const int64_t start = ::prophet::NowNs();
    update->function->Run(update->args, &update->rets, [update, start](const absl::Status& s) {
      if (::prophet::Timeline* timeline = ActiveTimeline())
        timeline->Complete("apply", update->name, start, ::prophet::NowNs());
      Release(*update, s.ok() ? ::prophet::Status::OK()
                              : FromTfStatus(absl::Status(s.code(), absl::StrCat("applying the update of '", update->name,
                                                                                 "': ", s.message()))));
    });
  }

  std::string tensor_name_;
  int64_t priority_ = 0;
  ::prophet::Encoding compression_ = ::prophet::Encoding::kNone;
  std::shared_ptr<UpdateFunction> function_;
};

}  // namespace

REGISTER_OP("ProphetGate")
    .Input("handle: resource")
    .Output("gated: resource")
    .Attr("var_name: string = ''")
    .SetIsStateful()
    .SetIsDistributedCommunication()  // fails with the push_pull's errors (see prophet_ops.cc)
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Scalar());
      const auto* handle_data = c->input_handle_shapes_and_types(0);
      if (handle_data != nullptr) c->set_output_handle_shapes_and_types(0, *handle_data);
      return absl::OkStatus();
    })
    .Doc("Waits until the variable's pending asynchronous update has been applied.");

REGISTER_OP("ProphetWaitAll")
    .SetIsStateful()
    .SetIsDistributedCommunication()  // fails with the push_pull's errors (see prophet_ops.cc)
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
    .Attr(kCompressionAttr)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // fails with the push_pull's errors (see prophet_ops.cc)
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sums `grad` over all workers in the background, then runs f(summed, *args). Returns at once; the
resource handles among `args` are gated until f has finished.
)doc");

REGISTER_KERNEL_BUILDER(Name("ProphetGate").Device(DEVICE_CPU), GateOp);
REGISTER_KERNEL_BUILDER(Name("ProphetWaitAll").Device(DEVICE_CPU), WaitAllOp);
REGISTER_KERNEL_BUILDER(Name("ProphetAsyncApply").Device(DEVICE_CPU), AsyncApplyOp);

}  // namespace tensorflow
