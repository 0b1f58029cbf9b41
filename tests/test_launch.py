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

from prophet_tf import launch as launch_mod
from prophet_tf.launch import EXIT_TIMEOUT, free_ports, launch

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

# Rank 1 fails after a short delay; the others record their pid and sleep.
FAIL_ONE = textwrap.dedent("""\
    import json, os, sys, time
    rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    out = sys.argv[1]
    if rank == 1:
        time.sleep(0.3)
        print("something went wrong on rank 1", file=sys.stderr)
        print("last words", file=sys.stderr)
        sys.exit(3)
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
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
    assert elapsed < 5.0, elapsed
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
    assert time.monotonic() - t0 < 4.0
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
    assert launch_mod._command(["x.py", "1"]) == [sys.executable, "-u", "x.py", "1"]
    assert launch_mod._command(["-m", "pkg.mod"]) == [sys.executable, "-u", "-m", "pkg.mod"]
    assert launch_mod._command(["/bin/true"]) == ["/bin/true"]
    with pytest.raises(ValueError):
        launch([], 2)
    with pytest.raises(ValueError):
        launch(["x.py"], 0)
