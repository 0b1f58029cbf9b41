// Accelerator-emulated compute for the training benchmark (prophet_tf/bench/emulated.py).
//
// ProphetEmulatedCompute stands for one layer's forward pass: it waits for the previous layer's
// output and for the reads of the layer's variables (its inputs), then occupies the emulated
// device (ops/tf_bench/emulated_device.h) for `forward_ns` and outputs zeros of shape [batch, units].
// Its gradient, ProphetEmulatedComputeGrad, occupies the device for `backward_ns` and outputs the
// gradient of the layer input and one gradient per variable, of the variables' real shapes and
// dtypes. Both are AsyncOpKernels: no TensorFlow thread is held and no CPU is used while the time
// passes. The variable gradients are zeros that each kernel allocates once and hands out every
// step (TensorFlow never writes into a buffer that is still referenced elsewhere), so producing
// hundreds of megabytes of gradients costs no memory traffic, as on an accelerator.
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "ops/core/engine.h"
#include "ops/tf_bench/emulated_device.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace tensorflow {
namespace {

using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

// Spans on the worker's timeline ("forward"/"backward" rows), when the runtime writes one.
void Trace(const char* track, const std::string& layer, int64_t start_ns, int64_t end_ns) {
  ::prophet::Engine* engine = ::prophet::GlobalEngine();
  if (engine != nullptr && engine->timeline().enabled()) engine->timeline().Complete(track, layer, start_ns, end_ns);
}

void ZeroFill(Tensor* t) {
  // Small tensors only (activations of shape [batch, units]); their dtype is one of T's.
  std::memset(const_cast<char*>(t->tensor_data().data()), 0, t->TotalBytes());
}

class EmulatedComputeOp : public AsyncOpKernel {
 public:
  explicit EmulatedComputeOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("forward_ns", &forward_ns_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("units", &units_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layer", &layer_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, x.dims() >= 1,
                      absl::InvalidArgumentError(absl::StrCat("ProphetEmulatedCompute '", layer_,
                                                              "': expected an input of rank >= 1 (batch first), got shape ",
                                                              x.shape().DebugString())),
                      done);
    Tensor* y = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, TensorShape({x.dim_size(0), units_}), &y), done);
    ZeroFill(y);
    ::prophet::GlobalEmulatedDevice().Run(forward_ns_, [this, done](int64_t start, int64_t end) {
      Trace("forward", layer_, start, end);
      done();
    });
  }

 private:
  int64_t forward_ns_ = 0;
  int64_t units_ = 1;
  std::string layer_;
};

class EmulatedComputeGradOp : public AsyncOpKernel {
 public:
  explicit EmulatedComputeGradOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("backward_ns", &backward_ns_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("layer", &layer_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("Tgrads", &grad_types_));
    std::vector<PartialTensorShape> shapes;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("grad_shapes", &shapes));
    OP_REQUIRES(ctx, shapes.size() == grad_types_.size(),
                absl::InvalidArgumentError(absl::StrCat("ProphetEmulatedComputeGrad '", layer_, "': expected ",
                                                        grad_types_.size(), " grad_shapes (one per Tgrads), got ",
                                                        shapes.size())));
    for (const PartialTensorShape& s : shapes) {
      TensorShape full;
      OP_REQUIRES(ctx, s.AsTensorShape(&full),
                  absl::InvalidArgumentError(absl::StrCat("ProphetEmulatedComputeGrad '", layer_,
                                                          "': expected fully defined variable shapes, got ",
                                                          s.DebugString())));
      grad_shapes_.push_back(full);
    }
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& x = ctx->input(1);
    Tensor* dx = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, x.shape(), &dx), done);
    ZeroFill(dx);
    OP_REQUIRES_OK_ASYNC(ctx, MakeZeroGradients(ctx), done);
    ::prophet::GlobalEmulatedDevice().Run(backward_ns_, [this, ctx, done](int64_t start, int64_t end) {
      // The gradients appear when the layer's backward pass ends, as on an accelerator.
      for (size_t i = 0; i < zeros_.size(); ++i) ctx->set_output(static_cast<int>(i) + 1, zeros_[i]);
      Trace("backward", layer_, start, end);
      done();
    });
  }

 private:
  absl::Status MakeZeroGradients(OpKernelContext* ctx) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!zeros_.empty() || grad_types_.empty()) return absl::OkStatus();
    std::vector<Tensor> zeros(grad_types_.size());
    for (size_t i = 0; i < grad_types_.size(); ++i) {
      AllocatorAttributes attr;
      TF_RETURN_IF_ERROR(ctx->allocate_temp(grad_types_[i], grad_shapes_[i], &zeros[i], attr));
      std::memset(const_cast<char*>(zeros[i].tensor_data().data()), 0, zeros[i].TotalBytes());
    }
    zeros_ = std::move(zeros);
    return absl::OkStatus();
  }

  int64_t backward_ns_ = 0;
  std::string layer_;
  DataTypeVector grad_types_;
  std::vector<TensorShape> grad_shapes_;
  std::mutex mu_;
  std::vector<Tensor> zeros_;  // one per variable; read-only after creation
};

}  // namespace

REGISTER_OP("ProphetEmulatedCompute")
    .Input("x: T")
    .Input("weights: Tweights")
    .Output("y: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tweights: list(type) >= 0")
    .Attr("forward_ns: int >= 0")
    .Attr("backward_ns: int >= 0")
    .Attr("units: int >= 1")
    .Attr("layer: string")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle x;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
      int64_t units = 0;
      TF_RETURN_IF_ERROR(c->GetAttr("units", &units));
      c->set_output(0, c->Matrix(c->Dim(x, 0), units));
      return absl::OkStatus();
    })
    .Doc(R"doc(
One layer's forward pass on the emulated accelerator: waits for `x` (the previous layer's output)
and `weights` (reads of the layer's variables), then takes `forward_ns` without using the CPU and
returns zeros of shape [batch, units]. `backward_ns` is the time of its gradient.
)doc");

REGISTER_OP("ProphetEmulatedComputeGrad")
    .Input("dy: T")
    .Input("x: T")
    .Output("dx: T")
    .Output("grads: Tgrads")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tgrads: list(type) >= 0")
    .Attr("grad_shapes: list(shape) >= 0")
    .Attr("backward_ns: int >= 0")
    .Attr("layer: string")
    .SetShapeFn([](InferenceContext* c) {
      c->set_output(0, c->input(1));
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("grad_shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        ShapeHandle s;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &s));
        c->set_output(static_cast<int>(i) + 1, s);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
One layer's backward pass on the emulated accelerator: after `dy` is available it takes
`backward_ns` without using the CPU, then returns zeros for the layer input's gradient (shape of
`x`) and for every variable's gradient (`grad_shapes`, `Tgrads`).
)doc");

REGISTER_KERNEL_BUILDER(Name("ProphetEmulatedCompute").Device(DEVICE_CPU), EmulatedComputeOp);
REGISTER_KERNEL_BUILDER(Name("ProphetEmulatedComputeGrad").Device(DEVICE_CPU), EmulatedComputeGradOp);

}  // namespace tensorflow
