"""Helpers for multi-worker tests: run a worker script as N real processes on loopback.

* ``run_workers(script, n, *args, timeout=...)`` runs ``python -m prophet_tf.launch -n N --threads
  1 --timeout T -- tests/workers/<script> args`` and returns a :class:`WorkerRun` (exit status,
  output, parsed ``RESULT {json}`` lines per rank).
* ``spawn_workers(script, n, *args)`` starts the N workers *without* the launcher (which would stop
  the survivors itself when one fails) and returns a :class:`Spawned`; every process still alive
  at teardown is killed.

Worker scripts print ``RESULT {json}`` lines (see ``tests/workers/strategy_common.py``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

import zygote

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"
_RESULT = re.compile(r"^(?:\[rank (\d+)\] )?RESULT (\{.*\})\s*$")


def _base_env() -> dict:
    env = dict(os.environ)
    extra_path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + extra_path if extra_path else "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.pop("TF_CONFIG", None)
    env.pop(zygote.SOCKET_ENV, None)
    env.pop(_SHARED_ZYGOTES_ENV, None)
    return env


def _worker_env(extra: Optional[dict] = None) -> dict:
    env = _base_env()
    zygotes = _zygotes()
    if zygotes:
        env[zygote.SOCKET_ENV] = os.pathsep.join(zygotes)
    if extra:
        env.update(extra)
    return env


# Worker processes forked from zygotes that have imported TensorFlow (tests/zygote.py): the
# suite's workers would otherwise spend most of its CPU importing it. PROPHET_TEST_ZYGOTE=0 starts
# every worker as a fresh interpreter instead.
_zygote_state: dict = {}
# Under pytest-xdist the controller starts the zygotes, before its test processes, and hands them
# their socket paths and client here: one pair serves the whole run (each zygote costs an import
# of TensorFlow, 9 CPU-s, and its memory).
_SHARED_ZYGOTES_ENV = "PROPHET_TEST_SHARED_ZYGOTES"


def _zygotes_enabled() -> bool:
    return os.environ.get("PROPHET_TEST_ZYGOTE", "1") != "0"


def _zygotes() -> list:
    """The zygotes' socket paths (two: see zygote.py), once they serve.

    Started on first use, or by the xdist controller when the run starts (they import TensorFlow
    while the tests are collected). The first use waits until they serve: a worker that did not
    would import TensorFlow itself, beside the zygotes' own imports."""
    if not _zygotes_enabled():
        return []
    _start_zygotes()
    if not _zygote_state.get("served"):
        deadline = time.monotonic() + 120
        procs = _zygote_state["procs"] or [None] * len(_zygote_state["paths"])
        for path, proc in zip(_zygote_state["paths"], procs):
            while (not os.path.exists(path) and (proc is None or proc.poll() is None)
                   and time.monotonic() < deadline):
                time.sleep(0.05)
        _zygote_state["served"] = True   # or failed to start: workers then start afresh
    return _zygote_state["paths"]


def pytest_configure(config) -> None:
    if (not os.environ.get("PYTEST_XDIST_WORKER") and _zygotes_enabled()
            and getattr(config.option, "numprocesses", None)):   # the xdist controller
        _start_zygotes()
        os.environ[_SHARED_ZYGOTES_ENV] = json.dumps(
            {"paths": _zygote_state["paths"], "python": _zygote_state["python"]})


def _start_zygotes() -> None:
    shared = os.environ.get(_SHARED_ZYGOTES_ENV)
    if shared and "paths" not in _zygote_state:
        started = json.loads(shared)
        _zygote_state.update(paths=started["paths"], python=started["python"], procs=[])
    if "paths" not in _zygote_state:
        import atexit
        import tempfile

        folder = tempfile.mkdtemp(prefix="prophet_tf-zygote-")
        env = _base_env()
        env.pop("PYTHONHASHSEED", None)   # each zygote its own, as separate processes have
        paths, procs = [], []
        for i in range(2):
            path = os.path.join(folder, f"zygote{i}.sock")
            # Its own output (a zygote that failed to start says why there; workers then start
            # fresh) goes to a log beside its socket.
            with open(os.path.join(folder, f"zygote{i}.log"), "wb") as log:
                procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"),
                                               path], stdin=subprocess.PIPE, stdout=log,
                                              stderr=subprocess.STDOUT, env=env, cwd=ROOT))
            paths.append(path)
        _zygote_state["paths"], _zygote_state["procs"] = paths, procs
        _zygote_state["python"] = zygote.write_client(os.path.join(folder, "python"), env)

        def stop() -> None:
            for proc in procs:
                proc.stdin.close()   # the zygote ends its own children and itself
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            codes = [proc.returncode for proc in procs]
            if all(code == 0 for code in codes):
                import shutil

                shutil.rmtree(folder, ignore_errors=True)
            else:   # kept, with the logs: this file says which zygote ended how
                with open(os.path.join(folder, "exit-status.txt"), "w") as f:
                    f.write(f"zygote exit statuses (0, 1): {codes}\n")

        atexit.register(stop)


def worker_python() -> str:
    """The interpreter to start a TensorFlow worker with: the zygotes' stand-in for ``python``
    (tests/zygote.py), or ``sys.executable`` with PROPHET_TEST_ZYGOTE=0."""
    return _zygote_state["python"] if _zygotes() else sys.executable


@pytest.fixture
def zygote_interpreter(monkeypatch):
    """For code the test runs in its own process that starts TensorFlow workers with
    ``sys.executable`` (the benchmarks' trial drivers, the launcher's API, a node's launcher):
    ``sys.executable`` becomes the zygotes' stand-in and ``os.environ`` the environment they
    serve, so those workers fork from a zygote instead of importing TensorFlow afresh (8 CPU-s
    each). Yields the interpreter (the real one with PROPHET_TEST_ZYGOTE=0)."""
    python = worker_python()
    if python != sys.executable:
        for key, value in _worker_env().items():
            if os.environ.get(key) != value:
                monkeypatch.setenv(key, value)
        monkeypatch.setattr(sys, "executable", python)
    yield python


def alive(pid: int) -> bool:
    """Whether a process with this pid still exists (a zombie counts: its parent has not waited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def parse_results(text: str, default_rank: Optional[int] = None) -> dict[int, list[dict]]:
    """``{rank: [result, ...]}`` from ``[rank i] RESULT {...}`` lines, in order."""
    out: dict[int, list[dict]] = {}
    for line in text.splitlines():
        m = _RESULT.match(line.strip())
        if not m:
            continue
        rank = int(m.group(1)) if m.group(1) is not None else default_rank
        out.setdefault(rank, []).append(json.loads(m.group(2)))
    return out


@dataclass
class WorkerRun:
    n: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    results_by_rank: dict = field(default_factory=dict)

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr

    def tail(self, chars: int = 6000) -> str:
        return self.output[-chars:]

    def results(self, rank: int, **match) -> list[dict]:
        return [r for r in self.results_by_rank.get(rank, [])
                if all(r.get(k) == v for k, v in match.items())]

    def one(self, rank: int, **match) -> dict:
        found = self.results(rank, **match)
        assert len(found) == 1, f"rank {rank}: expected one RESULT {match}, got {len(found)}\n" \
                                f"{self.tail()}"
        return found[0]

    def check_ok(self) -> "WorkerRun":
        assert self.returncode == 0, f"workers failed (exit {self.returncode}):\n{self.tail()}"
        return self


def launch_workers(script: str, n: int, *args: str, timeout: float = 200, threads: int = 1,
                   env: Optional[dict] = None) -> WorkerRun:
    cmd = [worker_python(), "-m", "prophet_tf.launch", "-n", str(n), "--threads", str(threads),
           "--timeout", str(timeout), "--", str(WORKERS / script), *map(str, args)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_worker_env(env), capture_output=True, text=True,
                          timeout=timeout + 60)
    return WorkerRun(n, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0,
                     parse_results(proc.stdout))


@pytest.fixture(scope="session")
def run_workers():
    """``run_workers(script, n, *args, timeout=200, threads=1, env=None) -> WorkerRun``."""
    return launch_workers


@dataclass
class Spawned:
    procs: list
    started: float       # time.monotonic() at start
    started_wall: float  # time.time() at the same moment (workers report wall-clock times)

    def wait(self, timeout: float) -> list[tuple[Optional[int], float, str]]:
        """Waits for every worker; returns ``(exit status or None if still running, seconds
        since start when it was seen to exit, output)`` per rank."""
        deadline = self.started + timeout
        done: dict[int, tuple[Optional[int], float]] = {}
        while len(done) < len(self.procs) and time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if i not in done and p.poll() is not None:
                    done[i] = (p.returncode, time.monotonic() - self.started)
            time.sleep(0.1)
        results = []
        for i, p in enumerate(self.procs):
            if i not in done:
                p.kill()
            out, _ = p.communicate(timeout=30)
            code, when = done.get(i, (None, time.monotonic() - self.started))
            results.append((code, when, out))
        return results


@pytest.fixture
def spawn_workers():
    """``spawn_workers(script, n, *args, env=None) -> Spawned`` (no launcher)."""
    from prophet_tf import launch

    spawned: list[subprocess.Popen] = []

    def spawn(script: str, n: int, *args: str, env: Optional[dict] = None) -> Spawned:
        addresses = [f"127.0.0.1:{p}" for p in launch.free_ports(n)]
        envs = launch.worker_envs(n, addresses, "strategy-test-token", threads=1,
                                  base_env=_worker_env(env))
        t0 = time.monotonic()
        procs = []
        for worker_env in envs:
            p = subprocess.Popen([worker_python(), "-u", str(WORKERS / script), *map(str, args)],
                                 cwd=ROOT, env=worker_env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            procs.append(p)
            spawned.append(p)
        return Spawned(procs, t0, time.time() - (time.monotonic() - t0))

    yield spawn
    for p in spawned:  # only the processes this fixture started, by their handles
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


class ProgramRuns:
    """Programs run on N workers and in one reference process (see
    :func:`run_programs_against_one_process`): their RESULT lines, saved weights and wall times."""

    def __init__(self, workdir: str, distributed: WorkerRun, reference: list,
                 reference_seconds: float):
        self.workdir = workdir
        self.distributed = distributed
        self.reference = reference
        # Wall time of the N-worker launch and of the one process (the suite's CI cost).
        self.seconds = (distributed.seconds, reference_seconds)

    def weights(self, program: str, who: str) -> list:
        """The arrays ``WORKDIR/<program>.<who>.npz`` holds, in the order they were saved."""
        import numpy as np

        with np.load(os.path.join(self.workdir, f"{program}.{who}.npz")) as saved:
            keys = sorted(saved.files, key=lambda k: int(re.sub(r"\D", "", k) or 0))
            return [saved[k] for k in keys]

    def result(self, program: str, rank: Optional[int] = None) -> dict:
        """The RESULT of ``program`` on ``rank``, or of the reference process (rank None)."""
        if rank is None:
            (found,) = [r for r in self.reference if r["program"] == program]
            return found
        return self.distributed.one(rank, program=program)

    def trained(self, program: str, n: int) -> tuple:
        """``program`` trained without error on ``n`` workers and in one process: (RESULTs by
        rank, the reference RESULT, weights by rank, the reference weights)."""
        results = [self.result(program, rank) for rank in range(n)]
        reference = self.result(program)
        for r in results + [reference]:
            assert r["error"] is None, f"{program} ({r['role']}) failed: {r['error']}"
        weights = [self.weights(program, f"rank{rank}") for rank in range(n)]
        return results, reference, weights, self.weights(program, "reference")


def run_programs_against_one_process(script: str, workdir: str, programs: list, n: int = 2,
                                     timeout: float = 600) -> ProgramRuns:
    """Runs ``tests/workers/<script> distributed WORKDIR --programs ...`` on ``n`` workers, then
    ``<script> reference WORKDIR --programs ...`` in one process (which reads the initial weights
    the distributed run recorded)."""
    joined = ",".join(programs)
    distributed = launch_workers(script, n, "distributed", workdir, "--programs", joined,
                                 timeout=timeout).check_ok()
    start = time.monotonic()
    proc = subprocess.run([worker_python(), str(WORKERS / script), "reference", workdir,
                           "--programs", joined], cwd=ROOT, env=_worker_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return ProgramRuns(workdir, distributed, parse_results(proc.stdout, default_rank=0)[0],
                       time.monotonic() - start)


# Files that run the most multi-worker launches start first: with the files run side by side
# (scripts/test.sh: pytest -n JOBS --dist loadfile) the suite then does not end waiting on one
# long file that started last. Order only; every file still runs.
SLOW_FILES_FIRST = (
    "test_conformance.py",
    "test_unseen_programs.py",
    "test_xla.py",
    "test_multinode.py",
    "test_saving.py",
    "test_netem.py",
    "test_preemption.py",
    "test_strategy_equivalence.py",
    "test_bench_train.py",
    "test_crossing.py",
    "test_compression.py",
    "test_fusion.py",
    "test_strategy_failures.py",
    "test_gradient_identity.py",
    "test_input_pipeline.py",
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable


# Where the suite's time goes: CPU-seconds (the test process and every subprocess it waited for)
# and wall seconds per test file, printed at the end. On 2 cores the CPU total, not the slowest
# test, bounds the suite's wall time.
def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            + _zygote_children_cpu_seconds())


def _zygote_children_cpu_seconds() -> float:
    """What the processes forked for this test process used, as the zygotes reaped them."""
    owner = os.environ.get(zygote.OWNER_ENV, "")
    total = 0.0
    for path in _zygote_state.get("paths", ()):
        try:
            with open(zygote.cpu_path(path)) as f:
                total += json.load(f).get(owner, 0.0)
        except (OSError, ValueError):
            continue
    return total


_cpu_mark = [0.0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid, location) -> None:
    _cpu_mark[0] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    now = _cpu_seconds()
    # Carried to the xdist controller with the report (pytest serializes a report's attributes).
    outcome.get_result().cpu_seconds = now - _cpu_mark[0]
    _cpu_mark[0] = now


_file_costs: dict = {}
_test_costs: dict = {}


def pytest_runtest_logreport(report) -> None:
    cpu = getattr(report, "cpu_seconds", 0.0)
    cost = _file_costs.setdefault(report.nodeid.split("::")[0], [0.0, 0.0])
    cost[0] += cpu
    cost[1] += report.duration
    _test_costs[report.nodeid] = _test_costs.get(report.nodeid, 0.0) + cpu


def pytest_terminal_summary(terminalreporter) -> None:
    if not _file_costs:
        return
    total_cpu = sum(c for c, _ in _file_costs.values())
    terminalreporter.section(f"cost per test file (CPU-s in all, {total_cpu:.0f})")
    for path, (cpu, wall) in sorted(_file_costs.items(), key=lambda kv: -kv[1][0])[:20]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s {wall:8.1f} s  {path}")
    # A module's shared launch is charged to the test that first asked for it.
    terminalreporter.section("costliest tests (CPU-s: set-up, call and tear-down)")
    for nodeid, cpu in sorted(_test_costs.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU-s  {nodeid}")
