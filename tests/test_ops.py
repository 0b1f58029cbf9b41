"""Multi-process tests of the communication ops on loopback (real workers, real sockets)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prophet_tf import launch

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def run_launcher(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(
        [sys.executable, "-m", "prophet_tf.launch", "-n", str(n), "--threads", "1", "--timeout", str(timeout),
         "--", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30,
    )


@pytest.mark.parametrize("n", [2, 3, 4])
def test_exact_results_every_dtype_and_size(n: int) -> None:
    # Up to 64 MiB with 2 workers; 3 and 4 workers share 2 cores, so they stop at 4 MiB.
    proc = run_launcher(n, str(WORKERS / "ops_worker.py"), "exact" if n == 2 else "exact-small")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(n):
        assert f"[rank {rank}] WORKER DONE" in proc.stdout, out[-4000:]
        assert not re.search(rf"\[rank {rank}\] CHECK .* FAILED", proc.stdout)
    # Every check ran on every worker (a check that silently did not run cannot pass).
    checks = re.findall(r"\[rank 0\] CHECK (.*) ok", proc.stdout)
    total = re.search(r"\[rank 0\] CHECKS TOTAL (\d+)", proc.stdout)
    assert total and len(checks) == int(total.group(1)) >= (55 if n == 2 else 47), (checks, total)


def test_shape_mismatch_fails_on_every_worker_with_both_shapes() -> None:
    proc = run_launcher(2, str(WORKERS / "ops_worker.py"), "mismatch", timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(2):
        assert f"[rank {rank}] CHECK mismatch message ok" in proc.stdout, out[-4000:]
        assert f"[rank {rank}] CHECK usable after mismatch ok" in proc.stdout, out[-4000:]


def _start_without_launcher(n: int, scenario: str, timeout_s: float) -> list[subprocess.Popen]:
    # Not through the launcher: it would stop the survivors itself, and we want to see them fail.
    ports = launch.free_ports(n)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    envs = launch.worker_envs(n, addresses, "failure-test-token")
    procs = []
    for env in envs:
        full = dict(os.environ, **env, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
                    TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / "failure_worker.py"), scenario, str(timeout_s)],
                                      env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.parametrize("scenario,timeout_s,bound_s", [("die", 60.0, 10.0), ("stall", 3.0, 10.0)])
def test_dead_or_stalled_peer_fails_the_others_in_bounded_time(scenario: str, timeout_s: float, bound_s: float) -> None:
    procs = _start_without_launcher(3, scenario, timeout_s)
    try:
        results = {}
        for rank in (0, 2):
            out, _ = procs[rank].communicate(timeout=120)
            assert procs[rank].returncode == 3, out[-3000:]
            match = re.search(r"ERROR_AFTER ([0-9.]+) (\w+): (.*)", out)
            assert match, out[-3000:]
            results[rank] = (float(match.group(1)), match.group(2), match.group(3))
            assert results[rank][0] < bound_s, results[rank]
        kinds = {kind for _, kind, _ in results.values()}
        if scenario == "die":
            # A dead peer is reported by name, long before the 60 s operation timeout.
            # (A survivor may first see the other survivor leave: any order is a named failure.)
            assert kinds == {"UnavailableError"}, results
            assert any("rank 1" in message for _, _, message in results.values()), results
        else:
            # The first survivor to time out names the stalled rank; the other may instead see
            # that survivor leave, which is also a bounded, named failure.
            assert "DeadlineExceededError" in kinds and kinds <= {"DeadlineExceededError", "UnavailableError"}, results
            assert any(kind == "DeadlineExceededError" and "rank(s) 1" in message
                       for _, kind, message in results.values()), results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
