"""What crossing the global barrier costs per variable per step.

    python -m prophet_tf.bench.overhead [--variables 200] [--steps 60] [--rounds 3]

Two workers on loopback (a fast link: communication is not the bottleneck) train a model made of
many small variables (a stack of tiny Dense layers, 2 variables each) with ProphetStrategy, once
with barrier crossing on and once with it off, alternating in the same run (``--rounds`` pairs).
Per-step times are medians after warm-up; the difference divided by the number of variables is
the crossing overhead per variable per step (gates, asynchronous hand-off and deferred apply).
The last line reads ``crossing overhead per variable per step: X us``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Sequence

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("variables", 200, "Trainable variables in the model (2 per Dense layer).")
flags.DEFINE_integer("steps", 60, "Timed steps per run (after warm-up).")
flags.DEFINE_integer("warmup", 10, "Steps before timing starts.")
flags.DEFINE_integer("rounds", 3, "Alternating on/off pairs of runs.")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")


def run_worker(config: dict) -> None:
    import numpy as np
    import keras
    import tensorflow as tf

    import prophet_tf

    strategy = prophet_tf.ProphetStrategy(schedule="prophet", cross_barrier=config["cross"])
    layers = config["variables"] // 2
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(layers)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    steps = config["warmup"] + config["steps"]
    x = np.random.default_rng(0).normal(size=(config["batch"] * steps, 8)).astype("float32")
    times: list[float] = []

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

    model.fit(x, x, batch_size=config["batch"], epochs=1, verbose=0, callbacks=[StepTimer()], shuffle=False)
    median = statistics.median(times[config["warmup"]:])
    if strategy.rank == 0:
        print("RESULT " + json.dumps({"cross": config["cross"], "step_s": median,
                                      "variables": len(model.trainable_variables)}), flush=True)


def measure(config: dict) -> dict:
    cmd = [sys.executable, "-m", "prophet_tf.launch", "-n", "2", "--threads", "1", "--timeout", "600", "--",
           "-m", "prophet_tf.bench.overhead", "--worker", json.dumps(config)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    match = re.search(r"RESULT (\{.*\})", proc.stdout)
    if proc.returncode != 0 or not match:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"run with cross_barrier={config['cross']} failed (exit code {proc.returncode})")
    return json.loads(match.group(1))


def main(argv: Sequence[str]) -> int:
    del argv
    if FLAGS.worker:
        run_worker(json.loads(FLAGS.worker))
        return 0
    base = {"variables": FLAGS.variables, "steps": FLAGS.steps, "warmup": FLAGS.warmup, "batch": FLAGS.batch}
    on, off = [], []
    n_vars = None
    for round_index in range(FLAGS.rounds):
        for cross, sink in ((False, off), (True, on)):
            result = measure(dict(base, cross=cross))
            n_vars = result["variables"]
            sink.append(result["step_s"])
            print(f"round {round_index + 1}/{FLAGS.rounds}: crossing {'on ' if cross else 'off'} "
                  f"{result['step_s'] * 1e3:8.3f} ms/step ({n_vars} variables)", flush=True)
    on_s, off_s = statistics.median(on), statistics.median(off)
    print(f"\nmedian step: crossing off {off_s * 1e3:.3f} ms, crossing on {on_s * 1e3:.3f} ms, "
          f"{n_vars} variables, 2 workers on loopback")
    print(f"crossing overhead per variable per step: {(on_s - off_s) / n_vars * 1e6:.1f} us")
    return 0


if __name__ == "__main__":
    app.run(main)
