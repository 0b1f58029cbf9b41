"""The transport benchmark's pre-landing verdict (no workers: its rule on given rows)."""

from __future__ import annotations

from prophet_tf.bench import transport


def row(nbytes: int, ratio: float, cpu_ratio: float) -> dict:
    return {"bytes": nbytes, "ratio": ratio, "cpu_ratio": cpu_ratio}


def test_check_names_every_size_and_goal_missed() -> None:
    rows = [row(4 << 20, 1.02, 1.01), row(64 << 20, 0.85, 1.10), row(256 << 20, 0.95, 1.30)]
    failures = transport.check_failures(rows)
    assert len(failures) == 2, failures
    assert failures[0].startswith("64 MiB:") and "0.85" in failures[0] and "throughput" in failures[0]
    assert failures[1].startswith("256 MiB:") and "1.30x" in failures[1] and "CPU per byte" in failures[1]


def test_check_passes_at_the_goals_themselves() -> None:
    rows = [row(16 << 20, transport.CHECK_MIN_RATIO, transport.CHECK_MAX_CPU_RATIO)]
    assert transport.check_failures(rows) == []
    assert transport.CHECK_SIZES == ["4MiB", "16MiB", "64MiB", "256MiB"]
