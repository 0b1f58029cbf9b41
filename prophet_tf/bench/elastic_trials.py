"""Elastic trials (``python -m prophet_tf.bench.faults --elastic``): a job of several nodes under
``prophetrun --nnodes MIN:MAX`` loses a node (kill -9, SIGTERM, network cut) or gains one while it
trains, and must go on with the new number of workers.

The job: one worker per node, on emulated hosts (one network namespace each, root; node 0, on
host 0, runs the master and is never the victim), fits the restart trials' model
(``restart_trials.run_worker``: a ``tf.data`` pipeline reshuffled every epoch, seeded by the job's
``$PROPHET_JOB_SEED``, ``BackupAndRestore(save_freq=...)``), with a pause after each step so that
faults land while it trains. A trial starts 3 nodes (``--nnodes 2:3``) and, at a random step and a
random fraction of it:

- ``kill``: SIGKILL to every process of a random node (its launcher and its worker: the machine
  dies);
- ``sigterm``: SIGTERM to that node's launcher (the machine is preempted);
- ``netcut``: that host's network interface goes down (its launcher and worker stay; after the
  master gave it up, its processes are killed and the link goes up again);
- ``grow``: the job starts with 2 nodes (``--join-wait 0``) and a third node is started; it joins
  once its standby workers imported TensorFlow, and until then every step of the job waits for
  it a few seconds (the job must still be training when it comes).

Per trial:

- kept training: the job ended with status 0 and its last attempt had the new number of workers;
- hang: the master node's launcher still running ``deadline_s`` after the fault (then killed);
- detected: when the master said so (a node lost or cut off, one arrived; a SIGTERM or a kill
  counts as detected when it is sent, the master's message comes once the job stopped);
- back to training: from the detection to the moment every worker of the next attempt finished
  its first step (the workers' clocks, on this machine);
- steps redone: the training steps applied when the interrupted attempt ended (where the workers
  stopped, or the last step one of them finished) minus those the next attempt starts from;
- bitwise: rank 0 of every attempt first copies the backup directory it starts from; after the
  trial, a fresh job of the new number of workers (``prophetrun -n N'`` on loopback) resumes from
  a copy of the one after the change, and its final weights must equal the elastic job's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

from prophet_tf import preemption
from prophet_tf.bench import restart_trials
from prophet_tf.cluster import ELASTIC_ENV
from prophet_tf.bench.restart_trials import Line, parse_event, position, wait_until

KINDS = ("kill", "sigterm", "netcut", "grow")
KIND_NAMES = {"kill": "kill -9", "sigterm": "SIGTERM", "netcut": "network cut", "grow": "node added"}
GOAL_S = 30.0
NODES = 3  # nodes of a trial (--nnodes NODES-1:NODES)
NODE_TIMEOUT_S = 5.0
HOLD_STEP_S = 5.0
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ------------------------------------------------------------------------------------------------
# The worker


def run_worker(config: dict) -> None:
    """The restart trials' program; rank 0 first keeps a copy of the checkpoint this attempt
    starts from (``snapshot_dir/<attempt>``: the fresh job of the same N resumes from it)."""
    token = os.environ.get("PROPHET_JOB_TOKEN", "")[:12]
    cluster = json.loads(os.environ.get("TF_CONFIG") or "{}")
    rank = int(cluster.get("task", {}).get("index", 0))
    world = len(cluster.get("cluster", {}).get("worker", [])) or 1
    snapshots = config.get("snapshot_dir")
    if snapshots and rank == 0:
        target = os.path.join(snapshots, token)
        if os.path.isdir(config["backup_dir"]):
            shutil.copytree(config["backup_dir"], target)
        else:
            os.makedirs(target)
    restart_trials.run_worker(config, world=world, token=token)


# ------------------------------------------------------------------------------------------------
# Reading a job's output (pure; unit-tested)


@dataclasses.dataclass
class Attempt:
    """The workers of one attempt of the elastic job (their events carry its token)."""

    token: str
    world: int
    started: float                                        # its first worker's start event
    pids: dict = dataclasses.field(default_factory=dict)  # rank -> pid
    steps: list = dataclasses.field(default_factory=list)
    done: dict = dataclasses.field(default_factory=dict)  # rank -> weights digest
    stopped: Optional[preemption.Report] = None           # where its workers stopped together


def attempts_of(lines: Sequence[Line]) -> list[Attempt]:
    """The attempts in the order they started; a preemption report belongs to the attempt that
    started last before it."""
    attempts: dict[str, Attempt] = {}
    reports: list[tuple[float, preemption.Report]] = []
    for line in lines:
        event = parse_event(line.text)
        if event is None:
            report = preemption.parse_report(line.text)
            if report is not None and report.epoch is not None:
                reports.append((line.t, report))
            continue
        token = event.get("token")
        if token is None:
            continue
        attempt = attempts.get(token)
        if attempt is None:
            attempt = attempts[token] = Attempt(token, int(event.get("world", 0)), float(event["t"]))
        if event["event"] == "start":
            attempt.pids[int(event["rank"])] = event["pid"]
            attempt.started = min(attempt.started, float(event["t"]))
        elif event["event"] == "step":
            attempt.steps.append(event)
        elif event["event"] == "done":
            attempt.done[int(event["rank"])] = event["weights"]
    ordered = sorted(attempts.values(), key=lambda a: a.started)
    for t, report in reports:
        before = [a for a in ordered if a.started <= t]
        if before and before[-1].stopped is None:
            before[-1].stopped = report
    return ordered


def attempts_events(lines: Sequence[Line], token: str, kind: str) -> list[dict]:
    """The events of one kind of the attempt with this token."""
    return [e for e in (parse_event(line.text) for line in lines)
            if e is not None and e.get("token") == token and e["event"] == kind]


def first_line_after(lines: Sequence[Line], t: float, *needles: str) -> Optional[Line]:
    """The first line at or after ``t`` that holds every needle."""
    return next((line for line in lines if line.t >= t and all(n in line.text for n in needles)), None)


@dataclasses.dataclass
class Result:
    """One trial and what followed the fault."""

    name: str
    kind: str
    victim: int                        # node rank (grow: the node added)
    at_step: int                       # steps applied when the fault was sent (last seen)
    fault_at: float = 0.0
    workers_before: int = 0
    workers_after: Optional[int] = None
    exit_code: Optional[int] = None    # the master node's launcher; None: still running (hang)
    kept_training: bool = False
    detected_after_s: Optional[float] = None   # the master's detection, after the fault
    training_after_s: Optional[float] = None   # every worker's first step, after the detection
    formed_after_s: Optional[float] = None     # the master sent the new plan, after the detection
    started_after_s: Optional[float] = None    # every new worker's strategy was up, after it
    applied: Optional[int] = None
    resumed_from: Optional[int] = None
    bitwise: Optional[bool] = None     # None: not compared (see detail)
    # A network cut: the cut-off node's launcher (which lost the master) stopped its worker and
    # exited by itself this long after the fault (None: it had not within node timeout + 20 s).
    victim_out_after_s: Optional[float] = None
    load: Optional[float] = None       # the machine's 1-minute load average at the fault
    detail: str = ""

    @property
    def hang(self) -> bool:
        return self.exit_code is None

    @property
    def redone(self) -> Optional[int]:
        if self.applied is None or self.resumed_from is None:
            return None
        return self.applied - self.resumed_from


def measure(result: Result, lines: Sequence[Line], master_lines: Sequence[Line],
            steps_per_epoch: int) -> tuple[Optional[Attempt], Optional[Attempt]]:
    """Fills in what followed the fault; returns the attempts before and after the change."""
    attempts = attempts_of(lines)
    before = next((a for a in reversed(attempts) if a.started <= result.fault_at), None)
    after = next((a for a in attempts if a.started > result.fault_at and a.world != result.workers_before
                  and a.steps), None)
    if before is None:
        return None, None
    if before.stopped is not None and before.stopped.epoch is not None:
        result.applied = before.stopped.epoch * steps_per_epoch + before.stopped.step
    else:
        result.applied = max((position(e, steps_per_epoch) for e in before.steps), default=0)
    needle = {"kill": "was lost", "netcut": "was lost", "sigterm": "left the job",
              "grow": "arrived"}[result.kind]
    seen = first_line_after(master_lines, result.fault_at, "master: ", needle)
    detected = result.fault_at if result.kind in ("kill", "sigterm") else (
        seen.t if seen is not None else None)
    if seen is not None:
        result.detected_after_s = seen.t - result.fault_at
    if after is None:
        return before, None
    result.workers_after = after.world
    result.resumed_from = position(after.steps[0], steps_per_epoch) - 1
    first: dict[int, float] = {}
    for e in after.steps:
        first.setdefault(e["pid"], e["t"])
    if detected is not None and len(first) == len(after.pids) == after.world:
        result.training_after_s = max(first.values()) - detected
    formed = first_line_after(master_lines, result.fault_at, "master: the job forms with")
    if detected is not None and formed is not None:
        result.formed_after_s = formed.t - detected
    starts = [e["t"] for e in attempts_events(lines, after.token, "start")]
    if detected is not None and len(starts) == after.world:
        result.started_after_s = max(starts) - detected
    return before, after


# ------------------------------------------------------------------------------------------------
# Hosts: emulated (network namespaces) or loopback


class _Hosts:
    """Where the nodes run: ``emulated`` (one network namespace per node, root) or loopback."""

    def __init__(self, emulated: bool, prefix: str, nodes: int) -> None:
        self.cluster = None
        if emulated:
            from prophet_tf.bench.netem import EmulatedCluster

            self.cluster = EmulatedCluster(nodes, 0, prefix=prefix)
            self.cluster.start()

    def address(self, node: int) -> str:
        return self.cluster.host_address(node) if self.cluster is not None else "127.0.0.1"

    def wrap(self, node: int, argv: list[str]) -> list[str]:
        return self.cluster.exec_argv(node, argv) if self.cluster is not None else argv

    def kill_node(self, node: int, proc: subprocess.Popen) -> None:
        """SIGKILL to every process of the node (emulated: every process of its namespace)."""
        if self.cluster is not None:
            ns = self.cluster.namespace(node)
            for _ in range(3):
                out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
                pids = [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                if not pids:
                    break
                time.sleep(0.05)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher; its workers die with it
        except ProcessLookupError:
            pass

    def link(self, node: int, up: bool) -> None:
        assert self.cluster is not None, "a network cut needs emulated hosts"
        self.cluster.run(node, ["ip", "link", "set", "eth0", "up" if up else "down"], check=True)

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


class ElasticJob:
    """The node launchers of one elastic job; their output lines, timed as they come."""

    def __init__(self, hosts: _Hosts, config: dict, workdir: str, job_seed: int, nnodes: str,
                 join_wait: float, timeout_s: float) -> None:
        self.hosts, self.config, self.workdir = hosts, config, workdir
        self.job_seed, self.nnodes, self.join_wait, self.timeout_s = job_seed, nnodes, join_wait, timeout_s
        self.lines: list[Line] = []
        self.by_node: dict[int, list[Line]] = {}
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.readers: list[threading.Thread] = []
        self.token = secrets.token_hex(16)
        from prophet_tf.launch import free_ports

        self.master = f"{hosts.address(0)}:{free_ports(1)[0]}"

    def start(self, node: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore",
                   PROPHET_JOB_TOKEN=self.token)
        env.pop("TF_CONFIG", None)
        env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [sys.executable, "-u", "-m", "prophet_tf.launch", "--nnodes", self.nnodes,
                "--node-rank", str(node), "--master", self.master, "-n", "1", "--threads", "1",
                "--grace", "2", "--node-timeout", f"{NODE_TIMEOUT_S:g}", "--join-wait",
                f"{self.join_wait:g}", "--rdzv-timeout", "120", "--timeout", f"{self.timeout_s:g}",
                "--env", f"PROPHET_JOB_SEED={self.job_seed}", "--",
                "-m", "prophet_tf.bench.faults", f"--elastic_worker={json.dumps(self.config)}"]
        proc = subprocess.Popen(self.hosts.wrap(node, argv), env=env, cwd=self.workdir,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.procs[node] = proc
        self.by_node[node] = []
        reader = threading.Thread(target=self._read, args=(node, proc), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _read(self, node: int, proc: subprocess.Popen) -> None:
        for text in proc.stdout:
            line = Line(time.time(), text.rstrip("\n"))
            with self.lock:
                self.lines.append(line)
                self.by_node[node].append(line)

    def snapshot(self) -> tuple[list[Line], list[Line]]:
        """(every line, the master node's lines)."""
        with self.lock:
            return list(self.lines), list(self.by_node.get(0, []))

    def attempts(self) -> list[Attempt]:
        return attempts_of(self.snapshot()[0])

    def tail(self, node: int = 0, count: int = 14) -> str:
        with self.lock:
            return "\n".join("    " + l.text[:300] for l in self.by_node.get(node, [])[-count:])

    def stop(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                self.hosts.kill_node(node, proc)
                proc.wait()
        for reader in self.readers:
            reader.join(10)


# ------------------------------------------------------------------------------------------------
# Trials


@dataclasses.dataclass
class TrialPlan:
    kind: str
    victim: int      # node killed/terminated/cut (1..NODES-1), or the node added (NODES-1)
    at_step: int     # the fault follows the first report of this step
    delay: float     # a fraction of a step, after that report


def plan_trials(per_kind: int, seed: int, total_steps: int, kinds: Sequence[str] = KINDS,
                nodes: int = NODES) -> list[TrialPlan]:
    """``per_kind`` trials of each kind in a seeded order, each with a random victim (never node 0,
    which runs the master), step and fraction of a step. Faults come after step 3 and at least
    30 steps before the end (the job must still train after the change)."""
    rng = random.Random(seed)
    plans = []
    for kind in kinds:
        for _ in range(per_kind):
            victim = nodes - 1 if kind == "grow" else rng.randrange(1, nodes)
            plans.append(TrialPlan(kind, victim, rng.randrange(3, total_steps - 30), rng.random()))
    rng.shuffle(plans)
    return plans


def job_config(seed: int, quick: bool) -> dict:
    steps, epochs = (20, 3) if quick else (20, 5)
    return {"seed": seed, "epochs": epochs, "steps_per_epoch": steps, "batch": 60,
            "save_freq": 5, "step_pause_s": 0.1}


def fresh_weights(workers: int, config: dict, job_seed: int, deadline_s: float) -> tuple[Optional[str], str]:
    """The final weights of a fresh ``prophetrun -n workers`` job from ``config["backup_dir"]``
    (its workers run as an elastic job's: one worker then coordinates as several do)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONWARNINGS="ignore",
               **{ELASTIC_ENV: "1"})
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = _PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-u", "-m", "prophet_tf.launch", "-n", str(workers), "--threads", "1",
           "--timeout", f"{deadline_s:g}", "--env", f"PROPHET_JOB_SEED={job_seed}", "--",
           "-m", "prophet_tf.bench.faults", f"--elastic_worker={json.dumps(config)}"]
    proc = subprocess.Popen(cmd, env=env, cwd=os.path.dirname(config["backup_dir"]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=deadline_s + 60)
    except subprocess.TimeoutExpired:
        out = ""
    finally:
        if proc.poll() is None:  # also when this bench is interrupted: its workers die with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    events = [e for e in (parse_event(t) for t in out.splitlines()) if e is not None]
    weights = {e["weights"] for e in events if e["event"] == "done"}
    done = sum(1 for e in events if e["event"] == "done")
    if proc.returncode == 0 and done == workers and len(weights) == 1:
        return weights.pop(), ""
    return None, f"the fresh job failed (exit {proc.returncode}): {out[-1500:]}"


def run_trial(plan: TrialPlan, name: str, base_config: dict, job_seed: int, emulated: bool,
              deadline_s: float, prefix: str, nodes: int = NODES) -> Result:
    """One elastic job, faulted as planned; measured; its weights compared with the fresh job's."""
    workdir = tempfile.mkdtemp(prefix="prophet_elastic_")
    config = dict(base_config, backup_dir=os.path.join(workdir, "backup"),
                  snapshot_dir=os.path.join(workdir, "snapshots"))
    spe = config["steps_per_epoch"]
    grow = plan.kind == "grow"
    hold = os.path.join(workdir, "hold")
    if grow:
        # The node added joins once its workers' interpreters have imported TensorFlow (a minute
        # on a loaded machine): until the master says it arrived, the job's steps wait for it
        # (HOLD_STEP_S each at most), so that it is still training then.
        config.update(hold_file=hold, hold_step_s=HOLD_STEP_S)
    result = Result(name, plan.kind, plan.victim, plan.at_step, workers_before=nodes - 1 if grow else nodes)
    hosts = _Hosts(emulated, prefix, nodes)
    job = ElasticJob(hosts, config, workdir, job_seed, f"{nodes - 1}:{nodes}",
                     join_wait=0.0 if grow else 60.0, timeout_s=deadline_s * 3)
    after: Optional[Attempt] = None
    try:
        for node in range(result.workers_before):
            job.start(node)

        def trained_past() -> bool:
            return any(a.world == result.workers_before and len(a.pids) == a.world and
                       any(position(e, spe) >= plan.at_step for e in a.steps) for a in job.attempts())

        if not wait_until(trained_past, deadline_s) or job.procs[0].poll() is not None:
            result.detail = f"fault not sent: the job never trained past step {plan.at_step}\n" + job.tail()
            return result
        attempt = [a for a in job.attempts() if a.world == result.workers_before][-1]
        times = sorted(e["t"] for e in attempt.steps)
        step_s = times[-1] - times[-2] if len(times) > 1 else 0.0
        time.sleep(plan.delay * min(max(step_s, 0.0), 1.0))
        result.at_step = max(position(e, spe) for e in job.attempts()[-1].steps)
        result.fault_at = time.time()
        result.load = os.getloadavg()[0]
        if plan.kind == "kill":
            hosts.kill_node(plan.victim, job.procs[plan.victim])
        elif plan.kind == "sigterm":
            job.procs[plan.victim].send_signal(signal.SIGTERM)
        elif plan.kind == "netcut":
            hosts.link(plan.victim, up=False)
        else:
            open(hold, "w").close()
            job.start(plan.victim)
            wait_until(lambda: first_line_after(job.snapshot()[1], result.fault_at, "master: ", "arrived")
                       is not None or job.procs[0].poll() is not None, deadline_s)
            os.unlink(hold)
        if plan.kind == "netcut":
            # Once the master gave the node up: the node's launcher notices the lost master by
            # itself (it then stops its worker); then its processes go and the link comes back.
            wait_until(lambda: first_line_after(job.snapshot()[1], result.fault_at, "was lost")
                       is not None or job.procs[0].poll() is not None, deadline_s)
            if wait_until(lambda: job.procs[plan.victim].poll() is not None, NODE_TIMEOUT_S + 20):
                result.victim_out_after_s = time.time() - result.fault_at
            hosts.kill_node(plan.victim, job.procs[plan.victim])
            hosts.link(plan.victim, up=True)
        try:
            result.exit_code = job.procs[0].wait(max(1.0, deadline_s - (time.time() - result.fault_at)))
        except subprocess.TimeoutExpired:
            result.exit_code = None
    finally:
        job.stop()
        hosts.close()
        lines, master_lines = job.snapshot()
        try:
            if result.fault_at:
                _, after = measure(result, lines, master_lines, spe)
            if after is not None:
                result.kept_training = (result.exit_code == 0 and len(after.done) == after.world
                                        and after.token == attempts_of(lines)[-1].token
                                        and len(set(after.done.values())) == 1)
            if result.kept_training:
                snapshot = os.path.join(config["snapshot_dir"], after.token)
                fresh = dict(base_config, backup_dir=os.path.join(workdir, "fresh", "backup"))
                if os.path.isdir(snapshot):
                    shutil.copytree(snapshot, fresh["backup_dir"])
                    weights, why = fresh_weights(after.world, fresh, job_seed, deadline_s)
                    result.bitwise = weights is not None and {weights} == set(after.done.values())
                    if weights is None:
                        result.detail = why
                else:
                    result.detail = f"no copy of the checkpoint attempt {after.token} started from"
            elif not result.detail:
                result.detail = "\n" + job.tail()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return result


def format_result(r: Result) -> str:
    what = {"kill": f"kill -9 of node {r.victim}", "sigterm": f"SIGTERM to node {r.victim}'s launcher",
            "netcut": f"network of node {r.victim} cut", "grow": f"node {r.victim} added"}[r.kind]
    head = (f"{r.name}: {what} after step {r.at_step}"
            + (f" (load {r.load:.1f})" if r.load is not None else "") + f", {r.workers_before} -> "
            f"{r.workers_after if r.workers_after is not None else '?'} workers: ")
    if r.hang:
        head += "HANG (the master node's launcher still running; killed)"
    elif not r.kept_training:
        head += f"DID NOT KEEP TRAINING (exit {r.exit_code})"
    else:
        head += "kept training"
    parts = []
    if r.detected_after_s is not None:
        parts.append(f"the master said so {r.detected_after_s:.1f} s after the fault")
    if r.training_after_s is not None:
        split = ""
        if r.formed_after_s is not None and r.started_after_s is not None:
            split = (f" (the job formed again after {r.formed_after_s:.1f} s, every new worker's "
                     f"strategy was up after {r.started_after_s:.1f} s)")
        parts.append(f"training again {r.training_after_s:.1f} s after the detection{split}")
    if r.redone is not None:
        parts.append(f"stopped at step {r.applied}, resumed from step {r.resumed_from}: "
                     f"{r.redone} step(s) redone" + (" [SKIPPED STEPS]" if r.redone < 0 else ""))
    if r.kind == "netcut":
        parts.append(f"the cut-off node stopped its worker and exited {r.victim_out_after_s:.1f} s "
                     "after the cut" if r.victim_out_after_s is not None else
                     "the cut-off node was STILL RUNNING (killed)")
    if r.bitwise is not None:
        parts.append("weights bitwise equal to the fresh job of that N from the same checkpoint"
                     if r.bitwise else "WEIGHTS DIFFER from the fresh job of that N")
    text = head + ("; " + "; ".join(parts) if parts else "")
    if r.detail:
        text += f"\n  {r.detail.strip()[:2500]}"
    return text


def goal_of(kind: str, save_freq: int) -> int:
    """The most steps a trial of this kind may redo: none after a coordinated stop (SIGTERM, a
    node added), at most ``save_freq`` after a loss."""
    return save_freq if kind in ("kill", "netcut") else 0


def summary_lines(results: Sequence[Result], save_freq: int) -> list[str]:
    lines = ["elastic trials: kind | trials | kept training | hangs | the master said so (max s after the fault) | "
             f"back to training after detection (median / max s; goal {GOAL_S:.0f}) | steps redone (max; goal) | "
             "bitwise equal to the fresh job of that N"]
    for kind in KINDS:
        found = [r for r in results if r.kind == kind]
        if not found:
            continue
        detected = [r.detected_after_s for r in found if r.detected_after_s is not None]
        back = [r.training_after_s for r in found if r.training_after_s is not None]
        redone = [r.redone for r in found if r.redone is not None]
        cells = [KIND_NAMES[kind], str(len(found)), str(sum(r.kept_training for r in found)),
                 str(sum(r.hang for r in found)), f"{max(detected):.1f}" if detected else "-",
                 (f"{statistics.median(back):.1f} / {max(back):.1f} ({sum(t <= GOAL_S for t in back)} "
                  f"of {len(found)} within the goal)") if back else "-",
                 f"{max(redone)} ({goal_of(kind, save_freq)})" if redone else "-",
                 f"{sum(bool(r.bitwise) for r in found)} of {len(found)}"]
        lines.append("  " + " | ".join(cells))
    return lines


def passed(results: Sequence[Result], save_freq: int) -> bool:
    """Every goal: kept training, no hang, back within the goal, steps redone within the goal,
    weights bitwise equal."""
    return bool(results) and all(
        r.kept_training and not r.hang and r.bitwise and r.training_after_s is not None
        and r.training_after_s <= GOAL_S and r.redone is not None
        and 0 <= r.redone <= goal_of(r.kind, save_freq) for r in results)


def _terminate(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def run(per_kind: int, seed: int, quick: bool, deadline_s: float, kinds: Sequence[str] = KINDS,
        emulated: bool = True, json_path: Optional[str] = None, log=print,
        nodes: int = NODES) -> list[Result]:
    """The elastic trials; prints each and the summary table; returns them."""
    job_seed = 2000 + seed
    config = job_config(seed, quick)
    total = config["epochs"] * config["steps_per_epoch"]
    plans = plan_trials(per_kind, seed, total, kinds, nodes)
    prefix = f"elst{os.getpid() % 100000}"
    log(f"elastic trials: {len(plans)} trials ({', '.join(f'{per_kind} {KIND_NAMES[k]}' for k in kinds)}), "
        f"seed {seed}; {nodes} nodes of 1 worker ({'emulated hosts' if emulated else 'loopback'}), "
        f"--nnodes {nodes - 1}:{nodes}, --node-timeout {NODE_TIMEOUT_S:g}; a fit of {config['epochs']} epochs "
        f"x {config['steps_per_epoch']} steps (global batch {config['batch']}) with "
        f"BackupAndRestore(save_freq={config['save_freq']}), PROPHET_JOB_SEED={job_seed}")
    results = []
    # A SIGTERM to the bench ends it through its clean-up (every job and namespace it started).
    previous = (signal.signal(signal.SIGTERM, _terminate)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        for index, plan in enumerate(plans, 1):
            result = run_trial(plan, f"elastic trial {index}/{len(plans)}", config, job_seed,
                               emulated, deadline_s, prefix, nodes)
            results.append(result)
            log(format_result(result))
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if json_path:
        with open(json_path, "w") as f:
            json.dump([dict(dataclasses.asdict(r), redone=r.redone, hang=r.hang) for r in results], f,
                      indent=1, default=str)
    for line in summary_lines(results, config["save_freq"]):
        log(line)
    loads = [r.load for r in results if r.load is not None]
    if loads:
        log(f"  load average (1 min) at the faults: median {statistics.median(loads):.1f}, "
            f"max {max(loads):.1f} on {os.cpu_count()} CPUs")
    return results


__all__ = ["run", "run_worker", "plan_trials", "attempts_of", "measure", "summary_lines", "passed",
           "Result", "Attempt", "TrialPlan", "KINDS"]
