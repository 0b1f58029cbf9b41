"""Crossing the global barrier: same results as synchronous training, and real overlap."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ["sgd", "momentum", "adam", "adamw", "schedule", "clipnorm", "batchnorm", "wide"]
FIRST_LAYER = "sequential/first/kernel"


@pytest.fixture(scope="module")
def equivalence(run_workers):
    return run_workers("crossing_equivalence.py", 2, timeout=600).check_ok()  # 112 s under load


@pytest.mark.parametrize("case", CASES)
def test_crossing_gives_exactly_the_synchronous_result(equivalence, case: str) -> None:
    for rank in range(2):
        r = equivalence.one(rank, case=case)
        assert r["deferred_updates_in_graph"] > 0, f"{case}: no update was deferred, crossing did not engage"
        assert r["moved"] > 1e-3, f"{case}: training did not change the weights"
        assert r["maxdiff"] == 0.0, f"{case} rank {rank}: weights differ from synchronous by {r['maxdiff']}"
        assert r["loss_cross"] == r["loss_sync"], case
        if case == "wide":  # sums received into recycled buffers (stale from the step before)
            assert r["recycled"] > 0, f"rank {rank}: no summed gradient came from the recycled pool"


def test_train_functions_end_while_updates_are_pending(run_workers) -> None:
    """Recompile, clear_session() and a deleted model while deferred updates still wait, with
    several models, evaluate/predict in between, steps_per_execution > 1 and a retrace. A pending
    update run through the dropped train function's freed FunctionLibraryRuntime would crash
    (SIGSEGV, or heap-use-after-free under ASan: see docs/development.md, "Sanitizers")."""
    run = run_workers("crossing_stress.py", 2, timeout=600,
                      env={"PROPHET_TEST_APPLY_DELAY_MS": "100"}).check_ok()
    for rank in range(2):
        summary = run.one(rank, summary=True)
        assert summary["endings"] == 4, summary
        # The delay holds each update 100 ms after its sum: ending right after a train step must
        # find updates pending (or the test did not exercise what it is about).
        assert summary["ended_with_pending"] >= 1, f"rank {rank}: no train function ended with pending updates"
        assert summary["pending_at_exit"] == 0, summary
        assert summary["counts"].get("deferred", 0) > 0, summary
    for model in ("mlp", "nested", "convnet"):
        assert run.one(0, model=model)["digest"] == run.one(1, model=model)["digest"], \
            f"{model}: weights differ across workers (an update was lost or applied twice)"


def overlapping_steps(trace: dict) -> tuple[int, int]:
    """Counts steps t whose successor's first-layer forward began before t's last gradient was summed.

    The first layer may run in step t+1 once its gate opens ("gate" span ends). A gate opening
    belongs to step t+1 when it comes after round t's first-layer gradient was summed (before that,
    it is step t's own forward pass).
    """
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    summed_end = defaultdict(dict)  # round -> gradient name -> end time
    for e in events:
        if e.get("ph") == "X" and tracks.get(e["tid"]) == "op" and e["name"].startswith("grad/"):
            summed_end[e["args"]["round"]][e["name"]] = e["ts"] + e["dur"]
    gates = sorted(e["ts"] + e["dur"] for e in events
                   if e.get("ph") == "X" and tracks.get(e["tid"]) == "gate" and e["name"] == FIRST_LAYER)
    crossed = 0
    rounds = sorted(summed_end)
    for r in rounds[:-1]:
        first_done = summed_end[r].get(f"grad/{FIRST_LAYER}")
        last_done = max(summed_end[r].values())
        if first_done is not None and any(first_done <= g < last_done for g in gates):
            crossed += 1
    return crossed, max(len(rounds) - 1, 0)


def test_next_step_starts_before_previous_gradients_are_summed(tmp_path: Path) -> None:
    """2 workers over a slowed link (network namespaces + tc), timeline read back.

    Step t+1 crosses when its first layer's gate opens before round t's last gradient is summed:
    the race between the CPU (round t's first-layer update, the train function's return, step
    t+1's forward pass up to the gate) and the link (the wide layers' bytes still to move). How
    many steps win it depends on this machine's load (7 to 21 of 23 at 200 Mbit/s, where the link
    part was 11-25 ms), so the test asserts what no speed can produce without crossing: a step
    that ran before the previous step's gradients were summed, which the synchronous runtime never
    does (test_overlap_detector_rejects_a_synchronous_trace). At 50 Mbit/s the link part is about
    4x what a loaded 2-core machine took for the CPU part (up to 30 ms), so every step can cross.
    """
    from prophet_tf.bench import netem

    try:
        netem.EmulatedCluster.check_available()
    except netem.NetemError as e:
        pytest.fail(f"network emulation unavailable ({e}); this test needs root, ip and tc")
    from prophet_tf import launch

    from conftest import _worker_env, worker_python

    trace_pattern = str(tmp_path / "trace.{rank}.json")
    env = _worker_env()   # the workers fork from the zygotes, on the emulated hosts too
    # A prefix of its own: another checkout may run this test on the same machine at the same time.
    with netem.EmulatedCluster(2, bandwidth_bps=50e6, prefix=f"ptfx{os.getpid()}") as cluster:
        code = launch.launch([worker_python(), str(ROOT / "tests" / "workers" / "crossing_overlap.py"), trace_pattern],
                             2, hosts=[cluster.host_address(i) for i in range(2)], wrap_argv=cluster.exec_argv,
                             env=env, threads=1, timeout=900, handle_signals=False)
    assert code == 0, f"workers failed with exit code {code}"
    for rank in range(2):
        trace = json.loads((tmp_path / f"trace.{rank}.json").read_text())
        crossed, steps = overlapping_steps(trace)
        print(f"rank {rank}: {crossed} of {steps} steps crossed the barrier")
        assert steps >= 20, steps
        step_spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"].startswith("step ")]
        assert len(step_spans) == 24, f"expected one step span per train step, got {len(step_spans)}"
        assert crossed >= 1, f"rank {rank}: none of {steps} steps crossed the barrier"


def test_overlap_detector_rejects_a_synchronous_trace() -> None:
    """The detector must not find overlap where there is none (step t+1 strictly after t)."""
    def x(track_id, name, ts, dur, **args):
        return {"ph": "X", "tid": track_id, "name": name, "ts": ts, "dur": dur, "args": args}
    meta = [{"ph": "M", "name": "thread_name", "tid": 1, "args": {"name": "op"}},
            {"ph": "M", "name": "thread_name", "tid": 2, "args": {"name": "gate"}}]
    events = list(meta)
    for r in range(3):
        t0 = r * 100
        events.append(x(2, FIRST_LAYER, t0, 1))                            # forward of step r
        events.append(x(1, "grad/sequential/wide/kernel", t0 + 10, 40, round=r))
        events.append(x(1, f"grad/{FIRST_LAYER}", t0 + 20, 10, round=r))   # summed at t0+30
    assert overlapping_steps({"traceEvents": events}) == (0, 2)
    # Now step r+1's forward starts at t0+35, before the wide gradient (ends t0+50) is summed.
    crossing = list(meta)
    for r in range(3):
        t0 = r * 100
        crossing.append(x(2, FIRST_LAYER, t0 - 65 if r else t0, 1))
        crossing.append(x(1, "grad/sequential/wide/kernel", t0 + 10, 40, round=r))
        crossing.append(x(1, f"grad/{FIRST_LAYER}", t0 + 20, 10, round=r))
    assert overlapping_steps({"traceEvents": crossing}) == (2, 2)
