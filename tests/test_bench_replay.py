"""The replay benchmark (python -m prophet_tf.bench.replay): replay workers (ops/replay, the real
engine without TensorFlow) on loopback, a few steps of a small profile, every element of every
sum checked by the workers; the results carry the fields the benchmark promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prophet_tf.predict import Profile, ProfiledLayer, ProfiledTensor

REPO = Path(__file__).resolve().parents[1]
CONTROL = 1 << 40


def small_profile() -> Profile:
    """Three layers of 2 ms forward; a 1.5 MiB first-layer gradient ready last (cut into
    partitions), two small ones that fuse, and a control collective; 12 ms of backward pass."""
    layers = [ProfiledLayer(f"layer{i}", 0.002, 0.004) for i in range(3)]
    tensors = [ProfiledTensor("grad/layer0/kernel", 1536 * 1024, 3, 0.012, "layer0"),
               ProfiledTensor("grad/layer1/kernel", 40 * 1024, 2, 0.008, "layer1"),
               ProfiledTensor("grad/layer2/kernel", 12 * 1024, 1, 0.004, "layer2"),
               ProfiledTensor("metrics/loss", 8, CONTROL, 0.012, None, element_size=8)]
    return Profile(layers=layers, tensors=tensors, backward_s=0.012, launch_s=0.001, tail_s=0.001,
                   gap_s=0.001, source="test")


def test_replay_on_loopback_sums_and_reports(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    small_profile().save(profile)
    out = tmp_path / "replay.json"
    r = subprocess.run([sys.executable, "-m", "prophet_tf.bench.replay", "--loopback",
                        f"--profile={profile}", "--workers=3", "--schedule=prophet,fifo",
                        "--steps=3", "--warmup=2", "--time_scale=1", "--byte_scale=1",
                        "--bandwidth=1G", "--check_all", "--probe", "--heartbeat_s=1",
                        "--timeout_s=30",
                        f"--json={out}", f"--out={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [run["schedule"] for run in runs] == ["prophet", "fifo"]
    step_s = small_profile().step_s
    for run in runs:
        for key in ("measured_step_s", "predicted_step_s", "ideal_step_s", "startup_s",
                    "peak_rss_bytes", "connections", "messages_per_worker_per_step", "stalls",
                    "cpu", "error"):
            assert key in run, key
        assert run["workers"] == 3 and run["connections"] == 3 * 2
        # The virtual clock plays the profile: no step is shorter than its compute.
        assert run["measured_step_s"] >= step_s - 1e-6
        assert run["ideal_step_s"] >= step_s - 1e-6
        assert run["predicted_step_s"] >= step_s - 1e-6
        assert run["stalls"] == 0 and run["ops_failed"] == 0
        # Every element of the 4 tensors' sums, on 3 workers, in 5 steps.
        elements = (1536 * 1024 + 40 * 1024 + 12 * 1024) // 4 + 1
        assert run["sums_checked"] == 3 * 5 * elements
        assert run["messages_per_worker_per_step"] > 0
        assert run["peak_rss_bytes"] > 2 * run["gradient_bytes"]
        assert run["startup_s"] >= run["connect_s"] > 0
        assert run["fusion_bucket_bytes"] > 0 and run["probe_agreed_bps"] > 0
        assert run["cpu"]["workers_cpu_s_per_step"] > 0
