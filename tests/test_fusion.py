"""Fusion through ProphetStrategy: a model of many small gradients trains to the weights of one
process on the global batch with its gradients fused into buckets, bitwise the same on every
worker; a model built differently on one worker fails fit everywhere, soon, naming the tensor
(docs/design.md, "Fusion"). The bucket plan, fused sums on 2-4 engines (bitwise, any
submission order, compression, failures naming the tensor, declarations that differ across
workers) are tested in C++: //ops/core:fusion_test and //ops/core:fuser_test."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from conftest import parse_results  # noqa: E402
from test_strategy_equivalence import _check_case  # noqa: E402


def test_many_small_gradients_fused_on_three_workers_match_one_process(run_workers, tmp_path):
    # many_small and momentum: updates deferred past the barrier (ProphetAsyncApply); adam
    # (steps_per_execution=2): synchronous push_pulls of the averaged gradients.
    cases = ["many_small", "momentum", "adam"]
    trace = tmp_path / "trace.{rank}.json"
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--fusion", "4096",
                      timeout=900, env={"PROPHET_TIMELINE": str(trace)}).check_ok()
    # Every fused gradient keeps its own "ready" and "op" events on the trace (users see its
    # wait; a trace read as a profile needs its bytes), beside its bucket's.
    from prophet_tf import timeline
    ops = timeline.events_by_track(timeline.load_trace(tmp_path / "trace.0.json"))["op"]
    members = {e["name"] for e in ops if (e.get("args") or {}).get("fused")}
    buckets = {e["name"] for e in ops if str(e["name"]).startswith("fused:")}
    assert buckets and len(members) > len(buckets), (sorted(buckets), sorted(members))
    assert all(not m.startswith("fused:") for m in members)
    for case in cases:
        _check_case(run, case)
        for rank in range(3):
            r = run.one(rank, case=case)
            # The gradients travelled fused (a fusable gradient alone in its run as a bucket of
            # one), every step: as many push_pulls held for buckets on every worker.
            assert r["fused"] >= r["gradients"] * r["steps"] // 2, r
            assert r["fused"] == run.one(0, case=case)["fused"], r


def test_fused_gradients_that_differ_across_workers_fail_fit_soon_naming_the_variable(spawn_workers):
    # Rank 1 freezes the layer "middle": it declares 4 gradients for fusion, rank 0 declares 6.
    # Unchecked, each worker's bucket would wait for the operation timeout for the other's.
    op_timeout_s = 120
    spawned = spawn_workers("fusion_mismatch.py", 2, str(op_timeout_s))
    for rank, (code, _, out) in enumerate(spawned.wait(timeout=300)):
        assert code == 3, f"rank {rank}:\n" + out[-4000:]
        assert "FINISHED WITHOUT ERROR" not in out
        (err,) = parse_results(out, default_rank=rank)[rank]
        message = err["message"]
        assert "the gradients declared for fusion differ across workers" in message, err
        assert "middle/kernel' is declared on rank 0 (shape [16, 16] float32" in message, err
        assert "but not on rank 1" in message and "build the same model" in message, err
        # Found by the check, not by the operation timeout: a bound only a hang reaches.
        assert err["seconds"] < op_timeout_s / 2, err


def test_fusion_settings_and_link_rate(monkeypatch):
    from prophet_tf import runtime
    from prophet_tf.strategy import _fusion_setting
    assert _fusion_setting(None) is None and _fusion_setting("off") is None
    assert _fusion_setting("auto") == -1 and _fusion_setting(1 << 20) == 1 << 20
    for bad in ("fast", 0, -5, True, 1.5):
        with pytest.raises(ValueError, match="fusion must be"):
            _fusion_setting(bad)
    monkeypatch.delenv(runtime.LINK_GBPS_ENV, raising=False)
    assert runtime.fusion_link_bps() == 0.0
    monkeypatch.setenv(runtime.LINK_GBPS_ENV, "25")
    assert runtime.fusion_link_bps() == 25e9 / 8
    monkeypatch.setenv(runtime.LINK_GBPS_ENV, "fast")
    with pytest.raises(ValueError, match="PROPHET_LINK_GBPS"):
        runtime.fusion_link_bps()


def test_two_workers_size_buckets_for_the_link_rate_they_measured_and_agreed(run_workers, tmp_path,
                                                                              monkeypatch):
    # Without $PROPHET_LINK_GBPS the first strategy measures the link once (its first fusion
    # declaration, when fit traces the step) and both workers take the same rate; the second
    # strategy, with $PROPHET_LINK_GBPS set, takes that rate and measures nothing.
    from prophet_tf import _link_probe, runtime, timeline
    monkeypatch.delenv(runtime.LINK_GBPS_ENV, raising=False)
    trace = tmp_path / "trace.{rank}.json"
    run = run_workers("fusion_link_probe.py", 2, timeout=900,
                      env={"PROPHET_TIMELINE": str(trace)}).check_ok()
    probed = [run.one(rank, case="probe") for rank in range(2)]
    for r in probed:
        assert r["rate_before"] is None, r  # nothing measured before the step is traced
        rate = r["rate"]
        assert rate["source"] == "probe" and rate["measured_gbps"] > 0, r
        assert rate["gbps"] == _link_probe.quantize_gbps(rate["agreed_gbps"]), r
        assert rate["agreed_gbps"] <= rate["measured_gbps"] and rate["probe_seconds"] > 0, r
        assert rate["io_threads"] is None, r  # one host: one lane, nothing to size
        assert r["fused"] > 0, r  # the gradients travelled in buckets sized for it
        # The probe's push_pulls are not gradients: Prophet's profile never holds them.
        assert not any(name.startswith(_link_probe.PROBE_NAME) for name in r["profiled"]), r
    # The same rate everywhere (the slowest worker's, from the same gathered values), so the same
    # buckets, hence the same weights on both workers.
    for key in ("gbps", "agreed_gbps"):
        assert probed[0]["rate"][key] == probed[1]["rate"][key], probed
    assert probed[0]["rate"]["agreed_gbps"] == min(r["rate"]["measured_gbps"] for r in probed), probed
    assert probed[0]["digest"] == probed[1]["digest"], probed
    for rank in range(2):
        env = run.one(rank, case="env")
        assert env["rate"] == {"source": "env", "gbps": 2.5, "measured_gbps": None, "agreed_gbps": None,
                               "probe_seconds": 0.0, "io_threads": None, "cpu_ns_per_byte": None,
                               "two_level": None, "two_level_round_s": None, "flat_round_s": None}, env
        assert env["fused"] > 0, env
        # One probe in the whole run: the first strategy's (its second fit traced the step again,
        # the second strategy had the environment's rate): its rounds and the gathering, once each.
        ops = timeline.events_by_track(timeline.load_trace(tmp_path / f"trace.{rank}.json"))["op"]
        probe_ops = sorted(e["name"] for e in ops if str(e["name"]).startswith(_link_probe.PROBE_NAME))
        assert probe_ops == sorted([f"{_link_probe.PROBE_NAME}/{k}" for k in range(_link_probe.PROBE_ROUNDS)]
                                   + [f"{_link_probe.PROBE_NAME}/rates"]), probe_ops


def test_lanes_keep_pace_with_the_link_at_most_three_quarters_busy():
    from prophet_tf._link_probe import LANE_BUSY_SHARE, lanes_for
    assert LANE_BUSY_SHARE == 0.75
    per_byte = 0.54e-9   # this machine: sending, receiving as much, summing half
    # 25 Gbit/s needs 1.69 lanes' time: 3 lanes (2 would each be 84% busy).
    assert lanes_for(25e9 / 8, per_byte) == 3
    # 100 Gbit/s needs 6.75: 9, which auto's 8 connected lanes cap.
    assert lanes_for(100e9 / 8, per_byte) == 9 and lanes_for(100e9 / 8, per_byte, 8) == 8
    assert lanes_for(0.75e9, 1e-9) == 1 and lanes_for(0.76e9, 1e-9) == 2
    assert lanes_for(0.0, per_byte) == 1 and lanes_for(1e12, per_byte, 1) == 1


def test_link_rate_rounds_to_the_series_within_the_payload_allowance():
    from prophet_tf._link_probe import (MIN_GBPS, PAYLOAD_ALLOWANCE, allreduce_rate, probe_bytes,
                                        quantize_gbps)
    # A link's TCP payload rate rounds to its nominal rate; a rate well below it, one step down.
    cases = {0.94: 1, 0.7: 1, 0.69: 0.5, 9.4: 10, 7.0: 10, 6.9: 5, 1.3: 1, 1.4: 2, 3.4: 2, 3.5: 5,
             24.0: 20, 95.0: 100, 1000.0: 1000, 0.36: 0.5, 0.3: 0.2, 0.14: 0.2, 0.1: 0.1}
    for measured, want in cases.items():
        assert quantize_gbps(measured) == want, (measured, quantize_gbps(measured), want)
    assert quantize_gbps(0.001) == MIN_GBPS  # below: the bucket floor applies anyway
    for value in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100):  # every series value maps to itself
        assert quantize_gbps(value) == value and quantize_gbps(value * PAYLOAD_ALLOWANCE) == value
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="link rate"):
            quantize_gbps(bad)
    # Every worker owns a share of the probe's tensor: N x 64 KiB from N = 64 on.
    assert probe_bytes(2) == probe_bytes(64) == 4 << 20 and probe_bytes(256) == 16 << 20
    # At least a slice per lane (the runtime's lane_slice_bytes), so that it travels on every lane,
    # and each slice spread over every worker (64 KiB each): 8 lanes x 64 x 64 KiB at N = 64.
    from prophet_tf._library import runtime_constants
    slice_bytes = runtime_constants()["lane_slice_bytes"]
    assert probe_bytes(2, lanes=8) == max(4 << 20, 8 * slice_bytes)
    assert probe_bytes(2, lanes=64) == 64 * slice_bytes > 4 << 20
    assert probe_bytes(64, lanes=8) == 8 * 64 * (64 << 10) == 32 << 20
    # 2 workers: each link carries the tensor once per direction; N: 2 (N-1)/N of it.
    assert allreduce_rate(2, 1000, 1.0) == 1000.0 and allreduce_rate(4, 1000, 1.0) == 1500.0
