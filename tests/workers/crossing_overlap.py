"""A short ProphetStrategy fit with crossing on and a timeline, for tests/test_crossing.py.

argv: timeline path (``{rank}`` is replaced). Step markers are added to the timeline.
"""

import sys
import time

import keras
import numpy as np

from prophet_tf import runtime
from prophet_tf.strategy import ProphetStrategy


def main() -> None:
    strategy = ProphetStrategy(schedule="prophet", cross_barrier=True, timeline_path=sys.argv[1])
    with strategy.scope():
        # A small first layer (sent first) and large later layers (sent last, still in flight
        # when the next step's forward pass may already use the first layer).
        model = keras.Sequential([
            keras.Input((32,)),
            keras.layers.Dense(32, activation="relu", name="first"),
            keras.layers.Dense(384, activation="relu", name="wide1"),
            keras.layers.Dense(384, activation="relu", name="wide2"),
            keras.layers.Dense(10, name="last"),
        ])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    class StepMarks(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.monotonic_ns()

        def on_train_batch_end(self, batch, logs=None):
            runtime.timeline_event("step", f"step {batch}", self.start, time.monotonic_ns())

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * 24, 32)).astype("float32")
    y = rng.normal(size=(16 * 24, 10)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[StepMarks()])
    runtime.shutdown()  # closes the timeline file
    print("OVERLAP RUN DONE", flush=True)


if __name__ == "__main__":
    main()
