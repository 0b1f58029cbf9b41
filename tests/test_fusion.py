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
                      timeout=240, env={"PROPHET_TIMELINE": str(trace)}).check_ok()
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
            # The gradients travelled fused (a gradient alone in its run travels alone), every
            # step: as many push_pulls held for buckets on every worker.
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
