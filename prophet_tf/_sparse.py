"""Where the indices of a sparse gradient come from, to reduce it with one-process semantics.

One process on the global batch and N workers on its N shares agree on a sparse gradient
(``tf.IndexedSlices``) in two situations, and they need different reductions:

* indices looked up from the batch (token ids): one process gets one slice per looked-up row of
  the global batch; the workers' slices, gathered in rank order, are exactly those slices.
* indices that do not come from the batch (``tf.range(maxlen)`` of a position embedding): one
  process gets one slice per index whose value is the sum over the whole batch; each worker gets
  the same indices with the sum over its share, so the values must be SUMMED across workers and
  the indices kept. Gathering them instead repeats every index N times with partial sums, which
  Keras applies slice by slice: Adam, RMSprop and Adagrad then see the sum of squared partial
  sums instead of the square of the sum.

``may_come_from_input`` tells them apart by walking the traced graph back from the indices. The
strategy still checks at run time that "not from the input" indices are identical on every
worker before it sums (a constant may depend on the rank). ``mixes_origins`` finds the one case
neither reduction gets right: one table looked up both ways in a step (TensorFlow concatenates
the two gradients into one ``IndexedSlices``).

Limits: indices are assumed to be one slice per looked-up row when they come from the input. A
lookup of ids deduplicated over the batch first (``tf.unique``) has one slice per distinct id in
one process, and per worker after gathering; eager execution (``run_eagerly=True``) has no
graph to inspect, so its sparse gradients are always gathered (as TensorFlow's strategies do).
"""

from __future__ import annotations

import tensorflow as tf

# Ops that produce the elements of an input pipeline inside a traced function.
_INPUT_OPS = frozenset([
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "OptionalGetValue",
    "MultiDeviceIteratorGetNextFromShard",
])
# Stateful ops whose output is the same on every worker: reads of (synchronized) variables.
_SHARED_STATE_OPS = frozenset(["ReadVariableOp", "VarHandleOp", "ResourceGather"])


def may_come_from_input(tensor) -> bool:
    """False only when ``tensor`` (a traced, symbolic tensor) provably does not depend on the
    values or shapes of the input data: its ancestors are constants, variable reads and
    stateless ops. True for eager tensors (no graph to inspect), function arguments (the batch
    Keras passes to its train step), input pipeline ops and stateful ops such as random ones."""
    if not tf.is_symbolic_tensor(tensor):
        return True
    stack, seen = [tensor], set()
    while stack:
        t = stack.pop()
        key = (id(t.graph), t.op.name, t.value_index)
        if key in seen:
            continue
        seen.add(key)
        op = t.op
        if op.type in _INPUT_OPS:
            return True
        if op.type == "Placeholder":
            external = _captured_value(t)
            if external is None:           # an argument of the traced function
                if t.dtype in (tf.resource, tf.variant):
                    continue               # a variable or iterator handle, not data itself
                return True
            if tf.is_symbolic_tensor(external):
                stack.append(external)     # captured from an enclosing function's graph
            continue                       # captured eager value: a constant or a handle
        if op._is_stateful and op.type not in _SHARED_STATE_OPS:  # noqa: SLF001
            return True
        stack.extend(op.inputs)
    return False


def mixes_origins(indices) -> bool:
    """True when ``indices`` concatenate gradients of lookups from the input with gradients of
    lookups that are not (a token and a position lookup of one ``Embedding``)."""
    if not tf.is_symbolic_tensor(indices):
        return False
    while indices.op.type == "Identity":
        indices = indices.op.inputs[0]
    if indices.op.type != "ConcatV2":
        return False
    return len({may_come_from_input(part) for part in indices.op.inputs[:-1]}) == 2


def _captured_value(placeholder):
    """The outer value a function graph placeholder captures, or None for an argument."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal is placeholder:
            return external
    return None
