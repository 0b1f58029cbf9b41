"""Every gradient reaches the update of its own variable, summed across workers exactly once.

Run: python -m prophet_tf.launch -n 2 tests/workers/gradient_identity.py [--cases a,b]

Training cases (crossing the barrier on, the default) train on N workers, then the same model
with the same initial weights in this process outside the strategy on the global batches, and
print the largest weight difference and a digest of the weights. Fail-closed cases apply
gradients outside the strategy's reduction and print the error they got.
"""

from __future__ import annotations

import argparse

import strategy_common as common

import keras
import numpy as np
import tensorflow as tf

from prophet_tf.errors import GradientReductionError
from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH, SAMPLES, EPOCHS = 16, 128, 2       # 16 steps
FEATURES, CLASSES, VOCAB, SEQ = 8, 3, 40, 5


class Block(keras.layers.Layer):
    """A Transformer-style block: its variables belong to sub-layers created in __init__."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.attention_like = keras.layers.Dense(width, activation="relu")
        self.feed_forward = keras.Sequential([keras.layers.Dense(2 * width, activation="relu"),
                                              keras.layers.Dense(width)])
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.feed_forward(self.attention_like(x)))


def nested():
    inputs = keras.Input((FEATURES,))
    h = Block(FEATURES)(inputs)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(h))


def embedding():
    inputs = keras.Input((SEQ,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(h))


def data(kind):
    rng = np.random.RandomState(5)
    if kind == "tokens":
        x = rng.randint(0, VOCAB, size=(SAMPLES, SEQ)).astype("int32")
        return x, (x[:, 0] % CLASSES).astype("int32")
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    return x, (np.abs(x[:, 0] * 2).astype("int32") % CLASSES)


# name: (model, optimizer, data, gradient reduction that must have happened)
TRAINING = {
    "nested_crossing": (nested, lambda: keras.optimizers.Adam(0.01), "dense", "deferred"),
    "embedding_adam": (embedding, lambda: keras.optimizers.Adam(0.01), "tokens", "gathered"),
}


def train_case(strategy, name):
    build, make_opt, kind, reduction = TRAINING[name]
    x, y = data(kind)
    strategy.extended.gradient_counts.clear()
    with strategy.scope():
        model = build()
        model.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy", steps_per_execution=1)
    initial = model.get_weights()
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    final = model.get_weights()
    counts = dict(strategy.extended.gradient_counts)

    reference = build()
    reference.set_weights(initial)
    reference.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy", run_eagerly=True)
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    common.result(case=name, maxdiff=common.max_abs_diff(final, reference.get_weights()),
                  moved=common.max_abs_diff(final, initial), digest=common.digest(final),
                  counts=counts, expected_reduction=reduction,
                  trainable=len(model.trainable_variables))


class MergeCallModel(keras.Model):
    """A custom train_step that applies its gradients from a cross-replica context (merge_call),
    where Keras's gradient all-reduce does nothing."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        tf.distribute.get_replica_context().merge_call(
            lambda _: self.optimizer.apply(grads, self.trainable_variables))
        return {"loss": loss}


def merge_call_train_step(strategy):
    x, y = data("dense")
    with strategy.scope():
        inputs = keras.Input((FEATURES,))
        model = MergeCallModel(inputs, keras.layers.Dense(CLASSES, name="head")(inputs))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0)


def custom_loop_without_run(strategy, eager):
    """The classic custom-loop mistake: the step is not wrapped in strategy.run."""
    x, y = data("dense")
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES, name="head")])
        optimizer = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    (step if eager else tf.function(step))(x[:8], y[:8])


FAIL_CLOSED = {
    "fail_merge_call_train_step": merge_call_train_step,
    "fail_custom_loop_graph": lambda s: custom_loop_without_run(s, eager=False),
    "fail_custom_loop_eager": lambda s: custom_loop_without_run(s, eager=True),
}


def fail_case(strategy, name):
    try:
        FAIL_CLOSED[name](strategy)
    except GradientReductionError as e:
        common.result(case=name, error="GradientReductionError", message=str(e))
    else:
        common.result(case=name, error=None, message="")
    # The failure stops each worker at its own point; meet again before the next case (a worker
    # that returned early could otherwise exit while a peer still waits for its broadcasts).
    strategy.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(list(TRAINING) + list(FAIL_CLOSED)))
    args = parser.parse_args()
    strategy = ProphetStrategy()
    for name in args.cases.split(","):
        (train_case if name in TRAINING else fail_case)(strategy, name)


if __name__ == "__main__":
    main()
