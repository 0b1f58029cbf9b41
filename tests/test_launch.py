"""Tests of prophet_tf.launch with tiny Python scripts (no TensorFlow)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Sequence

import pytest

from conftest import alive
from prophet_tf.launch import EXIT_TIMEOUT, free_ports, launch
from prophet_tf.launch.cli import parser
from prophet_tf.launch.workers import command

REPO = Path(__file__).resolve().parents[1]

REPORT = textwrap.dedent("""\
    import json, os, sys
    cfg = json.loads(os.environ["TF_CONFIG"])
    print("REPORT " + json.dumps({
        "index": cfg["task"]["index"], "type": cfg["task"]["type"],
        "workers": cfg["cluster"]["worker"], "token": os.environ["PROPHET_JOB_TOKEN"],
        "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
        "intra": os.environ.get("TF_NUM_INTRAOP_THREADS"),
        "inter": os.environ.get("TF_NUM_INTEROP_THREADS"),
        "extra": os.environ.get("EXTRA"), "argv": sys.argv[1:]}))
    print("to stderr", file=sys.stderr)
    sys.stdout.write("tail without newline")
    """)

# Rank 1 fails once the others have recorded their pid (however long their start takes); the
# others sleep.
FAIL_ONE = textwrap.dedent("""\
    import json, os, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = sys.argv[1]
    if rank == 1:
        while not all(os.path.exists(os.path.join(out, f"pid{r}")) for r in (0, 2)):
            time.sleep(0.01)
        print("something went wrong on rank 1", file=sys.stderr)
        print("last words", file=sys.stderr)
        sys.exit(3)
    with open(os.path.join(out, f"pid{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(out, f"pid{rank}.tmp"), os.path.join(out, f"pid{rank}"))
    time.sleep(600)
    """)

SLEEP = "import time\ntime.sleep(600)\n"


def _script(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_three_workers_prefixes_and_tf_config(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    rc = launch([_script(tmp_path, "report.py", REPORT), "a", "--flag"], 3, threads=1,
                env={"EXTRA": "x=y"}, stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert all(re.match(r"^\[rank [0-2]\] ", line) for line in lines), lines
    reports = {}
    for line in lines:
        m = re.match(r"^\[rank (\d)\] REPORT (.*)$", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [0, 1, 2]
    for rank, r in reports.items():
        assert r["index"] == rank  # the prefix matches the TF_CONFIG index
        assert r["type"] == "worker"
        assert r["argv"] == ["a", "--flag"]
        assert r["unbuffered"] == "1" and r["intra"] == "1" and r["inter"] == "1"
        assert r["extra"] == "x=y"
    workers = reports[0]["workers"]
    assert all(r["workers"] == workers for r in reports.values())
    assert len(set(workers)) == 3 and all(w.startswith("127.0.0.1:") for w in workers)
    tokens = {r["token"] for r in reports.values()}
    assert len(tokens) == 1 and len(tokens.pop()) >= 16
    for rank in range(3):
        assert f"[rank {rank}] tail without newline" in lines
        assert f"[rank {rank}] to stderr" in err.getvalue().splitlines()


def test_failing_worker_stops_the_others(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    rc = launch([_script(tmp_path, "fail.py", FAIL_ONE), str(tmp_path)], 3, grace=1.0,
                timeout=120, stdout=out, stderr=err)
    # The others sleep 600 s: the job ends with the failed worker's status only if the launcher
    # stopped them (the job's --timeout would end it with its own status), however loaded the
    # machine is.
    assert rc == 3
    msg = err.getvalue()
    assert "worker rank 1" in msg and "exited with status 3" in msg
    assert "something went wrong on rank 1" in msg.split("[launch]")[-1]  # stderr tail reported
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 2)]
    assert not any(alive(p) for p in pids)


def test_timeout_kills_everything(tmp_path: Path) -> None:
    err = io.StringIO()
    t0 = time.monotonic()
    rc = launch([_script(tmp_path, "sleep.py", SLEEP)], 2, timeout=0.7, grace=1.0,
                stdout=io.StringIO(), stderr=err)
    assert rc == EXIT_TIMEOUT
    assert time.monotonic() - t0 < 120.0  # the workers sleep 600 s: they were killed
    assert "timeout" in err.getvalue()


def test_worker_killed_by_signal(tmp_path: Path) -> None:
    script = _script(tmp_path, "kill.py", textwrap.dedent("""\
        import json, os, signal, time
        if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """))
    err = io.StringIO()
    rc = launch([script], 2, grace=1.0, timeout=30, stdout=io.StringIO(), stderr=err)
    assert rc == 128 + 9
    assert "SIGKILL" in err.getvalue()


def test_cli_with_separator_env_and_base_port(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", REPORT)
    base = free_ports(1)[0]
    if base > 65000:
        base = 40000
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "prophet_tf.launch", "-n", "2", "--base-port", str(base),
         "--env", "EXTRA=1", "--threads", "2", "--", script, "arg"],
        capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    reports = [json.loads(line.split("REPORT ", 1)[1]) for line in r.stdout.splitlines()
               if "REPORT " in line]
    assert sorted(x["index"] for x in reports) == [0, 1]
    assert reports[0]["workers"] == [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    assert all(x["extra"] == "1" and x["intra"] == "2" and x["argv"] == ["arg"]
               for x in reports)

    bad = subprocess.run([sys.executable, "-m", "prophet_tf.launch", "-n", "2", "--env", "NOEQ",
                          script], capture_output=True, text=True, env=env, timeout=30)
    assert bad.returncode == 2 and "KEY=VALUE" in bad.stderr


def test_free_ports_are_distinct() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


def test_command_forms() -> None:
    assert command(["x.py", "1"]) == [sys.executable, "-u", "x.py", "1"]
    assert command(["-m", "pkg.mod"]) == [sys.executable, "-u", "-m", "pkg.mod"]
    assert command(["/bin/true"]) == ["/bin/true"]
    with pytest.raises(ValueError):
        launch([], 2)
    with pytest.raises(ValueError):
        launch(["x.py"], 0)


def test_script_elsewhere_imports_the_launchers_package(tmp_path: Path) -> None:
    """A script outside the checkout, no PYTHONPATH: workers import the launcher's prophet_tf."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = _script(elsewhere, "train.py",
                     "import prophet_tf.launch, os\nprint('PKG', os.path.realpath(prophet_tf.__file__))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "prophet_tf.launch", "-np", "2", script],
                       cwd=REPO, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    found = sorted(line.split(" PKG ", 1)[0] + " " + line.split(" PKG ", 1)[1]
                   for line in r.stdout.splitlines() if " PKG " in line)
    want = os.path.realpath(REPO / "prophet_tf" / "__init__.py")
    assert found == [f"[rank 0] {want}", f"[rank 1] {want}"], r.stdout + r.stderr


def test_np_spelling_of_horovodrun() -> None:
    args = parser().parse_args(["-np", "3", "x.py"])
    assert args.n == 3 and args.script == ["x.py"]
    assert parser().parse_args(["-n", "2", "x.py"]).n == 2


# Rank 1 fails first but takes a while to exit (slow clean-up); the others notice (here through a
# file; in a real job through the runtime) and fail at once. The launcher must blame rank 1. The
# others fail only once the launcher has passed on rank 1's traceback (the file _SeesTraceback
# writes): before that, which failure the launcher sees first is a race, not what it promises.
FAILS_SLOWLY = textwrap.dedent("""\
    import atexit, json, os, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    if rank == 1:
        atexit.register(time.sleep, 3)
        raise ValueError("the real problem, on rank 1")
    while not os.path.exists(os.path.join(sys.argv[1], "launcher_saw_rank1_traceback")):
        time.sleep(0.01)
    raise RuntimeError(f"rank {rank}: my peer went away")
    """)


class _SeesTraceback(io.StringIO):
    """The launcher's stderr: creates `marker` once the traceback of one of `ranks` has been
    passed on."""

    def __init__(self, marker: Path, ranks: Sequence[int] = (1,)) -> None:
        super().__init__()
        self.marker = marker
        self.starts = tuple(f"[rank {r}] Traceback" for r in ranks)

    def write(self, text: str) -> int:
        n = super().write(text)
        if text.startswith(self.starts):
            self.marker.touch()
        return n

# Rank 1 is killed; the others see it die (pidfd) and fail right after it.
KILLED = textwrap.dedent("""\
    import json, os, select, signal, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    pidfile = os.path.join(sys.argv[1], "pid1")
    if rank == 1:
        with open(pidfile + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(pidfile + ".tmp", pidfile)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(pidfile):
        time.sleep(0.01)
    fd = os.pidfd_open(int(open(pidfile).read()))
    select.select([fd], [], [])
    raise RuntimeError(f"rank {rank}: my peer went away")
    """)


@pytest.mark.parametrize("text,status", [(FAILS_SLOWLY, "failed first"), (KILLED, "SIGKILL")],
                         ids=["traceback", "sigkill"])
def test_blames_the_worker_that_failed_first(tmp_path: Path, text: str, status: str) -> None:
    err = _SeesTraceback(tmp_path / "launcher_saw_rank1_traceback")
    rc = launch([_script(tmp_path, "w.py", text), str(tmp_path)], 3, grace=1.0, timeout=30,
                stdout=io.StringIO(), stderr=err)
    assert rc != 0
    report = err.getvalue().split("[launch]")[-1]
    assert report.startswith(" worker rank 1 ") and status in report, err.getvalue()
    if text is FAILS_SLOWLY:
        assert "the real problem, on rank 1" in report


# Rank 1 "dies" (the others learn it as from the runtime: a lost connection) but is seen dead by
# the launcher only after their tracebacks (a SIGKILLed process with much memory takes a moment
# to be torn down, while its peers' sockets already broke).
LOST_PEER_SEEN_DEAD_LATE = textwrap.dedent("""\
    import json, os, signal, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    gone = os.path.join(sys.argv[1], "rank1_gone")
    if rank == 1:
        open(gone, "w").close()
        while not os.path.exists(os.path.join(sys.argv[1], "launcher_saw_a_traceback")):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(gone):
        time.sleep(0.01)
    print(f"prophet_tf ERROR [rank {rank}]: lost the connection to rank 1 (127.0.0.1:1): "
          "receiving failed: Connection reset by peer", file=sys.stderr, flush=True)
    raise RuntimeError("allgather failed: lost the connection to rank 1 (127.0.0.1:1)")
    """)


def test_a_worker_that_lost_a_peer_is_not_blamed_for_the_peers_death(tmp_path: Path) -> None:
    err = _SeesTraceback(tmp_path / "launcher_saw_a_traceback", ranks=(0, 2))
    rc = launch([_script(tmp_path, "w.py", LOST_PEER_SEEN_DEAD_LATE), str(tmp_path)], 3, grace=1.0,
                timeout=30, stdout=io.StringIO(), stderr=err)
    report = err.getvalue().split("[launch]")[-1]
    assert rc == 137 and report.startswith(" worker rank 1 ") and "SIGKILL" in report, err.getvalue()


# ------------------------------------------------------------------------------------------------
# Restarts (--max-restarts)

# argv: OUT PLAN. Each start of a worker records itself in OUT/start.<rank>.<attempt> (attempt =
# how many times this rank started before); once every rank of the attempt started, it does what
# PLAN[attempt][rank] says (default "ok"): "preempt" (the lines a preempted worker writes, exit
# 75), "kill" (SIGKILL to itself), "bug" (a fit failing at the same place every time, exit 1),
# "fail" (a failure that differs per attempt, exit 3), "wait" (until a SIGTERM, which it answers
# as a preempted worker).
ATTEMPTS = textwrap.dedent("""\
    import json, os, signal, sys, time
    cfg = json.loads(os.environ["TF_CONFIG"])
    rank, world = cfg["task"]["index"], len(cfg["cluster"]["worker"])
    out, plan = sys.argv[1], json.loads(sys.argv[2])
    attempt = len([f for f in os.listdir(out) if f.startswith(f"start.{rank}.")])
    action = plan.get(str(attempt), {}).get(str(rank), "ok")
    def preempted(*_):
        print(f"prophet_tf: preempted: rank {rank}, 1 worker(s) asked to stop; stopped at epoch 1 "
              f"step 3; checkpoint: {out}/backup", file=sys.stderr, flush=True)
        os._exit(75)
    if action == "wait":  # before the start record: a test signals once every worker started
        signal.signal(signal.SIGTERM, preempted)
    record = {"workers": cfg["cluster"]["worker"], "token": os.environ["PROPHET_JOB_TOKEN"],
              "seed": os.environ.get("PROPHET_JOB_SEED"), "pid": os.getpid()}
    with open(os.path.join(out, f"tmp.{rank}"), "w") as f:
        json.dump(record, f)
    os.rename(os.path.join(out, f"tmp.{rank}"), os.path.join(out, f"start.{rank}.{attempt}"))
    deadline = time.monotonic() + 30
    while not all(os.path.exists(os.path.join(out, f"start.{r}.{attempt}")) for r in range(world)):
        assert time.monotonic() < deadline, "the other workers of this attempt never started"
        time.sleep(0.01)
    if action == "preempt":
        print(f"prophet_tf: rank {rank} received SIGTERM: every worker stops after the next "
              "training step of model.fit and writes a checkpoint (grace period 30 s)",
              file=sys.stderr, flush=True)
        preempted()
    elif action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "bug":
        print(f"prophet_tf: failed: rank {rank} at epoch 1 step 4: ValueError: a bug",
              file=sys.stderr, flush=True)
        sys.exit(1)
    elif action == "fail":
        print(f"something different went wrong in attempt {attempt}", file=sys.stderr)
        sys.exit(3)
    elif action == "wait":
        time.sleep(60)
    elif action != "ok":
        time.sleep(60)  # the others stop this one
    """)


def _starts(out: Path) -> dict[tuple[int, int], dict]:
    """{(rank, attempt): what the worker recorded at its start}."""
    found = {}
    for p in out.glob("start.*.*"):
        _, rank, attempt = p.name.split(".")
        found[(int(rank), int(attempt))] = json.loads(p.read_text())
    return found


def _attempts(tmp_path: Path, plan: dict, n: int = 2, **kwargs) -> tuple[int, str, Path]:
    out = tmp_path / "out"
    out.mkdir()
    err = io.StringIO()
    rc = launch([_script(tmp_path, "attempts.py", ATTEMPTS), str(out), json.dumps(plan)], n,
                grace=1.0, timeout=120, stdout=io.StringIO(), stderr=err, **kwargs)
    return rc, err.getvalue(), out


@pytest.mark.parametrize("fault", ["preempt", "kill"])
def test_a_preempted_or_killed_worker_restarts_every_worker_on_fresh_ports(
        tmp_path: Path, fault: str) -> None:
    rc, err, out = _attempts(tmp_path, {"0": {"1": fault}}, max_restarts=2)
    assert rc == 0, err
    starts = _starts(out)
    assert sorted(starts) == [(0, 0), (0, 1), (1, 0), (1, 1)], err
    first, second = starts[(0, 0)], starts[(0, 1)]
    assert first["workers"] != second["workers"] and first["token"] != second["token"]
    # The job's seed, the same in every attempt (the program resumes with the same input order).
    assert first["seed"] and {s["seed"] for s in starts.values()} == {first["seed"]}
    restarted = [line for line in err.splitlines() if "Restarting every worker" in line]
    assert len(restarted) == 1 and "(restart 1 of at most 2)" in restarted[0], err
    if fault == "preempt":
        assert ("the job was preempted (rank 1 received SIGTERM); every worker stopped at epoch 1 "
                f"step 3 (checkpoint: {out}/backup)") in restarted[0]
    else:
        assert "worker rank 1" in restarted[0] and "was killed by SIGKILL" in restarted[0]


def test_the_same_failure_at_the_same_step_twice_is_a_bug_not_a_fault(tmp_path: Path) -> None:
    rc, err, out = _attempts(tmp_path, {"0": {"1": "bug"}, "1": {"0": "bug"}}, max_restarts=5)
    assert rc == 1, err
    assert sorted(_starts(out)) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # two attempts, no third
    last = err.strip().splitlines()[-1]
    assert "model.fit failed at epoch 1 step 4: ValueError: a bug" in last, err
    assert "attempt 1 failed the same way at the same place (a bug, not a fault)" in last
    assert "exiting with status 1" in last


def test_used_up_restarts_end_the_job_with_the_failing_status(tmp_path: Path) -> None:
    plan = {str(a): {"0": "fail"} for a in range(3)}
    rc, err, out = _attempts(tmp_path, plan, max_restarts=2)
    assert rc == 3, err
    assert len([k for k in _starts(out) if k[0] == 0]) == 3
    assert err.count("Restarting every worker") == 2
    assert err.strip().splitlines()[-1].endswith(
        "Not restarting: the 2 restart(s) of --max-restarts are used up; exiting with status 3")


def test_without_restarts_a_failure_ends_the_job_as_before(tmp_path: Path) -> None:
    rc, err, out = _attempts(tmp_path, {"0": {"1": "preempt"}})
    assert rc == 75 and sorted(_starts(out)) == [(0, 0), (1, 0)]
    assert "Restarting" not in err and "exited with status 75" in err
    # How to resume by hand: the job's seed.
    seed = _starts(out)[(0, 0)]["seed"]
    assert f"run it again to resume it from its checkpoint, with PROPHET_JOB_SEED={seed}" in err


def test_a_sigterm_to_the_launcher_is_a_preemption_of_every_worker_not_a_restart(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, "attempts.py", ATTEMPTS)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    plan = {"0": {"0": "wait", "1": "wait"}}
    proc = subprocess.Popen([sys.executable, "-m", "prophet_tf.launch", "-n", "2",
                             "--max-restarts", "3", "--", script, str(out), json.dumps(plan)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(_starts(out)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "got SIGTERM; forwarding it to the workers: every worker stops at the same step" in err
    assert ("the launcher got SIGTERM; every worker stopped at epoch 1 step 3 (checkpoint: "
            f"{out}/backup)") in err and "not restarting" in err
    assert sorted(_starts(out)) == [(0, 0), (1, 0)]


def test_restart_policy_signatures_and_messages() -> None:
    from prophet_tf.launch.restarts import RestartPolicy, signature
    from prophet_tf.launch.workers import CAUSE_TIMEOUT, CAUSE_WORKER, Failure

    def bug(rank: int, step: int = 4) -> Failure:
        return Failure(1, f"worker rank {rank} (pid 9) exited with status 1", tail=["x"], rank=rank,
                       cause=CAUSE_WORKER,
                       fit_failure=f"[rank {rank}] prophet_tf: failed: rank {rank} at epoch 0 step "
                                   f"{step}: ValueError: bad")

    # The same place and error on another rank is the same bug; another step is not.
    assert signature(bug(0)) == signature(bug(1)) != signature(bug(1, step=5))
    killed = Failure(137, "worker rank 1 was killed by SIGKILL", tail=["x"], rank=1, cause=CAUSE_WORKER)
    assert signature(killed) is None
    segv = Failure(139, "worker rank 1 was killed by SIGSEGV", tail=["Fatal Python error"], rank=1,
                   cause=CAUSE_WORKER)
    assert signature(segv) == ("worker", 1, 139, "Fatal Python error")
    policy = RestartPolicy(3)
    assert policy.decide([killed]).restart and policy.decide([killed]).restart
    assert policy.decide([bug(0)]).restart
    assert not policy.decide([bug(1)]).restart  # the second time
    timeout = Failure(124, "the job's --timeout passed", cause=CAUSE_TIMEOUT)
    decision = RestartPolicy(3).decide([timeout])
    assert not decision.restart and "--timeout passed; not restarting" in decision.message
    assert RestartPolicy(0).decide([killed]).message == ""
    with pytest.raises(ValueError, match="--max-restarts"):
        RestartPolicy(-1)
