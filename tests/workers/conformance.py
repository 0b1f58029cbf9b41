"""Real Keras programs, written as the Keras guides write them, with only the data loading
replaced and ``strategy.scope()`` added.

Run:
  python -m prophet_tf.launch -n 2 tests/workers/conformance.py distributed WORKDIR [--programs a,b]
  python tests/workers/conformance.py reference WORKDIR [--programs a,b]        (one process)

``distributed`` trains every program under ``ProphetStrategy()`` (default options: crossing the
barrier on) and writes ``WORKDIR/<program>.initial.npz`` (rank 0: the initial weights, which the
strategy broadcast) and ``WORKDIR/<program>.rank<r>.npz`` (final weights). ``reference`` then
trains the same programs in ONE process on the global batch, starting from those initial
weights, and writes ``WORKDIR/<program>.reference.npz``. One ``RESULT`` line per program and
process carries the logs (``tests/test_conformance.py`` compares everything).
"""

from __future__ import annotations

import contextlib
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
FEATURES, CLASSES, VOCAB, MAXLEN = 8, 3, 200, 12


# ---- data (replaces the guides' downloads) -----------------------------------------------------

def tabular(seed=1):
    rng = np.random.RandomState(seed)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = np.argmax(x @ rng.randn(FEATURES, CLASSES), axis=1).astype("int32")
    return x, y


def tokens(seed=2):
    rng = np.random.RandomState(seed)
    x = rng.randint(1, VOCAB, size=(SAMPLES, MAXLEN)).astype("int32")
    y = (x[:, 0] % 2).astype("int32")
    return x, y


def images(seed=3):
    rng = np.random.RandomState(seed)
    x = rng.rand(SAMPLES, 8, 8, 1).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0.5).astype("int32")
    return x, y


# ---- the programs ----------------------------------------------------------------------------
# Each returns (model, fit): the model built and compiled under `scope()`, and a function that
# trains it and returns the History. The driver records the initial weights in between.

PROGRAMS = {}


def program(fn):
    PROGRAMS[fn.__name__] = fn
    return fn


@program
def mlp_sgd_momentum(scope, workdir):
    """Getting started: Sequential MLP, SGD with Nesterov momentum, NumPy arrays."""
    x, y = tabular()
    with scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            layers.Dense(32, activation="relu"),
            layers.Dense(16, activation="relu"),
            layers.Dense(CLASSES, activation="softmax"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


class ResidualBlock(layers.Layer):
    """Making new layers via subclassing: sub-layers created in __init__."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = layers.Dense(units, activation="relu")
        self.dense_2 = layers.Dense(units)
        self.inner = keras.Sequential([layers.Dense(units, activation="tanh")])

    def call(self, inputs):
        return inputs + self.dense_2(self.dense_1(inputs)) + self.inner(inputs)


class ResidualClassifier(keras.Model):
    def __init__(self):
        super().__init__()
        self.project = layers.Dense(16)
        self.block_1 = ResidualBlock(16)
        self.block_2 = ResidualBlock(16)
        self.head = layers.Dense(CLASSES)

    def call(self, inputs):
        return self.head(self.block_2(self.block_1(self.project(inputs))))


@program
def subclassed_nested_layers_adam(scope, workdir):
    """Subclassed model of custom layers that own Dense/Sequential sub-layers; Adam."""
    x, y = tabular()
    with scope():
        model = ResidualClassifier()
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model(x[:1])  # builds the weights (in the scope: they are the strategy's variables)
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


class TransformerBlock(layers.Layer):
    """keras.io 'Text classification with Transformer' (dropout rate 0: deterministic)."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = keras.ops.arange(start=0, stop=keras.ops.shape(x)[-1], step=1)
        return self.token_emb(x) + self.pos_emb(positions)


@program
def transformer_text_classifier(scope, workdir):
    """keras.io Transformer text classifier; Adam; steps_per_execution=2."""
    x, y = tokens()
    with scope():
        inputs = layers.Input(shape=(MAXLEN,))
        h = TokenAndPositionEmbedding(MAXLEN, VOCAB, 16)(inputs)
        h = TransformerBlock(16, 2, 16)(h)
        h = layers.GlobalAveragePooling1D()(h)
        outputs = layers.Dense(2, activation="softmax")(layers.Dense(8, activation="relu")(h))
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=2)
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


def _embedding_bag(scope, make_optimizer):
    x, y = tokens(seed=4)
    with scope():
        model = keras.Sequential([
            keras.Input((MAXLEN,), dtype="int32"),
            layers.Embedding(VOCAB, 8),
            layers.GlobalAveragePooling1D(),
            layers.Dense(1, activation="sigmoid"),
        ])
        model.compile(optimizer=make_optimizer(), loss="binary_crossentropy", metrics=["accuracy"])
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


@program
def embedding_adam(scope, workdir):
    """Embedding (200 x 8, sparse gradients with repeated indices) trained with Adam."""
    return _embedding_bag(scope, lambda: keras.optimizers.Adam(0.01))


@program
def embedding_rmsprop(scope, workdir):
    return _embedding_bag(scope, lambda: keras.optimizers.RMSprop(0.01))


@program
def embedding_adagrad(scope, workdir):
    return _embedding_bag(scope, lambda: keras.optimizers.Adagrad(0.1))


@program
def convnet_synced_batchnorm(scope, workdir):
    """Conv2D + BatchNormalization(synchronized=True): global batch statistics."""
    x, y = images()
    with scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            layers.Conv2D(4, 3, padding="same"),
            layers.BatchNormalization(synchronized=True),
            layers.Activation("relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(2, activation="softmax"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


@program
def convnet_local_batchnorm(scope, workdir):
    """Plain BatchNormalization: statistics of each worker's own rows (as MirroredStrategy)."""
    x, y = images()
    with scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            layers.Conv2D(4, 3, padding="same"),
            layers.BatchNormalization(),
            layers.Activation("relu"),
            layers.Flatten(),
            layers.Dense(2, activation="softmax"),
        ])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


@program
def dropout_mlp(scope, workdir):
    """Dropout: every worker draws its own masks, so only cross-worker identity is exact."""
    x, y = tabular()
    with scope():
        model = keras.Sequential([
            keras.Input((FEATURES,)),
            layers.Dense(32, activation="relu"),
            layers.Dropout(0.5),
            layers.Dense(CLASSES, activation="softmax"),
        ])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=4, shuffle=False,
                                    verbose=0)


class CustomFitModel(keras.Model):
    """keras.io 'Customizing what happens in fit()': a custom train_step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


@program
def custom_train_step(scope, workdir):
    x, y = tabular()
    with scope():
        inputs = keras.Input(shape=(FEATURES,))
        outputs = layers.Dense(CLASSES, activation="softmax")(layers.Dense(16, activation="relu")(inputs))
        model = CustomFitModel(inputs, outputs)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


@program
def mixed_precision(scope, workdir):
    """Mixed precision guide: mixed_float16 policy, float32 softmax output, loss scaling."""
    x, y = tabular()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with scope():
            inputs = keras.Input(shape=(FEATURES,))
            h = layers.Dense(32, activation="relu")(inputs)
            h = layers.Dense(CLASSES)(h)
            outputs = layers.Activation("softmax", dtype="float32")(h)
            model = keras.Model(inputs, outputs)
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0)


@program
def callbacks_save_restore_log(scope, workdir):
    """ModelCheckpoint, BackupAndRestore, CSVLogger and TensorBoard; steps_per_execution=2."""
    x, y = tabular()
    os.makedirs(workdir, exist_ok=True)
    with scope():
        model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                  layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer="rmsprop", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=2)
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "model.{epoch:02d}.keras")),
        keras.callbacks.ModelCheckpoint(os.path.join(workdir, "best.weights.h5"),
                                        save_weights_only=True, monitor="loss",
                                        save_best_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(workdir, "backup"), save_freq=2,
                                         delete_checkpoint=False),
        keras.callbacks.CSVLogger(os.path.join(workdir, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(workdir, "tb")),
    ]
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                                    verbose=0, callbacks=callbacks)


@program
def resume_with_backup_and_restore(scope, workdir):
    """BackupAndRestore restoring: a first fit of 1 epoch backs up; the weights are then wiped
    (as in a new process) and a second fit of 2 epochs must resume from the backup (weights,
    optimizer state, epoch 2 only). The resume itself is asserted here, the weights by the test."""
    x, y = tabular(seed=8)
    backup_dir = os.path.join(workdir, "backup")
    with scope():
        model = keras.Sequential([keras.Input((FEATURES,)), layers.Dense(16, activation="relu"),
                                  layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")

    def fit(epochs):
        return model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0,
                         callbacks=[keras.callbacks.BackupAndRestore(backup_dir,
                                                                     delete_checkpoint=False)])

    def interrupted_then_resumed():
        fit(1)
        model.set_weights([np.zeros_like(w) for w in model.get_weights()])
        history = fit(2)
        if history.epoch != [1]:
            raise AssertionError(f"BackupAndRestore did not resume at epoch 2: {history.epoch}")
        return history

    return model, interrupted_then_resumed


@program
def multi_input_multi_output(scope, workdir):
    """Functional API guide: ticket ranking with title, body and tags inputs, two outputs."""
    rng = np.random.RandomState(6)
    title = rng.randint(1, VOCAB, size=(SAMPLES, 6)).astype("int32")
    body = rng.randint(1, VOCAB, size=(SAMPLES, MAXLEN)).astype("int32")
    tags = rng.randint(0, 2, size=(SAMPLES, 4)).astype("float32")
    priority = rng.rand(SAMPLES, 1).astype("float32")
    department = rng.randint(0, 2, size=(SAMPLES, 3)).astype("float32")
    with scope():
        title_input = keras.Input(shape=(None,), name="title")
        body_input = keras.Input(shape=(None,), name="body")
        tags_input = keras.Input(shape=(4,), name="tags")
        title_features = layers.Embedding(VOCAB, 8)(title_input)
        body_features = layers.Embedding(VOCAB, 8)(body_input)
        title_features = layers.LSTM(8)(title_features)
        body_features = layers.LSTM(4)(body_features)
        x = layers.concatenate([title_features, body_features, tags_input])
        priority_pred = layers.Dense(1, name="priority")(x)
        department_pred = layers.Dense(3, name="department")(x)
        model = keras.Model(inputs=[title_input, body_input, tags_input],
                            outputs={"priority": priority_pred, "department": department_pred})
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                            "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
                      loss_weights={"priority": 1.0, "department": 0.2})
    return model, lambda: model.fit(
        {"title": title, "body": body, "tags": tags},
        {"priority": priority, "department": department},
        batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)


@program
def tf_data_preprocessing(scope, workdir):
    """tf.data pipeline with map/batch/prefetch and an adapted Normalization layer;
    steps_per_execution=3 (more than one step per call, a partial last call)."""
    x, y = tabular(seed=7)
    x = x * 5.0 + 3.0
    normalizer = layers.Normalization()
    normalizer.adapt(x)

    def preprocess(features, label):
        return tf.clip_by_value(features, -20.0, 30.0), label

    dataset = (tf.data.Dataset.from_tensor_slices((x, y))
               .map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
               .batch(GLOBAL_BATCH)
               .prefetch(tf.data.AUTOTUNE))
    with scope():
        model = keras.Sequential([keras.Input((FEATURES,)), normalizer,
                                  layers.Dense(16, activation="relu"),
                                  layers.Dense(CLASSES, activation="softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=3)
    return model, lambda: model.fit(dataset, epochs=EPOCHS, verbose=0)


class GAN(keras.Model):
    """keras.io 'Customizing what happens in fit()' GAN: train_step, no call()."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        # Latent vectors taken from each image (the guide draws them at random): deterministic,
        # and the same for a row whichever worker holds it.
        random_latent_vectors = tf.reshape(real_images, (batch_size, -1))[:, :self.latent_dim]
        generated_images = self.generator(random_latent_vectors)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(random_latent_vectors))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


@program
def gan_without_call(scope, workdir):
    x, _ = images()
    latent_dim = 4
    with scope():
        discriminator = keras.Sequential([keras.Input((8, 8, 1)), layers.Flatten(),
                                          layers.Dense(8, activation="relu"), layers.Dense(1)])
        generator = keras.Sequential([keras.Input((latent_dim,)), layers.Dense(64),
                                      layers.Reshape((8, 8, 1))])
        gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
        gan.compile(d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
                    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(GLOBAL_BATCH)
    return gan, lambda: gan.fit(dataset, epochs=EPOCHS, verbose=0)


class TiedTokenAndPositionEmbedding(TokenAndPositionEmbedding):
    """The token table looked up with the input's ids AND with the positions (pos_emb unused)."""

    def call(self, x):
        return self.token_emb(x) + self.token_emb(keras.ops.arange(keras.ops.shape(x)[-1]))


@program
def tied_token_position_embedding(scope, workdir):
    """No reduction of the workers' slices gives one process's gradient here: fails closed."""
    x, y = tokens(seed=5)
    with scope():
        model = keras.Sequential([keras.Input((MAXLEN,), dtype="int32"),
                                  TiedTokenAndPositionEmbedding(MAXLEN, VOCAB, 8),
                                  layers.GlobalAveragePooling1D(),
                                  layers.Dense(1, activation="sigmoid")])
        model.compile(optimizer="adam", loss="binary_crossentropy")
    return model, lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False,
                                    verbose=0)


# ---- driver ----------------------------------------------------------------------------------

def run(name, scope, workdir, rank, role):
    keras.utils.set_random_seed(1234)
    t0 = time.time()
    initial_path = os.path.join(workdir, f"{name}.initial.npz")
    result = dict(program=name, role=role)
    try:
        model, fit = PROGRAMS[name](scope, os.path.join(workdir, f"{name}.{role}"))
        if role == "reference":
            saved = np.load(initial_path)
            model.set_weights([saved[f"w{i}"] for i in range(len(saved.files))])
        initial = model.get_weights()
        if role == "distributed" and rank == 0:
            np.savez(initial_path, **{f"w{i}": w for i, w in enumerate(initial)})
        history = fit()
        final = model.get_weights()
        out = os.path.join(workdir, f"{name}.{'reference' if role == 'reference' else f'rank{rank}'}.npz")
        np.savez(out, **{f"w{i}": w for i, w in enumerate(final)})
        trainable = {id(v) for v in model.trainable_variables}
        result.update(
            history={k: common.floats(v) for k, v in history.history.items()},
            trainable_mask=[id(v) in trainable for v in model.weights],
            moved=common.max_abs_diff(final, initial), error=None)
    except Exception as e:  # noqa: BLE001 - a failing program is reported, the others still run
        text = f"{type(e).__name__}: {e}"   # the head says what, the tail which op/rank
        result.update(error=text if len(text) <= 3000 else f"{text[:1500]} [...] {text[-1500:]}")
    result["seconds"] = round(time.time() - t0, 2)
    common.result(**result)


if __name__ == "__main__":
    common.run_programs_main(
        PROGRAMS, lambda name, strategy, *rest: run(
            name, strategy.scope if strategy is not None else contextlib.nullcontext, *rest),
        eager_reference=True)
