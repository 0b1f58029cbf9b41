"""Fusion through ProphetStrategy: a model of many small gradients trains to the weights of one
process on the global batch with its gradients fused into buckets, bitwise the same on every
worker (docs/design.md, "Fusion"). The bucket plan, fused sums on 2-4 engines (bitwise, any
submission order, compression, failures naming the tensor) are tested in C++:
//ops/core:fusion_test and //ops/core:fuser_test."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")

from test_strategy_equivalence import _check_case  # noqa: E402


def test_many_small_gradients_fused_on_three_workers_match_one_process(run_workers):
    cases = ["many_small", "momentum"]
    run = run_workers("strategy_equivalence.py", 3, "--cases", ",".join(cases), "--fusion", "4096",
                      timeout=240).check_ok()
    for case in cases:
        _check_case(run, case)
        r = run.one(0, case=case)
        # The gradients travelled fused: fewer operations than gradients x steps (a bucket is one
        # operation; the metrics' control collectives are counted too).
        assert r["ops"] < r["gradients"] * r["steps"], r


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
