"""The step report in fit's epoch logs, for tests/test_step_report.py.

    python -m prophet_tf.launch -n 2 -- tests/workers/step_report.py WORKDIR   (two workers)
    python tests/workers/step_report.py WORKDIR                                 (one worker)

Two fits on two workers, each printing ``RESULT {"case": ..., "history": ..., "report": ...}``:

* ``gates``: crossing the barrier (the default). Run with ``PROPHET_TEST_APPLY_DELAY_MS``, every
  deferred update is applied that long after its sum arrived, as if the gradients came late: the
  next step's forward pass waits at the gates. With a CSVLogger on every worker and, on rank 0,
  the TensorBoard callback.
* ``barrier``: updates stay synchronous (``global_clipnorm`` cannot be deferred) and rank 1's
  backward pass sleeps ``BACKWARD_SLEEP_S`` between its last two layers, so rank 0 hands off its
  last gradient that much earlier and waits for rank 1's at the end of the step.

One worker runs the ``gates`` case only (no communication: nothing to wait for).
"""

import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

from prophet_tf.strategy import ProphetStrategy

BACKWARD_SLEEP_S = 0.1
STEPS, EPOCHS, BATCH = 6, 3, 16


def slow_backward_layer(seconds: float):
    @tf.custom_gradient
    def identity(x):
        def grad(dy):
            slept = tf.py_function(lambda: time.sleep(seconds) or np.int32(0), [], tf.int32)
            with tf.control_dependencies([slept]):
                return tf.identity(dy)
        return tf.identity(x), grad

    class SlowBackward(keras.layers.Layer):
        def call(self, x):
            return identity(x)

    return SlowBackward(name="slow_backward")


def floats(history: dict) -> dict:
    return {k: [float(v) for v in values] for k, values in history.items()}


def tensorboard_tags(logdir: str) -> list:
    tags = set()
    for root, _, files in os.walk(logdir):
        for name in files:
            if "tfevents" in name:
                for event in tf.compat.v1.train.summary_iterator(os.path.join(root, name)):
                    tags.update(v.tag for v in event.summary.value)
    return sorted(tags)


def main() -> None:
    workdir = sys.argv[1]
    strategy = ProphetStrategy(schedule="prophet")
    rank, n = strategy.rank, strategy.world_size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, 4)).astype("float32")

    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    csv_path = os.path.join(workdir, f"gates.{rank}.csv")
    callbacks = [keras.callbacks.CSVLogger(csv_path)]
    logdir = os.path.join(workdir, "tensorboard")
    if rank == 0:
        callbacks.append(keras.callbacks.TensorBoard(logdir))
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=2, shuffle=False,
                        callbacks=callbacks)
    report = strategy.step_report()
    with open(callbacks[0].csv_file.name) as f:  # ranks > 0 write below a private directory
        csv_header = f.readline().strip().split(",")
    print("RESULT " + json.dumps({
        "case": "gates", "workers": n, "history": floats(history.history),
        "report": {**report.__dict__, "last_step": report.last_step.__dict__},
        "csv_header": csv_header,
        "tensorboard_tags": tensorboard_tags(logdir) if rank == 0 else []}), flush=True)
    if n == 1:
        return

    with strategy.scope():
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = slow_backward_layer(BACKWARD_SLEEP_S if rank == 1 else 0.0)(h)
        h = keras.layers.Dense(16, activation="relu")(h)
        model = keras.Model(inputs, keras.layers.Dense(4)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.01, global_clipnorm=1e6), loss="mse")
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    report = strategy.step_report()
    print("RESULT " + json.dumps({
        "case": "barrier", "workers": n, "history": floats(history.history),
        "report": {**report.__dict__, "last_step": report.last_step.__dict__}}), flush=True)


if __name__ == "__main__":
    main()
