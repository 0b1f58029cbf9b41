"""The CPU costs the predictor charges (prophet_tf.predict.costs): the calibration on this machine,
the costs file, and a cost per byte and per frame changing a prediction by the amount computed by
hand (ops/core/simulator_test.cc has the other cases)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from prophet_tf.predict import PredictOptions, Profile, ProfiledLayer, ProfiledTensor, predict
from prophet_tf.predict.costs import COST_FIELDS, apply_costs, load_costs

REPO = Path(__file__).resolve().parents[1]


def one_tensor() -> Profile:
    """One 100,000-byte gradient, ready when the backward pass starts (which ends at once),
    after a 10 ms forward pass: on 1 MB/s links a step is 10 + 100 (its push) + 100 ms (its sum)."""
    return Profile(layers=[ProfiledLayer("dense", 0.010)],
                   tensors=[ProfiledTensor("grad/dense/kernel", 100_000, 1, 0.0, "dense")])


def slow_options(**costs: float) -> PredictOptions:
    return PredictOptions(payload_efficiency=1.0, frame_overhead_bytes=0, socket_buffer_bytes=0,
                          autotuned_socket_buffer_bytes=0, small_allreduce=False, warmup_steps=2,
                          steps=3, fusion_bytes=0, **costs)


def test_costs_per_byte_and_per_frame_lengthen_the_step() -> None:
    def step(**costs: float) -> float:
        return predict(one_tensor(), workers=2, bandwidth_bps=8e6, schedule="priority_nocross",
                       options=slow_options(**costs)).step_s
    assert step() == pytest.approx(0.210, abs=1e-6)
    # Receiving at twice the link's time per byte: each transfer ends 100 ms after its last byte.
    assert step(receive_byte_s=2e-6) == pytest.approx(0.410, abs=1e-6)
    # Summing at the owner only.
    assert step(sum_byte_s=2e-6) == pytest.approx(0.310, abs=1e-6)
    # 1 ms to send a frame and 2 to receive it, on each of the two frames.
    assert step(message_send_s=1e-3, message_receive_s=2e-3) == pytest.approx(0.216, abs=1e-6)


def test_costs_file_round_trip_and_scale(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": "prophet_tf.cpu_costs", "version": 1,
                                "options": {f: 1e-9 * (i + 1) for i, f in enumerate(COST_FIELDS)}}))
    costs = load_costs(str(path))
    assert set(costs) == set(COST_FIELDS)
    options = apply_costs(PredictOptions(), costs, scale=0.5)
    assert options.sum_byte_s == pytest.approx(0.5 * costs["sum_byte_s"])
    assert dataclasses.asdict(apply_costs(PredictOptions(), None)) == dataclasses.asdict(PredictOptions())
    path.write_text(json.dumps({"options": {}}))
    with pytest.raises(ValueError, match="not a costs file"):
        load_costs(str(path))


def test_calibrate_measures_every_cost(tmp_path: Path) -> None:
    out = tmp_path / "costs.json"
    r = subprocess.run([sys.executable, "-m", "prophet_tf.predict", "calibrate", f"--out={out}",
                        "--effort=0.05"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    costs = load_costs(str(out))
    assert all(v > 0 for v in costs.values()), costs
    # A frame costs microseconds, a byte nanoseconds or less.
    assert 1e-7 < costs["message_send_s"] < 1e-3
    assert costs["sum_byte_s"] < 1e-7 and costs["receive_byte_s"] < 1e-7
