"""Accelerator-emulated compute for the training benchmark (``--compute emulated``).

On a machine without accelerators, the model's TensorFlow compute and the communication fight
for the same CPU cores, so a step's time says more about CPU contention than about scheduling.
On the clusters Prophet is for, the compute runs on an accelerator and leaves the CPU to the
framework and the network. This module builds a model that keeps every variable of the real one
(same names, shapes, dtypes and order, hence the same gradient bytes, count and order) while its
layers' forward and backward passes take a fixed time on an emulated accelerator and use no CPU:

* :func:`layer_specs` walks a real Keras model and returns one :class:`LayerSpec` per layer with
  variables (its variables and its forward FLOPs per example). Layers without variables
  (activations, pooling, additions, padding) are merged into the previous layer with variables:
  their backward pass then runs just before that layer's, so its gradients become ready when
  they would (the first layers' merge into the first layer with variables).
* :func:`layer_times` turns FLOPs into seconds: forward = FLOPs x batch / accelerator rate,
  backward = :data:`BACKWARD_FLOPS_FACTOR` x forward (the gradients of the input and of the
  weights each cost about one forward pass), both multiplied by the time scale.
* :func:`build_emulated_model` makes a chain of :class:`EmulatedLayer` s. Layer k's forward op
  (``ProphetEmulatedCompute``, ops/tf_bench/emulated_compute_ops.cc) takes layer k-1's output and the
  reads of layer k's variables as inputs, so it waits for both (under ProphetStrategy those reads
  wait for the variables' pending updates: the barrier-crossing gates). Its registered gradient
  (``ProphetEmulatedComputeGrad``) waits for the gradient of layer k's output, takes the backward
  time and returns one gradient per variable of the variable's shape and dtype: gradients become
  ready layer by layer in backward order, as in real training.

The emulated accelerator runs one operation at a time, in issue order (ops/tf_bench/emulated_device.h),
like a GPU's compute stream. Activations between layers are ``[batch, 1]`` placeholders (the
last layer returns ``[batch, classes]`` logits for the loss); gradients are zeros.

Not emulated: the input pipeline (inputs are ``[batch, 1]`` zeros), host-device copies of
gradients, and memory-bound layers' real speed (a layer costs its FLOPs only).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional, Sequence

__all__ = ["BACKWARD_FLOPS_FACTOR", "DEFAULT_ACCELERATOR_TFLOPS", "WeightSpec", "LayerSpec",
           "layer_flops", "layer_specs", "layer_times", "step_flops", "accelerator_step_s",
           "specs_to_json", "specs_from_json", "load_or_make_specs", "emulated_profile",
           "emulated_compute",
           "EmulatedLayer", "build_emulated_model"]

#: A layer's backward pass costs this many forward passes (input gradient + weight gradient).
BACKWARD_FLOPS_FACTOR = 2.0
#: Default sustained accelerator rate, TFLOP/s: an NVIDIA A100 (312 TFLOP/s dense bf16/fp16 peak)
#: at the ~30% of peak that data-parallel training of these models sustains (docs/benchmarks.md).
DEFAULT_ACCELERATOR_TFLOPS = 100.0


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One variable of a real layer.

    Attributes:
      name: unique within the layer, without "/" (Keras 3 forbids it): a sub-layer's
        ``query/kernel`` becomes ``query_kernel``.
      shape: the variable's shape.
      dtype: the variable's dtype name (``float32``).
      trainable: whether it gets a gradient.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """A layer of the real model with variables, plus the layers merged into it.

    Attributes:
      name: the real layer's name.
      kind: the real layer's class name.
      weights: its variables, trainable ones first, each group in the real model's order.
      flops: forward FLOPs per example (this layer plus the layers merged into it).
      merged: names of the variable-free layers whose compute is counted here.
    """

    name: str
    kind: str
    weights: tuple[WeightSpec, ...]
    flops: float
    merged: tuple[str, ...] = ()

    def gradient_bytes(self) -> int:
        import numpy as np
        return sum(int(np.prod(w.shape, dtype=np.int64)) * np.dtype(w.dtype).itemsize
                   for w in self.weights if w.trainable)


def _prod(values: Sequence[Any]) -> int:
    out = 1
    for v in values:
        if v is None:
            raise ValueError("a layer's output shape must be known apart from the batch dimension")
        out *= int(v)
    return out


def _output_shape(layer: Any) -> tuple:
    out = layer.output
    if isinstance(out, (list, tuple)):
        out = out[0]
    return tuple(out.shape)


def layer_flops(layer: Any) -> float:
    """Forward FLOPs per example of a built Keras layer (a multiply-add counts as 2).

    * Layers with a ``kernel`` (Dense, ConvND, EinsumDense): 2 x kernel size x output positions,
      where positions = output elements / output channels.
    * ``MultiHeadAttention`` (self-attention, T tokens): its projections (2 x kernel sizes x T)
      plus the scores and the weighted sum (2 x 2 x T^2 x heads x key_dim).
    * ``Embedding``: 0 (a gather). Pooling: output elements x window. Anything else
      (normalisation, activations, additions): one FLOP per output element.
    """
    kind = type(layer).__name__
    out_shape = _output_shape(layer)[1:]
    out_elems = _prod(out_shape) if out_shape else 1
    if kind == "MultiHeadAttention":
        tokens = _prod(out_shape[:-1]) if len(out_shape) > 1 else 1
        proj = sum(_prod(w.shape) for w in layer.trainable_weights
                   if (getattr(w, "path", None) or w.name).endswith("kernel"))
        inner = layer._num_heads * layer._key_dim
        return 2.0 * proj * tokens + 4.0 * tokens * tokens * inner
    kernel = getattr(layer, "kernel", None) if kind not in ("Embedding",) else None
    if kernel is not None and hasattr(kernel, "shape") and len(kernel.shape) >= 2:
        channels = int(out_shape[-1]) if out_shape else 1
        positions = out_elems / max(1, channels)
        return 2.0 * _prod(kernel.shape) * positions
    if kind == "Embedding" or kind == "InputLayer":
        return 0.0
    pool = getattr(layer, "pool_size", None)
    if pool is not None and "Pooling" in kind and "Global" not in kind:
        return float(out_elems * _prod(pool if isinstance(pool, (tuple, list)) else (pool,)))
    if "GlobalAveragePooling" in kind or "GlobalMaxPooling" in kind:
        return float(_prod(tuple(layer.input.shape)[1:]))
    return float(out_elems)


def _weight_specs(layer: Any) -> tuple[WeightSpec, ...]:
    specs: list[WeightSpec] = []
    seen: set[str] = set()
    prefix = layer.name + "/"
    for trainable, group in ((True, layer.trainable_weights), (False, layer.non_trainable_weights)):
        for w in group:
            path = getattr(w, "path", None) or w.name
            name = path[len(prefix):] if path.startswith(prefix) else w.name
            name = name.replace("/", "_").replace(":", "_")
            base, k = name, 1
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            seen.add(name)
            dtype = getattr(w.dtype, "name", w.dtype)
            specs.append(WeightSpec(name, tuple(int(d) for d in w.shape), str(dtype), trainable))
    return tuple(specs)


def layer_specs(model: Any) -> list[LayerSpec]:
    """One :class:`LayerSpec` per layer of ``model`` that has variables, in ``model.layers`` order.

    The specs' trainable variables, concatenated, have exactly the shapes, dtypes and order of
    ``model.trainable_weights``. Raises ``ValueError`` if a layer is shared (called more than
    once): its FLOPs would be ambiguous.
    """
    specs: list[dict[str, Any]] = []
    pending_flops, pending_names = 0.0, []   # variable-free layers before the first with variables
    for layer in model.layers:
        if len(getattr(layer, "_inbound_nodes", [])) > 1:
            raise ValueError(f"layer {layer.name!r} is called more than once; the emulated model "
                             "needs every layer used once")
        flops = layer_flops(layer)
        weights = _weight_specs(layer)
        if weights:
            specs.append({"name": layer.name, "kind": type(layer).__name__, "weights": weights,
                          "flops": flops + pending_flops, "merged": list(pending_names)})
            pending_flops, pending_names = 0.0, []
        elif specs:
            specs[-1]["flops"] += flops
            specs[-1]["merged"].append(layer.name)
        else:
            pending_flops += flops
            pending_names.append(layer.name)
    if not specs:
        raise ValueError("the model has no variables")
    return [LayerSpec(s["name"], s["kind"], s["weights"], s["flops"], tuple(s["merged"]))
            for s in specs]


def step_flops(specs: Sequence[LayerSpec], batch: int) -> float:
    """FLOPs of one training step (forward + backward) of one worker."""
    return sum(s.flops for s in specs) * batch * (1.0 + BACKWARD_FLOPS_FACTOR)


def layer_times(specs: Sequence[LayerSpec], batch: int, tflops: float,
                time_scale: float = 1.0) -> list[tuple[float, float]]:
    """``(forward_s, backward_s)`` of every layer at ``tflops`` TFLOP/s, times ``time_scale``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not (tflops > 0 and math.isfinite(tflops)):
        raise ValueError(f"the accelerator rate must be a positive number of TFLOP/s, got {tflops}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"the time scale must be positive, got {time_scale}")
    per_flop = time_scale / (tflops * 1e12)
    return [(s.flops * batch * per_flop, s.flops * batch * per_flop * BACKWARD_FLOPS_FACTOR)
            for s in specs]


def accelerator_step_s(specs: Sequence[LayerSpec], batch: int, tflops: float,
                       time_scale: float = 1.0) -> float:
    """Emulated compute time of one step: the sum of every layer's forward and backward time."""
    return sum(f + b for f, b in layer_times(specs, batch, tflops, time_scale))


def emulated_profile(specs: Sequence[LayerSpec], batch: int, tflops: float,
                     time_scale: float = 1.0, source: str = "") -> Any:
    """The step of the emulated model as the predictor sees it (a
    :class:`prophet_tf.predict.Profile`), exactly, without recording a run: every layer's forward
    and backward times from :func:`layer_times`; the backward pass runs last layer first and each
    layer's gradients are ready when its backward op ends; priorities are the strategy's (the
    first layer's gradients most urgent); no update time, launch, tail or gap (what the CPU adds
    is not part of the emulated accelerator)."""
    import numpy as np

    from prophet_tf.predict import Profile, ProfiledLayer, ProfiledTensor
    times = layer_times(specs, batch, tflops, time_scale)
    grads = [(s.name, w) for s in specs for w in s.weights if w.trainable]
    priority = {(layer, w.name): len(grads) - i for i, (layer, w) in enumerate(grads)}
    ready, at = {}, 0.0
    for spec, (_, backward) in reversed(list(zip(specs, times))):
        at += backward
        ready[spec.name] = at
    tensors = [ProfiledTensor(name=f"grad/{layer}/{w.name}",
                              bytes=int(np.prod(w.shape, dtype=np.int64)) * np.dtype(w.dtype).itemsize,
                              priority=priority[(layer, w.name)], ready_s=ready[layer], layer=layer,
                              element_size=np.dtype(w.dtype).itemsize)
               for layer, w in grads]
    return Profile(layers=[ProfiledLayer(s.name, f, b) for s, (f, b) in zip(specs, times)],
                   tensors=tensors, backward_s=at, forward="measured",
                   source=source or f"emulated model ({len(specs)} layers)",
                   emulation={"time_scale": float(time_scale), "accelerator_tflops": float(tflops)})


# ------------------------------------------------------------------------------------------------
# Persistence: the specs of a model are computed once per benchmark run and shared by its workers


def specs_to_json(specs: Sequence[LayerSpec]) -> str:
    return json.dumps([dataclasses.asdict(s) for s in specs])


def specs_from_json(text: str) -> list[LayerSpec]:
    out = []
    for s in json.loads(text):
        weights = tuple(WeightSpec(w["name"], tuple(w["shape"]), w["dtype"], bool(w["trainable"]))
                        for w in s["weights"])
        out.append(LayerSpec(s["name"], s["kind"], weights, float(s["flops"]),
                             tuple(s.get("merged", ()))))
    return out


def load_or_make_specs(path: Optional[str], build_real_model: Any) -> list[LayerSpec]:
    """The specs stored at ``path``, or those of ``build_real_model()`` (then stored there).

    Building a real model allocates all its weights; the benchmark does it once per model (the
    first worker to need it writes the file, atomically) instead of once per worker.
    """
    if path and os.path.exists(path):
        with open(path) as f:
            return specs_from_json(f.read())
    specs = layer_specs(build_real_model())
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(specs_to_json(specs))
        os.replace(tmp, path)
    return specs


# ------------------------------------------------------------------------------------------------
# TensorFlow side


def _seconds_to_ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


def emulated_compute(x: Any, weights: Sequence[Any], forward_s: float, backward_s: float,
                     units: int, layer: str) -> Any:
    """One layer's forward pass on the emulated accelerator (differentiable; see module doc)."""
    from prophet_tf._library import bench_op_module
    _register_gradient()
    return bench_op_module().prophet_emulated_compute(
        x, list(weights), forward_ns=_seconds_to_ns(forward_s),
        backward_ns=_seconds_to_ns(backward_s), units=int(units), layer=layer)


_GRADIENT_REGISTERED = False


def _register_gradient() -> None:
    """Registers the gradient of ProphetEmulatedCompute with TensorFlow (once per process)."""
    global _GRADIENT_REGISTERED
    if _GRADIENT_REGISTERED:
        return
    import tensorflow as tf

    @tf.RegisterGradient("ProphetEmulatedCompute")
    def _emulated_compute_grad(op: Any, dy: Any) -> list:
        from prophet_tf._library import bench_op_module
        weights = list(op.inputs[1:])
        shapes = []
        for w in weights:
            if not w.shape.is_fully_defined():
                raise ValueError(f"emulated layer {op.get_attr('layer')!r}: variable read "
                                 f"{w.name} has no static shape ({w.shape}); the emulated "
                                 "gradient needs the variables' shapes")
            shapes.append(w.shape)
        outs = bench_op_module().prophet_emulated_compute_grad(
            dy, op.inputs[0], Tgrads=[w.dtype for w in weights], grad_shapes=shapes,
            backward_ns=op.get_attr("backward_ns"), layer=op.get_attr("layer"))
        return [outs[0]] + list(outs[1])

    _GRADIENT_REGISTERED = True


def _emulated_layer_class() -> type:
    import keras
    import tensorflow as tf

    class _EmulatedLayer(keras.layers.Layer):
        """A layer with the variables of a real one whose compute runs on the emulated device."""

        def __init__(self, spec: LayerSpec, forward_s: float, backward_s: float, units: int = 1,
                     **kwargs: Any) -> None:
            super().__init__(name=spec.name, **kwargs)
            self.spec, self.forward_s, self.backward_s = spec, forward_s, backward_s
            self.units = int(units)

        def build(self, input_shape: Any) -> None:
            for w in self.spec.weights:
                # Zeros: no random initialisation cost; the values never matter here.
                self.add_weight(name=w.name, shape=w.shape, dtype=w.dtype, trainable=w.trainable,
                                initializer="zeros")

        def call(self, x: Any) -> Any:
            # Reading the variables here (through the strategy's gates) is what makes the
            # forward op wait for their pending updates.
            reads = [tf.convert_to_tensor(v.value) for v in self.trainable_weights]
            return emulated_compute(x, reads, self.forward_s, self.backward_s, self.units,
                                    self.name)

        def compute_output_shape(self, input_shape: Any) -> tuple:
            return (input_shape[0], self.units)

    return _EmulatedLayer


_EMULATED_LAYER: Optional[type] = None


def EmulatedLayer(spec: LayerSpec, forward_s: float, backward_s: float, units: int = 1,
                  **kwargs: Any) -> Any:  # noqa: N802 - used like a class
    """A Keras layer with ``spec``'s variables and emulated forward/backward times."""
    global _EMULATED_LAYER
    if _EMULATED_LAYER is None:
        _EMULATED_LAYER = _emulated_layer_class()
    return _EMULATED_LAYER(spec, forward_s, backward_s, units, **kwargs)


def build_emulated_model(specs: Sequence[LayerSpec], batch: int, tflops: float,
                         time_scale: float, classes: int, name: str = "emulated") -> Any:
    """A Keras model: a chain of :func:`EmulatedLayer` s over ``[batch, 1]`` float inputs whose
    last layer returns ``[batch, classes]`` logits (zeros). Compile it with a from-logits loss."""
    import keras
    times = layer_times(specs, batch, tflops, time_scale)
    inputs = keras.Input(shape=(1,), dtype="float32", name="emulated_input")
    x = inputs
    for i, (spec, (fwd, bwd)) in enumerate(zip(specs, times)):
        units = classes if i == len(specs) - 1 else 1
        x = EmulatedLayer(spec, fwd, bwd, units)(x)
    return keras.Model(inputs, x, name=name)
