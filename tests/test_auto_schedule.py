"""ProphetStrategy(schedule="auto"): the decision logic on rank 0 (no TensorFlow) and, on two
worker processes, predictions at the decision step and every worker switching to rank 0's choice."""

from __future__ import annotations

import types

import pytest

from prophet_tf import _auto_schedule
from prophet_tf.predict import SCHEDULES, profile_from_ready_times
from prophet_tf.predict.profile import ProfiledTensor

N = 2


def test_link_rate_matching_a_measured_goodput_or_step():
    match = _auto_schedule.link_rate_matching
    # A simulated runtime that measures 40% of the link rate (bytes/s): 50 MB/s -> 1 Gbit/s.
    assert match(lambda r: 0.4 * r / 8, 50e6, 1e8, 1e11) == pytest.approx(1e9, rel=1e-3)
    # A step of 0.1 s compute + 100 MB at the link rate; 0.9 s measured -> 1 Gbit/s.
    step = lambda rate: 0.1 + 8e8 / rate  # noqa: E731
    assert match(step, 0.9, 1e8, 1e11) == pytest.approx(1e9, rel=1e-3)
    assert match(step, 0.05, 1e8, 1e11) == 1e11  # faster than the compute allows
    assert match(step, 100.0, 1e8, 1e11) == 1e8
    assert match(lambda r: None, 1.0, 1e8, 1e11) == 1e11  # nothing predictable


def fake_extended(rank: int = 0, world: int = 2, cross: bool = True, compression=None):
    return types.SimpleNamespace(_rank=rank, _world_size=world, _cross_barrier=cross,
                                 _compression=compression)


def measured_compute() -> dict:
    """What rank 0 measures in its clean step: four 1 MB gradients over 40 ms of backward pass."""
    tensors = [{"name": f"grad/dense_{i}/kernel", "priority": 4 - i, "bytes": 1 << 20,
                "ready_offset_ns": (3 - i) * 10_000_000} for i in range(4)]
    return {"tensors": tensors, "forward_s": 0.020, "tail_s": 0.001}


def test_rank_zero_predicts_every_candidate_and_picks_the_fastest():
    auto = _auto_schedule.AutoSchedule(fake_extended(), replan_threshold=0.2)
    auto._compute = measured_compute()
    auto._goodputs = [20e6]
    auto._periods = [0.25, 0.26, 0.24]   # steps measured with prophet
    chosen = auto._decide(4)
    decision = auto.decisions[-1]
    assert set(decision.predicted_s) == set(_auto_schedule.CANDIDATES)
    best = min(decision.predicted_s.values())
    assert decision.predicted_s[chosen] <= best * (1 + _auto_schedule.KEEP_MARGIN)
    assert "measured 250.0 ms" in decision.reason and "predicted step" in decision.reason
    # The link rate makes the model take the measured step with the schedule in use.
    assert decision.predicted_s["prophet"] == pytest.approx(0.25, rel=0.02)
    # A bandwidth within the re-plan threshold: no new decision; beyond it: a new one, here from
    # the goodput alone (no step measured since the switch).
    auto._goodputs = [22e6]
    assert auto._decide(14) is None and len(auto.decisions) == 1
    auto._goodputs, auto._periods = [60e6], []
    auto._decide(24)
    assert len(auto.decisions) == 2 and auto.decisions[-1].goodput_Bps == 60e6
    assert "goodput" in auto.decisions[-1].reason
    # That link rate: the simulated runtime measures the goodput the real one did.
    simulated = auto._simulated_goodput(auto._profile(), auto.decisions[-1].link_bps)
    assert simulated == pytest.approx(60e6, rel=0.1)


def test_rank_zero_predicts_with_the_strategys_compression():
    # The runtime's profile has the tensors' bytes; under compression="bf16" the predictions
    # send the gradients in half of them.
    plain = _auto_schedule.AutoSchedule(fake_extended(), replan_threshold=0.2)
    half = _auto_schedule.AutoSchedule(fake_extended(compression="bf16"), replan_threshold=0.2)
    predictions = []
    for auto in (plain, half):
        auto._compute = measured_compute()
        predictions.append(auto._prediction(auto._profile(), "prophet", 1e8))
    assert predictions[1].wire_bytes_per_step == pytest.approx(
        predictions[0].wire_bytes_per_step / 2, rel=0.01)
    assert predictions[1].step_s < predictions[0].step_s


def test_nothing_to_decide_without_a_measurement():
    auto = _auto_schedule.AutoSchedule(fake_extended(), replan_threshold=0.2)
    auto._goodputs = [20e6]
    assert auto._decide(4) is None  # no clean step measured yet
    auto._compute = measured_compute()
    auto._goodputs = []
    assert auto._decide(4) is None  # no bandwidth sample yet
    assert auto.decisions == []


def test_profile_from_runtime_measurements():
    tensors = [ProfiledTensor("grad/b/kernel", 4096, 1, 0.0), ProfiledTensor("grad/a/kernel", 4096, 2, 0.03)]
    profile = profile_from_ready_times(tensors, 0.012, tail_s=0.002, gap_s=0.001)
    assert [layer.name for layer in profile.layers] == ["a", "b"]  # first layer first
    assert profile.forward_s == pytest.approx(0.012)
    assert profile.layers[0].forward_s == pytest.approx(0.012)  # all the gap is a's backward
    assert {t.name: t.layer for t in profile.tensors} == {"grad/b/kernel": "b", "grad/a/kernel": "a"}
    assert "mwms" in SCHEDULES


@pytest.fixture(scope="module")
def auto_run(run_workers):
    return run_workers("auto_schedule.py", N, timeout=300).check_ok()


def test_every_worker_switches_to_rank_zeros_choice(auto_run):
    results = [auto_run.one(rank, section="auto") for rank in range(N)]
    for r in results:
        assert r["schedule"] == "auto"
        assert r["in_use"] == "fifo" and r["runtime"] == "fifo", r
    # Rank 0 predicted every candidate at a check step: the first (step 4) when the runtime had
    # profiled a step and measured the link by then, else a later one (how soon is timing).
    assert set(results[0]["predicted"]) == set(_auto_schedule.CANDIDATES)
    assert results[0]["real_decision"] in _auto_schedule.CANDIDATES
    first = results[0]["decisions"][0]
    assert first >= _auto_schedule.FIRST_DECISION_STEP, results[0]
    assert (first - _auto_schedule.FIRST_DECISION_STEP) % _auto_schedule.CHECK_EVERY_STEPS == 0, results[0]
    assert results[1]["decisions"] == [first]  # switched once, at rank 0's decision
    # Switching schedules changes no result: the workers end with the same weights.
    assert results[0]["digest"] == results[1]["digest"]
