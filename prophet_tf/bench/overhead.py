"""What crossing the global barrier, the step report and the coordinated preemption check cost
per step.

    python -m prophet_tf.bench.overhead [--variables 200] [--steps 60] [--rounds 3] [--fits 3]
    python -m prophet_tf.bench.overhead --compare preemption [--variables 4] [--steps 300]

``--compare crossing`` (the default): two workers on loopback (a fast link: communication is not
the bottleneck) train a model made of many small variables (a stack of tiny Dense layers, 2
variables each) with ProphetStrategy, once with barrier crossing on and once with it off,
alternating in the same run (``--rounds`` pairs of launches). Per-step times are medians after
warm-up.

* Crossing: the difference between the launches divided by the number of variables is the
  crossing overhead per variable per step (gates, asynchronous hand-off and deferred apply),
  measured with the step report off in both.
* Step report (``ProphetStrategy(step_report=...)``): inside every launch, ``--fits`` pairs of
  ``fit`` calls alternate the report off and on (the train function is made again for each, so
  that it is measured with and without the report's hooks); the difference is its cost per step
  (the kernels' timestamps and the per-step calls into the runtime), with crossing on and off.
  Its per-epoch part (one small collective, which also waits for the other worker to end its
  epoch, and a read of the scheduler's state) is timed apart.

The last lines read ``crossing overhead per variable per step: X us`` and ``step report overhead
per step: crossing on X us (P% of the step), crossing off ...; its per-step calls alone Y us of
CPU; per epoch Z ms``.

``--compare preemption``: the coordinated preemption check on and off. With it on, every step
carries one more float in its metric reduction and the step function's wrapper reads it back.
Both are measured in the same two worker processes (one launch): a model whose train function
was traced with the check and one traced without it, their steps alternating (``train_on_batch``,
``--steps`` x ``--rounds`` pairs), so that each pair sees the same load. The last line reads
``preemption check per step: X us``: the median of the pairs' differences.
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
CALL_LOOP = 2000  # begin/end pairs timed alone
flags.DEFINE_integer("variables", 200, "Trainable variables in the model (2 per Dense layer).")
flags.DEFINE_integer("steps", 60, "Timed steps per fit (after warm-up).")
flags.DEFINE_integer("warmup", 10, "Steps of every fit before timing starts.")
flags.DEFINE_integer("rounds", 3, "Alternating crossing off/on pairs of launches.")
flags.DEFINE_integer("fits", 3, "Alternating step report off/on pairs of fits in every launch.")
flags.DEFINE_integer("batch", 32, "Global batch size.")
flags.DEFINE_enum("compare", "crossing", ["crossing", "preemption"],
                  "What is turned on and off: barrier crossing (and the step report), or the "
                  "coordinated preemption check.")
flags.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")


def run_worker(config: dict) -> None:
    import numpy as np
    import keras

    import prophet_tf
    from prophet_tf._keras import step_report

    strategy = prophet_tf.ProphetStrategy(schedule="prophet", cross_barrier=config["cross"],
                                          report_every_epoch=False)
    reporter = strategy.extended._step_reporter
    layers = config["variables"] // 2
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(layers)])
        model.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
    steps = config["warmup"] + config["steps"]
    x = np.random.default_rng(0).normal(size=(config["batch"] * steps, 8)).astype("float32")
    epoch_end_s: list[float] = []
    end_epoch = step_report.StepReporter.end_epoch

    def timed_end_epoch(self, logs):
        start = time.perf_counter()
        try:
            return end_epoch(self, logs)
        finally:
            epoch_end_s.append(time.perf_counter() - start)

    step_report.StepReporter.end_epoch = timed_end_epoch

    class StepTimer(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    medians: dict[bool, list[float]] = {False: [], True: []}

    def timed_fit(report: bool) -> float:
        # The switch is read when fit starts and when the train function is made.
        strategy.extended._step_reporter = reporter if report else None
        model.train_function = None
        timer = StepTimer()
        model.fit(x, x, batch_size=config["batch"], epochs=1, verbose=0, callbacks=[timer],
                  shuffle=False)
        return statistics.median(timer.times[config["warmup"]:])

    timed_fit(True)  # the process's first fit warms up more than its steps
    epoch_end_s.clear()
    for pair in range(config["fits"]):
        for report in ((False, True) if pair % 2 == 0 else (True, False)):  # no order bias
            medians[report].append(timed_fit(report))
    # The per-step calls alone (ctypes into the runtime, bookkeeping), without a train step: CPU
    # time of this thread, which the machine's load does not inflate as much as wall time.
    strategy.extended._step_reporter = reporter
    reporter._crossing = False  # no reference steps in this loop
    start = time.thread_time_ns()
    for _ in range(CALL_LOOP):
        reporter.begin_step()
        reporter.end_step()
    calls_cpu_s = (time.thread_time_ns() - start) / 1e9 / CALL_LOOP
    if strategy.rank == 0:
        print("RESULT " + json.dumps({
            "cross": config["cross"], "variables": len(model.trainable_variables),
            "report_off_s": statistics.median(medians[False]),
            "report_on_s": statistics.median(medians[True]),
            "fits_off_s": medians[False], "fits_on_s": medians[True],
            "calls_cpu_s": calls_cpu_s,
            "epoch_end_s": statistics.median(epoch_end_s)}), flush=True)


def run_preemption_worker(config: dict) -> None:
    """One model traced with the preemption check, one without (the handling disarmed while its
    train function is made); then their steps alternate (``train_on_batch``, which runs the same
    train function and wrapper as ``fit``), so each pair of steps sees the same load."""
    import keras
    import numpy as np

    import prophet_tf
    from prophet_tf import preemption

    strategy = prophet_tf.ProphetStrategy(schedule="prophet", preemption_signals="SIGTERM",
                                          step_report=False)

    def model():
        with strategy.scope():
            m = keras.Sequential([keras.Input((8,))] +
                                 [keras.layers.Dense(8) for _ in range(config["variables"] // 2)])
            m.compile(optimizer=keras.optimizers.SGD(0.001), loss="mse")
        return m

    batch = np.random.default_rng(0).normal(size=(config["batch"], 8)).astype("float32")
    checked = model()
    checked.train_on_batch(batch, batch)  # traced with the check
    preemption.reset()
    unchecked = model()
    unchecked.train_on_batch(batch, batch)  # traced without it
    for _ in range(config["warmup"]):
        checked.train_on_batch(batch, batch)
        unchecked.train_on_batch(batch, batch)
    times: dict = {True: [], False: []}
    for step in range(config["steps"] * config["rounds"]):
        order = ((True, checked), (False, unchecked)) if step % 2 else ((False, unchecked), (True, checked))
        for on, m in order:
            start = time.perf_counter()
            m.train_on_batch(batch, batch)
            times[on].append(time.perf_counter() - start)
    if strategy.rank == 0:
        differences = [a - b for a, b in zip(times[True], times[False])]
        print("RESULT " + json.dumps({"on_s": statistics.median(times[True]),
                                      "off_s": statistics.median(times[False]),
                                      "difference_s": statistics.median(differences),
                                      "pairs": len(differences),
                                      "variables": len(checked.trainable_variables)}), flush=True)


def measure(config: dict) -> dict:
    cmd = [sys.executable, "-m", "prophet_tf.launch", "-n", "2", "--threads", "1", "--timeout", "900", "--",
           "-m", "prophet_tf.bench.overhead", "--worker", json.dumps(config)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    match = re.search(r"RESULT (\{.*\})", proc.stdout)
    if proc.returncode != 0 or not match:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        what = ("the preemption run" if config.get("compare") == "preemption" else
                f"run with cross_barrier={config['cross']}")
        raise SystemExit(f"{what} failed (exit code {proc.returncode})")
    return json.loads(match.group(1))


def main(argv: Sequence[str]) -> int:
    del argv
    if FLAGS.worker:
        config = json.loads(FLAGS.worker)
        if config.get("compare") == "preemption":
            run_preemption_worker(config)
        else:
            run_worker(config)
        return 0
    base = {"variables": FLAGS.variables, "steps": FLAGS.steps, "warmup": FLAGS.warmup,
            "batch": FLAGS.batch, "fits": FLAGS.fits}
    if FLAGS.compare == "preemption":
        result = measure(dict(base, compare="preemption", rounds=FLAGS.rounds))
        print(f"{result['pairs']} pairs of steps (train_on_batch), {result['variables']} variables, "
              f"2 workers on loopback: median step with the check {result['on_s'] * 1e3:.3f} ms, "
              f"without {result['off_s'] * 1e3:.3f} ms")
        print(f"preemption check per step: {result['difference_s'] * 1e6:.1f} us (median of the "
              "pairs' differences)")
        return 0
    results: dict[bool, list[dict]] = {False: [], True: []}
    n_vars = None
    for round_index in range(FLAGS.rounds):
        for cross in (False, True):
            result = measure(dict(base, cross=cross))
            n_vars = result["variables"]
            results[cross].append(result)
            fits = " ".join(f"{off * 1e3:.2f}/{on * 1e3:.2f}"
                            for off, on in zip(result["fits_off_s"], result["fits_on_s"]))
            print(f"round {round_index + 1}/{FLAGS.rounds}: crossing {'on ' if cross else 'off'} "
                  f"{result['report_off_s'] * 1e3:8.3f} ms/step, with the step report "
                  f"{result['report_on_s'] * 1e3:8.3f} ms/step ({n_vars} variables; fits off/on "
                  f"{fits})", flush=True)

    def med(cross: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[cross])

    off_s, on_s = med(False, "report_off_s"), med(True, "report_off_s")
    print(f"\nmedian step (step report off): crossing off {off_s * 1e3:.3f} ms, crossing on "
          f"{on_s * 1e3:.3f} ms, {n_vars} variables, 2 workers on loopback")
    print(f"crossing overhead per variable per step: {(on_s - off_s) / n_vars * 1e6:.1f} us")
    parts = []
    for cross in (True, False):
        # Paired within each launch (the same process, fits alternating), then the median.
        deltas = [r["report_on_s"] - r["report_off_s"] for r in results[cross]]
        delta, base_s = statistics.median(deltas), med(cross, "report_off_s")
        parts.append(f"crossing {'on' if cross else 'off'} {delta * 1e6:.1f} us "
                     f"({delta / base_s:.1%} of the step)")
    everyone = [r for rs in results.values() for r in rs]
    epoch_end_ms = statistics.median(r["epoch_end_s"] for r in everyone) * 1e3
    calls_us = statistics.median(r["calls_cpu_s"] for r in everyone) * 1e6
    print(f"step report overhead per step: {', '.join(parts)}; its per-step calls alone "
          f"{calls_us:.1f} us of CPU; per epoch {epoch_end_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    app.run(main)
