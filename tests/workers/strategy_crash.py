"""A worker dies in the middle of fit: every other worker must fail (not hang).

Run (without the launcher, which would stop the survivors itself):
  TF_CONFIG=... python tests/workers/strategy_crash.py CRASH_RANK CRASH_STEP
"""

from __future__ import annotations

import os
import sys
import time

import strategy_common as common

import numpy as np
import keras

from prophet_tf.strategy import ProphetStrategy


class Crash(keras.callbacks.Callback):
    def __init__(self, rank, crash_rank, step):
        super().__init__()
        self.rank, self.crash_rank, self.step = rank, crash_rank, step

    def on_train_batch_begin(self, batch, logs=None):
        if self.rank == self.crash_rank and batch == self.step:
            print(f"CRASHING rank {self.rank} at batch {batch}", flush=True)
            os._exit(17)


def main():
    crash_rank, crash_step = int(sys.argv[1]), int(sys.argv[2])
    strategy = ProphetStrategy(schedule="priority", timeout_s=float(sys.argv[3]))
    rng = np.random.RandomState(0)
    x = rng.randn(960, 8).astype("float32")
    y = rng.randint(0, 2, size=(960,)).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2, activation="softmax")])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    print("TRAINING", flush=True)
    t0 = time.time()
    try:
        model.fit(x, y, batch_size=16, epochs=5, verbose=0,
                  callbacks=[Crash(strategy.rank, crash_rank, crash_step)])
    except Exception as e:  # noqa: BLE001 - report what the survivors saw, then fail
        # The end of the message is the runtime's own words (a graph error starts with a trace).
        common.result(section="error", type=type(e).__name__, message=str(e)[-800:],
                      seconds=round(time.time() - t0, 2), wall=time.time())
        sys.exit(3)
    print("FINISHED WITHOUT ERROR", flush=True)


if __name__ == "__main__":
    main()
