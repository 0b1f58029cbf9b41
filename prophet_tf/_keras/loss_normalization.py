"""Losses averaged over the global batch, not over each worker's share of it.

A Keras loss with reduction ``"sum_over_batch_size"`` (the default), ``"mean"`` or
``"mean_with_sample_weight"`` divides the sum of its weighted values by a count: the number of
values, the number of unmasked values (a mask, e.g. from ``Embedding(mask_zero=True)``), or the
sum of the sample weights. Under a ``tf.distribute`` strategy every replica divides by its own
count and the results are summed, so the update is one process's only when every worker's count
is the same. It is not when the last batch of an epoch splits unevenly (a pipeline whose length is
unknown), when the padding differs between the workers' rows, or when their sample weights differ
(measured on 2 workers: up to 0.08 from one process after 8 steps, silently).

So in a multi-worker ``ProphetStrategy`` replica context the count is summed across the workers
(one small collective in the control band, ahead of the gradients) and every worker divides its
own sum by the global count; the sum over workers is then exactly one process's loss on the global
batch. A mask's weights (``total / valid`` on the valid positions) are made global the same way.
Other reductions (``"sum"``, ``None``) are already exact and left alone. A loss function that
returns one number for the whole batch (``tf.reduce_mean`` over everything) fails closed: a
worker cannot tell whether its number is a mean or a sum of its rows, and Keras adds the workers'
numbers up (a mean counts N times).

The logged loss follows: Keras weighs each step's loss in its ``loss`` tracker by the rows of this
worker's share, and the workers' trackers are summed (``get_metrics_result``); with shares of
different sizes that is not one process's average, so the tracker is weighted by the global batch.
"""

from __future__ import annotations

from typing import Any, Optional

from prophet_tf import runtime
from prophet_tf._keras.host import communicating_host
from prophet_tf._keras.patching import patch

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


def _replica_extended() -> Optional[Any]:
    """The extended of a multi-worker ProphetStrategy when called inside one of its replicas
    (where every worker runs the same computation); None elsewhere, e.g. in a callback or in the
    cross-replica context of ``strategy.scope()``, where a collective could run on one worker."""
    import tensorflow as tf

    extended = communicating_host(tf.distribute.get_strategy())
    if extended is None or tf.distribute.in_cross_replica_context():
        return None
    return extended


def _global_sum(ext, values: list, kind: str) -> list:
    """Sums scalar ``values`` across the workers (float64; no gradient flows through counts)."""
    import tensorflow as tf

    local = tf.stop_gradient(tf.stack([tf.cast(v, tf.float64) for v in values]))
    total = ext.collectives.push_pull(local, ext.collectives.site(kind), runtime.control_priority(), False)
    return tf.unstack(total)


def _scalar_loss_message(ext) -> str:
    import tensorflow as tf

    name = (tf.get_current_name_scope() or "").rstrip("/").split("/")[-1] or "loss"
    return (f"ProphetStrategy: the loss '{name}' returned one number for the whole batch (shape "
            f"()), so on each of the {ext._world_size} workers it covers only that worker's rows, "
            f"and whether it is their mean or their sum cannot be known: added up across the "
            f"workers it would not be one process's loss (a mean would count {ext._world_size} "
            f"times). Return one value per sample instead (reduce every axis but the first, e.g. "
            f"keras.ops.mean(..., axis=-1)); Keras then averages over the global batch.")


def _reduce_values(original, values, sample_weight=None, reduction="sum_over_batch_size"):
    ext = _replica_extended()
    if ext is None:
        return original(values, sample_weight, reduction)
    if values.shape.rank == 0:
        raise ValueError(_scalar_loss_message(ext))
    if reduction not in _MEAN_REDUCTIONS or tuple(values.shape) == (0,):
        return original(values, sample_weight, reduction)
    from keras.src import ops

    loss = ops.sum(values)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        count = ops.sum(sample_weight)
    else:
        count = ops.prod(ops.convert_to_tensor(ops.shape(values), dtype="int32"))
    (global_count,) = _global_sum(ext, [count], "loss_count")
    # Summed over the workers this is one process's sum / count; Keras' own 1/N scaling for
    # distribution (which assumes equal counts) is therefore not applied.
    return ops.divide_no_nan(loss, ops.cast(global_count, loss.dtype))


def _apply_mask(original, sample_weight, mask, dtype, reduction):
    weights = original(sample_weight, mask, dtype, reduction)
    ext = _replica_extended()
    if ext is None or mask is None or reduction not in ("mean", "sum_over_batch_size"):
        return weights
    from keras.src import ops

    # Keras weighs the valid positions by total / valid of this worker's rows; one process
    # weighs them by total / valid of the global batch.
    total = ops.prod(ops.convert_to_tensor(ops.shape(mask), dtype="int32"))
    valid = ops.sum(ops.cast(mask, "float64"))
    global_total, global_valid = _global_sum(ext, [total, valid], "loss_mask")
    local_weight = ops.divide_no_nan(ops.cast(total, "float64"), valid)
    global_weight = ops.divide_no_nan(global_total, global_valid)
    factor = ops.divide_no_nan(global_weight, local_weight)
    return weights * ops.cast(factor, weights.dtype)


def _update_loss_tracker(original, values, sample_weight=None):
    """A model's ``loss`` tracker weighs each step by the global batch's rows."""
    ext = _replica_extended()
    if ext is not None and sample_weight is not None:
        from keras.src import ops

        (rows,) = _global_sum(ext, [sample_weight], "loss_tracker_rows")
        # Each worker adds its (already global) loss times the global rows, and the trackers are
        # summed over N workers: total / count is one process's weighted average.
        sample_weight = ops.cast(rows, "float32")
    return original(values, sample_weight=sample_weight)


def _compile(original, self, *args, **kwargs):
    result = original(self, *args, **kwargs)
    if getattr(self, "_loss_tracker", None) is not None:
        patch(self._loss_tracker, "update_state", _update_loss_tracker)
    return result


def install() -> None:
    """Patches Keras' loss reduction and loss tracker (idempotent)."""
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import trainer as base_trainer

    patch(loss_module, "reduce_values", _reduce_values)
    patch(loss_module, "apply_mask", _apply_mask)
    patch(base_trainer.Trainer, "compile", _compile)
