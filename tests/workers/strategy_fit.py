"""Keras features under ProphetStrategy: fit with validation data and callbacks, evaluate,
predict, save/load (rank 0 writes), tf.train.Checkpoint, BatchNorm, mixed precision.

Run: python -m prophet_tf.launch -n N tests/workers/strategy_fit.py WORKDIR
WORKDIR is shared by all workers (only rank 0 may write into it).
"""

from __future__ import annotations

import os
import sys

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras

from prophet_tf._keras import saving
from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH = 24
FEATURES, CLASSES = 8, 3


def make_data(n, seed):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    teacher = np.random.RandomState(7).randn(FEATURES, CLASSES).astype("float32")
    y = np.argmax(x @ teacher, axis=1).astype("int32")
    return x, y


def dense_model():
    inp = keras.Input((FEATURES,))
    h = keras.layers.Dense(32, activation="relu")(inp)
    h = keras.layers.Dense(16, activation="relu")(h)
    out = keras.layers.Dense(CLASSES, activation="softmax")(h)
    return keras.Model(inp, out)


def compile_model(model):
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
                  steps_per_execution=2)
    return model


class BatchLogs(keras.callbacks.Callback):
    """Records every per-batch log value (must be identical on all workers)."""

    def __init__(self):
        super().__init__()
        self.values = []

    def on_train_batch_end(self, batch, logs=None):
        self.values.append(["train", batch] + [float(logs[k]) for k in sorted(logs)])

    def on_test_batch_end(self, batch, logs=None):
        self.values.append(["test", batch] + [float(logs[k]) for k in sorted(logs)])


def trainable(model):
    return [v.numpy() for v in model.trainable_weights]


def main():
    workdir = sys.argv[1]
    strategy = ProphetStrategy()
    rank = strategy.rank
    x, y = make_data(192, 1)
    xv, yv = make_data(48, 2)

    # ---- fit with validation data, steps_per_execution and callbacks --------------------------
    with strategy.scope():
        model = compile_model(dense_model())
    batch_logs = BatchLogs()
    callbacks = [
        batch_logs,
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "best.keras"), monitor="val_loss",
                                        save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=10),
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
    ]
    hist = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, validation_data=(xv, yv),
                     callbacks=callbacks, verbose=2, shuffle=False)
    common.result(section="fit", history={k: common.floats(v) for k, v in hist.history.items()},
                  batch_digest=common.digest_json(batch_logs.values),
                  batches=len(batch_logs.values),
                  digest=common.digest(trainable(model)))

    # ---- evaluate / predict ---------------------------------------------------------------------
    ev = model.evaluate(xv, yv, batch_size=GLOBAL_BATCH, verbose=0, return_dict=True)
    on_batch = model.predict_on_batch(xv[:5])  # not sharded: the whole batch on every worker
    pred = model.predict(xv, batch_size=GLOBAL_BATCH, verbose=0)
    local = model(xv, training=False).numpy()
    # Unweighted mean over all validation samples, computed locally for comparison.
    ce = float(np.mean(-np.log(local[np.arange(len(yv)), yv])))
    common.result(section="evaluate", logs={k: float(v) for k, v in ev.items()}, local_loss=ce,
                  local_accuracy=float(np.mean(np.argmax(local, 1) == yv)),
                  pred_shape=list(pred.shape), pred_maxdiff=common.max_abs_diff([pred], [local]),
                  on_batch_shape=list(on_batch.shape),
                  on_batch_maxdiff=common.max_abs_diff([on_batch], [local[:5]]))

    # ---- saving: rank 0 writes, the others write to a private temporary directory --------------
    model.save(os.path.join(workdir, "model.keras"))
    model.save_weights(os.path.join(workdir, "model.weights.h5"))
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(ckpt, os.path.join(workdir, "ckpts"), max_to_keep=2)
    for _ in range(3):
        manager.save()
    plain_path = ckpt.save(os.path.join(workdir, "plain", "ckpt"))
    strategy.barrier()  # rank 0's files are complete from here on
    redirected = []
    root = saving.temp_root()
    if root:
        for d, _, files in os.walk(root):
            redirected += [os.path.relpath(os.path.join(d, f), root) for f in files]
    state = open(os.path.join(workdir, "ckpts", "checkpoint")).read()
    common.result(section="save", latest=manager.latest_checkpoint, plain_path=plain_path,
                  redirected=sorted(redirected), temp_root=root, state=state)

    # ---- loading: every worker reads rank 0's files ---------------------------------------------
    reference = trainable(model)
    with strategy.scope():
        loaded = keras.models.load_model(os.path.join(workdir, "model.keras"))
        fresh = dense_model()
    fresh.load_weights(os.path.join(workdir, "model.weights.h5"))
    with strategy.scope():
        restored = compile_model(dense_model())
    status = tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(
        tf.train.latest_checkpoint(os.path.join(workdir, "ckpts")))
    # Training goes on identically from the restored optimizer state.
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    restored.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    status.assert_existing_objects_matched()
    common.result(section="load",
                  load_model_diff=common.max_abs_diff(trainable(loaded), reference),
                  loaded_iterations=int(loaded.optimizer.iterations.numpy()),
                  iterations=int(model.optimizer.iterations.numpy()) - 192 // GLOBAL_BATCH,
                  load_weights_diff=common.max_abs_diff(trainable(fresh), reference),
                  resumed_diff=common.max_abs_diff(trainable(restored), trainable(model)),
                  digest=common.digest(trainable(model)))

    # ---- BatchNorm (local statistics) ------------------------------------------------------------
    with strategy.scope():
        bn = keras.Sequential([
            keras.Input((FEATURES,)),
            keras.layers.Dense(16),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ])
        bn.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                   loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    bn_hist = bn.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False,
                     validation_data=(xv, yv))
    common.result(section="batchnorm", loss=common.floats(bn_hist.history["loss"]),
                  val_loss=common.floats(bn_hist.history["val_loss"]),
                  digest=common.digest(trainable(bn)))

    # ---- mixed precision: one worker overflows, every worker must skip the step ------------------
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            mp = keras.Sequential([
                keras.Input((FEATURES,)),
                # Positive weights: an input of 6e4 surely overflows float16 (8 * 6e4 > 65504).
                keras.layers.Dense(16, activation="relu", kernel_initializer="ones"),
                keras.layers.Dense(CLASSES),
                keras.layers.Activation("softmax", dtype="float32"),
            ])
            mp.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
        xm = x.copy()
        per_worker = GLOBAL_BATCH // strategy.num_replicas_in_sync
        bad_row = 2 * GLOBAL_BATCH + per_worker * (strategy.num_replicas_in_sync - 1)
        xm[bad_row] = 6.0e4  # float16 overflow on the last worker only (its piece of batch 2)
        mp.fit(xm, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
        opt = mp.optimizer
        common.result(section="mixed_precision", optimizer=type(opt).__name__,
                      scale=float(opt.dynamic_scale.numpy()),
                      initial_scale=float(opt.initial_scale),
                      iterations=int(opt.iterations.numpy()),
                      finite=bool(all(np.all(np.isfinite(w)) for w in trainable(mp))),
                      digest=common.digest(trainable(mp)))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    print("WORKER DONE", rank, flush=True)


if __name__ == "__main__":
    main()
