"""How a worker's values cross workers: the collectives a :class:`prophet_tf.ProphetStrategy`
makes over the runtime's ops (``push_pull``, ``allgather``, ``broadcast``).

:class:`Collectives` (a strategy's ``extended.collectives``) names every call site the same way
on every worker, casts what the ops do not carry natively, reduces sparse gradients with
one-process semantics, reduces Keras metric state, and declares the optimizer's gradients for
fusion. The strategy decides *what* is reduced and when (its optimizer step, crossing the
barrier, variable creation); this module decides *how* it travels.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import weakref
from typing import Any, Callable, Optional

import tensorflow as tf
from tensorflow.python.distribute import reduce_util
from tensorflow.python.eager import context as eager_context
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework import tensor_util

from prophet_tf import _gradients, _link_probe, _sparse, ops, runtime

logger = logging.getLogger("prophet_tf")

# Small collectives a step waits on (metrics, loss-scale flags, strategy.reduce) outrank every
# gradient (priorities 1..number of gradients): queued behind low-priority gradients they would
# put a barrier back at the end of every step. The runtime defines the band (never profiled as a
# gradient); this is its lower end.
CONTROL_PRIORITY: int = runtime.control_priority()

# runtime.declare_fusion's bucket size for fusion="auto": sized from N and the link rate.
AUTOMATIC_FUSION = -1


# --------------------------------------------------------------------------------------------
# Names identical on every worker
# --------------------------------------------------------------------------------------------

_CONTROL_FLOW_GRAPHS = ("CondBranchFuncGraph", "WhileBodyFuncGraph", "WhileCondFuncGraph")
_UID_SUFFIX = re.compile(r"_\d+$")


def _function_graph():
    """The function graph being built (skipping cond/while branch graphs), or None when eager."""
    if eager_context.executing_eagerly():
        return None
    g = tf_ops.get_default_graph()
    while type(g).__name__ in _CONTROL_FLOW_GRAPHS and getattr(g, "outer_graph", None) is not None:
        g = g.outer_graph
    return g


class Namer:
    """Gives every collective call site a name that is identical on all workers.

    Inside a ``tf.function`` a name is made unique per traced function graph by appending
    ``@k`` to its k-th repetition (k > 0): two ops of one graph may run concurrently, so they
    must not share a name. A retrace produces the same names again (the counters live on the
    graph), which keeps workers that retrace at different steps in agreement. Eagerly, ops run
    one after the other, so a name is simply reused (the runtime matches repetitions with its
    per-name round counter).
    """

    def __init__(self) -> None:
        self._counters: "weakref.WeakKeyDictionary[Any, dict[str, int]]" = (
            weakref.WeakKeyDictionary())
        self._lock = threading.Lock()

    @staticmethod
    def graph_key() -> str:
        g = _function_graph()
        if g is None:
            return "eager"
        return _UID_SUFFIX.sub("", getattr(g, "name", "graph") or "graph")

    def unique(self, base: str) -> str:
        g = _function_graph()
        if g is None:
            return base
        with self._lock:
            counts = self._counters.setdefault(g, {})
            k = counts.get(base, 0)
            counts[base] = k + 1
        return base if k == 0 else f"{base}@{k}"

    def site(self, kind: str) -> str:
        """A unique name for a call site of ``kind`` in the current graph (or eager)."""
        return self.unique(f"{kind}/{self.graph_key()}")


# --------------------------------------------------------------------------------------------
# The collectives
# --------------------------------------------------------------------------------------------

class Collectives:
    """One worker's collectives.

    Args:
      rank, world_size: this worker and the job's number of workers.
      communicates: the training step's collectives go through the runtime (several workers, or
        one recording a profile); without, reductions return their input.
      compression: how gradients travel (None, "fp16", "bf16"); control collectives never
        compress.
      fusion_bytes: the bucket size the optimizer's dense gradients are declared with for fusion
        (None: off; ``AUTOMATIC_FUSION``: sized from N and the link rate).
      sparse_as_dense_bytes: sparse gradients of at most this many dense bytes are summed as
        dense tensors (0: always gathered).
      before_each: called before every collective (the strategy closes variable creation).
    """

    def __init__(self, rank: int, world_size: int, *, communicates: bool,
                 compression: Optional[str], fusion_bytes: Optional[int],
                 sparse_as_dense_bytes: int, before_each: Callable[[], None]):
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.communicates = bool(communicates)
        self.compression = compression
        self.fusion_bytes = fusion_bytes
        self.sparse_as_dense_bytes = int(sparse_as_dense_bytes)
        self.namer = Namer()
        self._before_each = before_each
        # The link rate automatic fusion sizes buckets for, decided at the first declaration.
        self._fusion_link_rate: Optional[_link_probe.FusionLinkRate] = None

    def site(self, kind: str) -> str:
        """A name for a call site of ``kind``, the same on every worker (see :class:`Namer`)."""
        return self.namer.site(kind)

    # ---- the ops, with their dtype rules ----------------------------------------------------
    def push_pull(self, t, name, priority, mean, compression=None):
        """The sum (``mean``: average) of ``t`` over the workers."""
        self._before_each()
        wire = wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        if mean and not (wire.is_floating):
            y = ops.push_pull(x, name=name, priority=int(priority), average=False)
            y = tf.math.floordiv(y, tf.cast(self.world_size, wire))
        else:
            y = ops.push_pull(x, name=name, priority=int(priority), average=bool(mean),
                              compression=compression)
        return y if wire == t.dtype else tf.cast(y, t.dtype)

    def broadcast(self, t, name, root_rank=0):
        """``root_rank``'s ``t`` on every worker."""
        self._before_each()
        return self.broadcast_unchecked(t, name, root_rank)

    def broadcast_unchecked(self, t, name, root_rank=0):
        """:meth:`broadcast` without ``before_each`` (the strategy's own variable creation)."""
        wire = wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        y = ops.broadcast(x, name=name, root_rank=int(root_rank))
        return y if wire == t.dtype else tf.cast(y, t.dtype)

    def allgather(self, t, name, priority=CONTROL_PRIORITY, compression=None):
        """Every worker's ``t`` concatenated along dim 0, in rank order."""
        self._before_each()
        wire = wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        y = ops.allgather(x, name=name, priority=int(priority), compression=compression)
        return y if wire == t.dtype else tf.cast(y, t.dtype)

    # ---- reductions -------------------------------------------------------------------------
    def reduce(self, reduce_op, value, name, priority, compression=None):
        """Sums (or averages) one value, dense or sparse; ``compression`` only for gradients
        (see ``ProphetStrategy(compression=...)``), never for control collectives."""
        if isinstance(reduce_op, str):
            reduce_op = reduce_util.ReduceOp(reduce_op.upper())
        mean = reduce_op == reduce_util.ReduceOp.MEAN
        if isinstance(value, indexed_slices.IndexedSlices):
            return self._reduce_indexed_slices(value, name, priority, mean, compression)
        value = tf.convert_to_tensor(value)
        return self.push_pull(value, name, priority, mean, compression)

    def densified(self, slices) -> bool:
        """Whether these sparse gradients are summed as a dense tensor (``sparse_as_dense_bytes``)."""
        if self.sparse_as_dense_bytes <= 0:
            return False
        dense_bytes = _static_dense_bytes(slices)
        return dense_bytes is not None and dense_bytes <= self.sparse_as_dense_bytes

    def _reduce_indexed_slices(self, slices, name, priority, mean, compression=None):
        if self.densified(slices):
            # Asked for by the user: one dense push_pull (see sparse_as_dense_bytes).
            return self.push_pull(tf.convert_to_tensor(slices), name, priority, mean, compression)
        if _sparse.mixes_origins(slices.indices):
            raise _gradients.GradientReductionError(
                f"ProphetStrategy: the sparse gradient '{name}' joins lookups of ids from the "
                "input batch with lookups of ids that are not (e.g. one Embedding used for tokens "
                "and for tf.range positions). One process sums the latter over the batch and "
                "keeps the former per row; gathered or summed, the workers' slices cannot give "
                "both. Use a separate Embedding layer for each kind of lookup.")
        # The values travel compressed like dense gradients; the indices exactly.
        values = self.allgather(slices.values, name + "/values", priority, compression)
        indices = self.allgather(slices.indices, name + "/indices", priority)
        if not _sparse.may_come_from_input(slices.indices):
            sizes = self.allgather(tf.reshape(tf.size(slices.indices), [1]), name + "/sizes",
                                   priority)
            values, indices = self._sum_if_same_indices(sizes, values, indices)
        if mean:
            values = values / tf.cast(self.world_size, values.dtype)
        return indexed_slices.IndexedSlices(values, indices, slices.dense_shape)

    def _sum_if_same_indices(self, sizes, values, indices):
        """Gathered slices whose indices do not come from the input (see ``_sparse``): where
        every worker had the same indices, one process on the global batch has those indices once
        with the values summed over the batch, so sum the workers' values. Every worker decides
        on the same gathered tensors, so all take the same branch."""
        n = self.world_size
        first = sizes[0]

        def same_indices():
            rows = tf.reshape(indices, [n, first])
            return tf.reduce_all(tf.equal(rows, rows[:1]))

        same = tf.cond(tf.reduce_all(tf.equal(sizes, first)), same_indices,
                       lambda: tf.constant(False))

        def summed():
            per_worker = tf.reshape(values, tf.concat([[n, first], tf.shape(values)[1:]], 0))
            return tf.reduce_sum(per_worker, axis=0), indices[:first]

        return tf.cond(same, summed, lambda: (values, indices))

    def all_finite(self, finite):
        """True on every worker iff ``finite`` is true on every worker (loss scaling)."""
        if not self.communicates:
            return finite
        bad = tf.cast(tf.logical_not(tf.cast(finite, tf.bool)), tf.float32)
        total = self.push_pull(bad, self.site("loss_scale_finite"), CONTROL_PRIORITY, False)
        return tf.equal(total, 0.0)

    def reduce_metric_state(self, variables, stop_flag=None):
        """Reduces metric state variables across workers: ``(one tensor per variable, the
        summed ``stop_flag`` or None)``.

        All variables of one (dtype, aggregation) group travel in one push_pull. ``stop_flag`` (a
        float32 ``[1]`` tensor: this worker's preemption request, see ``prophet_tf.preemption``)
        rides as one more element of the float32 sum group, so that the step's coordination
        costs no collective of its own; without such a group it goes alone.
        """
        values = [tf.convert_to_tensor(v) for v in variables]
        if not self.communicates or not (values or stop_flag is not None):
            return values, None
        groups: dict = {}
        for i, (v, t) in enumerate(zip(variables, values)):
            agg = aggregation_name(v)
            groups.setdefault((t.dtype, agg), []).append(i)
        carrier = (tf.float32, "sum")
        if stop_flag is not None:
            groups.setdefault(carrier, [])
        out = list(values)
        agreed_stop = None
        site = self.site("metrics")
        for (dtype, agg), idx in groups.items():
            if agg == "none":
                continue
            parts = [tf.reshape(values[i], [-1]) for i in idx]
            sizes = [int(values[i].shape.num_elements()) for i in idx]
            carries = stop_flag is not None and (dtype, agg) == carrier
            if carries:
                parts.append(stop_flag)
                sizes.append(1)
            flat = tf.concat(parts, axis=0)
            name = f"{site}/{dtype.name}/{agg}/{sum(sizes)}" + ("/stop" if carries else "")
            if agg == "only_first_replica":
                red = self.broadcast(flat, name, root_rank=0)
            else:
                red = self.push_pull(flat, name, CONTROL_PRIORITY, agg == "mean")
            pieces = tf.split(red, sizes)
            if carries:
                agreed_stop = tf.reshape(pieces.pop(), [])
            for i, part in zip(idx, pieces):
                out[i] = tf.reshape(part, tf.shape(values[i]))
        return out, agreed_stop

    # ---- fusion -----------------------------------------------------------------------------
    def declare_fusion(self, group: str, gradients, reduce_op, values, deferred) -> None:
        """Declares the dense floating gradients of a fixed size to the runtime for fusion, each as
        its push_pull will be (``deferred[i]``: summed by ProphetAsyncApply; else
        :meth:`push_pull`), at trace time, before any of them is submitted. Every worker traces
        the same step, so every worker declares the same tensors; the others travel alone.
        ``gradients[i]`` (a ``_gradients`` record: name, priority) belongs to ``values[i]``."""
        self._settle_link()
        if self.fusion_bytes is None or self.world_size < 2:
            return
        if isinstance(reduce_op, str):
            reduce_op = reduce_util.ReduceOp(reduce_op.upper())
        declared = []
        for gradient, value, deferring in zip(gradients, values, deferred):
            if isinstance(value, indexed_slices.IndexedSlices) or not value.dtype.is_floating:
                continue
            if not value.shape.is_fully_defined():
                continue
            wire = value.dtype if deferring else wire_dtype(value.dtype)
            declared.append(runtime.FusedTensor(
                name=gradient.name, dtype=wire.name, shape=tuple(value.shape.as_list()),
                bytes=int(value.shape.num_elements()) * wire.size, priority=int(gradient.priority),
                average=not deferring and reduce_op == reduce_util.ReduceOp.MEAN,
                compression=self.compression))
        runtime.declare_fusion(group, declared, self.fusion_bytes, link_Bps=self.fusion_link_Bps())

    @property
    def fusion_link_rate(self) -> Optional[_link_probe.FusionLinkRate]:
        """The link rate automatic fusion sizes buckets for, the same on every worker: a
        ``prophet_tf._link_probe.FusionLinkRate`` (its ``source``: ``"probe"``, measured at
        start-up and agreed, ``"env"``, ``$PROPHET_LINK_GBPS``, or ``"assumed"``, the runtime's
        10 Gbit/s where no eager context could run the probe; ``gbps``; and, probed, this
        worker's ``measured_gbps``, the slowest worker's ``agreed_gbps`` and ``probe_seconds``).
        Known from the first fusion declaration on (when the first training step is traced);
        None before and with one worker; with ``fusion="off"`` or a bucket size in bytes, None
        unless the probe ran for the lanes or the path (``io_threads``, ``two_level``)."""
        return self._fusion_link_rate

    def fusion_link_Bps(self) -> Optional[float]:
        """The link rate runtime.declare_fusion sizes automatic buckets for: the one agreed at
        the first declaration (measured then, once); None where the runtime's own applies (a
        bucket size in bytes, $PROPHET_LINK_GBPS)."""
        if self.fusion_bytes != AUTOMATIC_FUSION:
            return None
        if self._fusion_link_rate is None:
            self._fusion_link_rate = self._agree_on_link_rate()
        rate = self._fusion_link_rate
        return rate.bytes_per_s if rate.source == "probe" else None

    def _settle_link(self) -> None:
        """Once, at the first step's trace (the same point on every worker): the link rate, where
        fusion="auto" sizes buckets for it, io_threads auto has lanes to size or hierarchical
        auto has a path to choose."""
        if self._fusion_link_rate is not None or self.world_size < 2:
            return
        if (self.fusion_bytes == AUTOMATIC_FUSION or _lanes_to_size()
                or _link_probe.path_to_choose(runtime.stats())):
            self._fusion_link_rate = self._agree_on_link_rate()

    def _agree_on_link_rate(self) -> _link_probe.FusionLinkRate:
        """$PROPHET_LINK_GBPS when set; else every worker measures the link (eagerly, also when
        called while a step is traced) and all take the slowest worker's rate, rounded to the
        1-2-5 series (prophet_tf/_link_probe.py). The probe also sizes the lanes where
        io_threads auto connected several (then it runs with $PROPHET_LINK_GBPS set too, for
        the CPU per byte, and sizes them for that rate), and chooses the push_pulls' path where
        hierarchical auto allows two (the faster in the probe's rounds)."""
        env_Bps = runtime.fusion_link_bps()
        lanes = _lanes_to_size()
        if env_Bps > 0 and not lanes and not _link_probe.path_to_choose(runtime.stats()):
            return _link_probe.FusionLinkRate(source="env", gbps=env_Bps * 8 / 1e9)
        # A worker still creating variables hears of it before it waits for the probe.
        self._before_each()
        with tf.init_scope():
            if not tf.executing_eagerly():
                logger.warning("fusion: no eager context to measure the link from; buckets are "
                               "sized for the runtime's assumed 10 Gbit/s (set $%s to the link "
                               "rate)", runtime.LINK_GBPS_ENV)
                return _link_probe.FusionLinkRate(source="assumed", gbps=None)
            rate = _link_probe.probe(self.world_size, CONTROL_PRIORITY, size_lanes=bool(lanes),
                                     link_Bps=env_Bps or None)
        logger.info("fusion: link rate measured %.3g Gbit/s on rank %d, agreed %.3g Gbit/s (the "
                    "slowest of %d workers), buckets sized for %g Gbit/s; the probe took %.0f ms",
                    rate.measured_gbps, self.rank, rate.agreed_gbps, self.world_size, rate.gbps,
                    rate.probe_seconds * 1e3)
        if rate.io_threads is not None:
            sized_gbps = env_Bps * 8 / 1e9 if env_Bps > 0 else rate.agreed_gbps
            logger.info("io_threads: %d of %d lanes for %.3g Gbit/s at %.3g ns of I/O CPU per byte "
                        "(the costliest worker)", rate.io_threads, lanes, sized_gbps,
                        rate.cpu_ns_per_byte)
        if rate.two_level is not None:
            logger.info("hierarchical: push_pulls take the %s path (the probe's slowest worker: "
                        "%.1f ms a round on the two-level path, %.1f ms on the flat one)",
                        "two-level" if rate.two_level else "flat", rate.two_level_round_s * 1e3,
                        rate.flat_round_s * 1e3)
        if env_Bps > 0:
            return dataclasses.replace(rate, source="env", gbps=env_Bps * 8 / 1e9)
        return rate


def _lanes_to_size() -> int:
    """The lanes io_threads auto connected and the probe has not sized yet (0: none to size)."""
    stats = runtime.stats()
    lanes = int(stats.get("lanes", 1))
    return lanes if lanes > int(stats.get("io_threads", 1)) else 0


def _static_dense_bytes(slices) -> Optional[int]:
    if slices.dense_shape is None:
        return None
    shape = tensor_util.constant_value(slices.dense_shape)
    if shape is None:
        return None
    n = 1
    for d in shape.tolist():
        n *= int(d)
    return n * slices.values.dtype.size


# Dtypes push_pull carries natively; others are cast (exactly) to one of these. (broadcast and
# allgather also take uint8 and bool, but casting those is cheap and keeps one rule.)
_NATIVE_DTYPES = frozenset([tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64])


def wire_dtype(dtype):
    """The dtype ``dtype`` travels as (exactly)."""
    dtype = tf.as_dtype(dtype)
    if dtype in _NATIVE_DTYPES:
        return dtype
    if dtype == tf.bool or dtype.is_integer:
        return tf.int64 if dtype.size >= 4 else tf.int32
    raise TypeError(f"ProphetStrategy cannot communicate tensors of dtype {dtype.name}")


def aggregation_name(v) -> str:
    """How a metric state variable's values combine across workers."""
    agg = getattr(v, "aggregation", None)
    if isinstance(agg, str):
        return agg
    if agg == tf.VariableAggregation.MEAN:
        return "mean"
    if agg == tf.VariableAggregation.ONLY_FIRST_REPLICA:
        return "only_first_replica"
    if agg == tf.VariableAggregation.NONE:
        return "none"  # stays local
    return "sum"  # metric state: counts and totals add up across workers
