"""Fault injection: what the survivors of a dead or stalled worker see, whether hostile
connections change a job's result, and whether a job restarted after a fault ends as if nothing
had happened.

    python -m prophet_tf.bench.faults [--quick] [--seed N] [--trials N]
    python -m prophet_tf.bench.faults --restarts [--restart_trials K] [--quick] [--seed N]
    python -m prophet_tf.bench.faults --elastic [--elastic_trials K] [--elastic_kinds ...] [--quick]

Fault trials: a small Keras job (ProphetStrategy, ``ModelCheckpoint`` on the chief every epoch)
runs on 2 or 3 workers, with or without the launcher; one worker gets SIGKILL or SIGSTOP at
start-up, in the middle of training, or while the chief saves. Every trial prints what each
survivor reported (error type and message) and after how long, whether it hung (still running
``--deadline_s`` after the fault: then it is killed), which rank the errors name, and whether the
last checkpoint loads.

The workers run with ``--heartbeat_s`` and ``--connect_timeout_s`` (printed in the first line):
a stopped worker is only told from a slow one by these, so they bound when its survivors know.

Hostile trials: the same job, run clean once, then twice with connections to the workers' ports
from the start: strangers (garbage, ``--idle_connections`` connections that never speak), then
impostors (a handshake with a proof made up without the job token; a hello with absurd sizes). A
job is *unaffected* when it succeeds with bitwise the same weights as the clean run, *failed
closed* when every worker failed saying why, else *AFFECTED*.

Restart trials (``--restarts``, see ``prophet_tf/bench/restart_trials.py``): K runs with a
SIGTERM to a random worker and K with a kill -9 of one, at a random moment of a 2-3 worker
``fit`` with ``BackupAndRestore(save_freq=...)`` under ``prophetrun --max-restarts``; per
interruption: completed, final weights bitwise equal to an uninterrupted run, steps redone, time
from the fault to training again. ``--quick``: one run interrupted by a SIGTERM, then a kill -9.

Elastic trials (``--elastic``, root; see ``prophet_tf/bench/elastic_trials.py``): K jobs per kind
under ``prophetrun --nnodes 2:3`` on emulated hosts lose a node (kill -9, SIGTERM to its launcher,
its network cut) or gain one while they train; per trial: kept training, hang, detection, time
back to training, steps redone, and whether the final weights equal those of a fresh job of the
new number of workers from the same checkpoint.

The last line of the fault trials is ``faults: T trials, H hangs, C corrupt checkpoints, E
unnamed errors, max detection S s``. An error is *named* when it names the worker that failed (or, for a survivor that
first saw another survivor leave, that survivor); *unnamed* otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional, Sequence

from absl import app, flags

from prophet_tf.bench import elastic_trials, restart_trials
from prophet_tf.bench.restart_trials import wait_until

FLAGS = flags.FLAGS
flags.DEFINE_bool("quick", False, "4 fault trials and one hostile trial (a few minutes).")
flags.DEFINE_integer("seed", 1, "Seed of the trial plan (workers, victims, moments, delays).")
flags.DEFINE_integer("trials", None, "Fault trials (default 24: every combination once; 4 with --quick).")
flags.DEFINE_bool("hostile", True, "Also run the hostile-connection trials.")
flags.DEFINE_integer("idle_connections", 200, "Idle connections opened against each hostile job.")
flags.DEFINE_float("deadline_s", 150.0, "A survivor still running this long after the fault hung.")
flags.DEFINE_float("timeout_s", None, "Runtime operation timeout of the workers (default: the runtime's).")
flags.DEFINE_float("heartbeat_s", 10.0, "Runtime heartbeat_s of the workers: a stopped worker is named after this "
                   "long instead of at the operation timeout (0: off, the runtime's default).")
flags.DEFINE_float("connect_timeout_s", 30.0, "Runtime connect_timeout_s of the workers: how long start-up waits "
                   "for a worker that never comes (a worker stopped at start-up).")
flags.DEFINE_string("json", None, "Also write every trial's record to this JSON file.")
flags.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")
flags.DEFINE_bool("restarts", False, "Run the restart trials (instead of the fault and hostile trials).")
flags.DEFINE_integer("restart_trials", 10, "Restart trials per fault (SIGTERM, kill -9); --quick: one run "
                     "interrupted once by each.")
flags.DEFINE_list("restart_workers", ["2", "3"], "Worker counts the restart trials draw from "
                  "(the weights of a worker count are compared only if its two uninterrupted runs "
                  "agree bitwise).")
flags.DEFINE_string("restart_worker", None, "Internal: run as a worker of the restart trials.")
flags.DEFINE_bool("elastic", False, "Run the elastic trials (prophetrun --nnodes MIN:MAX on emulated hosts, root) "
                  "instead of the fault and hostile trials.")
flags.DEFINE_integer("elastic_trials", 10, "Elastic trials per kind; --quick: one.")
flags.DEFINE_list("elastic_kinds", list(elastic_trials.KINDS), "Kinds of elastic trials: kill (kill -9 of a "
                  "node), sigterm (to a node's launcher), netcut (a host's network down), grow (a node added).")
flags.DEFINE_string("elastic_worker", None, "Internal: run as a worker of the elastic trials.")

EVENT = "FAULTS_EVENT"
SURVIVOR_GOAL_S = 60.0
_LAUNCH_PREFIX = re.compile(r"^\[rank (\d+)\] (.*)$")
_RANK_LIST = re.compile(r"\branks?(?:\(s\))? ((?:\d+)(?:\s*(?:,|and)\s*\d+)*)")

# ------------------------------------------------------------------------------------------------
# The worker


def _event(kind: str, **fields: Any) -> None:
    print(f"{EVENT} " + json.dumps(dict(event=kind, t=time.time(), **fields)), flush=True)


def run_worker(config: dict) -> None:
    """A small deterministic Keras job that reports its progress as events on stdout."""
    cluster_config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    rank = int(cluster_config.get("task", {}).get("index", 0))
    _event("pid", pid=os.getpid(), rank=rank, addresses=cluster_config.get("cluster", {}).get("worker", []))
    try:
        weights = _train(config)
    except Exception as e:  # noqa: BLE001 - the survivor's report is the measurement
        _event("error", type=type(e).__name__, message=essential_message(getattr(e, "message", None) or str(e)))
        sys.exit(3)
    _event("done", weights=weights)


def _train(config: dict) -> str:
    """Trains; returns a digest of the final weights."""
    import numpy as np
    import keras

    import prophet_tf

    strategy = prophet_tf.ProphetStrategy(**config["runtime_options"])
    _event("runtime_up")
    keras.utils.set_random_seed(config["seed"])
    rng = np.random.RandomState(config["seed"])
    steps, batch = config["steps_per_epoch"], 32
    x = rng.randn(steps * batch, 64).astype("float32")
    y = rng.randint(0, 10, size=(steps * batch,)).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="relu"),
                                  keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Events(keras.callbacks.Callback):
        def __init__(self, label: str) -> None:
            super().__init__()
            self.label = label

        def on_train_batch_end(self, batch_index, logs=None):
            if self.label == "saving":  # one instance reports steps
                _event("step", step=batch_index)

        def on_epoch_end(self, epoch, logs=None):
            _event(self.label, epoch=epoch)

    checkpoint = os.path.join(config["checkpoint_dir"], "model.keras")
    # "saving" comes right before ModelCheckpoint writes (callbacks run in list order).
    callbacks = [Events("saving"), keras.callbacks.ModelCheckpoint(checkpoint), Events("saved")]
    _event("training")
    model.fit(x, y, batch_size=batch, epochs=config["epochs"], shuffle=False, verbose=0, callbacks=callbacks)
    digest = hashlib.sha256()
    for w in model.get_weights():
        digest.update(np.ascontiguousarray(w).tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------
# Reading what the workers say (pure; unit-tested)


@dataclasses.dataclass
class Event:
    rank: Optional[int]
    kind: str
    t: float
    fields: dict


def parse_event(line: str, rank: Optional[int] = None) -> Optional[Event]:
    """An event from a worker's stdout line, with or without the launcher's ``[rank i]``."""
    m = _LAUNCH_PREFIX.match(line.rstrip("\n"))
    if m:
        rank, line = int(m.group(1)), m.group(2)
    line = line.strip()
    if not line.startswith(EVENT + " "):
        return None
    try:
        data = json.loads(line[len(EVENT) + 1:])
    except ValueError:
        return None
    kind, t = data.pop("event", None), data.pop("t", None)
    if not isinstance(kind, str) or not isinstance(t, (int, float)):
        return None
    return Event(rank, kind, float(t), data)


def essential_message(message: str) -> str:
    """An error's own words without TensorFlow's graph traceback ("Detected at node ... File ...")."""
    kept = [line.strip() for line in message.splitlines()
            if line.strip() and not line.startswith("  File ") and not line.lstrip().startswith("[[")
            and not line.startswith(("Detected at node", "Graph execution error"))]
    return " ".join(kept)[-2000:]


def named_ranks(message: str) -> set[int]:
    """The ranks a message names: "rank 1", "rank(s) 1, 2", "ranks 0 and 2"."""
    out: set[int] = set()
    for m in _RANK_LIST.finditer(message or ""):
        out.update(int(r) for r in re.findall(r"\d+", m.group(1)))
    return out


@dataclasses.dataclass
class Survivor:
    """What one surviving worker did after the fault (times in seconds since the fault)."""

    rank: int
    exit_after_s: Optional[float] = None  # None: still running at the deadline (then killed)
    exit_code: Optional[int] = None       # None when unknown (under the launcher)
    error_type: Optional[str] = None
    message: Optional[str] = None
    reported_after_s: Optional[float] = None
    finished: bool = False                # trained to the end without an error
    stopped_by_launcher: bool = False


def classify_survivor(s: Survivor, victim: int, left_first: Sequence[int] = (),
                      launcher_names: Sequence[int] = ()) -> str:
    """``hang``, ``named``, ``cascade``, ``launcher``, ``completed`` or ``unnamed``.

    ``left_first``: survivors that reported or exited before this one (a survivor may see one of
    them leave before it notices the victim: naming that one is a ``cascade``, still named).
    ``launcher_names``: ranks the launcher's report blames, for survivors the launcher stopped.
    """
    if s.exit_after_s is None:
        return "hang"
    if s.message:
        names = named_ranks(s.message)
        if victim in names:
            return "named"
        if names & set(left_first):
            return "cascade"
        return "unnamed"
    if s.finished:
        return "completed"
    if s.stopped_by_launcher and (victim in launcher_names or set(launcher_names) & set(left_first)):
        return "launcher"
    return "unnamed"


def detection_s(s: Survivor) -> Optional[float]:
    """When the survivor knew: its error report, else its exit."""
    return s.reported_after_s if s.reported_after_s is not None else s.exit_after_s


@dataclasses.dataclass
class Checkpoint:
    state: str  # "none" (never saved), "loads", "corrupt", "missing" (saved once, now gone)
    detail: str = ""


def classify_checkpoint(exists: bool, ever_saved: bool, load_error: Optional[str]) -> Checkpoint:
    if not exists:
        return Checkpoint("missing", "a save completed earlier, the file is gone") if ever_saved else Checkpoint("none")
    if load_error is not None:
        return Checkpoint("corrupt", load_error)
    return Checkpoint("loads")


@dataclasses.dataclass
class TrialRecord:
    name: str
    survivors: list = dataclasses.field(default_factory=list)  # (Survivor, classification)
    checkpoint: Optional[Checkpoint] = None
    launcher: str = ""
    hostile: Optional[dict] = None


# Outcomes of a survivor that learnt of the fault (the others finished, hung or were never told).
_REPORTED = ("named", "cascade", "launcher", "unnamed")


def summary_line(records: Sequence[TrialRecord]) -> str:
    hangs = sum(1 for r in records for _, c in r.survivors if c == "hang")
    corrupt = sum(1 for r in records if r.checkpoint and r.checkpoint.state in ("corrupt", "missing"))
    unnamed = sum(1 for r in records for _, c in r.survivors if c == "unnamed")
    detections = [d for r in records for s, c in r.survivors if c in _REPORTED and (d := detection_s(s)) is not None]
    worst = max(detections, default=0.0)
    return (f"faults: {len(records)} trials, {hangs} hangs, {corrupt} corrupt checkpoints, {unnamed} unnamed "
            f"errors, max detection {worst:.1f} s")


def goal_lines(records: Sequence[TrialRecord]) -> list[str]:
    """What the summary line leaves out: how fast the survivors got out, what hostile jobs did."""
    exits = [s.exit_after_s for r in records if r.hostile is None for s, c in r.survivors
             if c in _REPORTED and s.exit_after_s is not None]
    late = sum(1 for t in exits if t > SURVIVOR_GOAL_S)
    lines = [f"survivors out within {SURVIVOR_GOAL_S:.0f} s of the fault: {len(exits) - late} of {len(exits)}"
             + (f" (slowest {max(exits):.1f} s)" if exits else "")]
    hostile = [r.hostile["outcome"] for r in records if r.hostile is not None]
    if hostile:
        lines.append("hostile jobs: " + ", ".join(f"{hostile.count(o)} {o}" for o in sorted(set(hostile))))
    return lines


# ------------------------------------------------------------------------------------------------
# Running a job


class Job:
    """N workers of the bench job, with or without the launcher; collects their events."""

    def __init__(self, n: int, launcher: bool, config: dict, workdir: str) -> None:
        from prophet_tf import launch

        self.n, self.launcher, self.config = n, launcher, config
        self.events: list[Event] = []
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.exit_times: dict[int, float] = {}
        self.pids: dict[int, int] = {}
        self.addresses: list[str] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore")
        env.pop("TF_CONFIG", None)
        # The workers run in a scratch directory (their checkpoints go there): find this package.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        worker = [sys.executable, "-u", "-m", "prophet_tf.bench.faults", f"--worker={json.dumps(config)}"]
        self.started = time.time()
        if launcher:
            cmd = [sys.executable, "-u", "-m", "prophet_tf.launch", "-n", str(n), "--threads", "1",
                   "--timeout", "900", "--", *worker[2:]]
            self.procs.append(subprocess.Popen(cmd, env=env, cwd=workdir, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True))
        else:
            self.addresses = [f"127.0.0.1:{p}" for p in launch.free_ports(n)]
            for worker_env in launch.worker_envs(n, self.addresses, "faults-" + os.urandom(8).hex(), threads=1,
                                                 base_env=env):
                self.procs.append(subprocess.Popen(worker, env=worker_env, cwd=workdir, stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True))
        self.readers = [threading.Thread(target=self._read, args=(i, p), daemon=True) for i, p in enumerate(self.procs)]
        if launcher:  # the workers are the launcher's children: watch their pids
            self.readers.append(threading.Thread(target=self._watch_pids, daemon=True))
        for t in self.readers:
            t.start()

    def _watch_pids(self) -> None:
        while self.procs[0].poll() is None or any(self.worker_alive(r) for r in list(self.pids)):
            for r in list(self.pids):
                if r not in self.exit_times and not self.worker_alive(r):
                    with self.lock:
                        self.exit_times[r] = time.time()
            time.sleep(0.02)
        now = time.time()
        with self.lock:
            for r in self.pids:
                self.exit_times.setdefault(r, now)

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            ev = parse_event(line, None if self.launcher else index)
            with self.lock:
                self.lines.append(line.rstrip("\n") if self.launcher else f"[rank {index}] {line.rstrip()}")
                if ev is not None:
                    self.events.append(ev)
                    if ev.kind == "pid" and ev.rank is not None:
                        self.pids[ev.rank] = int(ev.fields["pid"])
                        if ev.fields.get("addresses"):
                            self.addresses = list(ev.fields["addresses"])
        proc.wait()
        if not self.launcher:
            with self.lock:
                self.exit_times[index] = time.time()

    def over(self) -> bool:
        return all(p.poll() is not None for p in self.procs)

    def tail(self, lines: int = 8) -> str:
        with self.lock:
            return "\n".join("    " + l[:300] for l in self.lines[-lines:])

    def find(self, kind: str, rank: Optional[int] = None, after: float = 0.0) -> Optional[Event]:
        with self.lock:
            for ev in self.events:
                if ev.kind == kind and (rank is None or ev.rank == rank) and ev.t >= after:
                    return ev
        return None

    def phase(self, rank: int) -> str:
        """Where a worker is, from its last event."""
        with self.lock:
            kinds = [ev.kind for ev in self.events if ev.rank == rank]
        if not kinds or kinds[-1] in ("pid", "runtime_up"):
            return "start-up"
        return {"saving": "save", "error": "failed", "done": "finished"}.get(kinds[-1], "mid-step")

    def worker_alive(self, rank: int) -> bool:
        if not self.launcher:
            return self.procs[rank].poll() is None
        pid = self.pids.get(rank)
        if pid is None:
            return self.procs[0].poll() is None
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def exit_time(self, rank: int) -> Optional[float]:
        with self.lock:
            return self.exit_times.get(rank)

    def kill_everything(self) -> None:
        """SIGKILL to the processes this job started (workers by their reported pids)."""
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for t in self.readers:
            t.join(5)


def _load_error(path: str) -> Optional[str]:
    """Loads a .keras file in a fresh interpreter; the error, or None when it loads."""
    proc = subprocess.run([sys.executable, "-c", "import sys, keras; keras.models.load_model(sys.argv[1])", path],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if proc.returncode == 0:
        return None
    lines = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


# ------------------------------------------------------------------------------------------------
# Fault trials


@dataclasses.dataclass
class FaultPlan:
    n: int
    launcher: bool
    fault: str   # "kill" | "stop"
    moment: str  # "start-up" | "mid-step" | "save"
    victim: int
    delay_s: float  # start-up: after the victim's pid; mid-step/save: after the triggering event
    step: int       # mid-step: after this step (of the first epoch that reaches it)
    epoch: int      # save: the chief's save at the end of this epoch


def plan_trials(count: int, seed: int, epochs: int, steps: int) -> list[FaultPlan]:
    """Every (workers, launcher, fault, moment) combination in turn, victims and timing seeded."""
    rng = random.Random(seed)
    combos = [(n, l, f, m) for n in (2, 3) for l in (False, True) for f in ("kill", "stop")
              for m in ("start-up", "mid-step", "save")]
    rng.shuffle(combos)
    plans = []
    for i in range(count):
        n, launcher, fault, moment = combos[i % len(combos)]
        # During a save, the chief itself half of the time: that is what can corrupt a checkpoint.
        victim = 0 if moment == "save" and rng.random() < 0.5 else rng.randrange(n)
        plans.append(FaultPlan(n, launcher, fault, moment, victim,
                               delay_s=rng.uniform(0.0, 4.0) if moment == "start-up" else rng.uniform(0.0, 0.05),
                               step=rng.randrange(2, steps), epoch=rng.randrange(0, epochs - 1)))
    return plans


def run_fault_trial(plan: FaultPlan, index: int, total: int, base_config: dict) -> TrialRecord:
    workdir = tempfile.mkdtemp(prefix="prophet_faults_")
    config = dict(base_config, checkpoint_dir=workdir)
    label = (f"trial {index}/{total}: {plan.n} workers, {'launcher' if plan.launcher else 'no launcher'}, "
             f"{'kill -9' if plan.fault == 'kill' else 'SIGSTOP'} rank {plan.victim} at {plan.moment}")
    record = TrialRecord(label)
    job = Job(plan.n, plan.launcher, config, workdir)
    try:
        fault_at, where = _inject(job, plan)
        survivors = [r for r in range(plan.n) if r != plan.victim]
        if fault_at is None:
            record.name += " (NOT INJECTED: the job ended first)\n" + job.tail()
            wait_until(job.over, FLAGS.deadline_s)
        else:
            record.name += f" (in {where})"
            wait_until(lambda: all(not job.worker_alive(r) for r in survivors) and
                  (not plan.launcher or job.procs[0].poll() is not None),
                  FLAGS.deadline_s - (time.time() - fault_at), step=0.05)
        record.survivors = _survivors(job, plan, survivors, fault_at)
        record.launcher = _launcher_report(job, fault_at) if plan.launcher else ""
    finally:
        job.kill_everything()
    ever_saved = job.find("saved", rank=0) is not None
    path = os.path.join(workdir, "model.keras")
    exists = os.path.exists(path)
    load_error = _load_error(path) if exists else None
    if load_error is not None:
        load_error = f"{os.path.getsize(path)} bytes: {load_error}"
    record.checkpoint = classify_checkpoint(exists, ever_saved, load_error)
    shutil.rmtree(workdir, ignore_errors=True)
    return record


def _inject(job: Job, plan: FaultPlan) -> tuple[Optional[float], str]:
    """Waits for the planned moment, signals the victim; (time of the fault, phase it was in)."""
    sig = signal.SIGKILL if plan.fault == "kill" else signal.SIGSTOP
    if not wait_until(lambda: plan.victim in job.pids or job.over(), 300) or job.over():
        return None, ""
    if plan.moment == "start-up":
        time.sleep(plan.delay_s)
    elif plan.moment == "mid-step":
        if not wait_until(lambda: job.over() or any(ev.fields.get("step", -1) >= plan.step
                                               for ev in _events_of(job, "step", plan.victim)), 300) or job.over():
            return None, ""
        time.sleep(plan.delay_s)
    else:  # the chief's save at the end of epoch `plan.epoch`
        if not wait_until(lambda: job.over() or any(ev.fields.get("epoch") == plan.epoch
                                               for ev in _events_of(job, "saving", 0)), 300) or job.over():
            return None, ""
        time.sleep(plan.delay_s)
    where = job.phase(plan.victim)
    if not job.worker_alive(plan.victim):
        return None, ""
    os.kill(job.pids[plan.victim], sig)
    return time.time(), where


def _events_of(job: Job, kind: str, rank: int) -> list[Event]:
    with job.lock:
        return [ev for ev in job.events if ev.kind == kind and ev.rank == rank]


def _survivors(job: Job, plan: FaultPlan, ranks: Sequence[int], fault_at: Optional[float]) -> list:
    base = fault_at if fault_at is not None else job.started
    found: list[Survivor] = []
    for r in ranks:
        s = Survivor(r)
        err = job.find("error", rank=r)
        if err is not None:
            s.error_type, s.message = err.fields.get("type"), err.fields.get("message")
            s.reported_after_s = err.t - base
        s.finished = job.find("done", rank=r) is not None
        if not job.worker_alive(r):
            t = job.exit_time(r)
            s.exit_after_s = (t if t is not None else time.time()) - base
            s.stopped_by_launcher = plan.launcher and err is None and not s.finished
            if not plan.launcher:
                s.exit_code = job.procs[r].returncode
        found.append(s)
    order = sorted(found, key=lambda s: detection_s(s) if detection_s(s) is not None else float("inf"))
    launcher_names = named_ranks(_launcher_report(job, fault_at)) if plan.launcher else set()
    out = []
    for s in found:
        earlier = [o.rank for o in order[:order.index(s)]]
        out.append((s, classify_survivor(s, plan.victim, earlier, sorted(launcher_names))))
    return out


def _launcher_report(job: Job, fault_at: Optional[float]) -> str:
    with job.lock:
        lines = [l for l in job.lines if l.startswith("[launch]")]
    code = job.procs[0].returncode
    return (" | ".join(l[len("[launch] "):] for l in lines)[:600] + (f" (exit {code})" if code is not None else " (running)"))


# ------------------------------------------------------------------------------------------------
# Hostile connections


# The start-up handshake as ops/core/handshake.h lays it out, in the protocol version of the
# library built here (an impostor of another version would be turned away before its token is
# looked at).
_MAGIC = 0x31465450
_VERDICT_BYTES, _CHALLENGE_BYTES, _PROOF_BYTES = 264, 64, 32


def _protocol_version() -> int:
    from prophet_tf._library import runtime_constants

    return int(runtime_constants()["protocol_version"])


def _client_hello(rank: int, world: int, acceptor_rank: int, heartbeat_ms: int, nonce: bytes) -> bytes:
    """The connecting side's ``ClientHello``: how a stranger would try to join."""
    return struct.pack("<IHHiiiI32s", _MAGIC, _protocol_version(), 0, rank, world, acceptor_rank, heartbeat_ms,
                       nonce)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def _verdict(data: bytes) -> str:
    if len(data) < 8:
        return "closed"
    status = struct.unpack_from("<H", data, 6)[0]
    return {0: "rejected", 1: "ACCEPTED", 2: "challenged", 3: "aborted"}.get(status, "odd verdict")


def _hostile_connection(address: str, kind: str, rng: random.Random, held: list, heartbeat_ms: int) -> str:
    host, port = address.rsplit(":", 1)
    try:
        s = socket.create_connection((host, int(port)), timeout=2)
    except OSError:
        return "refused"
    try:
        if kind == "probe":
            return "connected"
        if kind == "idle":
            held.append(s)
            return "held"
        s.settimeout(5)
        if kind == "garbage":
            s.sendall(bytes(rng.getrandbits(8) for _ in range(4096)))
        elif kind == "wrong_token":
            # A well-formed hello as rank 1 (to rank 0), then a proof made up without the token.
            s.sendall(_client_hello(1, 2, 0, heartbeat_ms, rng.randbytes(32)))
            first = _recv_exactly(s, _VERDICT_BYTES)
            if _verdict(first) != "challenged":
                return _verdict(first)
            _recv_exactly(s, _CHALLENGE_BYTES)
            s.sendall(rng.randbytes(_PROOF_BYTES))
        elif kind == "huge_lengths":
            s.sendall(struct.pack("<IHHiiiI", _MAGIC, _protocol_version(), 0xFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF,
                                  0xFFFFFFFF) + b"\xff" * 65536)
        try:
            return _verdict(_recv_exactly(s, _VERDICT_BYTES))
        except socket.timeout:
            return "no answer"
        except OSError:
            return "reset"
    except OSError:
        return "reset"
    finally:
        if kind != "idle":
            s.close()


#: Hostile trials: (connection kinds besides idle ones, whether idle ones are opened). Strangers
#: (garbage, idle connections) must leave the job unaffected; impostors speak the handshake.
HOSTILE_TRIALS = ((("garbage",), True), (("wrong_token", "huge_lengths"), False))


def classify_hostile_job(exit_codes: Sequence[Optional[int]], weights: set, baseline: Optional[str],
                         errors: Sequence[str]) -> str:
    """``unaffected`` (bitwise the clean run's weights), ``failed closed`` (no result, every worker
    said why), else ``AFFECTED`` (a hang, a silent failure or other weights)."""
    if list(exit_codes) == [0] * len(exit_codes) and baseline is not None and weights == {baseline}:
        return "unaffected"
    if (None not in exit_codes and all(c != 0 for c in exit_codes) and not weights
            and len(errors) == len(exit_codes)):
        return "failed closed"
    return "AFFECTED"


def run_hostile_trial(index: int, total: int, base_config: dict, baseline: Optional[str], kinds: Sequence[str],
                      idle: int, seed: int) -> TrialRecord:
    workdir = tempfile.mkdtemp(prefix="prophet_faults_")
    config = dict(base_config, checkpoint_dir=workdir)
    heartbeat_ms = int(config["runtime_options"].get("heartbeat_s", 0.0) * 1000 + 0.5)
    record = TrialRecord(f"trial {index}/{total}: hostile connections against 2 workers (no launcher): "
                         + ", ".join([k.replace("_", " ") for k in kinds] + ([f"{idle} idle"] if idle else [])))
    rng = random.Random(seed)
    job = Job(2, False, config, workdir)
    held: list[socket.socket] = []
    outcomes: dict[str, dict[str, int]] = {}
    finished_in_time: set[int] = set()
    try:
        wait_until(lambda: len(job.addresses) == 2, 300)
        addresses = list(job.addresses)
        # The workers listen only while they connect to each other: wait for the first listener.
        while not job.over() and _hostile_connection(rng.choice(addresses), "probe", rng, held, heartbeat_ms) == "refused":
            time.sleep(0.01)
        planned = ["idle"] * idle + list(kinds) * 10
        rng.shuffle(planned)
        start = time.time()
        # From start-up into training (after start-up the ports are closed: those attempts are refused).
        while time.time() - start < 120 and not job.over() and (planned or job.find("training") is None):
            kind = planned.pop() if planned else rng.choice(kinds)
            # Impostors knock where a real peer would: rank 0 accepts, rank 1 connects.
            address = addresses[0] if kind != "garbage" and kind != "idle" else rng.choice(addresses)
            result = _hostile_connection(address, kind, rng, held, heartbeat_ms)
            outcomes.setdefault(kind, {}).setdefault(result, 0)
            outcomes[kind][result] += 1
            if result == "refused":
                time.sleep(0.01)
        wait_until(lambda: all(p.poll() is not None for p in job.procs), 600)
        finished_in_time = {r for r, p in enumerate(job.procs) if p.poll() is not None}
    finally:
        for s in held:
            s.close()
        job.kill_everything()
        shutil.rmtree(workdir, ignore_errors=True)
    codes = [p.returncode if r in finished_in_time else None for r, p in enumerate(job.procs)]
    for r in range(2):
        s = Survivor(r, exit_code=codes[r], finished=job.find("done", rank=r) is not None)
        err = job.find("error", rank=r)
        if err is not None:
            s.error_type, s.message = err.fields.get("type"), err.fields.get("message")
            s.reported_after_s = err.t - job.started
        s.exit_after_s = None if r not in finished_in_time else job.exit_time(r) - job.started
        outcome = ("hang" if s.exit_after_s is None else "completed" if s.finished else
                   "failed" if s.message else "unnamed")
        record.survivors.append((s, outcome))
    weights = {ev.fields.get("weights") for ev in _all(job, "done")}
    errors = [f"rank {ev.rank}: {ev.fields.get('type')}: {ev.fields.get('message', '')[:300]}" for ev in _all(job, "error")]
    record.hostile = {"connections": outcomes, "exit_codes": codes, "errors": errors,
                      "same_weights_as_clean_run": baseline is not None and weights == {baseline},
                      "outcome": classify_hostile_job(codes, weights, baseline, errors)}
    return record


def _all(job: Job, kind: str) -> list[Event]:
    with job.lock:
        return [ev for ev in job.events if ev.kind == kind]


def clean_run_weights(base_config: dict) -> tuple[Optional[str], str]:
    """The weights digest of the job without any interference (and what went wrong if none)."""
    workdir = tempfile.mkdtemp(prefix="prophet_faults_")
    job = Job(2, False, dict(base_config, checkpoint_dir=workdir), workdir)
    try:
        wait_until(lambda: all(p.poll() is not None for p in job.procs), 600)
    finally:
        job.kill_everything()
        shutil.rmtree(workdir, ignore_errors=True)
    weights = {ev.fields.get("weights") for ev in _all(job, "done")}
    if [p.returncode for p in job.procs] == [0, 0] and len(weights) == 1:
        return weights.pop(), ""
    return None, "the clean run failed: " + " | ".join(job.lines[-5:])


# ------------------------------------------------------------------------------------------------
# Report


def format_record(r: TrialRecord) -> str:
    lines = [r.name]
    for s, c in r.survivors:
        if s.exit_after_s is None:
            what = f"still running {FLAGS.deadline_s:.0f} s after the fault: HANG (killed)"
        elif s.message:
            what = (f"{s.error_type} after {s.reported_after_s:.2f} s, out after {s.exit_after_s:.2f} s"
                    + (f" (exit {s.exit_code})" if s.exit_code is not None else "") + f": {s.message[:400]}")
        elif s.finished:
            what = f"finished training, out after {s.exit_after_s:.2f} s"
        elif s.stopped_by_launcher:
            what = f"stopped by the launcher, out after {s.exit_after_s:.2f} s"
        else:
            what = f"exited after {s.exit_after_s:.2f} s (exit {s.exit_code}) without reporting an error"
        late = (" [LATE: out after more than 60 s]" if c in _REPORTED and s.exit_after_s is not None
                and s.exit_after_s > SURVIVOR_GOAL_S else "")
        lines.append(f"  rank {s.rank}: [{c}] {what}{late}")
    if r.launcher:
        lines.append(f"  launcher: {r.launcher}")
    if r.checkpoint is not None:
        lines.append(f"  last checkpoint: {r.checkpoint.state}" + (f" ({r.checkpoint.detail[:300]})" if r.checkpoint.detail else ""))
    if r.hostile is not None:
        h = r.hostile
        conns = "; ".join(f"{k}: " + ", ".join(f"{n} {v}" for v, n in sorted(res.items())) for k, res in sorted(h["connections"].items()))
        lines.append(f"  connections: {conns}")
        lines.append(f"  job: exit codes {h['exit_codes']}, weights equal to the clean run: "
                     f"{'yes' if h['same_weights_as_clean_run'] else 'no'} -> {h['outcome']}")
        for e in h["errors"]:
            lines.append(f"    {e}")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    del argv
    if FLAGS.worker:
        run_worker(json.loads(FLAGS.worker))
        return
    if FLAGS.restart_worker:
        restart_trials.run_worker(json.loads(FLAGS.restart_worker))
        return
    if FLAGS.elastic_worker:
        elastic_trials.run_worker(json.loads(FLAGS.elastic_worker))
        return
    if FLAGS.elastic:
        kinds = [k for k in FLAGS.elastic_kinds if k]
        unknown = sorted(set(kinds) - set(elastic_trials.KINDS))
        if unknown or not kinds:
            raise app.UsageError(f"--elastic_kinds: {unknown or 'none'}; choose from {list(elastic_trials.KINDS)}")
        results = elastic_trials.run(1 if FLAGS.quick else FLAGS.elastic_trials, FLAGS.seed, FLAGS.quick,
                                     FLAGS.deadline_s * 2, kinds, json_path=FLAGS.json)
        sys.exit(0 if elastic_trials.passed(results, elastic_trials.job_config(FLAGS.seed, FLAGS.quick)["save_freq"])
                 else 1)
    if FLAGS.restarts:
        workers = [int(n) for n in FLAGS.restart_workers]
        if not workers or min(workers) < 2:
            raise app.UsageError(f"--restart_workers: worker counts of at least 2, got {workers}")
        results = restart_trials.run(FLAGS.restart_trials, FLAGS.seed, FLAGS.quick,
                                     FLAGS.deadline_s * 4, FLAGS.json, workers=workers)
        sys.exit(0 if results and all(r.completed and (r.bitwise or not r.comparable)
                                      for r in results) else 1)
    trials = FLAGS.trials if FLAGS.trials is not None else (4 if FLAGS.quick else 24)
    runtime_options = {k: v for k, v in (("timeout_s", FLAGS.timeout_s), ("heartbeat_s", FLAGS.heartbeat_s),
                                         ("connect_timeout_s", FLAGS.connect_timeout_s)) if v is not None}
    base_config = {"seed": FLAGS.seed, "epochs": 4, "steps_per_epoch": 20, "runtime_options": runtime_options}
    plans = plan_trials(trials, FLAGS.seed, base_config["epochs"], base_config["steps_per_epoch"])
    hostile = len(HOSTILE_TRIALS) if FLAGS.hostile else 0
    total = len(plans) + hostile
    print(f"fault injection: {len(plans)} fault trials + {hostile} hostile trial(s), seed {FLAGS.seed}, "
          f"survivors must be out within {SURVIVOR_GOAL_S:.0f} s; hang = still running after {FLAGS.deadline_s:.0f} s; "
          f"runtime options {runtime_options or 'defaults'}", flush=True)
    records = []
    for i, plan in enumerate(plans, 1):
        records.append(run_fault_trial(plan, i, total, base_config))
        print(format_record(records[-1]), flush=True)
    if hostile:
        baseline, why = clean_run_weights(base_config)
        if baseline is None:
            print(f"  (no clean reference: {why})", flush=True)
        for i, (kinds, with_idle) in enumerate(HOSTILE_TRIALS, len(plans) + 1):
            idle = (20 if FLAGS.quick else FLAGS.idle_connections) if with_idle else 0
            records.append(run_hostile_trial(i, total, base_config, baseline, kinds, idle, FLAGS.seed + i))
            print(format_record(records[-1]), flush=True)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in records], f, indent=1, default=str)
    for line in goal_lines(records):
        print(line, flush=True)
    print(summary_line(records), flush=True)


if __name__ == "__main__":
    app.run(main)
