"""`ProphetStrategy`: data-parallel `tf.distribute.Strategy` on top of the prophet_tf runtime.

One process per worker, one device per process. Unchanged Keras 3 code runs under
``strategy.scope()``; the strategy inserts the project's ops where tf.distribute and Keras ask for
cross-worker communication:

* gradients (``ReplicaContext.all_reduce`` from the Keras optimizer) -> ``push_pull`` with a
  deterministic name per variable (``grad/<variable path>``) and a priority that makes the first
  layer most urgent (``priority = number_of_gradients - index`` in ``trainable_weights`` order);
  sparse gradients (``tf.IndexedSlices``) -> ``allgather`` of indices and values (one-process
  semantics: repeated indices are kept; values summed where the indices do not come from the
  input and are the same on every worker, see ``_sparse``). Every gradient is tracked by its variable object from the
  reduction to the update, and a multi-worker run fails closed where a trainable variable would
  be updated with a gradient that was not summed exactly once (see ``prophet_tf/_gradients.py``);
* ``strategy.reduce`` / ``extended.reduce_to`` / ``batch_reduce_to`` -> ``push_pull`` (SUM is a real
  sum, MEAN divides by the number of workers);
* ``strategy.gather`` / ``ReplicaContext.all_gather`` -> ``allgather``;
* variable creation under the scope -> ``broadcast`` of the initial value from rank 0, after the
  workers agreed that they create the same variable (else every worker raises
  ``VariableMismatchError`` naming it, see ``prophet_tf/_variable_agreement.py``);
* Keras metrics, loss scaling and saving -> see ``prophet_tf/_keras/patches.py`` and
  ``prophet_tf/_keras/saving.py`` (installed when a multi-worker strategy is created).

Input pipelines are sharded with global-batch semantics: ``fit(batch_size=B)`` gives every worker
``B / N`` rows of every global batch (disjoint shards, equal step counts on all workers).

Every worker must run the same program: collectives are matched by name (and a per-name round
counter), so all workers have to create the same variables in the same order and make the same
``fit``/``evaluate``/``predict``/``reduce`` calls.

Known limits:

* every worker must see the same number of global batches per epoch (AUTO sharding is turned into
  DATA sharding, which guarantees it; an explicit FILE policy may not);
* BatchNorm statistics stay local unless ``BatchNormalization(synchronized=True)`` (non-trainable
  weights may differ across workers; rank 0's are saved); variables created with ``synchronization=ON_READ`` outside Keras metrics stay local;
* ``jit_compile=True`` is not supported (the ops have no XLA kernels);
* non-zero ranks write files into a private temporary directory (see ``_keras_saving``); reads are
  not redirected; a save ends when every worker's save did, so rank 0's files are complete then;
* ``evaluate``/``get_metrics_result``/``predict`` and saves are collectives: call them on every
  worker (not only on rank 0, as Horovod scripts do).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import threading
import weakref
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.distribute import reduce_util
from tensorflow.python.eager import context as eager_context
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework import tensor_util
from tensorflow.python.util import nest

from prophet_tf import (_auto_schedule, _crossing, _devices, _gradients, _link_probe, _seeds,
                        _sparse, _variable_agreement, _xla, ops, preemption, runtime)
from prophet_tf._keras import patches, saving
from prophet_tf._keras.host import KerasHost
from prophet_tf._keras.step_report import StepReport, StepReporter, report_every_epoch_default
from prophet_tf.cluster import ELASTIC_ENV, JOB_SEED_ENV, resolve_cluster

__all__ = ["ProphetStrategy", "SCHEDULES"]

logger = logging.getLogger("prophet_tf")

#: Scheduling policies accepted by ``ProphetStrategy(schedule=...)``: the runtime's, and "auto"
#: (the one predicted fastest; see prophet_tf/_auto_schedule.py).
SCHEDULES: tuple[str, ...] = runtime.schedules() + ("auto",)
# Small collectives a step waits on (metrics, loss-scale flags, strategy.reduce) outrank every
# gradient (priorities 1..number of gradients): queued behind low-priority gradients they would
# put a barrier back at the end of every step. The runtime defines the band (never profiled as a
# gradient); this is its lower end.
CONTROL_PRIORITY: int = runtime.control_priority()

# runtime.declare_fusion's bucket size for fusion="auto": sized from N and the link rate.
_AUTOMATIC_FUSION = -1
# Sparse gradients are gathered, never densified, unless the user asks for it (see the docstring of
# ProphetStrategy: densifying changes the result of Adam, RMSprop, Adagrad...).
_DEFAULT_SPARSE_AS_DENSE_BYTES = 0


# --------------------------------------------------------------------------------------------
# Deterministic collective names
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


class _Namer:
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
# Replica context
# --------------------------------------------------------------------------------------------


class _ProphetReplicaContext(distribute_lib.ReplicaContext):
    """Replica context of this worker: ``replica_id_in_sync_group`` is the worker's rank."""

    def __init__(self, strategy, rank: int):
        distribute_lib.ReplicaContext.__init__(self, strategy, replica_id_in_sync_group=rank)

    @property
    def devices(self):
        return self._strategy.extended.worker_devices


# --------------------------------------------------------------------------------------------
# Extended
# --------------------------------------------------------------------------------------------


class ProphetExtended(one_device_strategy.OneDeviceExtended, KerasHost):
    """Implementation of :class:`ProphetStrategy` (one device per worker process); the Keras
    glue (``prophet_tf._keras``) recognises it as a :class:`KerasHost`."""

    def __init__(self, container_strategy, device: str, rank: int, world_size: int,
                 sparse_as_dense_bytes: int = _DEFAULT_SPARSE_AS_DENSE_BYTES,
                 cross_barrier: bool = False, recording: bool = False,
                 compression: Optional[str] = None, fusion_bytes: Optional[int] = None,
                 coordinated: bool = False):
        super().__init__(container_strategy, device)
        # One worker of an elastic job: it runs as a job of several workers does (its collectives
        # go through the runtime, which returns them at once), so that a resumed attempt of one
        # worker continues step-exactly, and stops for a preemption with a checkpoint.
        self._coordinated = bool(coordinated)
        # Fusion of the optimizer's dense gradients (docs/design.md, "Fusion"): None: off; else the
        # bucket size given to runtime.declare_fusion (-1: automatic).
        self._fusion_bytes = fusion_bytes
        # The link rate automatic fusion sizes buckets for, decided at the first declaration
        # (see fusion_link_rate).
        self._fusion_link_rate: Optional[_link_probe.FusionLinkRate] = None
        self._cross_barrier = bool(cross_barrier)
        # How gradients travel (None, "fp16", "bf16"); control collectives never compress.
        self._compression = compression
        # A one-worker run that records a profile: the step's collectives (gradients, metrics,
        # loss-scale flags) go through the runtime as with several workers, which returns them at
        # once, so that the trace shows them (see prophet_tf.predict.profile).
        self._recording = bool(recording)
        self._auto_schedule = None  # an _auto_schedule.AutoSchedule with schedule="auto"
        self._step_reporter = None  # a step_report.StepReporter with step_report=True
        # Gradients verified so far, by how they were reduced ("summed", "gathered", "deferred"):
        # counted when an optimizer step is traced (or runs eagerly), see _gradients.GradientSite.
        self.gradient_counts: collections.Counter = collections.Counter()
        self._rank = int(rank)
        self._world_size = int(world_size)
        self._sparse_as_dense_bytes = int(sparse_as_dense_bytes)
        self._namer = _Namer()
        self._var_counter = 0
        self._var_lock = threading.Lock()
        # Variables were created since this worker last agreed with the others that it creates no
        # further one (see _close_variable_creation).
        self._creation_open = False
        self._local = threading.local()
        self._cluster_resolver = None
        # Preemption (prophet_tf/_keras/fit_session.py): where the strategy's own checkpoint of a
        # fit without BackupAndRestore goes (None: none), and how many fits this worker started.
        self._checkpoint_dir: Optional[str] = None
        self._fit_count = 0

    # ---- identity -----------------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return self._world_size

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return 0

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._rank

    def _in_multi_worker_mode(self):
        # Must stay False: True makes tf.data hand out PerReplica batches and Keras fit fails.
        return False

    @property
    def experimental_between_graph(self):
        return True

    @property
    def experimental_should_init(self):
        return True

    @property
    def should_checkpoint(self):
        return self._rank == 0

    @property
    def should_save_summary(self):
        return self._rank == 0

    @property
    def _multi(self) -> bool:
        return self._world_size > 1 or self._coordinated

    @property
    def _communicates(self) -> bool:
        """The training step's collectives go through the runtime (several workers, or a
        recording)."""
        return self._multi or self._recording

    # ---- replicas -----------------------------------------------------------------------
    def _call_for_each_replica(self, fn, args, kwargs):
        self._close_variable_creation()
        strategy = self._container_strategy()
        compiling = getattr(self._local, "compiling", False)
        with tf_ops.device(self._device), _ProphetReplicaContext(strategy, self._rank):
            if compiling and not eager_context.executing_eagerly():
                outputs = _xla.call_in_clusters(fn, args, kwargs, self._cross_barrier)
            else:
                outputs = fn(*args, **kwargs)
        if self._multi and getattr(self._local, "gather_outputs", 0):
            # Keras predict: every worker returns the predictions of the whole global batch.
            outputs = nest.map_structure(self._gather_output, outputs)
        return outputs

    def _gather_output(self, t):
        if isinstance(t, (tf.Tensor, tf.Variable)) and t.shape.rank:
            return self._allgather(tf.convert_to_tensor(t), self._namer.site("predict"))
        return t

    @contextlib.contextmanager
    def _gathering_outputs(self):
        """Within this context, ``run`` gathers its outputs along dim 0 (used by predict)."""
        self._local.gather_outputs = getattr(self._local, "gather_outputs", 0) + 1
        try:
            yield
        finally:
            self._local.gather_outputs -= 1

    @contextlib.contextmanager
    def _compiling_steps(self):
        """Within this context, the steps ``run`` traces are compiled by XLA in clusters around
        the exchange between workers (``jit_compile=True`` of a Keras model: see _xla)."""
        previous = getattr(self._local, "compiling", False)
        self._local.compiling = True
        try:
            with _xla.calls_without_fused_kernels():
                yield
        finally:
            self._local.compiling = previous

    # ---- variables ----------------------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        if self._multi and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ:
            # Identical initial values on every worker: rank 0's value wins. ON_READ variables
            # (metric state) start from zeros and stay local; they are reduced when read.
            with self._var_lock:
                index = self._var_counter
                self._var_counter += 1
            kwargs["initial_value"] = self._broadcast_initial_value(
                kwargs["initial_value"], kwargs.get("dtype"), index,
                kwargs.get("name") or "Variable", tf_ops.get_name_scope())
        if self._cross_barrier:
            return self._create_gated_variable(**kwargs)
        return super()._create_variable(next_creator, **kwargs)

    def _create_gated_variable(self, **kwargs):
        accepted = ("initial_value", "trainable", "collections", "validate_shape", "caching_device",
                    "name", "dtype", "constraint", "distribute_strategy", "import_scope",
                    "initial_value", "synchronization", "aggregation", "shape",
                    "experimental_enable_variable_lifting")
        args = {k: v for k, v in kwargs.items() if k in accepted and v is not None}
        with tf.device(self._device):
            return _crossing.GatedVariable(**args)

    def _broadcast_initial_value(self, initial_value, dtype, index: int, name: str, scope: str):
        def value():
            v = initial_value() if callable(initial_value) else initial_value
            if hasattr(v, "wrapped_value"):  # CheckpointInitialValue
                v = v.wrapped_value
            v = tf.convert_to_tensor(v, dtype=dtype)
            self._agree_on_variable(index, _variable_agreement.variable_record(
                name, scope, v.shape, v.dtype))
            return self._broadcast_unchecked(v, f"init/{index}/{name}", root_rank=0)
        return value

    def _agree_on_variable(self, index: int, record) -> None:
        """Every worker's record of its ``index``-th variable (or of its end of creation) is
        gathered, eagerly, before anything else is sent for it; VariableMismatchError on every
        worker where they differ (see prophet_tf/_variable_agreement.py). After that error the
        workers still agree on the next index, so the runtime stays usable."""
        with tf.init_scope():
            if not tf.executing_eagerly():
                return  # a graph built outside any eager context: nothing runs before it does
            gathered = ops.allgather(tf.constant(record), name=f"init/{index}",
                                     priority=CONTROL_PRIORITY).numpy()
        try:
            _variable_agreement.check(index, gathered, self._world_size)
        except _variable_agreement.VariableMismatchError:
            with self._var_lock:
                self._var_counter = index + 1
            self._creation_open = False
            raise
        self._creation_open = index < self._var_counter

    def _close_variable_creation(self) -> None:
        """Before this worker's first step or collective after it created variables: it agrees
        with the others that it creates no further one, so that a worker that goes on creating
        variables hears of it instead of waiting for its broadcasts until the timeout (this
        also runs while a step is traced)."""
        if not (self._multi and self._creation_open):
            return
        with self._var_lock:
            index = self._var_counter
        self._agree_on_variable(index, _variable_agreement.end_record(index))

    # ---- the single place where variables are updated --------------------------------------
    def _update(self, var, fn, args, kwargs, group):
        """Runs ``fn(var, *args)``: every optimizer/Keras variable update goes through here.

        Keras calls ``extended.update(var, fn, args=(reduced_grad, lr))`` once per variable after
        the gradients were reduced (and without ``args`` for weight decay, EMA, accumulation).
        Inside an optimizer step the gradient is looked up by the variable object: a deferred one
        becomes the asynchronous update ("crossing the barrier"); a trainable variable without a
        reduced gradient is an error (see _gradients.GradientSite.take_for_update).
        """
        site = self._active_site()
        gradient = site.take_for_update(var) if site is not None else None
        if gradient is not None and gradient.reduced == _gradients.DEFERRED:
            if len(args) != 2 or kwargs:
                raise _gradients.GradientReductionError(
                    f"ProphetStrategy: the deferred gradient of '{gradient.path}' must be applied "
                    f"as update(var, fn, args=(gradient, learning_rate)); got {len(args)} "
                    f"positional and {sorted(kwargs)} keyword arguments.")
            grad, learning_rate = args
            clip = _gradient_clipping(site.optimizer)
            if clip is not None:  # clipnorm/clipvalue: per tensor, on the sum (see _reduce_gradients)
                apply_fn = fn

                def fn(v, summed, lr):
                    return apply_fn(v, clip([summed])[0], lr)
            return _crossing.deferred_update(var, fn, grad, learning_rate, site.optimizer,
                                             gradient.name, gradient.priority,
                                             compression=self._compression)
        return super()._update(var, fn, args, kwargs, group)

    # ---- input --------------------------------------------------------------------------
    def _input_context(self):
        return distribute_lib.InputContext(num_input_pipelines=self._world_size,
                                           input_pipeline_id=self._rank,
                                           num_replicas_in_sync=self._world_size)

    def _experimental_distribute_dataset(self, dataset, options):
        if not self._multi:
            return _without_multi_device_iterator(super()._experimental_distribute_dataset(dataset, options))
        _check_replication_mode(options)
        distributed = _without_multi_device_iterator(input_util.get_distributed_dataset(
            _data_sharded(dataset),
            self._input_workers_with_options(options),
            self._container_strategy(),
            num_replicas_in_sync=self._world_size,
            input_context=self._input_context(),
            options=options))
        # What a resumed fit inspects to know whether its input repeats the interrupted order
        # (prophet_tf/_input_order.py).
        distributed._prophet_source = dataset
        return distributed

    def _distribute_datasets_from_function(self, dataset_fn, options):
        _check_replication_mode(options)
        return _without_multi_device_iterator(input_util.get_distributed_datasets_from_function(
            dataset_fn,
            self._input_workers_with_options(options),
            [self._input_context()],
            self._container_strategy(),
            options=options))

    def _experimental_distribute_values_from_function(self, value_fn):
        return value_fn(distribute_lib.ValueContext(replica_id_in_sync_group=self._rank,
                                                    num_replicas_in_sync=self._world_size))

    # ---- reductions ---------------------------------------------------------------------
    def _reduce_to(self, reduce_op, value, destinations, options):
        del destinations, options
        if not self._communicates:
            return value
        return self._reduce_one(reduce_op, value, self._namer.site("reduce"), priority=CONTROL_PRIORITY)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        values = [v for v, _ in value_destination_pairs]
        if not self._communicates:
            return values
        site = self._site_to_reduce()
        if site is not None:
            return self._reduce_gradients(site, reduce_op, values)
        prefix = self._namer.site("allreduce")
        return [self._reduce_one(reduce_op, v, f"{prefix}/{i}", priority=CONTROL_PRIORITY)
                for i, v in enumerate(values)]

    def _reduce_gradients(self, site, reduce_op, values):
        """The optimizer's gradient all-reduce: ``values[i]`` is the gradient of the site's i-th
        variable. Returns what Keras hands to ``update``: summed/gathered gradients, or the local
        ones where the update is deferred (it sums them itself).

        Clipping (``clipnorm``, ``clipvalue``, ``global_clipnorm``) applies to the reduced
        gradients, as in one process on the global batch: Keras's own clipping of the local
        gradients is skipped (see ``clips_after_reduction``); a deferred update clips its sum."""
        site.reduced = True
        if len(values) != len(site):
            raise _gradients.GradientReductionError(
                f"ProphetStrategy: the optimizer all-reduces {len(values)} gradients but applies "
                f"{len(site)} ({', '.join(site.paths()[:6])}...): cannot tell which gradient "
                "belongs to which variable.")
        defer = self._can_defer(site.optimizer)
        # A variable read inside compiled code waits for its update before the call of the
        # compiled function, not where it reads it (prophet_tf/_xla.py): its update stays in
        # the step.
        deferred = [defer and not isinstance(value, indexed_slices.IndexedSlices)
                    and value.dtype.is_floating and not _xla.read_in_compiled_code(g.variable)
                    for g, value in zip(site.gradients, values)]
        self._declare_fusion(site, reduce_op, values, deferred)
        out = []
        for gradient, value, deferring in zip(site.gradients, values, deferred):
            sparse = isinstance(value, indexed_slices.IndexedSlices)
            if deferring:
                gradient.reduced = _gradients.DEFERRED
                out.append(tf.convert_to_tensor(value))
            else:
                # Sparse gradients are gathered synchronously (also when crossing the barrier).
                gradient.reduced = _gradients.GATHERED if sparse and not self._densified(value) \
                    else _gradients.SUMMED
                out.append(self._reduce_one(reduce_op, value, gradient.name, gradient.priority,
                                            compression=self._compression))
        clip = _gradient_clipping(site.optimizer)
        if clip is None:
            return out
        if getattr(site.optimizer, "global_clipnorm", None):  # _can_defer: nothing deferred
            return clip(out)
        return [g if gradient.reduced == _gradients.DEFERRED else clip([g])[0]
                for gradient, g in zip(site.gradients, out)]

    def _declare_fusion(self, site, reduce_op, values, deferred) -> None:
        """Declares the dense floating gradients of a fixed size to the runtime for fusion, each as
        its push_pull will be (``deferred[i]``: summed by ProphetAsyncApply; else ``_push_pull``),
        at trace time, before any of them is submitted. Every worker traces the same step, so
        every worker declares the same tensors; the others travel alone."""
        if self._fusion_bytes is None or self._world_size < 2:
            return
        if isinstance(reduce_op, str):
            reduce_op = reduce_util.ReduceOp(reduce_op.upper())
        declared = []
        for gradient, value, deferring in zip(site.gradients, values, deferred):
            if isinstance(value, indexed_slices.IndexedSlices) or not value.dtype.is_floating:
                continue
            if not value.shape.is_fully_defined():
                continue
            wire = value.dtype if deferring else _wire_dtype(value.dtype)
            declared.append(runtime.FusedTensor(
                name=gradient.name, dtype=wire.name, shape=tuple(value.shape.as_list()),
                bytes=int(value.shape.num_elements()) * wire.size, priority=int(gradient.priority),
                average=not deferring and reduce_op == reduce_util.ReduceOp.MEAN,
                compression=self._compression))
        runtime.declare_fusion(f"optimizer {id(site.optimizer)}", declared, self._fusion_bytes,
                               link_Bps=self._fusion_link_Bps())

    @property
    def fusion_link_rate(self) -> Optional[_link_probe.FusionLinkRate]:
        """The link rate automatic fusion sizes buckets for, the same on every worker: a
        ``prophet_tf._link_probe.FusionLinkRate`` (its ``source``: ``"probe"``, measured at
        start-up and agreed, ``"env"``, ``$PROPHET_LINK_GBPS``, or ``"assumed"``, the runtime's
        10 Gbit/s where no eager context could run the probe; ``gbps``; and, probed, this
        worker's ``measured_gbps``, the slowest worker's ``agreed_gbps`` and ``probe_seconds``).
        Known from the first fusion declaration on (when the first training step is traced);
        None before, with one worker, and with ``fusion="off"`` or a bucket size in bytes."""
        return self._fusion_link_rate

    def _fusion_link_Bps(self) -> Optional[float]:
        """The link rate runtime.declare_fusion sizes automatic buckets for: the one agreed at
        this strategy's first declaration (measured then, once); None where the runtime's own
        applies (a bucket size in bytes, $PROPHET_LINK_GBPS)."""
        if self._fusion_bytes != _AUTOMATIC_FUSION:
            return None
        if self._fusion_link_rate is None:
            self._fusion_link_rate = self._agree_on_link_rate()
        rate = self._fusion_link_rate
        return rate.bytes_per_s if rate.source == "probe" else None

    def _agree_on_link_rate(self) -> _link_probe.FusionLinkRate:
        """$PROPHET_LINK_GBPS when set; else every worker measures the link (eagerly, also when
        called while a step is traced, as _agree_on_variable does) and all take the slowest
        worker's rate, rounded to the 1-2-5 series (prophet_tf/_link_probe.py)."""
        env_Bps = runtime.fusion_link_bps()
        if env_Bps > 0:
            return _link_probe.FusionLinkRate(source="env", gbps=env_Bps * 8 / 1e9)
        # A worker still creating variables hears of it before it waits for the probe.
        self._close_variable_creation()
        with tf.init_scope():
            if not tf.executing_eagerly():
                logger.warning("fusion: no eager context to measure the link from; buckets are "
                               "sized for the runtime's assumed 10 Gbit/s (set $%s to the link "
                               "rate)", runtime.LINK_GBPS_ENV)
                return _link_probe.FusionLinkRate(source="assumed", gbps=None)
            rate = _link_probe.probe(self._world_size, CONTROL_PRIORITY)
        logger.info("fusion: link rate measured %.3g Gbit/s on rank %d, agreed %.3g Gbit/s (the "
                    "slowest of %d workers), buckets sized for %g Gbit/s; the probe took %.0f ms",
                    rate.measured_gbps, self._rank, rate.agreed_gbps, self._world_size, rate.gbps,
                    rate.probe_seconds * 1e3)
        return rate

    def _reduce_one(self, reduce_op, value, name, priority, compression=None):
        """Sums (or averages) one value; ``compression`` only for gradients (see
        ``ProphetStrategy(compression=...)``), never for control collectives."""
        if isinstance(reduce_op, str):
            reduce_op = reduce_util.ReduceOp(reduce_op.upper())
        mean = reduce_op == reduce_util.ReduceOp.MEAN
        if isinstance(value, indexed_slices.IndexedSlices):
            return self._reduce_indexed_slices(value, name, priority, mean, compression)
        value = tf.convert_to_tensor(value)
        return self._push_pull(value, name, priority, mean, compression)

    def _densified(self, slices) -> bool:
        """Whether these sparse gradients are summed as a dense tensor (``sparse_as_dense_bytes``)."""
        if self._sparse_as_dense_bytes <= 0:
            return False
        dense_bytes = self._static_dense_bytes(slices)
        return dense_bytes is not None and dense_bytes <= self._sparse_as_dense_bytes

    def _reduce_indexed_slices(self, slices, name, priority, mean, compression=None):
        if self._densified(slices):
            # Asked for by the user: one dense push_pull (see sparse_as_dense_bytes).
            return self._push_pull(tf.convert_to_tensor(slices), name, priority, mean, compression)
        if _sparse.mixes_origins(slices.indices):
            raise _gradients.GradientReductionError(
                f"ProphetStrategy: the sparse gradient '{name}' joins lookups of ids from the "
                "input batch with lookups of ids that are not (e.g. one Embedding used for tokens "
                "and for tf.range positions). One process sums the latter over the batch and "
                "keeps the former per row; gathered or summed, the workers' slices cannot give "
                "both. Use a separate Embedding layer for each kind of lookup.")
        # The values travel compressed like dense gradients; the indices exactly.
        values = self._allgather(slices.values, name + "/values", priority, compression)
        indices = self._allgather(slices.indices, name + "/indices", priority)
        if not _sparse.may_come_from_input(slices.indices):
            sizes = self._allgather(tf.reshape(tf.size(slices.indices), [1]), name + "/sizes",
                                    priority)
            values, indices = self._sum_if_same_indices(sizes, values, indices)
        if mean:
            values = values / tf.cast(self._world_size, values.dtype)
        return indexed_slices.IndexedSlices(values, indices, slices.dense_shape)

    def _sum_if_same_indices(self, sizes, values, indices):
        """Gathered slices whose indices do not come from the input (see ``_sparse``): where
        every worker had the same indices, one process on the global batch has those indices once
        with the values summed over the batch, so sum the workers' values. Every worker decides
        on the same gathered tensors, so all take the same branch."""
        n = self._world_size
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

    @staticmethod
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

    # ---- gather -------------------------------------------------------------------------
    def _gather_to_implementation(self, value, destinations, axis, options):
        del destinations, options
        if not self._multi:
            return value
        value = tf.convert_to_tensor(value)
        axis = tf.get_static_value(axis) if tf.is_tensor(axis) else axis
        if axis is None:
            raise ValueError("ProphetStrategy.gather needs a static axis.")
        axis = int(axis)
        rank = value.shape.rank
        if rank is None or rank == 0:
            raise ValueError("gather needs a value of known, non-zero rank; use tf.expand_dims "
                             f"first (got shape {value.shape}).")
        if axis < 0:
            axis += rank
        name = self._namer.site("gather")
        if axis == 0:
            return self._allgather(value, name)
        perm = [axis] + [i for i in range(rank) if i != axis]
        inverse = [perm.index(i) for i in range(rank)]
        gathered = self._allgather(tf.transpose(value, perm), name)
        return tf.transpose(gathered, inverse)

    # ---- the optimizer step (Keras TFOptimizer._backend_update_step) ---------------------------
    def clips_after_reduction(self) -> bool:
        """Whether an optimizer step running now has its gradients clipped after they are reduced
        (by ``_reduce_gradients``) instead of by Keras before: exactly when the step will be
        tracked here (see ``_optimizer_update_step``)."""
        context = tf.distribute.get_replica_context()
        return (self._communicates and context is not None
                and context.strategy is self._container_strategy())

    def _optimizer_update_step(self, optimizer, grads, variables, apply):
        """Runs ``apply()`` (Keras's update step) with its gradients tracked by variable object.

        Raises GradientReductionError before anything is applied when the step runs outside this
        strategy's replica context, and after it when a gradient was not reduced and applied
        exactly once (at trace time in a tf.function).
        """
        keras_variables = [v for g, v in zip(grads, variables) if g is not None]
        paths = [_gradients.variable_path(v) for v in keras_variables]
        context = tf.distribute.get_replica_context()
        if context is None or context.strategy is not self._container_strategy():
            if not self._multi:  # one worker recording a profile: nothing to diverge from
                return apply()
            raise _gradients.outside_replica_context_error(paths, cross_replica=context is None)
        names = [self._namer.unique(f"grad/{p}") for p in paths]
        site = _gradients.GradientSite.create(optimizer, keras_variables, names)
        stack = self._site_stack()
        stack.append(site)
        try:
            result = apply()
        finally:
            stack.pop()
        self.gradient_counts.update(site.verify())
        return result

    def _site_stack(self) -> list:
        stack = getattr(self._local, "gradient_sites", None)
        if stack is None:
            stack = self._local.gradient_sites = []
        return stack

    def _active_site(self):
        """The optimizer step being traced or run in this thread, if any."""
        stack = getattr(self._local, "gradient_sites", None)
        return stack[-1] if stack else None

    def _site_to_reduce(self):
        """The optimizer step whose gradient all-reduce has not happened yet, if any."""
        site = self._active_site()
        return site if site is not None and not site.reduced else None

    # ---- crossing the barrier -------------------------------------------------------------
    def _can_defer(self, optimizer) -> bool:
        """Whether this gradient site's updates may run asynchronously (see cross_barrier)."""
        if not self._cross_barrier or optimizer is None or tf.executing_eagerly():
            return False
        if getattr(optimizer, "gradient_accumulation_steps", None):
            return False
        if getattr(optimizer, "global_clipnorm", None):
            return False  # the clipping needs the norm of every summed gradient first
        # Inside a cond (loss scaling skips a step, accumulation) or a while loop the update
        # must stay where Keras put it.
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if type(graph).__name__ in ("CondBranchFuncGraph", "WhileCondFuncGraph", "WhileBodyFuncGraph"):
                return False
            graph = getattr(graph, "outer_graph", None)
        return True

    def _all_finite(self, finite):
        """True on every worker iff ``finite`` is true on every worker (loss scaling)."""
        if not self._communicates:
            return finite
        bad = tf.cast(tf.logical_not(tf.cast(finite, tf.bool)), tf.float32)
        total = self._push_pull(bad, self._namer.site("loss_scale_finite"), CONTROL_PRIORITY, False)
        return tf.equal(total, 0.0)

    def _reduce_metric_state(self, variables, stop_flag=None):
        """Reduces metric state variables across workers: ``(one tensor per variable, the
        summed ``stop_flag`` or None)``.

        All variables of one (dtype, aggregation) group travel in one push_pull. ``stop_flag`` (a
        float32 ``[1]`` tensor: this worker's preemption request, see ``prophet_tf.preemption``)
        rides as one more element of the float32 sum group, so that the step's coordination
        costs no collective of its own; without such a group it goes alone.
        """
        values = [tf.convert_to_tensor(v) for v in variables]
        if not self._communicates or not (values or stop_flag is not None):
            return values, None
        groups: dict = {}
        for i, (v, t) in enumerate(zip(variables, values)):
            agg = _aggregation_name(v)
            groups.setdefault((t.dtype, agg), []).append(i)
        carrier = (tf.float32, "sum")
        if stop_flag is not None:
            groups.setdefault(carrier, [])
        out = list(values)
        agreed_stop = None
        site = self._namer.site("metrics")
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
                red = self._broadcast(flat, name, root_rank=0)
            else:
                red = self._push_pull(flat, name, CONTROL_PRIORITY, agg == "mean")
            pieces = tf.split(red, sizes)
            if carries:
                agreed_stop = tf.reshape(pieces.pop(), [])
            for i, part in zip(idx, pieces):
                out[i] = tf.reshape(part, tf.shape(values[i]))
        return out, agreed_stop

    def _barrier(self):
        if self._multi:
            return self._push_pull(tf.zeros([], tf.float32), self._namer.site("barrier"), 0, False)
        return tf.zeros([], tf.float32)

    # ---- op wrappers (dtype handling) -------------------------------------------------------
    def _push_pull(self, t, name, priority, mean, compression=None):
        self._close_variable_creation()
        wire = _wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        if mean and not (wire.is_floating):
            y = ops.push_pull(x, name=name, priority=int(priority), average=False)
            y = tf.math.floordiv(y, tf.cast(self._world_size, wire))
        else:
            y = ops.push_pull(x, name=name, priority=int(priority), average=bool(mean),
                              compression=compression)
        return y if wire == t.dtype else tf.cast(y, t.dtype)

    def _broadcast(self, t, name, root_rank=0):
        self._close_variable_creation()
        return self._broadcast_unchecked(t, name, root_rank)

    def _broadcast_unchecked(self, t, name, root_rank=0):
        wire = _wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        y = ops.broadcast(x, name=name, root_rank=int(root_rank))
        return y if wire == t.dtype else tf.cast(y, t.dtype)

    def _allgather(self, t, name, priority=CONTROL_PRIORITY, compression=None):
        self._close_variable_creation()
        wire = _wire_dtype(t.dtype)
        x = t if wire == t.dtype else tf.cast(t, wire)
        y = ops.allgather(x, name=name, priority=int(priority), compression=compression)
        return y if wire == t.dtype else tf.cast(y, t.dtype)


def _gradient_clipping(optimizer):
    """Keras's clipping of ``optimizer`` as a function of a gradient list, or None without
    clipping."""
    if not any(getattr(optimizer, option, None)
               for option in ("clipnorm", "clipvalue", "global_clipnorm")):
        return None
    return functools.partial(patches.keras_clip_gradients(), optimizer)


def _check_replication_mode(options) -> None:
    if (options and options.experimental_replication_mode ==
            distribute_lib.InputReplicationMode.PER_REPLICA):
        raise NotImplementedError(
            "InputReplicationMode.PER_REPLICA is not supported by ProphetStrategy (one "
            "replica per worker): use the default PER_WORKER mode.")


def _without_multi_device_iterator(distributed):
    """Makes the iterators of a distributed dataset plain tf.data iterators on the worker's one
    device, instead of TensorFlow's MultiDeviceIterator.

    A worker has one replica, so there is nothing for a MultiDeviceIterator to spread over
    devices, and it has a use-after-free (TensorFlow 2.21, MirroredStrategy too): its destructor
    drops the dataset before stopping the background thread that reads from it, so deleting an
    iterator while that thread is inside GetNext (an epoch that ends before the data does, as in
    every Keras ``fit`` with ``validation_split``) can crash the process with SIGSEGV.
    ``PER_REPLICA`` without ``fetch_to_device`` is the mode in which TensorFlow's worker iterator
    is ``iter(dataset)``; it is set after construction because ``DistributedDataset`` accepts it
    only from a dataset function. Every element is the same; only the iterator type changes."""
    options = distributed._options or distribute_lib.InputOptions()
    distributed._options = options._replace(
        experimental_fetch_to_device=False,
        experimental_replication_mode=distribute_lib.InputReplicationMode.PER_REPLICA)
    return distributed


def _data_sharded(dataset):
    """AUTO sharding -> DATA sharding: every worker runs the whole input pipeline and keeps its
    share of every global batch. FILE sharding (what AUTO picks for file-based datasets) can give
    workers different numbers of batches, and then they would not make the same collectives.
    An explicit FILE/DATA/HINT/OFF policy set by the user is kept."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    if policy != tf.data.experimental.AutoShardPolicy.AUTO:
        return dataset
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


# Dtypes push_pull carries natively; others are cast (exactly) to one of these. (broadcast and
# allgather also take uint8 and bool, but casting those is cheap and keeps one rule.)
_NATIVE_DTYPES = frozenset([tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64])


def _wire_dtype(dtype):
    dtype = tf.as_dtype(dtype)
    if dtype in _NATIVE_DTYPES:
        return dtype
    if dtype == tf.bool or dtype.is_integer:
        return tf.int64 if dtype.size >= 4 else tf.int32
    raise TypeError(f"ProphetStrategy cannot communicate tensors of dtype {dtype.name}")


def _aggregation_name(v) -> str:
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


# --------------------------------------------------------------------------------------------
# Strategy
# --------------------------------------------------------------------------------------------

class ProphetStrategy(one_device_strategy.OneDeviceStrategy):
    """Synchronous data-parallel training across worker processes with prophet_tf's runtime.

    Args:
      schedule: communication scheduling policy, one of ``"prophet"`` (the default),
        ``"priority"``, ``"fifo"``, or ``"auto"``: after a few steps of ``fit``, the one the
        predictor (``prophet_tf.predict``) expects to be fastest for the measured bandwidth,
        chosen on rank 0 for every worker and revisited when the bandwidth changes.
      cluster_resolver: a ``tf.distribute.cluster_resolver.ClusterResolver``; default: read
        ``TF_CONFIG`` (set by ``python -m prophet_tf.launch``); no ``TF_CONFIG`` = one worker.
      device: the device of this worker's replica. Default: its GPU when the process sees one
        (the launcher gives each worker of a node its own, ``CUDA_VISIBLE_DEVICES`` = its local
        rank; with several visible, the one at ``PROPHET_LOCAL_RANK``), else ``"/cpu:0"``. The
        communication ops run on the worker's CPU either way (see ``prophet_tf._devices``).
      sparse_as_dense_bytes: by default (0) sparse gradients (``tf.IndexedSlices``, e.g. of an
        ``Embedding``) are reduced by gathering every worker's indices and values, repeated
        indices kept, so the optimizer sees exactly the gradient of one process on the global
        batch (as TensorFlow's own strategies do). A value > 0 sums the sparse gradients of tables
        of at most this many bytes as one dense tensor instead (fewer bytes on the wire when most
        rows occur in every step). That CHANGES THE RESULT of optimizers that are not linear in
        the gradient when an index occurs more than once in a global batch: Keras applies an
        ``IndexedSlices`` gradient slice by slice, so e.g. Adam's and RMSprop's second moments and
        Adagrad's accumulator get the sum of the squared slices, whereas the dense sum gives them
        the square of the summed slices. SGD (with or without momentum) is unaffected (up to
        float rounding). Dense reduction is also synchronous, like gathering.
      cross_barrier: let the next step start while lower-priority gradients of the previous
        step are still being summed (results identical to synchronous training): each optimizer
        update is applied asynchronously when its summed gradient arrives, and every read of a
        variable waits only for that variable's pending update. Falls back to synchronous
        updates where an update cannot be deferred (sparse gradients, gradient accumulation,
        loss scaling, ``steps_per_execution`` > 1, eager execution); updates that read variables
        right after the optimizer (EMA, constraints, weight decay) simply wait for them.
      profile_path: record this run's timeline there for ``python -m prophet_tf.predict``
        (default ``$PROPHET_PROFILE``). On one worker, the step's collectives then go through the
        runtime (which returns them at once) so that the trace shows when each gradient is ready,
        its bytes and its update; with several workers it is the same as ``timeline_path``.
      compression: ``None`` (the default: exact), ``"fp16"`` or ``"bf16"``: dense float32 gradients
        (and the values of gathered sparse gradients) travel in 16 bits, half the bytes; the
        owners of the partitions add in float32 and send the sums back compressed, so every
        worker applies the same gradient. float16/bfloat16 gradients already travel in 16 bits,
        float64 ones travel exactly; metrics, loss-scale flags, ``strategy.reduce`` and every
        other collective are never compressed. fp16 scales each partition by a power of two, so
        no finite value becomes infinite. The difference from exact summation is bounded per
        element (docs/compression.md; docs/design.md, "Compression").
      fusion: ``"auto"`` (the default): the optimizer's small dense gradients travel fused into
        buckets of consecutive priorities sized for the number of workers and the link rate, so
        each bucket is summed by every worker instead of a few; a bucket size in bytes; or
        ``None``/``"off"``: every gradient is its own collective. ``"auto"`` with several
        workers measures the link once, when the first training step is traced (6 all-reduces
        of 4 MiB and a gather: 0.2-0.4 s at 1 Gbit/s), and every worker sizes for the slowest
        worker's rate rounded down to 1, 2 or 5 x 10^k Gbit/s (:attr:`fusion_link_rate`;
        docs/design.md, "Fusion", "The size"); ``$PROPHET_LINK_GBPS`` (the same on every worker)
        gives the rate instead, and no measurement is made. Results stay
        deterministic and the same on every worker; with 3 or more workers a fused element may be
        summed by another owner than unfused (another fixed order: other last bits). Workers
        whose gradients differ (a model built differently on one of them) fail ``fit`` within
        seconds with an error naming the first gradient that differs.
      sync_random_seed: when no TensorFlow global seed is set, set one (drawn on rank 0) on every
        worker, so that unseeded shuffles (``fit(shuffle=True)`` on arrays, ``Dataset.shuffle``)
        produce the same order everywhere and the shards of every global batch stay disjoint.
        Operations with a seed of their own (``Dataset.shuffle(seed=5)``) keep the order they
        have in one process without a global seed (``prophet_tf/_seeds.py``). Python's and
        NumPy's global random states (``random``, ``np.random``) become rank 0's on every worker,
        so a ``PyDataset`` that Keras shuffles, or a generator shuffling with them, gives every
        worker one order.
        Keras layers (dropout, initializers) draw their seeds elsewhere and stay independent.
        With ``$PROPHET_JOB_SEED`` that seed is used (the same for every attempt of a job: a
        restarted job's input then has the order of the interrupted one).
      step_report: measure where the time of every ``fit`` step goes (its wall time, the time it
        waited for gradients, the link rate, the schedule) and add it to the epoch logs under
        ``prophet/...`` keys, the same on every worker (see :meth:`step_report` and
        ``prophet_tf/_keras/step_report.py``).
      report_every_epoch: with ``step_report``, rank 0 prints one line per epoch of ``fit``
        (not with ``verbose=0``); default ``$PROPHET_REPORT_EVERY_EPOCH``, on unless 0.
      preemption_signals: signals that make every worker stop at the same step of ``fit``, write
        a checkpoint and exit with status 75 (``prophet_tf.preemption``): a name, a number or a
        list of them; default ``$PROPHET_PREEMPTION_SIGNALS``, else SIGTERM; ``()`` or
        ``"none"``: none (a signal then acts as without the strategy).
      preemption_grace_s: a worker still alive this long after such a signal (no step of
        ``fit`` came) leaves as the signal would have made it (default
        ``$PROPHET_PREEMPTION_GRACE_S``, else 30).
      checkpoint_dir: where a ``fit`` without ``BackupAndRestore`` keeps the checkpoint written
        at a preemption (model and optimizer state, position) and resumes from it (default
        ``$PROPHET_CHECKPOINT_DIR``, which ``prophetrun --checkpoint-dir`` sets; none:
        such a fit stops without a checkpoint).
      **runtime_options: the runtime's options, passed to ``prophet_tf.runtime.init``
        (``partition_bytes``, ``credit_bytes``, ``timeout_s``, ``timeline_path``...; the README's
        table of the runtime's options, ``prophet_tf.runtime.options()``).

    Raises:
      prophet_tf.errors.ClusterConfigError: the cluster description is unusable.
      prophet_tf.errors.ProphetError: the runtime could not start (port in use, peer
        unreachable...).
    """

    def __init__(self, schedule: Optional[str] = None, cluster_resolver=None, *,
                 device: Optional[str] = None,
                 sparse_as_dense_bytes: int = _DEFAULT_SPARSE_AS_DENSE_BYTES,
                 sync_random_seed: bool = True,
                 cross_barrier: bool = True,
                 profile_path: Optional[str] = None,
                 step_report: bool = True,
                 report_every_epoch: Optional[bool] = None,
                 preemption_signals: Any = None,
                 preemption_grace_s: Optional[float] = None,
                 checkpoint_dir: Optional[str] = None,
                 compression: Optional[str] = None,
                 fusion: Any = "auto",
                 **runtime_options):
        ops.compression_attr(compression)  # a bad value fails before the runtime starts
        fusion_bytes = _fusion_setting(fusion)
        auto = schedule == _auto_schedule.AUTO
        if not auto and schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if auto:
            runtime_options["schedule"] = "prophet"  # where AutoSchedule starts
        elif schedule is not None:
            runtime_options["schedule"] = schedule
        info = resolve_cluster(cluster_resolver)
        self._cluster_info = info
        profile_path = profile_path or os.environ.get("PROPHET_PROFILE") or None
        if profile_path:
            if runtime_options.get("timeline_path"):
                raise ValueError("give ProphetStrategy either profile_path (or $PROPHET_PROFILE) or "
                                 "timeline_path: a profile is the run's timeline")
            runtime_options["timeline_path"] = profile_path
        recording = bool(profile_path) and info.world_size == 1
        coordinated = info.world_size > 1 or os.environ.get(ELASTIC_ENV, "").strip() == "1"
        runtime.init(info.rank, info.world_size, list(info.addresses), info.token, **runtime_options)
        self._schedule = _auto_schedule.AUTO if auto else runtime.config()["schedule"]
        extended = ProphetExtended(self, device or _devices.default_device(), info.rank, info.world_size,
                                   sparse_as_dense_bytes=sparse_as_dense_bytes,
                                   cross_barrier=cross_barrier and (coordinated or recording),
                                   recording=recording, compression=compression,
                                   fusion_bytes=fusion_bytes, coordinated=coordinated)
        extended._cluster_resolver = cluster_resolver or _resolver_for(info)
        if step_report:
            extended._step_reporter = StepReporter(
                extended, report_every_epoch_default() if report_every_epoch is None
                else report_every_epoch)
        if auto and info.world_size > 1:
            extended._auto_schedule = _auto_schedule.AutoSchedule(
                extended, replan_threshold=runtime.config()["replan_threshold"],
                runtime_options=runtime.config())
        distribute_lib.Strategy.__init__(self, extended)
        distribute_lib.distribution_strategy_gauge.get_cell("V2").set("ProphetStrategy")
        if coordinated and sync_random_seed:
            _sync_global_seed(extended)
            _sync_host_random_states(extended)
        if coordinated:
            if preemption_signals is None:
                preemption_signals = os.environ.get(preemption.SIGNALS_ENV, "SIGTERM")
            preemption.arm(preemption_signals, preemption_grace_s, info.rank)
            extended._checkpoint_dir = (checkpoint_dir
                                        or os.environ.get(preemption.CHECKPOINT_DIR_ENV) or None)
        patches.install()  # each hook acts only for the strategies it concerns
        if extended._communicates:
            saving.install(extended)

    # Convenience accessors -------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank (0 is the chief: it writes checkpoints and summaries)."""
        return self._cluster_info.rank

    @property
    def world_size(self) -> int:
        """Number of workers (= ``num_replicas_in_sync``)."""
        return self._cluster_info.world_size

    @property
    def schedule(self) -> str:
        """The schedule asked for (a policy of the runtime, or ``"auto"``)."""
        return self._schedule

    @property
    def compression(self) -> Optional[str]:
        """How gradients travel: ``None`` (exact), ``"fp16"`` or ``"bf16"``."""
        return self.extended._compression

    @property
    def fusion_link_rate(self) -> Optional[_link_probe.FusionLinkRate]:
        """The link rate ``fusion="auto"`` sizes buckets for (see
        ``ProphetExtended.fusion_link_rate``): None until the first training step is traced."""
        return self.extended.fusion_link_rate

    @property
    def schedule_in_use(self) -> str:
        """The runtime's policy now (with ``"auto"``, the last one chosen)."""
        auto = self.extended._auto_schedule
        return auto.current if auto is not None else self._schedule

    @property
    def schedule_decisions(self) -> list:
        """With ``schedule="auto"``: every decision so far (step, schedule, predicted step time
        of each candidate, link rate, reason); otherwise empty."""
        auto = self.extended._auto_schedule
        return list(auto.decisions) if auto is not None else []

    def step_report(self) -> StepReport:
        """Where the time of this worker's ``fit`` steps went since the start of the current (or
        last) epoch: a ``prophet_tf._keras.step_report.StepReport`` (mean step time, time waiting
        for gradients and its parts, compute time, link rate, schedule and Prophet's blocks, the
        last step's figures). The epoch logs hold the same figures averaged over the workers.

        Raises:
          ValueError: the strategy was created with ``step_report=False``.
        """
        reporter = self.extended._step_reporter
        if reporter is None:
            raise ValueError("this ProphetStrategy was created with step_report=False: create it "
                             "with step_report=True (the default) to measure the steps of fit")
        return reporter.report()

    def barrier(self):
        """Blocks until every worker has called ``barrier()`` (e.g. after rank 0 saved a file)."""
        return self.extended._barrier()

    def __deepcopy__(self, memo):
        # Like other strategies (the runtime is process-global): a copy is the same strategy.
        memo[id(self)] = self
        return self


def _fusion_setting(fusion: Any) -> Optional[int]:
    """``ProphetStrategy(fusion=...)`` as runtime.declare_fusion's bucket size (None: off)."""
    if fusion is None or fusion == "off":
        return None
    if fusion == "auto":
        return _AUTOMATIC_FUSION
    if isinstance(fusion, int) and not isinstance(fusion, bool) and fusion > 0:
        return fusion
    raise ValueError(f"fusion must be None, 'off', 'auto' or a positive number of bytes, got {fusion!r}")


def _resolver_for(info):
    """A cluster resolver describing the job in rank order (``task_id`` == rank)."""
    from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver
    spec = tf.train.ClusterSpec({"worker": list(info.addresses)} if info.addresses else {})
    return SimpleClusterResolver(spec, task_type="worker", task_id=info.rank)


def _sync_global_seed(extended) -> None:
    """Sets the same TF global seed on every worker unless the program already set one: rank 0's
    ``$PROPHET_JOB_SEED``, else a number rank 0 draws."""
    if not eager_context.executing_eagerly() or eager_context.global_seed() is not None:
        return
    import random
    job_seed = os.environ.get(JOB_SEED_ENV, "").strip()
    try:
        chosen = int(job_seed) if job_seed else random.SystemRandom().randrange(1, 2**31 - 1)
    except ValueError:
        raise ValueError(f"${JOB_SEED_ENV} must be an integer, got {job_seed!r}") from None
    local = tf.constant([chosen], tf.int64)
    seed = int(extended._broadcast(local, "init/random_seed", root_rank=0).numpy()[0])
    _seeds.set_job_seed(seed)



def _sync_host_random_states(extended) -> None:
    """Python's and NumPy's global random states of rank 0 on every worker
    (``prophet_tf/_seeds.py``, :func:`set_host_random_states`)."""
    if not eager_context.executing_eagerly():
        return
    local = tf.constant(_seeds.host_random_states())
    _seeds.set_host_random_states(
        extended._broadcast(local, "init/host_random_states", root_rank=0).numpy())
