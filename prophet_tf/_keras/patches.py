"""Small, guarded hooks into Keras 3 for multi-worker `ProphetStrategy` runs.

Keras 3 leaves a few cross-worker concerns to the strategy that a one-device-per-process strategy
cannot see through the tf.distribute API alone. Each hook below only acts when the model's (or
the current) strategy is a multi-worker :class:`prophet_tf.ProphetStrategy` (or a one-worker one
recording a profile); otherwise it calls the original Keras method unchanged. ``install()`` is
idempotent.

* ``Trainer.get_metrics_result``: metric state variables are summed across workers (one
  ``push_pull`` per dtype) and the results computed from the global state with
  ``Metric.stateless_result``. Keras calls it in every train/test step (the logs) and once after
  each epoch/evaluation, identically on every worker, so every worker prints the same numbers.
* ``TFOptimizer._backend_update_step``: the strategy tracks the step's gradients by variable
  object from the all-reduce to the updates and fails closed when one is not summed across
  workers exactly once (``ProphetExtended._optimizer_update_step``, ``prophet_tf/_gradients.py``).
* ``BaseOptimizer._clip_gradients``: in a tracked optimizer step the local gradients are not
  clipped; the strategy clips the reduced ones (``clipnorm``, ``clipvalue`` and
  ``global_clipnorm`` then act on the global batch's gradient, as in one process).
* ``keras.src.losses.loss.reduce_values``/``apply_mask`` and each model's loss tracker: losses
  are averaged over the global batch's count, not each worker's
  (``prophet_tf/_keras/loss_normalization.py``).
* ``LossScaleOptimizer.check_finite``: finiteness is reduced across workers, so either every
  worker applies the step (and makes its gradient all-reduce) or none does.
* ``TensorFlowTrainer.predict``: the input is sharded like fit's, so the per-step outputs are
  all-gathered and every worker returns the predictions for all of the input, in order.
* ``reduce_per_replica`` (what Keras applies to the values a train/test step returns): values not
  already global are averaged across workers, as ``MultiWorkerMirroredStrategy`` does, so a
  custom ``train_step`` logs the same numbers on every worker. (The default steps return metric
  results computed from reduced state: those are left as they are.)
* ``make_train_function``/``make_test_function``: the step functions run in a wrapper (timeline
  marks, ``schedule="auto"``, and the preemption request carried in the step's metric reduction).
* ``TensorFlowTrainer.fit``, ``TFEpochIterator``, ``EpochIterator._enumerate_iterator``: a fit
  knows its position, resumes step-exactly from a backup and stops for a preemption
  (``prophet_tf/_keras/fit_session.py``).
* ``TensorFlowTrainer._make_function``/``make_predict_function`` with ``jit_compile=True``: the
  step functions are built without it, and XLA compiles each step in clusters around the
  exchange between workers, which it cannot compile (``prophet_tf/_xla.py``).
* ``TensorFlowTrainer._maybe_symbolic_build``: the model is built from the input's element spec,
  without reading a batch, so the input is read as in one process (a generator's first batch,
  a reshuffling ``shuffle``'s seeds).
* ``Trainer._symbolic_build``: a model that defines ``train_step`` but no ``call()`` (a GAN, a
  VAE) is not traced symbolically (Keras would fail with "Unable to automatically build the
  model" under any strategy); like without a strategy, it builds in its first step.
* ``TensorFlowTrainer.fit``, ``CallbackList.on_epoch_end`` and the train function: the step
  report (``prophet_tf/_keras/step_report.py``; any ProphetStrategy with ``step_report=True``, one
  worker included) measures every step and adds its ``prophet/...`` keys to the epoch logs.
"""

from __future__ import annotations

import functools
import itertools
import time
import threading
import weakref

from prophet_tf import preemption, runtime
from prophet_tf._gradients import tf_variable
from prophet_tf._keras import fit_session, loss_normalization, step_report
from prophet_tf._keras.fit_session import STOP_KEY
from prophet_tf._keras.host import communicating_host, host_of
from prophet_tf._keras.patching import patch

_installed = False
_lock = threading.Lock()


def _current_extended():
    import tensorflow as tf
    return communicating_host(tf.distribute.get_strategy())


def _model_extended(model):
    try:
        strategy = model.distribute_strategy
    except Exception:  # noqa: BLE001 - not a TF trainer
        return None
    return communicating_host(strategy)


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _patch_metrics()
        _patch_optimizer()
        _patch_clipping()
        _patch_loss_scale()
        _patch_predict()
        _patch_step_functions()
        _patch_fit()
        _patch_step_outputs()
        _patch_build_without_call()
        _patch_build_without_reading()
        _patch_jit_compile()
        loss_normalization.install()
        _installed = True


# ---- step functions ------------------------------------------------------------------------

def _patch_step_functions():
    """Each call of the train (and test) function runs in a wrapper that

    * marks it as a "step" span on the timeline (train, when one is written);
    * measures it for the step report (train; prophet_tf/_step_report);
    * gives ``schedule="auto"`` its occasion to choose the schedule (prophet_tf/_auto_schedule);
    * carries this worker's preemption request in the step's reductions and acts on the agreed
      one (prophet_tf/preemption.py, prophet_tf/_keras/fit_session.py).

    Forward and backward progress inside a step are already on the trace: a layer's forward pass
    starts when its "gate" span ends, and the backward pass emits a "ready" instant per gradient.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def make_train_function(original, self, force=False):
        result = original(self, force)
        self.train_function = _wrap_step_function(self, self.train_function, training=True)
        return result

    def make_test_function(original, self, force=False):
        result = original(self, force)
        self.test_function = _wrap_step_function(self, self.test_function, training=False)
        return result

    patch(tf_trainer.TensorFlowTrainer, "make_train_function", make_train_function)
    patch(tf_trainer.TensorFlowTrainer, "make_test_function", make_test_function)


def _wrap_step_function(model, function, training: bool):
    if function is None or getattr(function, "_prophet_wrapped", False):
        return function
    ext = _model_extended(model)
    reporter = step_report.reporter_of(model) if training else None  # one worker included
    auto = ext._auto_schedule if training and ext is not None else None
    marking = training and ext is not None and runtime.timeline_enabled()
    coordinating = ext is not None and ext._multi and preemption.armed()
    if not (marking or auto is not None or reporter is not None or coordinating):
        return function
    steps = itertools.count()
    per_call = max(1, int(getattr(model, "steps_per_execution", 1) or 1))

    def wrapped(*args, **kwargs):
        step = next(steps)
        if auto is not None:
            auto.before_step(step)
        if coordinating:
            preemption.before_step()
        start = time.monotonic_ns()
        if reporter is not None:
            reporter.begin_step()
        try:
            if coordinating:
                out = preemption.run_carrying(function, *args, **kwargs)
            else:
                out = function(*args, **kwargs)
        finally:
            if reporter is not None:
                reporter.end_step()
            if marking:
                runtime.timeline_event("step", f"step {step}", start, time.monotonic_ns())
        if auto is not None:
            auto.after_step(step, start, time.monotonic_ns())
        if coordinating:
            fit_session.after_step(out, training, per_call)
        return out

    wrapped._prophet_wrapped = True
    return wrapped


# ---- fit: the step report, position, step-exact resume, preemption stop ----------------------

def _patch_fit():
    """``fit`` (one patch: ``_patch`` wraps a method once) runs, on several workers, in a session
    (prophet_tf/_keras/fit_session.py: its position, a step-exact resume from a restored backup, the
    preemption stop), and inside it gets the step report's callback first among its callbacks
    (its keys reach every other callback). The training epoch iterator resumes step-exactly.
    The report's line is printed once every callback's ``on_epoch_end`` ran, after Keras's
    progress bar."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.callbacks import callback_list
    from keras.src.trainers import epoch_iterator

    def fit(original, self, *args, **kwargs):
        @functools.wraps(original)
        def with_report(model, *a, **k):
            return step_report.fit_with_report(original, model, a, k)

        ext = _model_extended(self)
        if ext is None or not ext._multi:
            return with_report(self, *args, **kwargs)
        return fit_session.run_fit(with_report, self, ext, args, kwargs)

    def epoch_iterator_init(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        fit_session.claim_iterator(self)

    def enumerate_iterator(original, self):
        return fit_session.enumerate_epoch(original, self)

    def on_epoch_end(original, self, epoch, logs=None):
        original(self, epoch, logs)
        step_report.after_epoch_end(self)

    patch(tf_trainer.TensorFlowTrainer, "fit", fit)
    patch(tf_trainer.TFEpochIterator, "__init__", epoch_iterator_init)
    patch(epoch_iterator.EpochIterator, "_enumerate_iterator", enumerate_iterator)
    patch(callback_list.CallbackList, "on_epoch_end", on_epoch_end)


# ---- metrics ------------------------------------------------------------------------------

def _patch_metrics():
    from keras.src.trainers import trainer as base_trainer

    def get_metrics_result(original, self):
        ext = _model_extended(self)
        if ext is None:
            return original(self)
        metrics = list(self.metrics)
        per_metric = [list(m.variables) for m in metrics]
        flat = [v for vs in per_metric for v in vs]

        stop_flag = preemption.flag_to_carry() if ext._multi else None
        reduced, agreed_stop = ext.collectives.reduce_metric_state(flat, stop_flag)
        return_metrics = {}
        k = 0
        for metric, vs in zip(metrics, per_metric):
            values = reduced[k:k + len(vs)]
            k += len(vs)
            result = metric.stateless_result(values) if vs else metric.result()
            if isinstance(result, dict):
                return_metrics.update(result)
            else:
                return_metrics[metric.name] = result
        if agreed_stop is not None:
            return_metrics[STOP_KEY] = agreed_stop  # taken out by the step function's wrapper
        for value in return_metrics.values():
            _mark_global(value)
        return return_metrics

    patch(base_trainer.Trainer, "get_metrics_result", get_metrics_result)


# ---- the optimizer step ---------------------------------------------------------------------

def _patch_optimizer():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    def _backend_update_step(original, self, grads, trainable_variables, learning_rate):
        ext = _optimizer_extended(self, trainable_variables)
        if ext is None:
            return original(self, grads, trainable_variables, learning_rate)
        return ext._optimizer_update_step(
            self, grads, trainable_variables,
            lambda: original(self, grads, trainable_variables, learning_rate))

    patch(tf_optimizer.TFOptimizer, "_backend_update_step", _backend_update_step)


def _optimizer_extended(optimizer, variables):
    """The multi-worker ProphetExtended that owns these variables (or this optimizer, or the
    current scope), whatever context the optimizer step runs in: a step outside the strategy's
    replica context must be caught, not passed through."""
    for v in variables:
        ext = communicating_host(getattr(tf_variable(v), "_distribute_strategy", None))
        if ext is not None:
            return ext
    return (communicating_host(getattr(optimizer, "_distribution_strategy", None))
            or _current_extended())


# ---- gradient clipping ----------------------------------------------------------------------

def keras_clip_gradients():
    """Keras's own ``BaseOptimizer._clip_gradients(optimizer, grads)`` (unpatched)."""
    from keras.src.optimizers import base_optimizer

    method = base_optimizer.BaseOptimizer._clip_gradients
    return getattr(method, "__wrapped__", method)


def _patch_clipping():
    from keras.src.optimizers import base_optimizer

    def _clip_gradients(original, self, grads):
        ext = _optimizer_extended(self, [])
        if ext is not None and ext.clips_after_reduction():
            return grads  # clipped once reduced (ProphetExtended._reduce_gradients)
        return original(self, grads)

    patch(base_optimizer.BaseOptimizer, "_clip_gradients", _clip_gradients)


# ---- loss scaling -------------------------------------------------------------------------

def _patch_loss_scale():
    from keras.src.optimizers import loss_scale_optimizer as lso

    def check_finite(original, self, grads):
        finite = original(self, grads)
        ext = _current_extended()
        if ext is None:
            return finite
        return ext.collectives.all_finite(finite)

    patch(lso.LossScaleOptimizer, "check_finite", check_finite)


# ---- predict ------------------------------------------------------------------------------

# model -> (its compile config when traced, the predict function that gathers its outputs).
_gathering_predict_functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _patch_predict():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    # Only predict: its input is sharded. predict_on_batch gives every worker the whole batch it
    # was called with, so its local result is already complete; it keeps Keras' own cached
    # predict function, predict uses a second one (traced with the gathering) cached here.
    def predict(original, self, *args, **kwargs):
        ext = _model_extended(self)
        if ext is None:
            return original(self, *args, **kwargs)
        key = getattr(self, "_compile_config", None)  # compile() makes a new one
        cached = _gathering_predict_functions.get(self)
        plain = self.predict_function
        self.predict_function = cached[1] if cached is not None and cached[0] is key else None
        try:
            with ext._gathering_outputs():
                return original(self, *args, **kwargs)
        finally:
            _gathering_predict_functions[self] = (key, self.predict_function)
            self.predict_function = plain

    patch(tf_trainer.TensorFlowTrainer, "predict", predict)


# ---- values returned by train/test steps ------------------------------------------------------

_GLOBAL_MARK = "_prophet_global"


def _mark_global(value) -> None:
    """Marks a step output that is already the same on every worker (from reduced state)."""
    try:
        setattr(value, _GLOBAL_MARK, True)
    except (AttributeError, TypeError):
        pass  # not a tensor (a Python number is the same everywhere anyway)


def _average_step_outputs(ext, values):
    """Averages the floating-point step outputs across workers (one push_pull per dtype);
    other dtypes take rank 0's value. Outputs marked global are returned unchanged."""
    import tensorflow as tf
    from keras.src import tree

    flat = tree.flatten(values)
    groups: dict = {}
    for i, value in enumerate(flat):
        if tf.is_tensor(value) and not getattr(value, _GLOBAL_MARK, False):
            groups.setdefault(tf.as_dtype(value.dtype), []).append(i)
    if not groups:
        return values
    out = list(flat)
    site = ext.collectives.site("step_outputs")
    for dtype, idx in groups.items():
        parts = [tf.reshape(flat[i], [-1]) for i in idx]
        sizes = [tf.size(p) for p in parts]
        joined = tf.concat(parts, axis=0)
        name = f"{site}/{dtype.name}/{len(idx)}"
        if dtype.is_floating:
            reduced = ext.collectives.push_pull(joined, name, runtime.control_priority(), True)
        else:
            reduced = ext.collectives.broadcast(joined, name, root_rank=0)
        for i, part in zip(idx, tf.split(reduced, tf.stack(sizes))):
            out[i] = tf.reshape(part, tf.shape(flat[i]))
            _mark_global(out[i])
    return tree.pack_sequence_as(values, out)


def _patch_step_outputs():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def reduce_per_replica(original, values, strategy, reduction):
        ext = communicating_host(strategy)
        if ext is None or reduction not in ("auto", "mean"):
            return original(values, strategy, reduction)  # "concat" (predict) is gathered
        return fit_session.carry_stop_flag(ext, _average_step_outputs(ext, values))

    patch(tf_trainer, "reduce_per_replica", reduce_per_replica)


# ---- models without call() --------------------------------------------------------------------

def _defines_call(model) -> bool:
    from keras.src.models.model import Model
    return type(model).call is not Model.call


def _patch_build_without_call():
    from keras.src.trainers import trainer as base_trainer

    def _symbolic_build(original, self, iterator=None, data_batch=None):
        if (host_of(getattr(self, "_distribute_strategy", None)) is not None
                and not _defines_call(self)):
            # Keras would trace call() on a symbolic batch; there is none. Without a strategy
            # Keras does not build here either: the first train step creates what is missing.
            return None
        return original(self, iterator=iterator, data_batch=data_batch)

    patch(base_trainer.Trainer, "_symbolic_build", _symbolic_build)


def _patch_build_without_reading():
    """Under any distribution strategy Keras builds the model before ``fit``/``evaluate``/
    ``predict`` from a batch it reads from a fresh iterator of the input. That read is not part
    of one process's run (without a strategy Keras builds in the first step): it takes a batch
    from a Python generator, starts a ``PyDataset``'s epoch, and advances the seeds of a
    ``shuffle`` that reshuffles each iteration, so training would start with one process's
    second order. Under a ProphetStrategy the model is built from the input's element spec (the
    shapes and dtypes, which is all the symbolic build reads), without reading."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def _maybe_symbolic_build(original, self, iterator=None, data_batch=None):
        spec = _element_spec(iterator) if iterator is not None else None
        if spec is None or host_of(getattr(self, "_distribute_strategy", None)) is None:
            return original(self, iterator=iterator, data_batch=data_batch)
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=spec)

    patch(tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _maybe_symbolic_build)


def _element_spec(epoch_iterator):
    """The ``tf.TypeSpec`` structure of one batch of a Keras ``TFEpochIterator``'s input (one
    worker's share), or None when it has none."""
    dataset = getattr(epoch_iterator, "_distributed_dataset", None)
    try:
        spec = dataset.element_spec
    except (AttributeError, NotImplementedError, TypeError):
        return None
    from tensorflow.python.util import nest

    # A per-replica spec (several replicas in a process) has one spec per replica: any will do.
    return nest.map_structure(lambda s: getattr(s, "_value_specs", (s,))[0], spec)


# ---- jit_compile=True -------------------------------------------------------------------------

def _patch_jit_compile():
    """Keras compiles a step function as a whole with ``jit_compile=True``, the exchange between
    workers included, which XLA cannot compile. Under a communicating ProphetStrategy the step
    functions are built without ``jit_compile``, and each call runs in the strategy's
    ``_compiling_steps`` context: the replica step it traces is marked for XLA, which compiles
    it in clusters around the exchange (``prophet_tf/_xla.py``)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def compiles_in_clusters(model) -> bool:
        return (_model_extended(model) is not None and not model.run_eagerly
                and bool(model.jit_compile))

    def built_without_jit(original, model, *args):
        jit = model._jit_compile
        model._jit_compile = False  # what Keras reads when it creates the tf.function
        try:
            return original(model, *args)
        finally:
            model._jit_compile = jit

    def _make_function(original, self, step_function):
        if not compiles_in_clusters(self):
            return original(self, step_function)
        function = built_without_jit(original, self, step_function)
        return _compiling_steps(_model_extended(self), function)

    def make_predict_function(original, self, force=False):
        if not compiles_in_clusters(self):
            return original(self, force)
        result = built_without_jit(original, self, force)
        function = self.predict_function
        if function is not None and not getattr(function, "_prophet_compiling", False):
            self.predict_function = _compiling_steps(_model_extended(self), function)
        return result

    patch(tf_trainer.TensorFlowTrainer, "_make_function", _make_function)
    patch(tf_trainer.TensorFlowTrainer, "make_predict_function", make_predict_function)


def _compiling_steps(ext, function):
    """``function`` (a step function) called in ``ext._compiling_steps()``: its trace, which
    happens in its first call, compiles the replica step in XLA clusters."""
    def compiling(*args, **kwargs):
        with ext._compiling_steps():
            return function(*args, **kwargs)

    compiling._prophet_compiling = True
    return compiling
