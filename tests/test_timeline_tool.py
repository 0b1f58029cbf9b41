"""Tests of the timeline tool (prophet_tf.timeline) on small synthetic traces (no TensorFlow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prophet_tf import timeline
from prophet_tf.errors import ProphetError

REPO = Path(__file__).resolve().parents[1]
TRACKS = ("step", "forward", "backward", "ready", "block", "push", "pull", "apply")


def synthetic_trace(rank: int, steps: int = 3) -> dict:
    """What the runtime writes for one worker: metadata, spans, instants, bandwidth counter."""
    events = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"worker {rank}"}},
    ]
    for tid, track in enumerate(TRACKS, start=1):
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"name": track}})
    tid_of = {track: tid for tid, track in enumerate(TRACKS, start=1)}

    def span(track, name, ts, dur, **args):
        event = {"name": name, "cat": track, "ph": "X", "ts": ts, "dur": dur, "pid": rank,
                 "tid": tid_of[track]}
        if args:
            event["args"] = args
        events.append(event)

    base = 7_000_000.0 + 150.0 * rank  # microseconds of the shared monotonic clock
    for step in range(steps):
        start = base + step * 60_000
        span("step", f"step {step}", start, 60_000)
        span("forward", "forward", start, 15_000)
        span("backward", "backward", start + 15_000, 30_000)
        span("block", "block 1/2", start + 15_000, 10_000, members=2)
        for layer in range(6):
            ready = start + 15_000 + layer * 5_000
            name = f"dense_{5 - layer}/kernel#{step}"
            events.append({"name": name, "ph": "i", "s": "t", "ts": ready, "pid": rank,
                           "tid": tid_of["ready"]})
            span("push", name, ready + 100, 2_900, bytes=500_000)
            span("pull", name, ready + 3_000, 1_000)
            span("apply", name, ready + 4_000, 300)
        events.append({"name": "bandwidth_MBps", "ph": "C", "ts": start + 30_000, "pid": rank,
                       "args": {"value": 110.0 + 5 * step + rank}})
    return {"displayTimeUnit": "ms", "traceEvents": events}


def write(path: Path, content) -> Path:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.fixture
def traces(tmp_path):
    return [write(tmp_path / f"trace.{rank}.json", synthetic_trace(rank)) for rank in (0, 1)]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "prophet_tf.timeline", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_command_line_draws_png(traces, tmp_path):
    out = tmp_path / "timeline.png"
    proc = run_tool(*map(str, traces), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.exists()
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # two bands of 8 rows and a counter panel, not an empty canvas

    import matplotlib.image

    pixels = matplotlib.image.imread(str(out))
    height, width = pixels.shape[:2]
    assert width >= 1000 and height >= 500
    assert pixels[..., :3].std() > 0.05  # something was drawn


def test_load_trace_and_helpers(traces):
    events = timeline.load_trace(traces[1])
    assert timeline.worker_names(events) == {1: "worker 1"}
    by_track = timeline.events_by_track(events)
    assert set(by_track) == set(TRACKS)
    assert len(by_track["push"]) == 3 * 6
    assert len(by_track["ready"]) == 3 * 6
    assert all(e["ph"] == "i" for e in by_track["ready"])
    assert len(by_track["step"]) == 3
    assert timeline.events_by_track(events, pid=0) == {}
    series = timeline.counter_series(events)
    assert list(series) == [(1, "bandwidth_MBps")]
    assert [value for _, value in series[(1, "bandwidth_MBps")]] == [111.0, 116.0, 121.0]


def test_track_falls_back_to_category_without_metadata(tmp_path):
    path = write(tmp_path / "t.json", [
        {"name": "a", "cat": "push", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 7},
        {"name": "b", "ph": "X", "ts": 3, "dur": 1, "pid": 0, "tid": 9},
    ])
    by_track = timeline.events_by_track(timeline.load_trace(path))
    assert sorted(by_track) == ["push", "tid 9"]


def test_array_form_without_closing_bracket(tmp_path):
    # Chrome's array format allows a missing "]" (a process killed mid-run).
    path = write(tmp_path / "t.json",
                 '[{"name": "a", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 1},\n')
    assert len(timeline.load_trace(path)) == 1


def test_tracks_option_and_python_api(traces, tmp_path):
    out = tmp_path / "subset.png"
    rc = timeline.main([str(traces[0]), "-o", str(out), "--tracks", "push,pull",
                        "--start-ms", "0", "--end-ms", "70", "--title", "two rows"])
    assert rc == 0
    assert out.stat().st_size > 5_000


@pytest.mark.parametrize("content, message", [
    ('{"traceEvents": [', "not valid JSON"),
    ("", "is empty"),
    ('{"events": []}', 'no "traceEvents"'),
    ('{"traceEvents": {"ph": "X"}}', "expected an array"),
    ('{"traceEvents": [42]}', "event #0 is a int"),
    ('{"traceEvents": [{"name": "a", "ts": 1}]}', 'no phase ("ph")'),
    ('{"traceEvents": [{"name": "a", "ph": "X", "ts": "soon", "dur": 1}]}', 'no numeric "ts"'),
    ('{"traceEvents": [{"name": "a", "ph": "X", "ts": 1, "dur": "long"}]}', 'non-numeric "dur"'),
])
def test_malformed_trace_is_a_clear_error(tmp_path, content, message):
    path = write(tmp_path / "bad.json", content)
    with pytest.raises(timeline.TraceError, match="bad.json") as info:
        timeline.load_trace(path)
    assert message in str(info.value)
    assert isinstance(info.value, ProphetError) and isinstance(info.value, ValueError)


def test_command_line_reports_malformed_trace(traces, tmp_path):
    bad = write(tmp_path / "broken.json", '{"traceEvents": [{"ph": "X", "ts": 1,')
    out = tmp_path / "never.png"
    proc = run_tool(str(traces[0]), str(bad), "-o", str(out))
    assert proc.returncode == 2
    assert "broken.json" in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_missing_file_and_nothing_to_draw(tmp_path, capsys):
    assert timeline.main([str(tmp_path / "absent.json"), "-o", str(tmp_path / "x.png")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    only_metadata = write(tmp_path / "meta.json", {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "worker 0"}}]})
    assert timeline.main([str(only_metadata), "-o", str(tmp_path / "x.png")]) == 2
    assert "nothing to draw" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_step_window_and_clipping(traces, tmp_path):
    events = timeline.load_trace(traces[0])
    start, end = timeline.step_window(events, 1)
    assert (start, end) == (7_060_000.0, 7_120_000.0)     # step 1 to the start of step 2
    assert timeline.step_window(events, 2) == (7_120_000.0, 7_180_000.0)   # last: its own end
    with pytest.raises(timeline.TraceError, match="no step 3 in the trace: it has 3"):
        timeline.step_window(events, 3)
    clipped = timeline._clip(events, start, end)
    spans = [e for e in clipped if e.get("ph") == "X"]
    assert spans and all(start <= e["ts"] and e["ts"] + e["dur"] <= end for e in spans)
    assert len([e for e in spans if e["cat"] == "push"]) == 6      # step 1's pushes only
    assert sum(1 for e in clipped if e.get("ph") == "M") == sum(
        1 for e in events if e.get("ph") == "M")
    out = timeline.plot_timeline([events], tmp_path / "one.png", window_us=(start, end))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_command_line_step_option(traces, tmp_path):
    out = tmp_path / "step.png"
    proc = run_tool(*map(str, traces), "-o", str(out), "--step", "1")
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = run_tool(*map(str, traces), "-o", str(out), "--step", "7")
    assert proc.returncode == 2 and "no step 7" in proc.stderr
