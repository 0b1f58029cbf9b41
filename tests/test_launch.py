"""Tests of prophet_tf.launch with tiny Python scripts (no TensorFlow)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

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
    time.sleep(60)
    """)

SLEEP = "import time\ntime.sleep(60)\n"


def _script(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
    t0 = time.monotonic()
    rc = launch([_script(tmp_path, "fail.py", FAIL_ONE), str(tmp_path)], 3, grace=1.0,
                timeout=30, stdout=out, stderr=err)
    elapsed = time.monotonic() - t0
    assert rc == 3
    # The others sleep 60 s and the job's timeout is 30 s: only stopping them ends it sooner.
    assert elapsed < 20.0, elapsed
    msg = err.getvalue()
    assert "worker rank 1" in msg and "exited with status 3" in msg
    assert "something went wrong on rank 1" in msg.split("[launch]")[-1]  # stderr tail reported
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 2)]
    assert not any(_alive(p) for p in pids)


def test_timeout_kills_everything(tmp_path: Path) -> None:
    err = io.StringIO()
    t0 = time.monotonic()
    rc = launch([_script(tmp_path, "sleep.py", SLEEP)], 2, timeout=0.7, grace=1.0,
                stdout=io.StringIO(), stderr=err)
    assert rc == EXIT_TIMEOUT
    assert time.monotonic() - t0 < 20.0  # the workers sleep 60 s: they were killed
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
    """The launcher's stderr: creates `marker` once rank 1's traceback has been passed on."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker

    def write(self, text: str) -> int:
        n = super().write(text)
        if text.startswith("[rank 1] Traceback"):
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
