"""Small, guarded hooks into Keras 3 for multi-worker `ProphetStrategy` runs.

Keras 3 leaves a few cross-worker concerns to the strategy that a one-device-per-process strategy
cannot see through the tf.distribute API alone. Each hook below only acts when the model's (or
the current) strategy is a multi-worker :class:`prophet_tf.ProphetStrategy`; otherwise it calls
the original Keras method unchanged. ``install()`` is idempotent.

* ``Trainer.get_metrics_result``: metric state variables are summed across workers (one
  ``push_pull`` per dtype) and the results computed from the global state with
  ``Metric.stateless_result``. Keras calls it in every train/test step (the logs) and once after
  each epoch/evaluation, identically on every worker, so every worker prints the same numbers.
* ``TFOptimizer._backend_update_step``: tells the strategy which variables the next all-reduce
  belongs to, so gradients are named ``grad/<variable path>``.
* ``LossScaleOptimizer.check_finite``: finiteness is reduced across workers, so either every
  worker applies the step (and makes its gradient all-reduce) or none does.
* ``TensorFlowTrainer.predict``: the input is sharded like fit's, so the per-step outputs are
  all-gathered and every worker returns the predictions for all of the input, in order.
"""

from __future__ import annotations

import functools
import itertools
import time
import threading
import weakref

_installed = False
_lock = threading.Lock()


def _prophet_extended(strategy):
    from prophet_tf.strategy import ProphetStrategy
    if isinstance(strategy, ProphetStrategy) and strategy.extended._world_size > 1:
        return strategy.extended
    return None


def _current_extended():
    import tensorflow as tf
    return _prophet_extended(tf.distribute.get_strategy())


def _model_extended(model):
    try:
        strategy = model.distribute_strategy
    except Exception:  # noqa: BLE001 - not a TF trainer
        return None
    return _prophet_extended(strategy)


def install() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _patch_metrics()
        _patch_optimizer()
        _patch_loss_scale()
        _patch_predict()
        _patch_step_markers()
        _installed = True


# ---- timeline step markers ----------------------------------------------------------------

def _patch_step_markers():
    """Each call of the train function becomes a "step" span on the timeline (when one is written).

    Forward and backward progress inside a step are already on the trace: a layer's forward pass
    starts when its "gate" span ends, and the backward pass emits a "ready" instant per gradient.
    """
    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TensorFlowTrainer
    original = cls.make_train_function
    if getattr(original, "_prophet_patched", False):
        return

    @functools.wraps(original)
    def make_train_function(self, force=False):
        result = original(self, force)
        from prophet_tf import runtime

        function = self.train_function
        if (_model_extended(self) is None or function is None or getattr(function, "_prophet_marked", False)
                or not runtime.timeline_enabled()):
            return result
        steps = itertools.count()

        def marked(*args, **kwargs):
            start = time.monotonic_ns()
            try:
                return function(*args, **kwargs)
            finally:
                runtime.timeline_event("step", f"step {next(steps)}", start, time.monotonic_ns())

        marked._prophet_marked = True
        self.train_function = marked
        return result

    make_train_function._prophet_patched = True
    cls.make_train_function = make_train_function


# ---- metrics ------------------------------------------------------------------------------

def _patch_metrics():
    from keras.src.trainers import trainer as base_trainer

    original = base_trainer.Trainer.get_metrics_result
    if getattr(original, "_prophet_patched", False):
        return

    @functools.wraps(original)
    def get_metrics_result(self):
        ext = _model_extended(self)
        if ext is None:
            return original(self)
        metrics = list(self.metrics)
        per_metric = [list(m.variables) for m in metrics]
        flat = [v for vs in per_metric for v in vs]
        reduced = ext._reduce_metric_state(flat)
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
        return return_metrics

    get_metrics_result._prophet_patched = True
    base_trainer.Trainer.get_metrics_result = get_metrics_result


# ---- gradient names -----------------------------------------------------------------------

def _patch_optimizer():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer

    cls = tf_optimizer.TFOptimizer
    original = cls._backend_update_step
    if getattr(original, "_prophet_patched", False):
        return

    @functools.wraps(original)
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        ext = _current_extended()
        if ext is None:
            return original(self, grads, trainable_variables, learning_rate)
        paths = [_variable_path(v) for g, v in zip(grads, trainable_variables) if g is not None]
        with ext._gradient_site(paths, self):
            return original(self, grads, trainable_variables, learning_rate)

    _backend_update_step._prophet_patched = True
    cls._backend_update_step = _backend_update_step


def _variable_path(v) -> str:
    path = getattr(v, "path", None)
    if not path:
        path = getattr(v, "name", None) or "variable"
        if path.endswith(":0"):
            path = path[:-2]
    return str(path)


# ---- loss scaling -------------------------------------------------------------------------

def _patch_loss_scale():
    from keras.src.optimizers import loss_scale_optimizer as lso

    cls = lso.LossScaleOptimizer
    original = cls.check_finite
    if getattr(original, "_prophet_patched", False):
        return

    @functools.wraps(original)
    def check_finite(self, grads):
        finite = original(self, grads)
        ext = _current_extended()
        if ext is None:
            return finite
        return ext._all_finite(finite)

    check_finite._prophet_patched = True
    cls.check_finite = check_finite


# ---- predict ------------------------------------------------------------------------------

# model -> (its compile config when traced, the predict function that gathers its outputs).
_gathering_predict_functions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _patch_predict():
    from keras.src.backend.tensorflow import trainer as tf_trainer

    cls = tf_trainer.TensorFlowTrainer
    original = cls.predict
    if getattr(original, "_prophet_patched", False):
        return

    # Only predict: its input is sharded. predict_on_batch gives every worker the whole batch it
    # was called with, so its local result is already complete; it keeps Keras' own cached
    # predict function, predict uses a second one (traced with the gathering) cached here.
    @functools.wraps(original)
    def predict(self, *args, **kwargs):
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

    predict._prophet_patched = True
    cls.predict = predict
