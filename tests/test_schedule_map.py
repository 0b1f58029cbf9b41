"""The predictor's map of prophet against priority (prophet_tf/bench/schedule_map.py): its
predictions on a small model, the table, the summary and the chart (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from prophet_tf.bench import schedule_map
from prophet_tf.bench.schedule_map import MapPoint
from prophet_tf.predict import PredictOptions, Profile, ProfiledLayer, ProfiledTensor


def small_model() -> Profile:
    """Four layers of 1 ms forward; a 4 MB gradient on the last layer (ready first) and small
    ones on the others, the first layer's last."""
    layers = [ProfiledLayer(f"L{i}", 1e-3, 2e-3) for i in range(4)]
    sizes = [64_000, 64_000, 64_000, 4_000_000]
    tensors = [ProfiledTensor(f"grad/L{i}/k", sizes[i], 4 - i, (4 - i) * 2e-3, f"L{i}")
               for i in range(4)]
    return Profile(layers=layers, tensors=tensors, backward_s=8e-3)


def test_map_points_predict_both_schedules_above_the_ideal():
    options = PredictOptions(steps=4, warmup_steps=3)
    points = schedule_map.map_points({"small": small_model()}, [2, 4], [1e9, 10e9],
                                     [100e-6, 5e-3], options, threads=2)
    assert len(points) == 2 * 2 * 2
    assert {(p.workers, p.bandwidth_bps, p.rtt_s) for p in points} == {
        (n, bw, r) for n in (2, 4) for bw in (1e9, 10e9) for r in (100e-6, 5e-3)}
    for p in points:
        assert p.compute_s == pytest.approx(0.012)
        for schedule in schedule_map.SCHEDULES:
            assert p.step_s[schedule] >= p.ideal_s > 0
        assert p.speedup == pytest.approx(p.step_s["priority"] / p.step_s["prophet"])
    # a longer round trip never shortens a step, and the ideal grows by the extra one-way latency
    for short in (p for p in points if p.rtt_s == 100e-6):
        long = next(q for q in points if (q.workers, q.bandwidth_bps, q.rtt_s) ==
                    (short.workers, short.bandwidth_bps, 5e-3))
        assert long.ideal_s >= short.ideal_s
        assert long.step_s["priority"] >= short.step_s["priority"] * 0.999


def point(speedup: float, **fields) -> MapPoint:
    base = dict(model="m", workers=2, bandwidth_bps=1e9, rtt_s=1e-3, compute_s=0.1, ideal_s=0.1)
    base.update(fields)
    return MapPoint(step_s={"prophet": 0.11, "priority": 0.11 * speedup}, **base)


def test_tables_summary_and_chart(tmp_path):
    points = [point(1.0), point(1.3, rtt_s=10e-3), point(0.9, bandwidth_bps=1e11),
              dataclasses.replace(point(1.0, bandwidth_bps=1e11, rtt_s=10e-3),
                                  step_s={"prophet": None, "priority": 0.2})]
    table = schedule_map.format_tables(points)
    assert "| N | link | RTT 1 ms | RTT 10 ms |" in table
    assert "| 2 | 1 Gbit/s | 1.00 (1.10) | **1.30** (1.10) |" in table
    assert "| 2 | 100 Gbit/s | 0.90 (1.10) | deadlock: prophet |" in table
    lines = schedule_map.summary_lines(points)
    assert lines[0] == "4 settings, 1 with a simulated deadlock"
    assert "faster than priority by more than 2%: 1 of 3; slower by more than 2%: 1" in lines[1]
    assert lines[2].startswith("  largest gain 1.30x: m, N=2, 1 Gbit/s, RTT 10 ms")
    pytest.importorskip("matplotlib")
    schedule_map.plot(points, str(tmp_path / "map.png"))
    assert (tmp_path / "map.png").read_bytes()[:4] == b"\x89PNG"


def test_points_are_logged_as_predicted_and_a_rerun_predicts_only_the_rest(tmp_path):
    options = PredictOptions(steps=3, warmup_steps=2)
    path = str(tmp_path / "points.jsonl")
    header = {"options": dataclasses.asdict(options), "library": "abc", "shape": (1, 2)}
    log = schedule_map.PointLog(path, header)
    first = schedule_map.map_points({"small": small_model()}, [2], [1e9], [100e-6, 5e-3], options,
                                    threads=1, on_point=log.add)
    log.close()
    with open(path, "a") as f:
        f.write('{"model": "small", "workers"')  # a line cut short when the run was stopped

    log = schedule_map.PointLog(path, header)
    assert sorted(p.setting for p in log.kept) == sorted(p.setting for p in first)
    predicted = []
    points = schedule_map.map_points({"small": small_model()}, [2, 4], [1e9], [100e-6, 5e-3],
                                     options, threads=1, known=log.kept, on_point=predicted.append)
    log.close()
    assert sorted(p.setting for p in predicted) == [("small", 4, 1e9, 100e-6), ("small", 4, 1e9, 5e-3)]
    assert [p.setting for p in points] == [("small", n, 1e9, r) for n in (2, 4) for r in (100e-6, 5e-3)]
    assert points[:2] == first  # kept as they were, floats and all

    changed = dict(header, library="def")
    log = schedule_map.PointLog(path, changed)
    assert log.kept == [] and "library" in log.why_not_kept
    log.close()
    log = schedule_map.PointLog(path, changed, resume=False)
    assert log.kept == [] and log.why_not_kept == "--noresume"
    log.close()
    with open(path) as f:
        assert [json.loads(line) for line in f] == [{"header": json.loads(json.dumps(changed))}]
