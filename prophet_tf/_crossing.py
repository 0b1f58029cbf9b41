"""Crossing the global barrier: deferred optimizer updates and gated variables.

The next training step may start while low-priority gradients of the previous step are still
being summed, with results identical to synchronous training:

* :func:`deferred_update` replaces ``strategy.extended.update(var, fn, (grad, lr))`` inside the
  traced train step. It emits ``ProphetAsyncApply``, which hands the *local* gradient to the
  runtime and returns at once; when the sum arrives the runtime runs ``fn`` (traced once into a
  function, fed with snapshots of the learning rate and the iteration count it would have seen)
  on TensorFlow's thread pool.
* :class:`GatedVariable` is the variable class the strategy creates. Every read or write first
  runs ``ProphetGate``, which waits only for *that* variable's pending update. The next step's
  first layer therefore waits only for the first layer's gradient (sent first), and anything
  read from outside the step (evaluate, predict, save, ``get_weights``) sees applied updates.

Inside the deferred update itself variables are read ungated (it is the update the gate waits
for).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import resource_variable_ops

from prophet_tf import _xla
from prophet_tf._devices import HOST_DEVICE
from prophet_tf._library import c_api, op_module
from prophet_tf.ops import compression_attr

_local = threading.local()


@contextlib.contextmanager
def ungated() -> Iterator[None]:
    """Variables accessed in this block are not gated (used while tracing a deferred update)."""
    previous = getattr(_local, "ungated", False)
    _local.ungated = True
    try:
        yield
    finally:
        _local.ungated = previous


def _gating() -> bool:
    return not getattr(_local, "ungated", False)


def wait_all() -> None:
    """Blocks until no deferred update is pending (eager)."""
    op_module().prophet_wait_all()


def pending_updates() -> int:
    """Number of deferred updates of this process that have not been applied yet."""
    return int(c_api().prophet_pending_updates())


def _gated(method_name: str) -> Callable[..., Any]:
    base = getattr(resource_variable_ops.ResourceVariable, method_name)

    def method(self, *args, **kwargs):
        if not _gating():
            return base(self, *args, **kwargs)
        if _xla.in_compiled_function():  # the gate waits outside the compiled code
            gate = _xla.gate_outside_compiled_code(self, self._gate)
        else:
            gate = self._gate()
        with tf_ops.control_dependencies([gate]):
            return base(self, *args, **kwargs)

    method.__name__ = method_name
    method.__doc__ = base.__doc__
    return method


class GatedVariable(resource_variable_ops.ResourceVariable):
    """A resource variable whose every access waits for its pending deferred update."""

    def _shared_name_for_trace(self) -> str:
        # The variable's name (e.g. "dense/kernel"), shown on the timeline's "gate" track.
        return self._unique_id if not self.name else self.name.split(":")[0]

    def _gate(self) -> tf.Tensor:
        with tf.device(HOST_DEVICE):
            return op_module().prophet_gate(self.handle, var_name=self._shared_name_for_trace())

    _read_variable_op = _gated("_read_variable_op")
    sparse_read = _gated("sparse_read")
    gather_nd = _gated("gather_nd")
    assign = _gated("assign")
    assign_add = _gated("assign_add")
    assign_sub = _gated("assign_sub")
    scatter_add = _gated("scatter_add")
    scatter_sub = _gated("scatter_sub")
    scatter_max = _gated("scatter_max")
    scatter_min = _gated("scatter_min")
    scatter_mul = _gated("scatter_mul")
    scatter_div = _gated("scatter_div")
    scatter_update = _gated("scatter_update")
    batch_scatter_update = _gated("batch_scatter_update")
    scatter_nd_add = _gated("scatter_nd_add")
    scatter_nd_sub = _gated("scatter_nd_sub")
    scatter_nd_update = _gated("scatter_nd_update")
    scatter_nd_max = _gated("scatter_nd_max")
    scatter_nd_min = _gated("scatter_nd_min")


@contextlib.contextmanager
def _iterations_snapshot(optimizer: Any, snapshot: tf.Tensor) -> Iterator[None]:
    # Keras optimizers read `self.iterations` (Adam's bias correction, schedules) inside the
    # update; the deferred update must see the value of the step that produced the gradient.
    original = optimizer._iterations
    object.__setattr__(optimizer, "_iterations", snapshot)
    try:
        yield
    finally:
        object.__setattr__(optimizer, "_iterations", original)


def deferred_update(var: Any, fn: Callable[..., Any], grad: tf.Tensor, learning_rate: Any, optimizer: Any,
                    name: str, priority: int, compression: Optional[str] = None) -> tf.Operation:
    """Emits the asynchronous update ``fn(var, sum_over_workers(grad), learning_rate)``.

    Args:
      var: the variable (Keras or TensorFlow) that ``fn`` updates.
      fn: Keras's ``apply_grad_to_update_var(var, grad, learning_rate)``.
      grad: the LOCAL dense gradient; the runtime sums it across workers.
      learning_rate: the learning rate of this step.
      optimizer: the Keras optimizer (its iteration count is snapshotted).
      name: the gradient's name, the same on every worker.
      priority: larger is sent earlier.
      compression: how the gradient travels (``prophet_tf.ops.push_pull``'s ``compression``).
    """
    _xla.refuse_collective(f"the sum over workers '{name}' (of a deferred update)")
    learning_rate = tf.convert_to_tensor(learning_rate)
    iterations = tf.convert_to_tensor(optimizer._iterations)

    def update(summed, lr_snapshot, iterations_snapshot):
        with ungated(), _iterations_snapshot(optimizer, iterations_snapshot):
            fn(var, summed, lr_snapshot)
        return []

    concrete = tf.function(update, autograph=False).get_concrete_function(
        tf.TensorSpec(grad.shape, grad.dtype),
        tf.TensorSpec(learning_rate.shape, learning_rate.dtype),
        tf.TensorSpec(iterations.shape, iterations.dtype),
    )
    args = [learning_rate, iterations] + list(concrete.captured_inputs)

    # A CPU kernel (the gradient is copied from the GPU once, as its input); `f` runs where the
    # variables live (its nodes keep the devices they were traced with).
    with tf.device(HOST_DEVICE):
        return op_module().prophet_async_apply(grad, args, f=concrete, tensor_name=name,
                                               priority=int(priority),
                                               compression=compression_attr(compression))
