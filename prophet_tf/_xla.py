"""XLA and the exchange between workers.

prophet_tf's ops (the sums, broadcasts and gathers, and with ``cross_barrier`` the gates and the
deferred updates) have no XLA kernels: they wait for other processes, which compiled code cannot.
A function XLA compiles as a whole (``tf.function(jit_compile=True)``) cannot contain them, so:

* ``model.compile(jit_compile=True)`` under a multi-worker ProphetStrategy builds the step
  functions without ``jit_compile`` and marks the step's operations for XLA instead
  (:func:`compute_scope`, TensorFlow's ``jit_scope``): XLA compiles them in clusters, and the
  exchange stays between the clusters (:func:`calls_without_fused_kernels` keeps Grappler from
  replacing the heavy operations by fused kernels XLA cannot compile). One warning says what
  runs outside XLA and why.
* a collective inside a function compiled as a whole raises :class:`JitCompileError` while the
  function is traced (XLA's own error would come at the first call and name the runtime's op),
  naming the fix.
* a variable of the strategy read or written inside such a function (a ``tf.function(
  jit_compile=True)`` computing the loss and gradients, called from a custom loop) waits for its
  pending update outside the compiled code: before the outermost function call (a capture
  evaluated at every call) and, for an update deferred earlier in the same traced caller, at that
  point of the caller (:func:`gate_outside_compiled_code`). From then on the variable's updates are
  no longer deferred (:func:`read_in_compiled_code`), so none can be pending between a step's
  update and a compiled read in a later step of the same traced function.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

from prophet_tf.errors import JitCompileError

logger = logging.getLogger("prophet_tf")

#: The runtime's op types (none has an XLA kernel).
RUNTIME_OPS = frozenset(["ProphetPushPull", "ProphetBroadcast", "ProphetAllgather", "ProphetGate",
                         "ProphetAsyncApply", "ProphetWaitAll"])
# Inputs of a step's graph, not computation XLA would compile.
_INPUT_OPS = frozenset(["Placeholder"])

_lock = threading.Lock()
_warned: set = set()
# Set on a variable read or written inside a compiled function: its updates are never deferred.
_COMPILED_ACCESS = "_prophet_compiled_access"
# (compiled graph, variable id) -> the token a gated access in that graph depends on.
_tokens: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def in_compiled_function() -> bool:
    """Whether the operations being created go into a function XLA compiles as a whole
    (``tf.function(jit_compile=True)``, also when nested in other functions)."""
    import tensorflow as tf
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if tf.executing_eagerly():
        return False
    return bool(control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()))


def refuse_collective(description: str) -> None:
    """Raises :class:`JitCompileError` when a collective would go into a compiled function.

    ``description`` says which collective, e.g. ``"the sum over workers 'grad/dense/kernel'"``.
    """
    if not in_compiled_function():
        return
    raise JitCompileError(
        f"prophet_tf: {description} is inside a function compiled with XLA "
        "(tf.function(jit_compile=True)). XLA cannot compile an exchange between workers (it "
        "waits for other processes). Fix: remove jit_compile=True from the tf.function that "
        "calls strategy.run (or that makes the collective) and compile only the computation: "
        "put jit_compile=True on a tf.function that computes the loss and gradients, and call "
        "it inside strategy.run before apply_gradients. With Keras, "
        "model.compile(jit_compile=True) does this split itself.")


# ---- Keras: XLA clusters around the exchange ------------------------------------------------

def _compilable(node_def: Any) -> bool:
    return node_def.op not in RUNTIME_OPS


@contextlib.contextmanager
def compute_scope() -> Iterator[None]:
    """Marks the operations created inside for XLA (TensorFlow's ``jit_scope``), except the
    runtime's: XLA compiles the marked operations in clusters it forms around those it cannot
    compile, so the exchange between workers runs between compiled clusters. Only inside a
    function being traced."""
    import tensorflow as tf

    with tf.xla.experimental.jit_scope(compile_ops=_compilable,
                                       separate_compiled_gradients=False):
        yield


@contextlib.contextmanager
def calls_without_fused_kernels() -> Iterator[None]:
    """Functions called (and so instantiated) in this block are optimized without Grappler's
    remapper. The remapper replaces MatMul, Conv2D, BatchNorm... and what follows them by fused
    CPU/GPU kernels (_FusedMatMul, _FusedConv2D) before XLA forms its clusters, and XLA has no
    kernels for those: the model's heaviest operations would stay out of the compiled code.
    (TensorFlow turns the remapper's fusions off itself when XLA clusters every function.)"""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    options = context.context().function_call_options  # this thread's
    saved = options.config_proto_serialized
    config = config_pb2.ConfigProto()
    if saved:
        config.ParseFromString(saved)
    config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF
    options.config_proto_serialized = config
    try:
        yield
    finally:
        options._config_proto_serialized = saved  # the setter takes no bytes


def call_in_clusters(fn: Callable[..., Any], args: tuple, kwargs: dict, crossing: bool) -> Any:
    """``fn(*args, **kwargs)`` (a replica step being traced) in a :func:`compute_scope`; warns
    once about what of it XLA does not compile."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    start = len(graph.get_operations())
    with compute_scope():
        outputs = fn(*args, **kwargs)
    runtime_ops, other_ops = uncompiled_op_types(graph.get_operations()[start:])
    warn_once(runtime_ops, other_ops, crossing)
    return outputs


def _xla_kernel_types() -> Callable[[str], bool]:
    """A predicate: whether an op type has an XLA kernel (for the CPU, or a GPU when one is
    visible). XLA registers its kernels when it first compiles; a tiny compiled function makes
    sure it has."""
    import tensorflow as tf
    from tensorflow.python.framework import kernels

    with tf.init_scope():
        tf.function(lambda: tf.constant(0.0) + 1.0, jit_compile=True, autograph=False)()
    devices = {"XLA_CPU_JIT", "XLA_GPU_JIT"}

    def has_kernel(op_type: str) -> bool:
        return any(k.device_type in devices
                   for k in kernels.get_registered_kernels_for_op(op_type).kernel)
    return has_kernel


def uncompiled_op_types(operations: Iterable[Any]) -> tuple[list[str], list[str]]:
    """Of the operations created in a :func:`compute_scope`: the runtime's op types among them,
    and the other op types XLA has no kernel for (both sorted, without repeats)."""
    runtime, other = set(), set()
    has_kernel = None
    for op in operations:
        if op.type in RUNTIME_OPS:
            runtime.add(op.type)
            continue
        if op.type in other or op.type in _INPUT_OPS:
            continue
        try:
            marked = op.get_attr("_XlaCompile")
        except ValueError:
            marked = False
        if not marked:
            continue
        if has_kernel is None:
            has_kernel = _xla_kernel_types()
        if not has_kernel(op.type):
            other.add(op.type)
    return sorted(runtime), sorted(other)


def warn_once(runtime_ops: list[str], other_ops: list[str], crossing: bool) -> None:
    """The warning of ``jit_compile=True`` steps, once per process and content: what runs
    outside XLA, and why."""
    if not runtime_ops and not other_ops:
        return
    message = ("prophet_tf: jit_compile=True under ProphetStrategy: XLA compiles the steps' "
               "computation in clusters")
    if runtime_ops:
        waits = ", the waits for updates still being summed" if crossing else ""
        message += (f"; the exchange between workers (gradient sums, metric reductions{waits}) "
                    "runs between them, uncompiled: XLA cannot compile operations that wait for "
                    "other processes")
    if other_ops:
        message += f"; also uncompiled, having no XLA kernel: {', '.join(other_ops)}"
    message += "."
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    logger.warning(message)


# ---- variables of the strategy inside compiled functions --------------------------------------

def read_in_compiled_code(variable: Any) -> bool:
    """Whether ``variable`` was read or written inside a compiled function (then its updates
    are applied where the optimizer makes them, never deferred)."""
    return bool(getattr(variable, _COMPILED_ACCESS, False))


def gate_outside_compiled_code(variable: Any, make_gate: Callable[[], Any]) -> Any:
    """A scalar tensor of the compiled function being traced that is ready only once
    ``variable``'s pending update has been applied: ``make_gate()`` (the variable's gate) runs
    outside the compiled code. The caller makes the access depend on it."""
    import tensorflow as tf
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    graph = ops.get_default_graph()
    setattr(variable, _COMPILED_ACCESS, True)
    with _lock:
        cached = _tokens.setdefault(graph, {}).get(id(variable))
    if cached is not None:
        return cached

    def token_after_gate():
        gate = make_gate()
        with tf.control_dependencies([gate]):
            return tf.zeros([], tf.float32)

    # The graph the outermost compiled function is called from (it is not compiled itself): an
    # update deferred earlier in it is waited for there, in program order (automatic control
    # dependencies order the gate after that update and before the call, both use the variable).
    caller = graph
    while caller is not None and not control_flow_util.InXlaContext(caller):
        caller = getattr(caller, "outer_graph", None)
    if caller is not None and getattr(caller, "building_function", False):
        with caller.as_default():
            make_gate()
    # Every call (also of a trace reused by another caller) waits before it starts for updates
    # deferred by earlier calls.
    with tf.init_scope():
        saved = tf.zeros([], tf.float32)  # what a SavedModel's trace holds: no gate there
    token = graph.capture_call_time_value(token_after_gate, tf.TensorSpec([], tf.float32),
                                          default_value=saved)
    with _lock:
        _tokens[graph][id(variable)] = token
    return token
