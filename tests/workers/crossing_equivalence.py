"""Crossing the barrier must not change results: the same training with crossing on and off.

Run: python -m prophet_tf.launch -n 2 tests/workers/crossing_equivalence.py [--cases a,b]
For each case both runs start from the same initial weights (rank 0's, broadcast) and see the same
data; prints one RESULT line per case with the largest weight difference and whether any
update was actually deferred.
"""

from __future__ import annotations

import argparse
import json

import keras
import numpy as np
import tensorflow as tf

from prophet_tf import _crossing, runtime
from prophet_tf.strategy import ProphetStrategy

GLOBAL_BATCH, SAMPLES, EPOCHS, FEATURES, CLASSES = 16, 96, 2, 6, 3


def dense_model():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(12, activation="tanh"),
                             keras.layers.Dense(CLASSES, activation="softmax")])


def batchnorm_model():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16),
                             keras.layers.BatchNormalization(), keras.layers.ReLU(),
                             keras.layers.Dense(CLASSES, activation="softmax")])


def wide_model():
    # A 600 x 512 kernel (1.2 MB) is above the runtime's recycling threshold (1 MiB): its sums are
    # received into recycled buffers, which hold the previous step's values.
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(600, activation="relu"),
                             keras.layers.Dense(512, activation="tanh"),
                             keras.layers.Dense(CLASSES, activation="softmax")])


def schedule():
    return keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.7)


CASES = {
    "sgd": (dense_model, lambda: keras.optimizers.SGD(0.1)),
    "momentum": (dense_model, lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
    "adam": (dense_model, lambda: keras.optimizers.Adam(0.01)),
    "adamw": (dense_model, lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05)),
    "schedule": (dense_model, lambda: keras.optimizers.Adam(schedule())),
    "clipnorm": (dense_model, lambda: keras.optimizers.SGD(0.2, clipnorm=0.05)),
    "batchnorm": (batchnorm_model, lambda: keras.optimizers.Adam(0.01)),
    "wide": (wide_model, lambda: keras.optimizers.SGD(0.05, momentum=0.9)),
}


def train(strategy, build, make_opt, x, y, initial=None):
    with strategy.scope():
        model = build()
        model.compile(optimizer=make_opt(), loss="sparse_categorical_crossentropy")
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights()
    history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model, start, history.history["loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    crossing = ProphetStrategy(cross_barrier=True)
    synchronous = ProphetStrategy(cross_barrier=False)
    rng = np.random.RandomState(7)
    x = rng.randn(SAMPLES, FEATURES).astype("float32")
    y = (np.abs(x[:, 0] * 3).astype("int32")) % CLASSES
    for case in args.cases.split(","):
        build, make_opt = CASES[case]
        recycled = runtime.stats()["outputs_recycled"]
        model_x, initial, loss_x = train(crossing, build, make_opt, x, y)
        _crossing.wait_all()
        recycled = runtime.stats()["outputs_recycled"] - recycled
        deferred = crossing.extended.gradient_counts["deferred"]
        crossing.extended.gradient_counts.clear()
        weights_x = [np.array(w) for w in model_x.get_weights()]
        model_s, _, loss_s = train(synchronous, build, make_opt, x, y, initial)
        weights_s = model_s.get_weights()
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights_x, weights_s))
        moved = max(float(np.max(np.abs(a - b))) for a, b in zip(weights_x, initial))
        print("RESULT " + json.dumps({"case": case, "rank": crossing.rank, "maxdiff": diff, "moved": moved,
                                      "deferred_updates_in_graph": deferred, "recycled": recycled, "loss_cross": loss_x,
                                      "loss_sync": loss_s}), flush=True)
    _crossing.wait_all()


if __name__ == "__main__":
    main()
