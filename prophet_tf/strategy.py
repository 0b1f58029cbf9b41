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
import threading
from typing import Any, Optional

import tensorflow as tf
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import input_util
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.eager import context as eager_context
from tensorflow.python.framework import indexed_slices
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.util import nest

from prophet_tf import (_auto_schedule, _crossing, _devices, _gradients, _link_probe, _seeds,
                        _variable_agreement, _xla, ops, preemption, runtime)
from prophet_tf._collectives import AUTOMATIC_FUSION, CONTROL_PRIORITY, Collectives
from prophet_tf._keras import patches, saving
from prophet_tf._keras.host import KerasHost
from prophet_tf._keras.step_report import StepReport, StepReporter, report_every_epoch_default
from prophet_tf.cluster import ELASTIC_ENV, JOB_SEED_ENV, resolve_cluster

__all__ = ["ProphetStrategy", "SCHEDULES"]

logger = logging.getLogger("prophet_tf")

#: Scheduling policies accepted by ``ProphetStrategy(schedule=...)``: the runtime's, and "auto"
#: (the one predicted fastest; see prophet_tf/_auto_schedule.py).
SCHEDULES: tuple[str, ...] = runtime.schedules() + ("auto",)
# Sparse gradients are gathered, never densified, unless the user asks for it (see the docstring of
# ProphetStrategy: densifying changes the result of Adam, RMSprop, Adagrad...).
_DEFAULT_SPARSE_AS_DENSE_BYTES = 0


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
        self._cross_barrier = bool(cross_barrier)
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
        # How values cross workers (prophet_tf/_collectives.py). Fusion of the optimizer's dense
        # gradients (docs/design.md, "Fusion"): fusion_bytes None: off; else the bucket size given
        # to runtime.declare_fusion (AUTOMATIC_FUSION: sized from N and the link rate).
        self.collectives = Collectives(
            rank, world_size, communicates=self._communicates, compression=compression,
            fusion_bytes=fusion_bytes, sparse_as_dense_bytes=sparse_as_dense_bytes,
            before_each=self._close_variable_creation)
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
    def _compression(self) -> Optional[str]:
        """How gradients travel (None, "fp16", "bf16"); control collectives never compress."""
        return self.collectives.compression

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
            return self.collectives.allgather(tf.convert_to_tensor(t),
                                              self.collectives.site("predict"))
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
            return self.collectives.broadcast_unchecked(v, f"init/{index}/{name}", root_rank=0)
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
        return self.collectives.reduce(reduce_op, value, self.collectives.site("reduce"),
                                       priority=CONTROL_PRIORITY)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        del options
        values = [v for v, _ in value_destination_pairs]
        if not self._communicates:
            return values
        site = self._site_to_reduce()
        if site is not None:
            return self._reduce_gradients(site, reduce_op, values)
        prefix = self.collectives.site("allreduce")
        return [self.collectives.reduce(reduce_op, v, f"{prefix}/{i}", priority=CONTROL_PRIORITY)
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
        self.collectives.declare_fusion(f"optimizer {id(site.optimizer)}", site.gradients,
                                        reduce_op, values, deferred)
        out = []
        for gradient, value, deferring in zip(site.gradients, values, deferred):
            sparse = isinstance(value, indexed_slices.IndexedSlices)
            if deferring:
                gradient.reduced = _gradients.DEFERRED
                out.append(tf.convert_to_tensor(value))
            else:
                # Sparse gradients are gathered synchronously (also when crossing the barrier).
                gradient.reduced = _gradients.GATHERED \
                    if sparse and not self.collectives.densified(value) else _gradients.SUMMED
                out.append(self.collectives.reduce(reduce_op, value, gradient.name,
                                                   gradient.priority,
                                                   compression=self._compression))
        clip = _gradient_clipping(site.optimizer)
        if clip is None:
            return out
        if getattr(site.optimizer, "global_clipnorm", None):  # _can_defer: nothing deferred
            return clip(out)
        return [g if gradient.reduced == _gradients.DEFERRED else clip([g])[0]
                for gradient, g in zip(site.gradients, out)]

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
        name = self.collectives.site("gather")
        if axis == 0:
            return self.collectives.allgather(value, name)
        perm = [axis] + [i for i in range(rank) if i != axis]
        inverse = [perm.index(i) for i in range(rank)]
        gathered = self.collectives.allgather(tf.transpose(value, perm), name)
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
        names = [self.collectives.namer.unique(f"grad/{p}") for p in paths]
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


# --------------------------------------------------------------------------------------------
# Strategy
# --------------------------------------------------------------------------------------------

class ProphetStrategy(one_device_strategy.OneDeviceStrategy):
    """Synchronous data-parallel training across worker processes with prophet_tf's runtime.

    Args:
      schedule: communication scheduling policy, one of ``"prophet"`` (the default),
        ``"priority"``, ``"fifo"``, or ``"auto"``: after a few steps of ``fit``, the one the
        predictor (``prophet_tf.predict``) expects to be fastest for the measured bandwidth,
        chosen on rank 0 for every worker and revisited when the bandwidth changes; or, for
        comparison, the published schedulers as their code defines them: ``"bytescheduler"``
        (partitions of 1M parameters, a credit of 4M parameters that returns when a partition's
        sum is back) and ``"p3"`` (slices of 40,000 parameters, one slice per peer waiting to
        leave); these two cut the gradients themselves, so ``fusion="auto"`` fuses nothing
        under them (docs/design.md, "The published schedulers").
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
        policy = runtime.config()["schedule"]
        if fusion_bytes == AUTOMATIC_FUSION and not runtime.schedule_traits()[policy]["automatic_fusion"]:
            fusion_bytes = None  # the schedule's own partitions are what travels
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
    def two_level_hosts(self) -> int:
        """How many hosts the two-level path sums over (``hierarchical``: by default where the job
        spans several hosts and some host has several workers, unless the start-up probe found
        the flat path faster: ``fusion_link_rate.two_level``); 0 on the flat path."""
        if not runtime.is_initialized():
            return 0
        return int(runtime.stats().get("two_level_hosts", 0))

    @property
    def fusion_link_rate(self) -> Optional[_link_probe.FusionLinkRate]:
        """The link rate ``fusion="auto"`` sizes buckets for (see
        ``prophet_tf._collectives.Collectives.fusion_link_rate``): None until the first training step is traced."""
        return self.extended.collectives.fusion_link_rate

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
        collectives = self.extended.collectives
        if self.extended._multi:
            return collectives.push_pull(tf.zeros([], tf.float32), collectives.site("barrier"), 0,
                                         False)
        return tf.zeros([], tf.float32)

    def __deepcopy__(self, memo):
        # Like other strategies (the runtime is process-global): a copy is the same strategy.
        memo[id(self)] = self
        return self


def _fusion_setting(fusion: Any) -> Optional[int]:
    """``ProphetStrategy(fusion=...)`` as runtime.declare_fusion's bucket size (None: off)."""
    if fusion is None or fusion == "off":
        return None
    if fusion == "auto":
        return AUTOMATIC_FUSION
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
    seed = int(extended.collectives.broadcast(local, "init/random_seed", root_rank=0).numpy()[0])
    _seeds.set_job_seed(seed)



def _sync_host_random_states(extended) -> None:
    """Python's and NumPy's global random states of rank 0 on every worker
    (``prophet_tf/_seeds.py``, :func:`set_host_random_states`)."""
    if not eager_context.executing_eagerly():
        return
    local = tf.constant(_seeds.host_random_states())
    _seeds.set_host_random_states(
        extended.collectives.broadcast(local, "init/host_random_states", root_rank=0).numpy())
