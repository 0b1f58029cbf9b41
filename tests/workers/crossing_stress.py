"""Ends train functions while deferred updates are still pending (crossing the barrier).

Run: PROPHET_TEST_APPLY_DELAY_MS=100 python -m prophet_tf.launch -n 2 tests/workers/crossing_stress.py

Several models live in one process and take turns: train -> evaluate -> predict -> train again,
with ``steps_per_execution`` 1 and 3, validation after each epoch, a retrace (new batch size),
recompiles (Keras drops the train function), ``keras.backend.clear_session()`` (TensorFlow drops
every cached function) and deleted models. Each of the last three happens right after ``fit``
another train step, while that step's updates are still pending (the delay holds every update for
a while after its sum arrived). The process must not crash, every update must be applied (weights
bitwise identical on all workers), and the run reports how often a train function really ended
with updates pending.

Prints ``RESULT`` lines: one per surviving model (weights digest), and a summary.
"""

from __future__ import annotations

import gc

import strategy_common as common

import keras
import numpy as np

from prophet_tf import _crossing
from prophet_tf.strategy import ProphetStrategy

SAMPLES, BATCH = 64, 16


class Block(keras.layers.Layer):
    """A residual block whose variables live in sub-layers (nested variable paths)."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.Sequential([keras.layers.Dense(width, activation="relu"), keras.layers.Dense(width)])
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return self.norm(x + self.inner(x))


def mlp():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(256, activation="relu"), keras.layers.Dense(4, activation="softmax")])


def nested():
    inputs = keras.Input((16,))
    h = Block(16)(keras.layers.Dense(16)(inputs))
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(h))


def convnet():
    return keras.Sequential([keras.Input((16,)), keras.layers.Reshape((4, 4, 1)),
                             keras.layers.Conv2D(8, 2, activation="relu"), keras.layers.Flatten(),
                             keras.layers.Dropout(0.25), keras.layers.Dense(4, activation="softmax")])


class Run:
    def __init__(self, strategy):
        self.strategy = strategy
        rng = np.random.RandomState(11)
        self.x = rng.randn(SAMPLES, 16).astype("float32")
        self.y = rng.randint(0, 4, SAMPLES).astype("int32")
        self.ended_with_pending = 0   # train functions ended while updates were pending
        self.endings = 0

    def build(self, make, steps_per_execution=1):
        with self.strategy.scope():
            model = make()
            self.compile(model, steps_per_execution)
        return model

    def compile(self, model, steps_per_execution=1):
        with self.strategy.scope():
            model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
                          metrics=["accuracy"], steps_per_execution=steps_per_execution)

    def fit(self, model, **kwargs):
        kwargs.setdefault("batch_size", BATCH)
        model.fit(self.x, self.y, epochs=kwargs.pop("epochs", 1), shuffle=False, verbose=0, **kwargs)

    def ending(self, model, end) -> None:
        """One more train step (its updates stay pending for a while), then ``end()`` ends train
        functions at once; counts whether updates really were pending."""
        model.train_on_batch(self.x[:BATCH], self.y[:BATCH])
        self.endings += 1
        if _crossing.pending_updates() > 0:
            self.ended_with_pending += 1
        end()
        gc.collect()


def main() -> None:
    strategy = ProphetStrategy()
    run = Run(strategy)
    a = run.build(mlp)
    b = run.build(nested, steps_per_execution=3)
    c = run.build(convnet)

    # A: train, then drop its train function (recompile) while its last updates are pending.
    run.fit(a)
    run.ending(a, lambda: run.compile(a))
    # B (steps_per_execution=3) and C (validation after each epoch) interleaved with A.
    run.fit(b)
    run.fit(c, epochs=2, validation_split=0.25)
    a.evaluate(run.x, run.y, verbose=0)
    c.predict(run.x, verbose=0)
    run.fit(c, batch_size=8)  # retrace: a new batch size
    run.ending(c, lambda: run.compile(c, steps_per_execution=2))
    b.evaluate(run.x, run.y, verbose=0)
    b.predict(run.x, verbose=0)
    run.fit(c)                # steps_per_execution=2 now
    run.fit(b)

    # A throw-away model deleted while its updates are pending.
    throwaway = {"d": run.build(nested)}
    run.fit(throwaway["d"])
    run.ending(throwaway["d"], throwaway.clear)

    # Every cached function dropped (Keras state too) while A's updates are pending.
    run.fit(a)
    run.ending(a, keras.backend.clear_session)
    a.evaluate(run.x, run.y, verbose=0)
    run.fit(a)
    _crossing.wait_all()

    for name, model in (("mlp", a), ("nested", b), ("convnet", c)):
        common.result(model=name, digest=common.digest(model.get_weights()))
    common.result(summary=True, endings=run.endings, ended_with_pending=run.ended_with_pending,
                  pending_at_exit=_crossing.pending_updates(),
                  counts=dict(strategy.extended.gradient_counts))


if __name__ == "__main__":
    main()
