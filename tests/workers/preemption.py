"""Coordinated preemption and step-exact resume (2 workers, WORKDIR shared by all of them).

  preemption.py scenarios WORKDIR      in one launch: the uninterrupted references, then each
                                       scenario of SCENARIOS: a fit that gets SIGTERM on one
                                       worker at its moment, stops (Preempted, caught), and the
                                       same fit run again in the same processes, which resumes;
                                       then a program with its own SIGTERM handler, installed
                                       after the strategy, then before it (no checkpoint); then
                                       a fit that fails in a callback

Every fit prints ``RESULT {"section": "fit", ...}`` with its final weights' digest, the steps
whose batch-end callbacks ran and, when preempted, the position of the stop."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import strategy_common as common

import numpy as np
import keras
import tensorflow as tf

GLOBAL_BATCH, FEATURES, CLASSES, SAMPLES, EPOCHS, SEED = 16, 6, 3, 96, 2, 11
STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH

# name -> (what holds the checkpoint, input, the moment of the signal, the rank that gets it)
SCENARIOS = {
    "during_save": ("backup2", "dataset", "during_save", 0),
    "before_first_step": ("own", "arrays", "before_fit", 1),
    "during_validation": ("backup_epoch", "arrays", "validation", 1),
}


def data():
    rng = np.random.RandomState(5)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = np.argmax(x @ rng.randn(FEATURES, CLASSES), axis=1).astype("int32")
    return x, y


def build(strategy):
    keras.utils.set_random_seed(SEED)  # the same initial weights and input seeds in every fit
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
        model.optimizer.build(model.trainable_variables)
    return model


class Fresh:
    """One model for many fits (its train function is traced once): each fit starts from the
    initial weights and optimizer state, as a newly built model does."""

    def __init__(self, strategy):
        self.model = build(strategy)
        self.initial = [v.numpy() for v in self.model.weights + self.model.optimizer.variables]

    def __call__(self, strategy):
        keras.utils.set_random_seed(SEED)  # the input's seeds, as in build()
        for variable, value in zip(self.model.weights + self.model.optimizer.variables, self.initial):
            variable.assign(value)
        self.model._initial_epoch = None  # Keras keeps the epoch a BackupAndRestore restored
        return self.model


def train_input(kind):
    """Arrays (shuffled by Keras: the same permutation every epoch) or a tf.data pipeline that
    reshuffles every epoch."""
    x, y = data()
    if kind == "dataset":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES).batch(GLOBAL_BATCH)
        return dict(x=ds)
    return dict(x=x, y=y, batch_size=GLOBAL_BATCH, shuffle=True)


class SignalAt(keras.callbacks.Callback):
    """SIGTERM to this process (on ``rank`` only) at ``moment`` of epoch 1."""

    def __init__(self, rank, victim, moment, backup_dir=None):
        super().__init__()
        self.armed = rank == victim
        self.moment, self.backup_dir, self.epoch = moment, backup_dir, -1

    def _send(self, why):
        if self.armed:
            self.armed = False
            print(f"SENDING SIGTERM {why}", flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self.moment.startswith("mid_step") and (self.epoch, batch) == (1, 2) and self.armed:
            # From another thread while the step runs: the handler runs once the step returned.
            self.armed = False
            threading.Timer(0.001, os.kill, (os.getpid(), signal.SIGTERM)).start()

    def on_train_batch_end(self, batch, logs=None):
        if self.moment == "during_save" and (self.epoch, batch) == (1, 2) and self.armed:
            # BackupAndRestore(save_freq=2) saves after this batch: signal at its first write.
            self.armed = False
            directory, before = self.backup_dir, _listing(self.backup_dir)

            def watch():
                deadline = time.monotonic() + 30
                while _listing(directory) == before and time.monotonic() < deadline:
                    time.sleep(0.0002)
                os.kill(os.getpid(), signal.SIGTERM)

            threading.Thread(target=watch, daemon=True).start()

    def on_test_batch_begin(self, batch, logs=None):
        if self.moment == "validation" and self.epoch == 1 and batch == 1:
            self._send("during validation")


def _listing(directory):
    try:
        return sorted((e.name, e.stat().st_mtime_ns, e.stat().st_ino) for e in os.scandir(directory))
    except OSError:
        return []


class CountSteps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def run_fit(strategy, workdir, label, holder, kind, moment=None, victim=None, make=build):
    """One fit of the model ``make(strategy)`` gives; returns its RESULT (also printed)."""
    from prophet_tf import preemption

    model = make(strategy)
    backup_dir = os.path.join(workdir, label, "backup")
    callbacks = []
    if holder == "backup2":
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir, save_freq=2))
    elif holder == "backup_epoch":
        callbacks.append(keras.callbacks.BackupAndRestore(backup_dir))
    strategy.extended._checkpoint_dir = (os.path.join(workdir, label, "own") if holder == "own"
                                         else None)
    counter = CountSteps()
    callbacks.append(counter)
    if moment is not None:
        callbacks.append(SignalAt(strategy.rank, victim, moment, backup_dir))
        if moment == "before_fit" and strategy.rank == victim:
            os.kill(os.getpid(), signal.SIGTERM)
    x, y = data()
    stopped = None
    start = time.monotonic()
    try:
        model.fit(**train_input(kind), epochs=EPOCHS, verbose=0, callbacks=callbacks,
                  validation_data=(x[:32], y[:32]))
    except preemption.Preempted as p:
        stopped = p.report
    result = dict(section="fit", label=label, kind=kind, steps=counter.steps,
                  seconds=round(time.monotonic() - start, 2),
                  digest=common.digest([v.numpy() for v in model.weights]),
                  stopped=None if stopped is None else [stopped.epoch, stopped.step],
                  signals=None if stopped is None else stopped.signals,
                  checkpoint=None if stopped is None else stopped.checkpoint,
                  backup_left=os.path.exists(backup_dir) or os.path.exists(
                      os.path.join(workdir, label, "own", f"fit-{strategy.extended._fit_count}")))
    common.result(**result)
    return result


def rearm(strategy, program_handler=None):
    """Tests only: the process handles the next SIGTERM as a new preemption (with
    ``program_handler`` installed first, as a program would before creating the strategy)."""
    from prophet_tf import preemption
    preemption.reset()
    if program_handler is not None:
        signal.signal(signal.SIGTERM, program_handler)
    preemption.arm("SIGTERM", 60.0, strategy.rank)


def scenarios(strategy, workdir):
    fresh = Fresh(strategy)
    for kind in ("arrays", "dataset"):
        run_fit(strategy, workdir, f"reference-{kind}", "none", kind, make=fresh)
    for name, (holder, kind, moment, victim) in SCENARIOS.items():
        rearm(strategy)
        fits = strategy.extended._fit_count
        run_fit(strategy, workdir, name, holder, kind, moment, victim, make=fresh)
        rearm(strategy)
        strategy.extended._fit_count = fits  # the same fit of the program, run again
        run_fit(strategy, workdir, name, holder, kind, make=fresh)
    own_handler(strategy, workdir, fresh)
    rearm(strategy)
    fails(strategy, fresh)


class FailAt(keras.callbacks.Callback):
    epoch = -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, 3):
            raise ValueError("a bug at epoch 1 batch 3")


def fails(strategy, fresh):
    """A fit that raises in a callback: the worker says where (for the launcher's restarts)."""
    model = fresh(strategy)
    try:
        model.fit(**train_input("arrays"), epochs=EPOCHS, verbose=0, callbacks=[FailAt()])
    except ValueError as e:
        common.result(section="failed", error=str(e))


def own_handler(strategy, workdir, fresh):
    """The program installs its own SIGTERM handler after the strategy (it replaces the
    strategy's), then before it (the strategy calls it after recording the request); the second
    fit has no checkpoint anywhere."""
    def handler(signum, frame):
        print(f"PROGRAM HANDLER got {signal.Signals(signum).name}", flush=True)

    rearm(strategy)
    signal.signal(signal.SIGTERM, handler)
    run_fit(strategy, workdir, "replaced", "backup2", "arrays", "mid_step", 1, make=fresh)
    rearm(strategy, program_handler=handler)
    run_fit(strategy, workdir, "chained", "none", "arrays", "mid_step", 1, make=fresh)


def main():
    mode, workdir = sys.argv[1], sys.argv[2]
    from prophet_tf.strategy import ProphetStrategy

    strategy = ProphetStrategy(preemption_grace_s=60.0)
    from tensorflow.python.eager import context
    common.result(section="seed", seed=context.global_seed())  # before the program sets its own
    {"scenarios": scenarios}[mode](strategy, workdir)
    print("WORKER DONE", flush=True)


if __name__ == "__main__":
    main()
