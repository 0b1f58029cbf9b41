"""Keras programs the runtime's authors did not write for it: optimizer options (clipping, EMA,
gradient accumulation, loss scale factor), several models in one process, train_on_batch, a
custom loop, fine-tuning, non-trainable state updated in call(), an unused variable, class
weights, an uneven last batch, callbacks that decide (EarlyStopping, ReduceLROnPlateau,
LearningRateScheduler), a callback writing files on every worker, BackupAndRestore falling back
to its previous backup, and a Horovod-style save on rank 0 only. Written as the Keras guides write them; only the data
loading is replaced and ``strategy.scope()`` added.

Run:
  python -m prophet_tf.launch -n 2 tests/workers/unseen_programs.py distributed WORKDIR [--programs a,b]
  python tests/workers/unseen_programs.py reference WORKDIR [--programs a,b]      (one process)

Every program calls ``ctx.init(model)`` right after building a model: in the distributed run rank
0 records the model's initial weights (those the strategy broadcast), the reference run starts
from them. Each process writes ``WORKDIR/<program>.<rank<r>|reference>.npz`` (the final weights of
the program's models and their optimizers' variables) and prints one ``RESULT`` line per program
with the logs the program returned (``tests/test_unseen_programs.py`` compares everything).
"""

from __future__ import annotations

import json
import os
import time

import strategy_common as common

import numpy as np
import tensorflow as tf
import keras
from keras import layers

GLOBAL_BATCH = 16     # each of 2 workers gets 8 rows of every global batch
SAMPLES = 64          # 4 steps per epoch
EPOCHS = 2
FEATURES, CLASSES = 8, 3


class Context:
    """What a program needs from the driver: the scope, its strategy, initial weights."""

    def __init__(self, name: str, role: str, rank: int, strategy, workdir: str):
        self.name, self.role, self.rank, self.strategy = name, role, rank, strategy
        self.workdir = workdir
        self.files = os.path.join(workdir, f"{name}.{role}")  # a program's own output directory
        os.makedirs(self.files, exist_ok=True)
        self._models = 0

    def scope(self):
        return self.strategy.scope()

    def init(self, model):
        """Records (distributed, rank 0) or restores (reference) a new model's initial weights."""
        path = os.path.join(self.workdir, f"{self.name}.init{self._models}.npz")
        self._models += 1
        if self.role == "distributed" and self.rank == 0:
            np.savez(path, *model.get_weights())
        elif self.role == "reference":
            with np.load(path) as saved:
                model.set_weights([saved[f"arr_{i}"] for i in range(len(saved.files))])
        return model


def tabular(seed=1, samples=SAMPLES):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, FEATURES).astype("float32")
    y = np.argmax(x @ rng.randn(FEATURES, CLASSES), axis=1).astype("int32")
    return x, y


def mlp(hidden=16, **dense_kwargs):
    return keras.Sequential([
        keras.Input((FEATURES,)),
        layers.Dense(hidden, activation="relu", **dense_kwargs),
        layers.Dense(CLASSES, activation="softmax"),
    ])


def fit(model, x, y, epochs=EPOCHS, **kwargs):
    kwargs.setdefault("batch_size", GLOBAL_BATCH)
    return model.fit(x, y, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def history_logs(history) -> dict:
    return {k: common.floats(v) for k, v in history.history.items()}


PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


# ---- optimizer options ---------------------------------------------------------

def _optimizer_program(make_optimizer):
    def run(ctx):
        x, y = tabular()
        with ctx.scope():
            model = mlp()
            model.compile(optimizer=make_optimizer(), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"])
        ctx.init(model)
        return [model], history_logs(fit(model, x, y))
    return run


OPTIMIZERS = {
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01,
                                         l2_regularization_strength=0.01),
    # Clipping is active: thresholds far below the gradients' norms.
    "clipnorm_adam": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "clipvalue_sgd": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
    "global_clipnorm_sgd": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9,
                                         ema_overwrite_frequency=3),
    "gradient_accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2),
    "loss_scale_factor": lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0),
}
for _name, _make in OPTIMIZERS.items():
    PROGRAMS[f"opt_{_name}"] = _optimizer_program(_make)


# ---- several models, several calls --------------------------------------------------------------

@program
def two_models_alternating(ctx):
    """Two compiled models in one process, trained in turns."""
    x, y = tabular()
    with ctx.scope():
        a = mlp(16)
        a.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        b = mlp(12)
        b.compile(optimizer=keras.optimizers.RMSprop(0.01), loss="sparse_categorical_crossentropy")
    ctx.init(a)
    ctx.init(b)
    logs = {}
    for i, model in enumerate([a, b, a, b]):
        logs[f"fit{i}"] = history_logs(fit(model, x, y, epochs=1))
    return [a, b], logs



@program
def fit_evaluate_predict_fit(ctx):
    x, y = tabular()
    xv, yv = tabular(seed=9, samples=32)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    logs = {"fit1": history_logs(fit(model, x, y))}
    logs["evaluate"] = common.floats(model.evaluate(xv, yv, batch_size=GLOBAL_BATCH, verbose=0))
    logs["predict_sum"] = float(np.sum(model.predict(xv, batch_size=GLOBAL_BATCH, verbose=0)))
    logs["fit2"] = history_logs(fit(model, x, y))
    return [model], logs


@program
def train_on_batch_loop(ctx):
    x, y = tabular()
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    losses = []
    for epoch in range(EPOCHS):
        for start in range(0, SAMPLES, GLOBAL_BATCH):
            out = model.train_on_batch(x[start:start + GLOBAL_BATCH], y[start:start + GLOBAL_BATCH])
            losses.append(common.floats(out))
    test = common.floats(model.test_on_batch(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH]))
    return [model], {"train": losses, "test": test}


@program
def custom_loop_strategy_run(ctx):
    """keras.io 'Writing a training loop from scratch' + the distributed training guide."""
    x, y = tabular()
    strategy = ctx.strategy
    with ctx.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                  layers.Dense(CLASSES)])
        optimizer = keras.optimizers.Adam(1e-2)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    ctx.init(model)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    dist_dataset = strategy.experimental_distribute_dataset(dataset)

    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            loss = tf.nn.compute_average_loss(loss_fn(yb, logits), global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    @tf.function
    def train_step(xb, yb):
        per_replica = strategy.run(step_fn, args=(xb, yb))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    losses = []
    for epoch in range(EPOCHS):
        for xb, yb in dist_dataset:
            losses.append(float(train_step(xb, yb)))
    return [model], {"loss": losses}


@program
def fine_tuning_freeze_unfreeze(ctx):
    """Transfer learning guide: freeze the base, train the head, unfreeze, recompile, train."""
    x, y = tabular()
    with ctx.scope():
        base = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                 layers.BatchNormalization(synchronized=True),
                                 layers.Dense(12, activation="relu")], name="base")
        base.trainable = False
        inputs = keras.Input((FEATURES,))
        h = base(inputs, training=False)
        outputs = layers.Dense(CLASSES, activation="softmax")(h)
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss="sparse_categorical_crossentropy")
    ctx.init(model)
    logs = {"head": history_logs(fit(model, x, y))}
    base.trainable = True
    with ctx.scope():
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss="sparse_categorical_crossentropy")
    logs["all"] = history_logs(fit(model, x, y))
    model.optimizer.learning_rate = 5e-4  # users also just set the learning rate
    logs["lower_lr"] = history_logs(fit(model, x, y, epochs=1))
    return [model], logs


class CallCounter(layers.Layer):
    """Counts training calls in a non-trainable weight updated from call()."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     dtype="int64", name="calls")
        self.total = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="total")

    def call(self, inputs, training=False):
        if training:
            self.calls.assign_add(1)
            self.total.assign_add(1.0)
        return inputs


@program
def counter_assign_add_in_call(ctx):
    x, y = tabular()
    with ctx.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                  CallCounter(), layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ctx.init(model)
    return [model], history_logs(fit(model, x, y))



class WithUnusedWeight(layers.Layer):
    """A layer with a trainable weight its call() never uses (no gradient)."""

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], 4), name="kernel")
        self.unused = self.add_weight(shape=(4,), initializer="ones", name="unused")

    def call(self, inputs):
        return tf.matmul(inputs, self.kernel)


@program
def unused_variable(ctx):
    x, y = tabular()
    with ctx.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), WithUnusedWeight(),
                                  layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    ctx.init(model)
    return [model], history_logs(fit(model, x, y))


@program
def class_weight(ctx):
    x, y = tabular()
    with ctx.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    return [model], history_logs(fit(model, x, y, class_weight={0: 1.0, 1: 3.0, 2: 0.5}))



@program
def uneven_last_batch(ctx):
    """69 rows, global batch 16: the last batch has 5 rows (3 on one worker, 2 on the other)."""
    x, y = tabular(samples=69)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    return [model], history_logs(fit(model, x, y))


@program
def uneven_last_batch_dataset(ctx):
    """The same with a tf.data pipeline."""
    x, y = tabular(samples=69)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    ctx.init(model)
    return [model], history_logs(model.fit(dataset, epochs=EPOCHS, verbose=0))




@program
def sample_weighted_mean(ctx):
    """reduction="mean_with_sample_weight": the loss is divided by the batch's sum of sample weights,
    which differs between the workers' shares of a global batch."""
    x, y = tabular()
    weights = np.random.RandomState(5).uniform(0.1, 2.0, size=len(x)).astype("float32")
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(reduction="mean_with_sample_weight"))
    ctx.init(model)
    return [model], history_logs(fit(model, x, y, sample_weight=weights))


@program
def last_batch_of_one_row(ctx):
    """65 rows, global batch 16: the last batch has one row, so one worker's share is empty."""
    x, y = tabular(samples=65)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    return [model], history_logs(fit(model, x, y))

def mean_squared_error_scalar(y_true, y_pred):
    """A custom loss reduced to one number over the batch, as many tutorials write it."""
    return tf.reduce_mean(tf.square(tf.one_hot(tf.cast(tf.reshape(y_true, [-1]), tf.int32), CLASSES) - y_pred))


@program
def custom_loss_returning_a_scalar(ctx):
    x, y = tabular()
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=mean_squared_error_scalar)
    ctx.init(model)
    return [model], history_logs(fit(model, x, y))

@program
def masked_sequence_loss(ctx):
    """Embedding(mask_zero=True) tagging padded sequences: the loss averages over the valid
    (unpadded) positions, whose count differs between the workers' shares of a global batch."""
    rng = np.random.RandomState(6)
    length, vocab = 6, 20
    tokens = rng.randint(1, vocab, size=(SAMPLES, length)).astype("int32")
    lengths = rng.randint(1, length + 1, size=SAMPLES)
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0  # padding
    tags = (tokens % CLASSES).astype("int32")
    with ctx.scope():
        model = keras.Sequential([
            keras.Input((length,), dtype="int32"),
            layers.Embedding(vocab, 8, mask_zero=True),
            layers.Dense(CLASSES, activation="softmax"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    ctx.init(model)
    return [model], history_logs(fit(model, tokens, tags))


@program
def uneven_last_batch_filtered_dataset(ctx):
    """69 rows through a filter (the pipeline's length is unknown before it runs): the last
    global batch has 5 rows, split 3 and 2."""
    x, y = tabular(samples=69)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(GLOBAL_BATCH)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
    ctx.init(model)
    return [model], history_logs(model.fit(dataset, epochs=EPOCHS, verbose=0))


class LearningRateLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rates = []

    def on_epoch_end(self, epoch, logs=None):
        self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))


@program
def callbacks_that_decide(ctx):
    """validation_data + EarlyStopping + ReduceLROnPlateau + LearningRateScheduler: every worker
    must take the decisions one process takes."""
    x, y = tabular()
    xv, yv = tabular(seed=5, samples=32)
    with ctx.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    rates = LearningRateLog()
    callbacks = [
        keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
        # min_delta so large that every epoch counts as "no improvement".
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1,
                                          min_delta=10.0, min_lr=1e-4),
        keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=2, min_delta=0.2,
                                      restore_best_weights=True),
        rates,
    ]
    history = fit(model, x, y, epochs=8, validation_data=(xv, yv), callbacks=callbacks)
    logs = history_logs(history)
    logs["epochs_run"] = [len(history.epoch)]
    logs["rates"] = rates.rates
    return [model], logs


class JsonEpochWriter(keras.callbacks.Callback):
    """A user callback that writes its own file every epoch (no rank check, as in one process)."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: round(float(v), 6) for k, v in (logs or {}).items()})
        with open(self.path, "w") as f:
            json.dump(self.epochs, f)


@program
def callback_writes_file_every_worker(ctx):
    x, y = tabular()
    path = os.path.join(ctx.workdir, f"{ctx.name}.{ctx.role}.json")
    with ctx.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    ctx.init(model)
    # The file is compared with one process's by the test, after the job (reading it here while
    # another worker may be rewriting it would race, as with any file two processes write).
    return [model], history_logs(fit(model, x, y, callbacks=[JsonEpochWriter(path)]))


@program
def backup_falls_back_to_previous(ctx):
    """BackupAndRestore(double_checkpoint=True) after a chief was killed while writing its backup:
    the latest weights are corrupt, so Keras falls back to the previous backup."""
    x, y = tabular()
    backup = os.path.join(ctx.files, "backup")
    os.makedirs(backup, exist_ok=True)
    latest = os.path.join(backup, "latest.weights.h5")
    with ctx.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ctx.init(model)
    fit(model, x, y, epochs=1)
    previous = os.path.join(ctx.files, "previous.weights.h5")
    model.save_weights(previous)  # a save: every worker calls it
    if ctx.rank == 0:
        os.replace(previous, latest + ".bkp")
        for name, epoch in (("training_metadata.json.bkp", 1), ("training_metadata.json", 2)):
            with open(os.path.join(backup, name), "w") as f:
                json.dump({"epoch": epoch, "batch": 0}, f)
        with open(latest, "wb") as f:
            f.write(b"\x89HDF\r\n")  # the kill came while writing it
    if hasattr(ctx.strategy, "barrier"):
        ctx.strategy.barrier()  # rank 0 prepared the files
    corrupt_inode = os.stat(latest).st_ino
    with ctx.scope():
        restarted = mlp()
        restarted.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ctx.init(restarted)
    history = fit(restarted, x, y, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(
        backup, save_freq=1000, delete_checkpoint=False, double_checkpoint=True)])
    if ctx.rank == 0:
        with open(latest, "rb") as a, open(latest + ".bkp", "rb") as b:
            restored = {"same_as_previous": a.read() == b.read(),
                        "replaced_atomically": os.stat(latest).st_ino != corrupt_inode}
        with open(os.path.join(ctx.files, "restored.json"), "w") as f:
            json.dump(restored, f)
    return [restarted], history_logs(history)


@program
def horovod_style_save_on_rank_0_only(ctx):
    """``if rank == 0: model.save(...)``, then the script ends: the save is a collective here, so
    rank 0 must fail at once (rank 1 leaves) with an error that says so. Run it last: rank 1 ends
    the job after it."""
    x, y = tabular()
    with ctx.scope():
        model = mlp()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    ctx.init(model)
    fit(model, x, y, epochs=1)
    logs = {}
    if ctx.rank == 0:
        start = time.time()
        try:
            model.save(os.path.join(ctx.files, "model.keras"))
        except Exception as e:  # noqa: BLE001 - the error is what the test checks
            logs["save_error"] = "\n".join([f"{type(e).__name__}: {e}"] + getattr(e, "__notes__", []))
        logs["save_seconds"] = round(time.time() - start, 2)
    return [model], logs


# ---- driver ----------------------------------------------------------------------------------

def run(name, strategy, workdir, rank, role):
    keras.utils.set_random_seed(1234)
    t0 = time.time()
    result = dict(program=name, role=role)
    try:
        ctx = Context(name, role, rank, strategy, workdir)
        models, logs = PROGRAMS[name](ctx)
        final = []
        for model in models:
            final += [np.asarray(w) for w in model.get_weights()]
            optimizer = getattr(model, "optimizer", None)
            if optimizer is not None:
                final += [np.asarray(v) for v in optimizer.variables]
        who = "reference" if role == "reference" else f"rank{rank}"
        np.savez(os.path.join(workdir, f"{name}.{who}.npz"), *final)
        result.update(logs=logs, error=None)
    except Exception as e:  # noqa: BLE001 - a failing program is reported, the others still run
        text = str(e)
        text = text if len(text) <= 3000 else text[:1000] + " ... " + text[-2000:]
        result.update(error=f"{type(e).__name__}: {text}")
    result["seconds"] = round(time.time() - t0, 2)
    common.result(**result)


if __name__ == "__main__":
    # The rank-0-only save needs rank 1 to end its script without waiting for rank 0.
    common.run_programs_main(
        PROGRAMS, lambda name, strategy, *rest: run(
            name, strategy if strategy is not None else tf.distribute.get_strategy(), *rest),
        timeout_s=60.0, leave_without_barrier={"horovod_style_save_on_rank_0_only"},
        eager_reference=True, traced_reference={"uneven_last_batch_filtered_dataset"})
