"""Multi-process tests of the communication ops on loopback (real workers, real sockets)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import _worker_env, worker_python
from prophet_tf import launch

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def run_launcher(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = _worker_env({"TF_CPP_MIN_LOG_LEVEL": "2"})
    return subprocess.run(
        [worker_python(), "-m", "prophet_tf.launch", "-n", str(n), "--threads", "1", "--timeout", str(timeout),
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
    assert total and len(checks) == int(total.group(1)) >= (61 if n == 2 else 53), (checks, total)


def test_shape_mismatch_fails_on_every_worker_with_both_shapes() -> None:
    proc = run_launcher(2, str(WORKERS / "ops_worker.py"), "mismatch", timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in range(2):
        assert f"[rank {rank}] CHECK mismatch message ok" in proc.stdout, out[-4000:]
        assert f"[rank {rank}] CHECK usable after mismatch ok" in proc.stdout, out[-4000:]


def _start_without_launcher(n: int, *args: str) -> list[subprocess.Popen]:
    # Not through the launcher: it would stop the survivors itself, and we want to see them fail.
    ports = launch.free_ports(n)
    addresses = [f"127.0.0.1:{p}" for p in ports]
    envs = launch.worker_envs(n, addresses, "failure-test-token")
    procs = []
    for env in envs:
        full = {**_worker_env(), **env, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2",
                "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2"}
        procs.append(subprocess.Popen([worker_python(), str(WORKERS / "failure_worker.py"), *args],
                                      env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


# The runtime's own words in a TensorFlow error message (eager and graph errors decorate it
# differently): "push_pull 'train/grad' (round N) ..." ("push_pull 'train/grad' failed: ..." when it
# was submitted after the runtime had already failed), up to TensorFlow's node annotations.
_CORE_MESSAGE = re.compile(r"(push_pull 'train/grad' (?:\(round \d+\) )?.*?)(?:\s*\[\[|\s*\[Op:|$)", re.S)


@pytest.mark.parametrize("scenario,timeout_s,heartbeat_s", [("die", 60.0, 0.0), ("stall", 3.0, 0.0),
                                                            ("stop", 60.0, 1.0)])
def test_dead_stalled_or_stopped_peer_is_named_by_every_survivor(scenario: str, timeout_s: float,
                                                                 heartbeat_s: float) -> None:
    """What the runtime promises when rank 1 of 3 fails after a warm-up, to both survivors (rank 0
    eager, rank 2 inside a tf.function), well before anything else could fail the job:
    die   -> UnavailableError naming rank 1 (its connection was lost);
    stall -> DeadlineExceededError once timeout_s has passed, naming rank 1 and nobody else, the
             same words on both (rank 1's runtime answers that it never reached the operation);
    stop  -> with heartbeat_s, UnavailableError naming rank 1 as unresponsive, long before
             timeout_s (a frozen process answers nothing)."""
    procs = _start_without_launcher(3, scenario, str(timeout_s), str(heartbeat_s))
    try:
        results = {}
        for rank in (0, 2):
            # Only a guard against a hang: TensorFlow's import alone takes over a minute on a loaded
            # machine. What is promised is asserted on the messages below, not on wall time.
            out, _ = procs[rank].communicate(timeout=400)
            assert procs[rank].returncode == 3, out[-3000:]
            match = re.search(r"ERROR_AFTER ([0-9.]+) (\w+): (.*)", out, re.S)
            assert match, out[-3000:]
            core = _CORE_MESSAGE.search(match.group(3))
            assert core, match.group(3)
            results[rank] = (float(match.group(1)), match.group(2), core.group(1).strip())
        for seconds, kind, message in results.values():
            if scenario == "stall":
                assert kind == "DeadlineExceededError", results
                assert "rank(s) 1 did not reach it" in message and message.count("rank(s)") == 1, results
            else:
                assert kind == "UnavailableError", results
                assert "rank 1 (" in message, results
                if scenario == "stop":
                    assert "unresponsive" in message and "heartbeat_s" in message, results
        if scenario == "stall":
            assert results[0][2] == results[2][2], results  # the same verdict on every survivor
    finally:
        for p in procs:
            if p.poll() is None:
                if scenario == "stop":
                    p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait(timeout=30)
