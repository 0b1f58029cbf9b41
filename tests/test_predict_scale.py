"""The predictor at scale: time scale conversion of emulated profiles, workers per
host and the two-level path through the Python API and the command line, and the scaling
table's arithmetic. Each test takes about a second."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prophet_tf import timeline
from prophet_tf.predict import (PredictError, PredictOptions, Profile, ProfiledLayer,
                                ProfiledTensor, ProfileError, ideal_bound, predict,
                                profile_from_trace)
from prophet_tf.predict.profile import EMULATION_TRACK, emulation_record

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_predict import EXACT, one_tensor_profile, synthetic_trace  # noqa: E402


def emulated_trace(time_scale: float) -> list[dict]:
    """The synthetic one-worker trace with an emulated worker's record on its own track."""
    events = synthetic_trace()
    tid = 99
    events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
                   "args": {"name": EMULATION_TRACK}})
    events.append({"name": emulation_record(time_scale, 100.0), "ph": "i", "s": "t", "ts": 5.0,
                   "pid": 0, "tid": tid})
    return events


def test_profile_reads_the_emulation_record_and_scales_every_time():
    profile = profile_from_trace(emulated_trace(28.0))
    assert profile.emulation == {"time_scale": 28.0, "accelerator_tflops": 100.0}
    real = profile.scaled(28.0)
    assert real.emulation["time_scale"] == pytest.approx(1.0)
    assert real.step_s == pytest.approx(profile.step_s / 28.0)
    for a, b in zip(profile.layers, real.layers):
        assert b.forward_s == pytest.approx(a.forward_s / 28.0)
    for a, b in zip(profile.tensors, real.tensors):
        assert (b.ready_s, b.apply_s, b.bytes) == (pytest.approx(a.ready_s / 28.0),
                                                   pytest.approx(a.apply_s / 28.0), a.bytes)
    assert any("divided by 28" in note for note in real.notes)
    with pytest.raises(ProfileError, match="time scale"):
        profile.scaled(0.0)
    # A plain trace has no record.
    assert profile_from_trace(synthetic_trace()).emulation == {}


def test_emulated_profile_scaled_back_is_the_accelerators():
    from prophet_tf.bench.emulated import LayerSpec, WeightSpec, emulated_profile
    specs = [LayerSpec(f"dense_{i}", "Dense", (WeightSpec("kernel", (64, 64), "float32", True),),
                       2e9 * (i + 1)) for i in range(3)]
    slow = emulated_profile(specs, 8, 100.0, time_scale=28.0)
    fast = emulated_profile(specs, 8, 100.0, time_scale=1.0)
    assert slow.emulation["time_scale"] == 28.0
    back = slow.scaled(slow.emulation["time_scale"])
    assert back.step_s == pytest.approx(fast.step_s)
    p_slow = predict(back, workers=4, bandwidth_bps=10e9, schedule="priority")
    p_fast = predict(fast, workers=4, bandwidth_bps=10e9, schedule="priority")
    assert p_slow.step_s == pytest.approx(p_fast.step_s, rel=1e-6)


def test_workers_per_host_and_the_two_level_path():
    # The cases ops/sim/simulator_test.cc computes by hand, through the Python API.
    profile = one_tensor_profile()
    local = dataclasses.replace(EXACT, workers_per_host=2, loopback_bytes_per_s=1e9)
    p = predict(profile, workers=2, bandwidth_bps=8e6, schedule="priority", options=local)
    assert p.step_s == pytest.approx(0.0102, abs=1e-9)
    assert p.wire_bytes_per_step == 0
    two_hosts = dataclasses.replace(EXACT, workers_per_host=2, loopback_bytes_per_s=1e12)
    flat = predict(profile, workers=4, bandwidth_bps=8e6, schedule="priority",
                   options=dataclasses.replace(two_hosts, hierarchical=False))
    two_level = predict(profile, workers=4, bandwidth_bps=8e6, schedule="priority",
                        options=dataclasses.replace(two_hosts, hierarchical=True))
    assert flat.step_s == pytest.approx(0.410, abs=1e-5)
    assert two_level.step_s == pytest.approx(0.210, abs=1e-5)
    # Unset, the runtime's default (auto) takes the two-level path on 2 hosts x 2 workers ...
    by_default = predict(profile, workers=4, bandwidth_bps=8e6, schedule="priority", options=two_hosts)
    assert by_default.step_s == pytest.approx(two_level.step_s, abs=1e-9)
    # ... and the flat one where every worker has a host of its own (nothing to sum on a host).
    alone = dataclasses.replace(EXACT, loopback_bytes_per_s=1e12)
    assert predict(profile, workers=4, bandwidth_bps=8e6, schedule="priority",
                   options=alone).step_s == pytest.approx(
        predict(profile, workers=4, bandwidth_bps=8e6, schedule="priority",
                options=dataclasses.replace(alone, hierarchical=False)).step_s, abs=1e-9)
    # The bound counts the hosts' NICs: one crossing each way.
    assert ideal_bound(profile, workers=4, bandwidth_bps=8e6,
                       options=two_hosts).step_s <= two_level.step_s
    # mwms keeps its ring with the option set (the option applies to the runtime's schedules).
    ring = predict(profile, workers=4, bandwidth_bps=8e6, schedule="mwms",
                   options=dataclasses.replace(two_hosts, hierarchical=True))
    assert ring.step_s > 0
    with pytest.raises(PredictError, match="multiple of workers_per_host"):
        predict(profile, workers=3, bandwidth_bps=8e6, options=two_hosts)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "prophet_tf.predict", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_command_line_time_scale_and_placement(tmp_path):
    profile = profile_from_trace(emulated_trace(4.0))
    path = tmp_path / "profile.json"
    profile.save(path)
    out = tmp_path / "out.json"
    done = run_cli(str(path), "--workers", "4,8", "--bandwidth", "10G", "--schedule",
                   "priority,mwms", "--time_scale", "profile", "--workers_per_host", "2",
                   "--hierarchical", "--output", "", "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "divided by 4" in done.stdout and "two-level path (--hierarchical" in done.stdout
    data = json.loads(out.read_text())
    assert data["options"]["workers_per_host"] == 2 and data["options"]["hierarchical"]
    assert data["profile"]["emulation"]["time_scale"] == pytest.approx(1.0)
    for p in data["predictions"]:
        assert p["single_step_s"] == pytest.approx(profile.step_s / 4.0, rel=1e-6)
    bad = run_cli(str(path), "--workers", "3", "--workers_per_host", "2", "--output", "")
    assert bad.returncode == 2 and "multiple of --workers_per_host" in bad.stderr
    plain = tmp_path / "plain.json"
    Profile(layers=[ProfiledLayer("dense", 0.01)],
            tensors=[ProfiledTensor("grad/dense/kernel", 1000, 1, 0.0, "dense")]).save(plain)
    missing = run_cli(str(plain), "--time_scale", "profile", "--output", "")
    assert missing.returncode == 2 and "no emulation record" in missing.stderr


def test_scaling_table_efficiency_and_shortfalls():
    from prophet_tf.bench.scaling import ScalingPoint, format_tables, shortfalls
    points = [ScalingPoint("m", 10e9, 2, 0.010, 0.010, {"prophet": 0.0105, "mwms": 0.020}),
              ScalingPoint("m", 10e9, 64, 0.010, 0.0105, {"prophet": 0.030, "mwms": 0.020}),
              ScalingPoint("m", 10e9, 256, 0.010, 0.050, {"prophet": None, "mwms": 0.060})]
    assert points[0].efficiency("prophet") == pytest.approx(0.010 / 0.0105)
    table = format_tables(points, ["prophet", "mwms"])
    assert "| 10 Gbit/s | 64 | 30.0 (33%) | 20.0 (50%) | 10.5 (95%) |" in table
    assert "deadlock" in table
    lines = shortfalls(points, ["prophet", "mwms"])
    assert lines == [
        "prophet: below 90% efficiency where the ideal bound reaches it: 1 settings "
        "(efficiency %): m 10 Gbit/s: N = 64 (33)",
        "prophet: step more than 1.11x the ideal bound: 1 settings (x the ideal): "
        "m 10 Gbit/s: N = 64 (2.86)",
        "prophet: slower than the ring (mwms) by more than 1%: 1 settings (x the ring): "
        "m 10 Gbit/s: N = 64 (1.50)",
        "prophet: simulated deadlock: m 10 Gbit/s N=256"]


def test_scaling_runs_join(tmp_path):
    from prophet_tf.bench.scaling import ScalingPoint, load_points
    run = tmp_path / "a" / "scaling"
    run.mkdir(parents=True)
    point = ScalingPoint("m", 10e9, 2, 0.010, 0.010, {"prophet": 0.0105, "mwms": 0.020}, 1.5)
    (run / "scaling.json").write_text(json.dumps({"command": "x", "points": [point.to_json()]}))
    assert load_points(str(run / "scaling.json")) == [point]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "prophet_tf.bench.scaling", "--merge",
                           str(tmp_path / "a"), "--out", str(tmp_path / "joined")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "joined" / "scaling" / "scaling.png").exists()
    assert "| 10 Gbit/s | 2 | 10.5 (95%) | 20.0 (50%) | 10.0 (100%) |" in (
        tmp_path / "joined" / "scaling" / "scaling.md").read_text()
