"""Restart trials (``python -m prophet_tf.bench.faults --restarts``): a job interrupted by a
SIGTERM or a ``kill -9`` of one of its workers must finish, under ``prophetrun --max-restarts``,
with the weights of an uninterrupted run.

The job: 2 or 3 workers ``fit`` a small model on a ``tf.data`` pipeline that reshuffles every
epoch (its seed is the job's ``$PROPHET_JOB_SEED``; the program sets none of its own), with
``BackupAndRestore(save_freq=...)``. A trial interrupts it at a random moment of training (a
random step, seen as soon as a worker reports it, then a random fraction of the last step's
time) by sending SIGTERM to a random worker, or SIGKILL; the launcher restarts every worker and
the program resumes from its backup. Per interruption:

- completed: the launcher exited 0 and every worker of the last attempt finished;
- bitwise: every worker's final weights equal the uninterrupted run's (same workers, same seed);
- steps redone: the training steps applied when the interrupted attempt ended (a preemption
  says where it stopped; after a kill, the last step a worker finished) minus the position the
  next attempt's first step starts from. A SIGTERM must redo none; a kill redoes the steps since
  the last backup. A negative count would be steps skipped;
- training again: from the fault to the moment every worker of the next attempt finished its
  first step (the workers' clocks, on this machine), split into the old attempt ending (the
  launcher's restart message) and the new one starting up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

from prophet_tf import preemption

EVENT = "RESTART_EVENT"
FAULTS = {"sigterm": signal.SIGTERM, "kill": signal.SIGKILL}
FAULT_NAMES = {"sigterm": "SIGTERM", "kill": "kill -9"}
GOAL_S = 30.0

# ------------------------------------------------------------------------------------------------
# The worker


def _event(kind: str, **fields: Any) -> None:
    print(f"{EVENT} " + json.dumps(dict(event=kind, t=time.time(), pid=os.getpid(), **fields)),
          flush=True)


def run_worker(config: dict, **tags: Any) -> None:
    """The job's program: the same in every attempt (it resumes through its BackupAndRestore).

    ``tags`` go into every event; ``config["step_pause_s"]`` (optional) is slept after each step
    (a longer job without more computation); while the file ``config["hold_file"]`` (optional)
    exists, each step waits for it to go, up to ``config["hold_step_s"]`` seconds (the job trains
    on, slowly, until the bench lets it go)."""
    import numpy as np
    import keras
    import tensorflow as tf

    import prophet_tf

    strategy = prophet_tf.ProphetStrategy()
    _event("start", rank=strategy.rank, **tags)
    pause = float(config.get("step_pause_s", 0.0))
    hold, hold_s = config.get("hold_file"), float(config.get("hold_step_s", 0.0))
    steps, batch, features = config["steps_per_epoch"], config["batch"], 32
    rng = np.random.RandomState(config["seed"])
    x = rng.randn(steps * batch, features).astype("float32")
    y = rng.randint(0, 10, size=(steps * batch,)).astype("int32")
    # Reshuffled every epoch, seeded by TensorFlow's global seed: the job's seed.
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(steps * batch).batch(batch)

    def init(i: int):
        return keras.initializers.GlorotUniform(seed=config["seed"] + i)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((features,)),
            keras.layers.Dense(128, activation="relu", kernel_initializer=init(0)),
            keras.layers.Dense(128, activation="relu", kernel_initializer=init(1)),
            keras.layers.Dense(10, kernel_initializer=init(2))])
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Steps(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch_index, logs=None):
            _event("step", epoch=self.epoch, batch=batch_index, **tags)
            if pause:
                time.sleep(pause)
            until = time.monotonic() + hold_s
            while hold and os.path.exists(hold) and time.monotonic() < until:
                time.sleep(0.05)

    backup = keras.callbacks.BackupAndRestore(config["backup_dir"], save_freq=config["save_freq"])
    # Steps first: a step is reported before the backup after it is written (a kill during that
    # write leaves a backup of a step the workers had applied).
    model.fit(data, epochs=config["epochs"], verbose=0, callbacks=[Steps(), backup])
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    _event("done", weights=digest.hexdigest(), **tags)


# ------------------------------------------------------------------------------------------------
# Reading a job's output and measuring (pure; unit-tested)


@dataclasses.dataclass
class Line:
    """One line of the launcher's output and when the bench read it (``time.time()``)."""

    t: float
    text: str


def parse_event(text: str) -> Optional[dict]:
    """A worker event (with ``rank`` from the launcher's prefix when there is one)."""
    rank = None
    if text.startswith("[rank "):
        head, _, text = text.partition("] ")
        rank = int(head[len("[rank "):])
    if not text.startswith(EVENT + " "):
        return None
    try:
        event = json.loads(text[len(EVENT) + 1:])
    except ValueError:
        return None
    if not isinstance(event, dict) or "event" not in event or "pid" not in event:
        return None
    event.setdefault("rank", rank)
    return event


@dataclasses.dataclass
class Attempt:
    """The workers of one attempt (grouped by their start events) and what they did."""

    pids: dict = dataclasses.field(default_factory=dict)   # rank -> pid
    steps: list = dataclasses.field(default_factory=list)  # step events
    done: dict = dataclasses.field(default_factory=dict)   # rank -> weights digest
    preempted: Optional[preemption.Report] = None  # the first worker's report
    reports: dict = dataclasses.field(default_factory=dict)  # rank -> its preemption Report
    ended_at: Optional[float] = None  # when the launcher said it ended (restart message)


def attempts_of(lines: Sequence[Line], n: int) -> list[Attempt]:
    """The attempts of a job from its output: a start event after ``n`` starts begins the next
    attempt (the launcher starts an attempt only once every worker of the previous one is gone)."""
    attempts: list[Attempt] = []
    owner: dict[int, Attempt] = {}
    for line in lines:
        event = parse_event(line.text)
        if event is None:
            if "] attempt " in line.text and " ended: " in line.text and attempts:
                if attempts[-1].ended_at is None:
                    attempts[-1].ended_at = line.t
            report = preemption.parse_report(line.text)
            if report is not None and attempts:
                if attempts[-1].preempted is None:
                    attempts[-1].preempted = report
                attempts[-1].reports.setdefault(report.rank, report)
            continue
        if event["event"] == "start":
            if not attempts or len(attempts[-1].pids) >= n:
                attempts.append(Attempt())
            attempts[-1].pids[int(event["rank"])] = event["pid"]
            owner[event["pid"]] = attempts[-1]
        elif event["pid"] in owner:
            attempt = owner[event["pid"]]
            if event["event"] == "step":
                attempt.steps.append(event)
            elif event["event"] == "done":
                attempt.done[int(event["rank"])] = event["weights"]
    return attempts


def position(event: dict, steps_per_epoch: int) -> int:
    """Training steps applied once the step of ``event`` finished."""
    return int(event["epoch"]) * steps_per_epoch + int(event["batch"]) + 1


@dataclasses.dataclass
class Interruption:
    """One fault and what followed it."""

    fault: str                         # "sigterm" | "kill"
    victim: int
    at_step: int                       # steps applied when the fault was sent (last seen)
    fault_at: float                    # time.time()
    applied: Optional[int] = None      # steps applied when the interrupted attempt ended
    resumed_from: Optional[int] = None  # steps applied before the next attempt's first step
    ended_after_s: Optional[float] = None   # the launcher's restart message, after the fault
    training_after_s: Optional[float] = None  # every worker's first step of the next attempt
    # A SIGTERM: every worker of the attempt said it stopped at the same step with a checkpoint.
    stopped_together: Optional[bool] = None

    @property
    def redone(self) -> Optional[int]:
        if self.applied is None or self.resumed_from is None:
            return None
        return self.applied - self.resumed_from


def measure(interruption: Interruption, before: Attempt, after: Optional[Attempt],
            steps_per_epoch: int) -> None:
    """Fills in what followed the fault from the interrupted attempt and the next one."""
    i = interruption
    if i.fault == "sigterm":
        places = {(r.epoch, r.step, r.checkpoint) for r in before.reports.values()}
        i.stopped_together = (set(before.reports) == set(before.pids) and len(places) == 1
                              and None not in next(iter(places)))
    if before.preempted is not None and before.preempted.epoch is not None:
        i.applied = before.preempted.epoch * steps_per_epoch + before.preempted.step
    elif before.steps:
        i.applied = max(position(e, steps_per_epoch) for e in before.steps)
    else:
        i.applied = 0
    if before.ended_at is not None:
        i.ended_after_s = before.ended_at - i.fault_at
    if after is None or not after.steps:
        return
    i.resumed_from = position(after.steps[0], steps_per_epoch) - 1
    first = {}
    for e in after.steps:
        first.setdefault(e["pid"], e["t"])
    if len(first) == len(after.pids):
        i.training_after_s = max(first.values()) - i.fault_at


@dataclasses.dataclass
class TrialResult:
    name: str
    workers: int
    interruptions: list = dataclasses.field(default_factory=list)
    exit_code: Optional[int] = None    # None: still running at the deadline (killed)
    completed: bool = False
    bitwise: bool = False
    detail: str = ""
    # False: two uninterrupted runs of this many workers ended with different weights, so the
    # weights were not compared (no run can be bitwise equal to "the" uninterrupted run).
    comparable: bool = True


def format_trial(r: TrialResult) -> str:
    lines = [f"{r.name}: " + ("completed" if r.completed else
                              f"NOT COMPLETED (launcher exit {r.exit_code}{'; ' + r.detail if r.detail else ''})")
             + (", weights bitwise equal to the uninterrupted run" if r.bitwise else
                ("" if not r.completed else
                 ", WEIGHTS DIFFER from the uninterrupted run" if r.comparable else
                 f", weights not compared (two uninterrupted runs of {r.workers} workers differ "
                 "from each other)"))]
    for i in r.interruptions:
        redone = i.redone
        what = (f"  {FAULT_NAMES[i.fault]} to rank {i.victim} after step {i.at_step}: "
                + (f"stopped at step {i.applied}, " if i.fault == "sigterm" else f"last step {i.applied}, ")
                + (f"resumed from step {i.resumed_from}: {redone} step(s) redone"
                   + (" [SKIPPED STEPS]" if redone < 0 else "") if redone is not None
                   else "never resumed"))
        if i.stopped_together is False:
            what += "; NOT every worker stopped at the same step with a checkpoint"
        if i.training_after_s is not None:
            ended = f"{i.ended_after_s:.1f} s" if i.ended_after_s is not None else "?"
            what += (f"; training again {i.training_after_s:.1f} s after the fault (attempt "
                     f"ended after {ended})")
        lines.append(what)
    return "\n".join(lines)


def summary_lines(results: Sequence[TrialResult]) -> list[str]:
    interruptions = [i for r in results for i in r.interruptions]
    by_kind = {k: [i for i in interruptions if i.fault == k] for k in FAULTS}
    runs = len(results)
    lines = [f"restarts: {len(interruptions)} interruptions ("
             + ", ".join(f"{len(v)} {FAULT_NAMES[k]}" for k, v in by_kind.items())
             + f") in {runs} runs: {sum(r.completed for r in results)} of {runs} completed, "
             f"{sum(r.bitwise for r in results)} of {sum(r.comparable for r in results)} bitwise "
             "equal to the uninterrupted run"]
    apart = sorted({r.workers for r in results if not r.comparable})
    if apart:
        lines[0] += (f" ({sum(not r.comparable for r in results)} runs of "
                     f"{'/'.join(map(str, apart))} workers not compared: two uninterrupted runs of "
                     "as many workers differ from each other)")
    for kind, found in by_kind.items():
        redone = [i.redone for i in found if i.redone is not None]
        if found:
            together = ""
            if kind == "sigterm":
                together = (f"; every worker stopped at one step with a checkpoint in "
                            f"{sum(bool(i.stopped_together) for i in found)} of {len(found)}")
            lines.append(f"  steps redone after {FAULT_NAMES[kind]}: "
                         + (f"max {max(redone)}, mean {statistics.mean(redone):.1f}"
                            + (f" ({len(found) - len(redone)} never resumed)" if len(redone) < len(found) else "")
                            if redone else "never resumed") + together)
    again = [i.training_after_s for i in interruptions if i.training_after_s is not None]
    if again:
        late = sum(1 for t in again if t > GOAL_S)
        lines.append(f"  training again after the fault: median {statistics.median(again):.1f} s, "
                     f"max {max(again):.1f} s; {len(again) - late} of {len(interruptions)} within "
                     f"{GOAL_S:.0f} s")
    return lines


# ------------------------------------------------------------------------------------------------
# Running jobs


class RestartJob:
    """One job under ``prophetrun --max-restarts``: its output lines, timed as they come."""

    def __init__(self, n: int, config: dict, workdir: str, max_restarts: int, job_seed: int,
                 timeout_s: float) -> None:
        self.n = n
        self.lines: list[Line] = []
        self.lock = threading.Lock()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONWARNINGS="ignore")
        env.pop("TF_CONFIG", None)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-u", "-m", "prophet_tf.launch", "-n", str(n), "--threads", "1",
               "--max-restarts", str(max_restarts), "--timeout", str(timeout_s),
               "--env", f"PROPHET_JOB_SEED={job_seed}", "--",
               "-m", "prophet_tf.bench.faults", f"--restart_worker={json.dumps(config)}"]
        self.proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for text in self.proc.stdout:
            with self.lock:
                self.lines.append(Line(time.time(), text.rstrip("\n")))

    def attempts(self) -> list[Attempt]:
        with self.lock:
            lines = list(self.lines)
        return attempts_of(lines, self.n)

    def tail(self, count: int = 12) -> str:
        with self.lock:
            return "\n".join("    " + l.text[:300] for l in self.lines[-count:])

    def wait(self, timeout: float) -> Optional[int]:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
        self.stop()
        return code

    def stop(self) -> None:
        """The launcher and its workers (one process group: the workers have their own, and die
        with the launcher)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.reader.join(10)


def wait_until(condition, timeout: float, step: float = 0.01) -> bool:
    """Polls ``condition`` every ``step`` s until it holds (True) or ``timeout`` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclasses.dataclass
class TrialPlan:
    workers: int
    faults: list        # [(kind, victim, at_step, delay)] in order, one per attempt; delay:
    #                     the fraction of a step to wait after step at_step was seen
    seed: int


def plan_trials(per_kind: int, seed: int, total_steps: int, quick: bool,
                workers: Sequence[int] = (2, 3)) -> list[TrialPlan]:
    """``per_kind`` SIGTERM and ``per_kind`` kill -9 trials in a seeded order (one of ``workers``
    workers, random victim, step, and a delay of up to one step after it, as a fraction of the step);
    ``quick``: one run of 2 workers interrupted twice (a SIGTERM, then a kill -9). Faults come
    before the last 6 steps (a SIGTERM stops the workers one or two steps later)."""
    rng = random.Random(seed)
    last = total_steps - 6

    def fault(kind: str, n: int, low: int) -> tuple:
        return (kind, rng.randrange(n), rng.randrange(low, last), rng.random())

    if quick:
        first = fault("sigterm", 2, 2)
        return [TrialPlan(2, [first, fault("kill", 2, min(first[2] + 3, last - 1))], seed)]
    kinds = ["sigterm"] * per_kind + ["kill"] * per_kind
    rng.shuffle(kinds)
    plans = []
    for kind in kinds:
        n = rng.choice(tuple(workers))
        plans.append(TrialPlan(n, [fault(kind, n, 2)], seed))
    return plans


def job_config(seed: int, workdir: str, quick: bool) -> dict:
    steps, epochs = (10, 3) if quick else (20, 4)
    return {"seed": seed, "epochs": epochs, "steps_per_epoch": steps, "batch": 64,
            "save_freq": 3 if quick else 5, "backup_dir": os.path.join(workdir, "backup")}


def reference_weights(n: int, config: dict, job_seed: int, deadline_s: float) -> tuple[Optional[str], str]:
    """The weights of the uninterrupted job (and what went wrong when there are none)."""
    workdir = tempfile.mkdtemp(prefix="prophet_restarts_")
    try:
        job = RestartJob(n, dict(config, backup_dir=os.path.join(workdir, "backup")), workdir, 0,
                         job_seed, deadline_s)
        code = job.wait(deadline_s + 60)
        attempts = job.attempts()
        weights = set(attempts[-1].done.values()) if attempts else set()
        if code == 0 and len(attempts) == 1 and len(attempts[0].done) == n and len(weights) == 1:
            return weights.pop(), ""
        return None, f"the uninterrupted run failed (exit {code}):\n{job.tail()}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_trial(plan: TrialPlan, name: str, base_config: dict, reference: Optional[str], job_seed: int,
              deadline_s: float, comparable: bool = True) -> TrialResult:
    """Runs one job, interrupting it as planned; measures what followed each fault
    (``comparable``: the uninterrupted runs of as many workers reproduce their weights)."""
    workdir = tempfile.mkdtemp(prefix="prophet_restarts_")
    config = dict(base_config, backup_dir=os.path.join(workdir, "backup"))
    spe = config["steps_per_epoch"]
    result = TrialResult(name, plan.workers, comparable=comparable)
    job = RestartJob(plan.workers, config, workdir, len(plan.faults) + 1, job_seed, deadline_s)
    started = time.monotonic()
    try:
        for index, (kind, victim, at_step, delay) in enumerate(plan.faults):
            def trained_past() -> bool:
                attempts = job.attempts()
                return (len(attempts) == index + 1 and len(attempts[index].pids) == plan.workers and
                        any(position(e, spe) >= at_step for e in attempts[index].steps))

            left = deadline_s - (time.monotonic() - started)
            if not wait_until(trained_past, left) or job.proc.poll() is not None:
                result.detail = f"fault {index + 1} not sent: attempt {index + 1} never trained past step {at_step}"
                break
            attempt = job.attempts()[index]
            times = sorted(e["t"] for e in attempt.steps)
            step_s = times[-1] - times[-2] if len(times) > 1 else 0.0
            time.sleep(delay * min(max(step_s, 0.0), 1.0))
            attempt = job.attempts()[index]
            pid = attempt.pids[victim]
            seen = max(position(e, spe) for e in attempt.steps)
            if not _alive(pid):
                result.detail = f"fault {index + 1} not sent: rank {victim} had exited"
                break
            fault_at = time.time()
            os.kill(pid, FAULTS[kind])
            result.interruptions.append(Interruption(kind, victim, seen, fault_at))
            # The next fault goes to the next attempt, once it trains.
        result.exit_code = job.wait(max(1.0, deadline_s - (time.monotonic() - started)))
    finally:
        job.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    attempts = job.attempts()
    for k, interruption in enumerate(result.interruptions):
        if k < len(attempts):
            measure(interruption, attempts[k], attempts[k + 1] if k + 1 < len(attempts) else None, spe)
    last = attempts[-1] if attempts else None
    result.completed = (result.exit_code == 0 and last is not None and len(last.done) == plan.workers
                        and len(attempts) == len(result.interruptions) + 1)
    result.bitwise = (result.completed and comparable and reference is not None
                      and set(last.done.values()) == {reference})
    if not result.completed and not result.detail:
        result.detail = "\n" + job.tail()
    return result


def run(per_kind: int, seed: int, quick: bool, deadline_s: float, json_path: Optional[str] = None,
        log=print, workers: Sequence[int] = (2, 3)) -> list[TrialResult]:
    """The restart trials; prints each and the summary; returns them. Without ``quick`` the
    uninterrupted run of each worker count runs twice: when the two end with different weights
    (the runtime sums the contributions of 3+ workers in their order of arrival, so float
    rounding may differ from run to run), the weights of those trials are not compared."""
    job_seed = 1000 + seed
    probe = job_config(seed, "", quick)
    total = probe["epochs"] * probe["steps_per_epoch"]
    plans = plan_trials(per_kind, seed, total, quick, workers)
    log(f"restart trials: {sum(len(p.faults) for p in plans)} interruptions in {len(plans)} runs, "
        f"seed {seed}; a fit of {probe['epochs']} epochs x {probe['steps_per_epoch']} steps with "
        f"BackupAndRestore(save_freq={probe['save_freq']}) under prophetrun --max-restarts, "
        f"PROPHET_JOB_SEED={job_seed}; training again = fault -> every worker finished its first "
        f"step of the next attempt (goal {GOAL_S:.0f} s)")
    references: dict[int, Optional[str]] = {}
    reproducible: dict[int, bool] = {}
    results = []
    for index, plan in enumerate(plans, 1):
        n = plan.workers
        if n not in references:
            references[n], why = reference_weights(n, probe, job_seed, deadline_s)
            reproducible[n] = True
            if references[n] is None:
                log(f"  (no uninterrupted reference for {n} workers: {why})")
            elif not quick:
                again, why = reference_weights(n, probe, job_seed, deadline_s)
                reproducible[n] = again == references[n]
                log(f"  uninterrupted runs of {n} workers: "
                    + ("the same weights twice" if reproducible[n] else
                       f"DIFFERENT weights ({references[n][:12]} and {str(again)[:12]}{', ' + why if why else ''}): "
                       "their trials' weights are not compared"))
        faults = " then ".join(FAULT_NAMES[f[0]] for f in plan.faults)
        result = run_trial(plan, f"restart trial {index}/{len(plans)}: {n} workers, {faults}",
                           probe, references[n], job_seed, deadline_s, reproducible[n])
        results.append(result)
        log(format_trial(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1, default=str)
    for line in summary_lines(results):
        log(line)
    return results
