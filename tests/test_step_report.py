"""The step report: fit's epoch logs say how long steps waited for gradients, on every worker.

Two workers on loopback (tests/workers/step_report.py): gradients made late at the gates by
holding every deferred update (``PROPHET_TEST_APPLY_DELAY_MS``), and a barrier made late by a
worker whose backward pass is slower; one worker, which waits for nothing. Thresholds are
fractions of the injected delays, which the steps cannot finish without waiting for.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import pytest

from prophet_tf._keras import step_report
from prophet_tf._keras.step_report import (COMPUTE_MS, LINK_GBPS, LOG_KEYS, PLAN_BLOCKS,
                                           SCHEDULE, STEP_MS, WAIT_MS, StepReport, StepTimes,
                                           parse_timeline_label, timeline_label)
from prophet_tf.bench import step_report_check
from conftest import ROOT, WORKERS, _worker_env, parse_results, worker_python

# The gates wait for what is left of the delay when the next step reaches them. The gap between a
# sum's arrival and the next step's forward pass (Keras's per-step Python, callbacks) has reached
# 104 ms on a loaded 2-core machine: the delay is large enough that half of it stays measurable.
APPLY_DELAY_MS = 400
BACKWARD_SLEEP_MS = 100  # tests/workers/step_report.py: BACKWARD_SLEEP_S


@pytest.fixture(scope="module")
def two_workers(run_workers, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("step_report")
    run = run_workers("step_report.py", 2, str(workdir), timeout=300,
                      env={"PROPHET_TEST_APPLY_DELAY_MS": str(APPLY_DELAY_MS)}).check_ok()
    return run


def test_the_keys_are_in_history_csv_and_tensorboard_the_same_on_every_worker(two_workers):
    results = [two_workers.one(rank, case="gates") for rank in range(2)]
    for r in results:
        assert set(LOG_KEYS) <= set(r["history"]), r["history"].keys()
        assert set(LOG_KEYS) <= set(r["csv_header"]), r["csv_header"]  # CSVLogger on each worker
    runtime_logs = [{k: v for k, v in r["history"].items() if step_report.is_report_key(k)}
                    for r in results]
    assert runtime_logs[0] == runtime_logs[1], runtime_logs  # the same values everywhere
    assert results[0]["csv_header"] == results[1]["csv_header"]
    tags = results[0]["tensorboard_tags"]
    for key in LOG_KEYS:
        assert f"epoch_{key}" in tags, (key, tags)


def test_waiting_at_the_gates_is_measured(two_workers):
    history = two_workers.one(0, case="gates")["history"]
    for epoch in range(1, len(history[STEP_MS])):  # epoch 0 includes tracing
        step, wait = history[STEP_MS][epoch], history[WAIT_MS][epoch]
        assert 0.5 * APPLY_DELAY_MS < wait < step, (epoch, wait, step)
        assert math.isclose(history[COMPUTE_MS][epoch], step - wait, rel_tol=1e-9)
        assert history[LINK_GBPS][epoch] > 0
        assert history[SCHEDULE][epoch] == 0.0  # runtime.schedules().index("prophet")
    for rank in range(2):
        report = two_workers.one(rank, case="gates")["report"]
        assert report["schedule"] == "prophet" and report["workers"] == 2, report
        assert isinstance(report["plan_blocks"], int) and report["plan_blocks"] >= 0, report
        # The forward pass waits for the updates: the gates' part, within its bounds.
        last = report["last_step"]
        lower, upper = last["gate_wait_bounds_ms"]
        assert lower <= last["gate_wait_ms"] <= upper, last
        assert last["gate_wait_ms"] > 0.5 * APPLY_DELAY_MS, last
        assert report["gate_wait_ms"] > report["barrier_wait_ms"], report
    lines = [line for line in two_workers.stdout.splitlines() if "waiting for gradients" in line]
    assert len(lines) == 3, two_workers.tail()  # one per epoch, rank 0 only
    assert all(line.startswith("[rank 0]") and "schedule prophet (" in line for line in lines), lines


def test_waiting_at_the_barrier_is_measured(two_workers):
    # Rank 1's backward pass is BACKWARD_SLEEP_MS slower before its first layer's gradient: rank 0
    # hands off its last gradient that much earlier and waits for rank 1's at the barrier.
    report = two_workers.one(0, case="barrier")["report"]
    assert report["barrier_wait_ms"] > 0.5 * BACKWARD_SLEEP_MS, report
    assert report["wait_ms"] < report["step_ms"], report
    history = two_workers.one(0, case="barrier")["history"]
    assert all(0 < wait < step for wait, step in zip(history[WAIT_MS][1:], history[STEP_MS][1:])), history


def test_one_worker_waits_for_nothing(tmp_path):
    proc = subprocess.run([worker_python(), str(WORKERS / "step_report.py"), str(tmp_path)], cwd=ROOT,
                          env=_worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (result,) = parse_results(proc.stdout, default_rank=0)[0]
    history = result["history"]
    assert set(LOG_KEYS) <= set(history)
    assert history[WAIT_MS] == [0.0] * len(history[WAIT_MS]), history
    assert history[LINK_GBPS] == [0.0] * len(history[LINK_GBPS]), history
    assert all(s > 0 for s in history[STEP_MS]), history
    assert "waiting for gradients 0 ms (0%), no link (one worker), schedule prophet" in proc.stdout, \
        proc.stdout[-3000:]


def test_the_line_names_the_schedule():
    report = StepReport(steps=10, step_ms=446.2, wait_ms=30.4, gate_wait_ms=25.0, barrier_wait_ms=5.4,
                        link_gbps=1.93, schedule="prophet", plan_blocks=7, workers=2)
    assert report.line() == ("step 446 ms: waiting for gradients 30 ms (7%), link 1.93 Gbit/s, "
                             "schedule prophet (7 blocks)")
    report = StepReport(steps=10, step_ms=100, wait_ms=0, gate_wait_ms=0, barrier_wait_ms=0,
                        link_gbps=0.35, schedule="priority", plan_blocks=None, workers=2)
    assert report.line().endswith("link 350 Mbit/s, schedule priority")
    assert math.isclose(report.compute_ms, 100)
    report = dataclasses.replace(report, schedule="prophet", plan_blocks=1)
    assert report.line().endswith("schedule prophet (1 block)")


def test_report_every_epoch_follows_the_environment(monkeypatch):
    monkeypatch.setenv(step_report.REPORT_EVERY_EPOCH_ENV, "0")
    assert not step_report.report_every_epoch_default()
    monkeypatch.delenv(step_report.REPORT_EVERY_EPOCH_ENV)
    assert step_report.report_every_epoch_default()
    assert step_report.is_report_key(PLAN_BLOCKS) and not step_report.is_report_key("loss")


def test_the_check_against_the_emulated_accelerator_reads_its_idle_time(tmp_path):
    """bench.step_report_check on a hand-made trace: a 100 ms step whose forward pass (40 ms of
    compute) starts 20 ms late, whose backward pass ends 10 ms before the step does."""
    figures = StepTimes(100.0, 30.5, 20.5, 10.0, (20.0, 35.0))
    assert parse_timeline_label(timeline_label(figures)) == dataclasses.replace(figures, step_ms=0.0)
    ms = 1000.0  # trace times are microseconds
    tracks = {"step": 1, "forward": 2, "backward": 3, "report": 4}
    events = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}}
              for name, tid in tracks.items()]

    def span(track, start, end, name="x"):
        events.append({"ph": "X", "name": name, "pid": 0, "tid": tracks[track], "ts": start * ms,
                       "dur": (end - start) * ms})

    span("step", 0, 100)
    span("forward", 20, 40)
    span("forward", 45, 65)  # 5 ms idle between the layers: 25 ms of forward idle in all
    span("backward", 66, 90)
    events.append({"ph": "i", "name": timeline_label(figures), "pid": 0, "tid": tracks["report"],
                   "ts": 100.01 * ms, "s": "t"})
    path = tmp_path / "trace.0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    (row,) = step_report_check.check(str(path), skip=0)
    assert math.isclose(row["forward_idle_ms"], 25.0) and math.isclose(row["tail_idle_ms"], 10.0), row
    assert row["gate_wait_ms"] == 20.5 and row["barrier_wait_ms"] == 10.0, row
