"""A short ProphetStrategy fit with crossing on and a timeline, for tests/test_crossing.py.

argv: timeline path (``{rank}`` is replaced). The strategy adds a "step" span per train step.
"""

import sys

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

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16 * 24, 32)).astype("float32")
    y = rng.normal(size=(16 * 24, 10)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    runtime.shutdown()  # closes the timeline file
    print("OVERLAP RUN DONE", flush=True)


if __name__ == "__main__":
    main()
