"""Input pipelines as users write them, trained with ``fit`` on several workers and in one
process: seeded shuffles (with and without reshuffling each epoch), ``repeat`` with
``steps_per_epoch``, parallel ``interleave``/``map`` with ``deterministic=True``, a global seed
set before or after the dataset is built, Keras 3's ``PyDataset`` (plain, with worker threads,
with worker processes), a Python generator, NumPy arrays with ``validation_split``, and a run
interrupted mid-epoch and resumed from its backup.

Run:
  python -m prophet_tf.launch -n 2 tests/workers/input_programs.py distributed WORKDIR [--programs a,b]
  python tests/workers/input_programs.py reference WORKDIR [--programs a,b]      (one process)

No program sets a global seed unless it says so (the driver clears any seed a program set, so
that the next starts as a fresh program would). Every program calls ``ctx.init(model)`` after
building its model: rank 0 records the broadcast initial weights, the reference starts from
them. Each process writes ``WORKDIR/<program>.<rank<r>|reference>.npz`` (weights and optimizer
variables) and prints one ``RESULT`` line per program (tests/test_input_pipeline.py compares).
"""

from __future__ import annotations

import os
import time

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras
from keras import layers

FEATURES, CLASSES = 6, 3
GLOBAL_BATCH = 16  # each of 2 workers gets 8 rows of every global batch
SAMPLES = 80       # 5 steps per epoch
EPOCHS = 2


class Context:
    def __init__(self, name, role, rank, strategy, workdir):
        self.name, self.role, self.rank, self.strategy = name, role, rank, strategy
        self.workdir = workdir
        self.files = os.path.join(workdir, f"{name}.{role}")
        os.makedirs(self.files, exist_ok=True)
        self._models = 0

    def scope(self):
        return self.strategy.scope()

    @property
    def distributed(self) -> bool:
        return self.role == "distributed"

    def init(self, model):
        path = os.path.join(self.workdir, f"{self.name}.init{self._models}.npz")
        self._models += 1
        if self.distributed and self.rank == 0:
            np.savez(path, *model.get_weights())
        elif not self.distributed:
            with np.load(path) as saved:
                model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
        return model


def tabular(seed=1, samples=SAMPLES):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, FEATURES).astype("float32")
    y = np.argmax(x @ rng.randn(FEATURES, CLASSES), axis=1).astype("int32")
    return x, y


def compiled_model(ctx, optimizer=None):
    """A small classifier; Adam makes every difference in the batches visible in the weights."""
    with ctx.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                  layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return ctx.init(model)


def history_logs(history) -> dict:
    return {k: common.floats(v) for k, v in history.history.items()}


PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


def fits_in_turn(ctx, inputs):
    """One model fitted on each input in turn (as when training goes on with new data): every
    fit reuses the traced step, so one launch covers several pipelines. The logs of each fit
    are kept under ``<key>@<input>``, so a difference shows which input caused it."""
    model = compiled_model(ctx)
    logs = {}
    for name, make_input, fit_kwargs in inputs:
        history = model.fit(make_input(), verbose=0, **{"epochs": EPOCHS, **fit_kwargs})
        logs.update({f"{k}@{name}": v for k, v in history_logs(history).items()})
    return model, logs


# ---- tf.data ----------------------------------------------------------------------------------

def shuffle_with_seed():
    """The tf.data guide's pipeline: a seeded shuffle buffer, reshuffled every epoch."""
    x, y = tabular()
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(200, seed=5).batch(GLOBAL_BATCH)


def shuffle_with_seed_once():
    """A seeded shuffle with reshuffle_each_iteration=False: one order for every epoch."""
    x, y = tabular(seed=2)
    return (tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(SAMPLES, seed=8, reshuffle_each_iteration=False).batch(GLOBAL_BATCH))


def shuffle_repeat():
    """An endless pipeline (shuffle, repeat, prefetch), fitted with steps_per_epoch: epochs do
    not line up with passes over the data."""
    x, y = tabular(seed=3)
    return (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=11).repeat()
            .batch(GLOBAL_BATCH).prefetch(tf.data.AUTOTUNE))


def interleave_and_map_in_parallel():
    """Records read by a parallel interleave over shards and a parallel map with a stateless
    augmentation, batched, then a parallel map over whole batches (TensorFlow cannot tell the
    batch size of such a dataset), all deterministic=True."""
    x, y = tabular(seed=4)
    shards = 4

    def shard(i):
        return tf.data.Dataset.from_tensor_slices((x, y)).shard(shards, i)

    def augment(features, label):
        noise = tf.random.stateless_normal(tf.shape(features), seed=[3, tf.cast(label, tf.int32)])
        return features + 0.01 * noise, label

    def standardize(features, labels):
        mean, variance = tf.nn.moments(features, axes=[0])
        return (features - mean) / tf.sqrt(variance + 1e-3), labels

    return (tf.data.Dataset.range(shards)
            .interleave(shard, cycle_length=shards, num_parallel_calls=tf.data.AUTOTUNE,
                        deterministic=True)
            .map(augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(GLOBAL_BATCH)
            .map(standardize, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True))


@program
def tf_data_pipelines(ctx):
    """Seeded shuffles, repeat with steps_per_epoch, parallel deterministic interleave and map;
    no global seed anywhere."""
    return fits_in_turn(ctx, [
        ("shuffle_with_seed", shuffle_with_seed, {}),
        ("shuffle_with_seed_once", shuffle_with_seed_once, {}),
        ("shuffle_repeat_steps_per_epoch", shuffle_repeat, {"steps_per_epoch": 3}),
        ("interleave_and_map_in_parallel", interleave_and_map_in_parallel, {}),
    ])


@program
def global_seed_set_before_the_dataset(ctx):
    """tf.random.set_seed, then an unseeded shuffle and an unseeded augmentation: the global
    seed decides both."""
    tf.random.set_seed(7)
    x, y = tabular()

    def augment(features, label):
        return features + 0.05 * tf.random.normal(tf.shape(features)), label

    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES).map(augment)
               .batch(GLOBAL_BATCH))
    model = compiled_model(ctx)
    return model, history_logs(model.fit(dataset, epochs=EPOCHS, verbose=0))


@program
def global_seed_set_after_the_dataset(ctx):
    """A seeded shuffle built first, keras.utils.set_random_seed afterwards (before fit)."""
    x, y = tabular()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=4).batch(GLOBAL_BATCH)
    keras.utils.set_random_seed(99)
    model = compiled_model(ctx)
    return model, history_logs(model.fit(dataset, epochs=EPOCHS, verbose=0))


# ---- Keras' own inputs ------------------------------------------------------------------------

class Batches(keras.utils.PyDataset):
    """keras.io's PyDataset: fixed batches from arrays."""

    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


def batches_forever(seed):
    """An endless Python generator of batches."""
    x, y = tabular(seed=seed)
    while True:
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            yield x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH]


@program
def keras_python_inputs(ctx):
    """keras.io's PyDataset shuffled by fit (the default) with Keras' reproducibility recipe
    (keras.utils.set_random_seed), 78 rows (the last batch is short): plain, with worker
    threads, with worker processes; then a Python generator with steps_per_epoch."""
    keras.utils.set_random_seed(17)

    def py_dataset(seed, **kwargs):
        return lambda: Batches(*tabular(seed=seed, samples=78), GLOBAL_BATCH, **kwargs)

    return fits_in_turn(ctx, [
        ("py_dataset", py_dataset(5), {}),
        ("py_dataset_worker_threads", py_dataset(6, workers=2), {}),
        ("py_dataset_worker_processes", py_dataset(7, workers=2, use_multiprocessing=True), {}),
        ("python_generator", lambda: batches_forever(8), {"steps_per_epoch": 4}),
    ])


@program
def numpy_arrays_with_validation_split(ctx):
    """NumPy arrays, Keras' own shuffling (shuffle=True, the default) and validation_split,
    with keras.utils.set_random_seed first, as Keras' reproducibility guide says."""
    keras.utils.set_random_seed(21)
    x, y = tabular()
    model = compiled_model(ctx)
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, validation_split=0.2,
                        verbose=0)
    return model, history_logs(history)


# ---- a resumed run --------------------------------------------------------------------------

class Interrupt(keras.callbacks.Callback):
    """Stops the program at a given step (as a crash or preemption would): after
    BackupAndRestore saved it."""

    def __init__(self, epoch, step):
        super().__init__()
        self.epoch, self.step, self.current = epoch, step, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current, batch) == (self.epoch, self.step):
            raise KeyboardInterrupt(f"interrupted at epoch {self.epoch} step {self.step}")


@program
def resumed_mid_epoch(ctx):
    """A reshuffled seeded pipeline trained with BackupAndRestore(save_freq=1), interrupted in
    the second epoch and resumed by a new model in the same program, as a restarted job would.
    One process trains it without interruption: the resumed run must match that."""
    x, y = tabular()

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=6).batch(GLOBAL_BATCH)

    backup = os.path.join(ctx.files, "backup")
    first = compiled_model(ctx)
    if not ctx.distributed:
        return first, history_logs(first.fit(dataset(), epochs=EPOCHS, verbose=0))
    try:
        first.fit(dataset(), epochs=EPOCHS, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup, save_freq=1), Interrupt(1, 2)])
        raise AssertionError("the interruption did not happen")
    except KeyboardInterrupt:
        pass
    resumed = compiled_model(ctx)
    history = resumed.fit(dataset(), epochs=EPOCHS, verbose=0,
                          callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    return resumed, {"resumed_epochs": len(history.epoch)}


# ---- driver ----------------------------------------------------------------------------------

def run(name, strategy, workdir, rank, role):
    t0 = time.time()
    result = dict(program=name, role=role)
    try:
        ctx = Context(name, role, rank, strategy, workdir)
        model, logs = PROGRAMS[name](ctx)
        final = [np.asarray(w) for w in model.get_weights()]
        final += [np.asarray(v) for v in model.optimizer.variables]
        who = "reference" if role == "reference" else f"rank{rank}"
        np.savez(os.path.join(workdir, f"{name}.{who}.npz"), *final)
        result.update(logs=logs, error=None)
    except Exception as e:  # noqa: BLE001 - a failing program is reported, the others still run
        text = str(e)
        text = text if len(text) <= 3000 else text[:1000] + " ... " + text[-2000:]
        result.update(error=f"{type(e).__name__}: {text}")
    result["seconds"] = round(time.time() - t0, 2)
    common.result(**result)


def main() -> None:
    from tensorflow.python.eager import context

    job_seed = []

    def run_as_a_fresh_program(name, strategy, workdir, rank, role):
        """The next program starts as a fresh process would: without a global seed of its own
        (on the workers: with the strategy's job seed, as after ProphetStrategy())."""
        if strategy is None:
            tf.random.set_seed(None)
            strategy = tf.distribute.get_strategy()
        else:
            from prophet_tf import _seeds
            if not job_seed:
                job_seed.append(context.global_seed())
            _seeds.set_job_seed(job_seed[0])
        run(name, strategy, workdir, rank, role)

    common.run_programs_main(PROGRAMS, run_as_a_fresh_program, timeout_s=60.0,
                             eager_reference=True, traced_reference={"tf_data_pipelines"})


if __name__ == "__main__":
    main()
