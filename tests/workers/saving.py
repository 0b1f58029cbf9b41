"""Saving under faults: atomic checkpoints, one outcome per save, resume after a kill.

Run (2 workers, WORKDIR shared by all of them):
  saving.py kill_during_save WORKDIR   rank 0 SIGKILLs itself while ModelCheckpoint overwrites
                                       ckpt.keras (the first change it sees in WORKDIR)
  saving.py interrupted WORKDIR        fit 4 epochs with BackupAndRestore + ModelCheckpoint;
                                       rank 0 SIGKILLs itself in the middle of epoch 3
  saving.py resume WORKDIR             resume both ways, train uninterrupted, compare; then a save
                                       into a missing directory
  saving.py check PATH                 (one process) load PATH, print its weights' digest
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras

GLOBAL_BATCH, FEATURES, CLASSES, SAMPLES, EPOCHS = 16, 6, 3, 64, 4


def data():
    rng = np.random.RandomState(5)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = np.argmax(x @ rng.randn(FEATURES, CLASSES), axis=1).astype("int32")
    return x, y


def small_model():
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(CLASSES, activation="softmax")])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def weights(model):
    return [v.numpy() for v in model.weights]


class KillAt(keras.callbacks.Callback):
    """SIGKILL of this process (rank 0 only) after batch ``batch`` of epoch ``epoch``."""

    def __init__(self, rank, epoch, batch):
        super().__init__()
        self.rank, self.epoch, self.batch, self.current = rank, epoch, batch, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.rank == 0 and (self.current, batch) == (self.epoch, self.batch):
            print("KILLING rank 0 mid-epoch", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class KillDuringNextSave(keras.callbacks.Callback):
    """From the end of epoch ``epoch`` on, rank 0 SIGKILLs itself as soon as anything in
    ``directory`` changes (the save that follows this callback has started writing)."""

    def __init__(self, rank, directory, epoch):
        super().__init__()
        self.rank, self.directory, self.epoch = rank, directory, epoch

    def _listing(self):
        out = {}
        for entry in os.scandir(self.directory):
            st = entry.stat()
            out[entry.name] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out

    def on_epoch_end(self, epoch, logs=None):
        if self.rank != 0 or epoch != self.epoch:
            return
        before = self._listing()
        common.result(section="armed", files=sorted(before))

        def watch():
            while True:
                if self._listing() != before:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(0.0005)

        threading.Thread(target=watch, daemon=True).start()


def kill_during_save(strategy, workdir):
    ckpts = os.path.join(workdir, "ckpts")
    os.makedirs(ckpts, exist_ok=True)
    with strategy.scope():
        # A few MB with Adam's slots: the kill comes at the save's first write, whatever the size.
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(512),
                                  keras.layers.Dense(512), keras.layers.Dense(512),
                                  keras.layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    x, y = data()

    class Report(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            common.result(section="saved", epoch=epoch, digest=common.digest(weights(model)))

    target = os.path.join(ckpts, "ckpt.keras")
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, verbose=0, shuffle=False,
              callbacks=[KillDuringNextSave(strategy.rank, ckpts, epoch=1),
                         keras.callbacks.ModelCheckpoint(target), Report()])
    common.result(section="finished")  # only reached if the kill did not happen


def fit_kwargs(callbacks=(), **kwargs):
    return dict(batch_size=GLOBAL_BATCH, verbose=0, shuffle=False, callbacks=list(callbacks),
                **kwargs)


def interrupted(strategy, workdir):
    x, y = data()
    with strategy.scope():
        model = small_model()
    model.save_weights(os.path.join(workdir, "initial.weights.h5"))
    model.fit(x, y, epochs=EPOCHS, **fit_kwargs([
        keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup")),
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "ckpt-{epoch:02d}.keras")),
        KillAt(strategy.rank, epoch=2, batch=1)]))
    common.result(section="finished")  # only reached if the kill did not happen


def resume(strategy, workdir):
    x, y = data()
    initial = os.path.join(workdir, "initial.weights.h5")
    # (a) BackupAndRestore: the same fit call again restores the last backup (end of epoch 2).
    with strategy.scope():
        restored = small_model()
    history = restored.fit(x, y, epochs=EPOCHS, **fit_kwargs(
        [keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"))]))
    # (b) ModelCheckpoint + load_model, continuing from the last epoch it saved.
    last = sorted(f for f in os.listdir(workdir) if f.startswith("ckpt-"))[-1]
    with strategy.scope():
        loaded = keras.models.load_model(os.path.join(workdir, last))
    loaded.fit(x, y, epochs=EPOCHS, initial_epoch=int(last[5:7]), **fit_kwargs())
    # (c) uninterrupted on the same workers, (d) one process on the global batch.
    with strategy.scope():
        full = small_model()
    full.load_weights(initial)
    full.fit(x, y, epochs=EPOCHS, **fit_kwargs())
    reference = small_model()
    reference.load_weights(initial)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      run_eagerly=True)
    reference.fit(x, y, epochs=EPOCHS, **fit_kwargs())
    common.result(section="resume", resumed_epochs=len(history.history["loss"]), last_checkpoint=last,
                  backup_digest=common.digest(weights(restored)),
                  checkpoint_digest=common.digest(weights(loaded)),
                  full_digest=common.digest(weights(full)),
                  backup_vs_full=common.max_abs_diff(weights(restored), weights(full)),
                  checkpoint_vs_full=common.max_abs_diff(weights(loaded), weights(full)),
                  full_vs_one_process=common.max_abs_diff(weights(full), weights(reference)),
                  moved=common.max_abs_diff(weights(full), weights(small_model_with(initial))))

    # A save the chief cannot make (missing directory): every worker gets the chief's error.
    missing = os.path.join(workdir, "no", "such", "dir", "model.keras")
    t0 = time.monotonic()
    try:
        full.save(missing)
        error = None
    except Exception as e:  # noqa: BLE001 - reported
        error = e
    common.result(section="missing_dir", seconds=round(time.monotonic() - t0, 2),
                  error=type(error).__name__ if error else None, message=str(error))
    strategy.barrier()  # still in step: the next collective works on every worker
    common.result(section="after_error", ok=True)


def small_model_with(path):
    model = small_model()
    model.load_weights(path)
    return model


def check(path):
    model = keras.models.load_model(path)
    common.result(section="check", digest=common.digest(weights(model)))


def main():
    mode, arg = sys.argv[1], sys.argv[2]
    if mode == "check":
        return check(arg)
    from prophet_tf.strategy import ProphetStrategy

    strategy = ProphetStrategy()
    {"kill_during_save": kill_during_save, "interrupted": interrupted, "resume": resume}[mode](
        strategy, arg)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
