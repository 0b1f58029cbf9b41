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
                    "longest_op_s", "cpu", "error"):
            assert key in run, key
        assert run["workers"] == 3 and run["connections"] == 3 * 2
        # The runtime's default (auto) and a host per worker: the flat path.
        assert run["hierarchical"] == "auto" and run["two_level_hosts"] == 0
        # The virtual clock plays the profile: no step is shorter than its compute.
        assert run["measured_step_s"] >= step_s - 1e-6
        assert run["ideal_step_s"] >= step_s - 1e-6
        assert run["predicted_step_s"] >= step_s - 1e-6
        assert run["ops_failed"] == 0 and run["longest_op_s"] > 0
        # Every element of the 4 tensors' sums, on 3 workers, in 5 steps.
        elements = (1536 * 1024 + 40 * 1024 + 12 * 1024) // 4 + 1
        assert run["sums_checked"] == 3 * 5 * elements
        assert run["messages_per_worker_per_step"] > 0
        assert run["peak_rss_bytes"] > 2 * run["gradient_bytes"]
        assert run["startup_s"] >= run["connect_s"] > 0
        assert run["fusion_bucket_bytes"] > 0 and run["probe_agreed_bps"] > 0
        # byte_scale 1: the strategy's probe, 4 MiB a round, timed within start-up.
        assert run["probe_bytes"] == 4 << 20 and 0 < run["probe_s"] < run["startup_s"]
        assert run["cpu"]["workers_cpu_s_per_step"] > 0


def test_a_stall_is_a_step_over_twice_its_workers_median() -> None:
    from prophet_tf.bench.replay import STALL_FACTOR, count_stalls
    assert STALL_FACTOR == 2.0
    assert count_stalls([]) == 0
    assert count_stalls([0.1, 0.1, 0.2, 0.1]) == 0          # twice the median is not over it
    assert count_stalls([0.1, 0.11, 0.25, 0.1, 0.9]) == 2


def test_each_hosts_queue_holds_frames_of_every_connection_that_crosses_its_link() -> None:
    import pytest

    from prophet_tf.bench.replay import crossing_connections, tbf_queue_ms
    # 8 hosts x 8 workers: flat, each worker sends to the 56 elsewhere; two-level, to one a host.
    assert crossing_connections(64, 8, "off", 1) == 8 * 56
    assert crossing_connections(64, 8, "on", 1) == 8 * 7
    # auto: the start-up probe's flat rounds, and maybe the flat path after them.
    assert crossing_connections(64, 8, "auto", 1) == 8 * 56
    assert crossing_connections(64, 8, "off", 2) == 2 * 8 * 56            # a connection a lane
    assert crossing_connections(16, 1, "auto", 1) == 15                  # one a host: flat
    # ResNet50 at 100 Gbit/s slowed 600 x with 1.2% of its bytes: 2 Mbit/s a host. A 2 s queue
    # (0.5 MB) dropped packets of its 448 connections until they ended with ETIMEDOUT.
    link_bps = 100e9 * 0.012 / 600
    with pytest.raises(ValueError, match=r"2000 gives each host a queue of 0\.50 MB .* 448 "
                                         r"crossing connections .* ETIMEDOUT.*0 \(sized for them: "
                                         r"10852 ms\)"):
        tbf_queue_ms(link_bps, 448, 1500, 2000)
    assert tbf_queue_ms(link_bps, 448, 1500, 0) == pytest.approx(448 * 4 * 1514 * 8 / 2e6 * 1e3)
    # Packets of 4 segments, two a socket: 8 frames each.
    assert tbf_queue_ms(link_bps, 448, 1500, 0, 4) == pytest.approx(448 * 8 * 1514 * 8 / 2e6 * 1e3)
    assert tbf_queue_ms(link_bps, 448, 1500, 8000) == 8000            # 2.9 frames each
    assert tbf_queue_ms(1e9, 15, 1500, 0) == 1000                     # at least a second
    with pytest.raises(ValueError, match="a smaller --time_scale or a larger --byte_scale"):
        tbf_queue_ms(1e9, 100000, 9000, 20)
    for wrong in (-5, float("nan")):
        with pytest.raises(ValueError, match=r"--tbf_latency_ms .*: expected 0 \(sized for"):
            tbf_queue_ms(1e9, 15, 1500, wrong)


def test_saved_runs_load_and_give_their_error_line(tmp_path: Path) -> None:
    from prophet_tf.bench import replay
    base = dict(model="m", schedule="prophet", workers=16, workers_per_host=1, hierarchical="off",
                measured_step_s=0.100, predicted_step_s=0.110, ideal_step_s=0.09, startup_s=1.0,
                peak_rss_bytes=2**20, messages_per_worker_per_step=10.0, stalls=0,
                cpu={"workers_cores": 1.0, "machine_busy_cores": 2.0})
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [base, dict(base, workers=8, predicted_step_s=0.080)]}))
    loaded = replay.load_runs(str(path))
    assert [r.workers for r in loaded] == [16, 8]
    assert loaded[0].longest_op_s is None           # a field the file does not carry
    assert abs(loaded[0].error - 0.10) < 1e-9 and abs(loaded[1].error + 0.20) < 1e-9
    assert replay.error_line(loaded, "e") == "e: median 15.0%, max 20.0% over 2 runs"
    assert replay.error_line(loaded[:0], "e") == "e: no run with a prediction"
    assert "| m | prophet | 16x1 | 100 | 110 | 90 | +10.0% |" in replay.format_row(loaded[0])
    # The row names the path the engines took, not the setting alone.
    two_level = replay.ReplayRun(**dict(vars(loaded[0]), workers_per_host=4, hierarchical="auto",
                                        two_level_hosts=4))
    assert "| 4x4 2-level (auto) |" in replay.format_row(two_level)
    flat = replay.ReplayRun(**dict(vars(two_level), workers_per_host=16, two_level_hosts=0))
    assert "| 1x16 |" in replay.format_row(flat)


def test_configs_with_their_own_output_tree_keep_bazel_bin_on_the_default_one() -> None:
    """The replay worker runs from bazel-bin, and scripts/test.sh builds the ASan fuzz targets
    while pytest runs: a config that builds into another output tree (-c, --platform_suffix,
    --cpu) must make its own convenience links, or bazel-bin follows it to a tree without the
    worker."""
    moves_tree = ("-c", "--compilation_mode", "--platform_suffix", "--cpu")
    options: dict[str, list[str]] = {}
    for line in (REPO / ".bazelrc").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0].startswith("build:"):
            options.setdefault(words[0][len("build:"):], []).extend(words[1:])
    moving = {name for name, opts in options.items()
              if any(o.split("=", 1)[0] in moves_tree for o in opts)}
    assert {"asan", "tsan"} <= moving, sorted(moving)  # what scripts/test.sh and the docs use
    for name in sorted(moving):
        assert any(o.startswith("--symlink_prefix") for o in options[name]), (
            f"build:{name} builds into its own output tree but sets no --symlink_prefix: "
            "a build with it moves bazel-bin away from the replay worker")
