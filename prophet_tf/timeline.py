"""Draw the Chrome-trace timelines written by the prophet_tf runtime as one PNG.

Each worker writes its own trace (``timeline_path=...``): Chrome trace JSON with one process per
worker (pid = rank) and one thread row per track ("ready", "block", "push", "pull", "apply",
"step", ...), timestamps in microseconds of CLOCK_MONOTONIC, which every worker on one machine
shares. Perfetto opens those files directly; this tool puts several workers side by side in a
static picture, e.g. for a report::

    python -m prophet_tf.timeline /tmp/trace.0.json /tmp/trace.1.json -o timeline.png

Top panel: a Gantt chart, one band per worker, one row per track. Bottom panel: counter samples
(the runtime's bandwidth estimate) as lines, one per worker.

The loading helpers (:func:`load_trace`, :func:`events_by_track`, :func:`counter_series`) need no
matplotlib and are meant for tests and notebooks as well.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

from prophet_tf.errors import ProphetError

__all__ = [
    "DEFAULT_TRACKS",
    "TraceError",
    "counter_series",
    "events_by_track",
    "load_trace",
    "main",
    "plot_timeline",
    "step_window",
    "track_names",
    "worker_names",
]

# Rows in this order when present; any other track follows, alphabetically.
DEFAULT_TRACKS = ("ready", "block", "push", "pull", "apply", "step", "forward", "backward")

_TRACK_COLORS = {
    "ready": "#7f7f7f",
    "queue": "#bcbd22",
    "block": "#9467bd",
    "push": "#1f77b4",
    "sum": "#17becf",
    "pull": "#2ca02c",
    "apply": "#ff7f0e",
    "step": "#8c564b",
    "forward": "#e377c2",
    "backward": "#d62728",
}

Event = Dict[str, object]
PathLike = Union[str, Path]


class TraceError(ProphetError, ValueError):
    """A trace file cannot be read or is not a Chrome trace this tool understands."""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_trace(path: PathLike) -> List[Event]:
    """Returns the events of a Chrome trace file.

    Accepts the object form (``{"traceEvents": [...]}``, what the runtime writes) and the array
    form (``[...]``, whose closing bracket Chrome allows to be missing). Raises :class:`TraceError`
    naming the file and the problem when the file is missing, not JSON, or has events without the
    fields a viewer needs.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"trace {str(path)!r} is not UTF-8 text: {e}") from None
    if not text.strip():
        raise TraceError(f"trace {str(path)!r} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        data = _load_unterminated_array(text)
        if data is None:
            raise TraceError(
                f"trace {str(path)!r} is not valid JSON (line {e.lineno}, column {e.colno}: "
                f"{e.msg}); was the run killed before the timeline was flushed?"
            ) from None

    if isinstance(data, dict):
        if "traceEvents" not in data:
            raise TraceError(f"trace {str(path)!r} has no \"traceEvents\" array "
                             f"(keys: {', '.join(sorted(map(str, data))) or 'none'})")
        events = data["traceEvents"]
    else:
        events = data
    if not isinstance(events, list):
        raise TraceError(f"trace {str(path)!r}: \"traceEvents\" is a {type(events).__name__}, "
                         "expected an array")

    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise TraceError(f"trace {str(path)!r}: event #{index} is a {type(event).__name__}, "
                             "expected an object")
        phase = event.get("ph")
        if not isinstance(phase, str):
            raise TraceError(f"trace {str(path)!r}: event #{index} has no phase (\"ph\")")
        if phase == "M":
            continue
        if not _is_number(event.get("ts")):
            raise TraceError(f"trace {str(path)!r}: event #{index} ({phase!r} "
                             f"{event.get('name')!r}) has no numeric \"ts\"")
        if phase == "X" and not _is_number(event.get("dur", 0)):
            raise TraceError(f"trace {str(path)!r}: event #{index} ({event.get('name')!r}) has a "
                             "non-numeric \"dur\"")
    return events


def _load_unterminated_array(text: str) -> Optional[list]:
    """The array form may lack its closing bracket (Chrome accepts that); try to close it."""
    stripped = text.rstrip()
    if not stripped.startswith("["):
        return None
    try:
        data = json.loads(stripped.rstrip(",") + "]")
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, list) else None


def _pid(event: Event) -> int:
    pid = event.get("pid", 0)
    return int(pid) if _is_number(pid) else 0


def _tid(event: Event) -> int:
    tid = event.get("tid", 0)
    return int(tid) if _is_number(tid) else 0


def _metadata(events: Iterable[Event], name: str) -> Dict[Tuple[int, int], str]:
    names: Dict[Tuple[int, int], str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == name:
            args = event.get("args")
            if isinstance(args, dict) and isinstance(args.get("name"), str):
                names[(_pid(event), _tid(event))] = args["name"]
    return names


def worker_names(events: Sequence[Event]) -> Dict[int, str]:
    """pid -> process name ("worker 0"), for every pid with events or metadata."""
    names = {pid: name for (pid, _), name in _metadata(events, "process_name").items()}
    for event in events:
        names.setdefault(_pid(event), f"worker {_pid(event)}")
    return names


def track_names(events: Sequence[Event]) -> Dict[Tuple[int, int], str]:
    """(pid, tid) -> track name, from the thread_name metadata the runtime writes."""
    return _metadata(events, "thread_name")


def events_by_track(events: Sequence[Event], pid: Optional[int] = None) -> Dict[str, List[Event]]:
    """Spans ("X") and instants ("i"/"I") grouped by track name, in file order.

    The track of an event is its thread's name (thread_name metadata), else its category, else
    "tid N". With `pid`, only that worker's events.
    """
    threads = track_names(events)
    tracks: Dict[str, List[Event]] = {}
    for event in events:
        if event.get("ph") not in ("X", "i", "I"):
            continue
        if pid is not None and _pid(event) != pid:
            continue
        name = threads.get((_pid(event), _tid(event)))
        if name is None:
            category = event.get("cat")
            name = category if isinstance(category, str) and category else f"tid {_tid(event)}"
        tracks.setdefault(name, []).append(event)
    return tracks


def counter_series(events: Sequence[Event]) -> Dict[Tuple[int, str], List[Tuple[float, float]]]:
    """(pid, "counter.series") -> [(ts_us, value), ...] sorted by time, from "C" events."""
    series: Dict[Tuple[int, str], List[Tuple[float, float]]] = {}
    for event in events:
        if event.get("ph") != "C":
            continue
        args = event.get("args")
        if not isinstance(args, dict):
            continue
        for key, value in args.items():
            if not _is_number(value):
                continue
            label = str(event.get("name", "counter"))
            if key != "value":
                label += "." + str(key)
            series.setdefault((_pid(event), label), []).append((float(event["ts"]), float(value)))
    for points in series.values():
        points.sort()
    return series


def step_window(events: Sequence[Event], step: int) -> Tuple[float, float]:
    """``(start_us, end_us)`` of training step ``step`` (0 = the first "step" span of the trace):
    from its start to the next step's start (the step's own end for the last one).

    The strategy writes one "step" span per call of the train function. Raises
    :class:`TraceError` when the trace has no such step.
    """
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0) or 0))
                   for e in events_by_track(events).get("step", []) if e.get("ph") == "X")
    if not 0 <= step < len(spans):
        raise TraceError(f"no step {step} in the trace: it has {len(spans)} \"step\" spans "
                         "(steps are marked when ProphetStrategy writes a timeline)")
    start, end = spans[step]
    if step + 1 < len(spans):
        end = max(end, spans[step + 1][0])
    return start, end


def _clip(events: Sequence[Event], start_us: float, end_us: float) -> List[Event]:
    """The events that overlap [start_us, end_us], cut to it (metadata kept)."""
    out: List[Event] = []
    for e in events:
        phase = e.get("ph")
        if phase not in ("X", "i", "I", "C"):
            out.append(e)
            continue
        ts = float(e["ts"])
        end = ts + float(e.get("dur", 0) or 0) if phase == "X" else ts
        if end < start_us or ts > end_us:
            continue
        if phase == "X":
            e = dict(e, ts=max(ts, start_us), dur=min(end, end_us) - max(ts, start_us))
        out.append(e)
    return out


def _ordered_tracks(present: Iterable[str], wanted: Optional[Sequence[str]]) -> List[str]:
    present = set(present)
    if wanted:
        return [t for t in wanted if t in present]
    known = [t for t in DEFAULT_TRACKS if t in present]
    return known + sorted(present - set(DEFAULT_TRACKS))


def plot_timeline(
    traces: Sequence[Sequence[Event]],
    output: PathLike,
    *,
    tracks: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    start_ms: Optional[float] = None,
    end_ms: Optional[float] = None,
    dpi: int = 120,
    window_us: Optional[Tuple[float, float]] = None,
) -> Path:
    """Draws `traces` (one event list per file) into the PNG `output` and returns its path.

    Time is in milliseconds from the earliest event of all traces (the workers share the clock).
    `tracks` selects and orders the rows; `start_ms`/`end_ms` crop the time axis. `window_us`
    (trace timestamps, e.g. from :func:`step_window`) keeps only what happens in that window,
    cut to it, and counts time from its start.
    """
    if window_us is not None:
        traces = [_clip(events, *window_us) for events in traces]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Bands: one per (file, pid), so two files that both say "rank 0" are still kept apart.
    bands = []  # (label, {track: [events]}, [(series label, points)])
    for file_index, events in enumerate(traces):
        names = worker_names(events)
        counters = counter_series(events)
        pids = sorted({_pid(e) for e in events if e.get("ph") in ("X", "i", "I", "C")})
        for pid in pids:
            label = names.get(pid, f"worker {pid}")
            if len(traces) > 1 and sum(1 for b in bands if b[0] == label):
                label = f"{label} (file {file_index + 1})"
            series = [(f"{label}: {name}", points)
                      for (counter_pid, name), points in sorted(counters.items())
                      if counter_pid == pid]
            bands.append((label, events_by_track(events, pid), series))

    all_tracks = set()
    for _, by_track, _ in bands:
        all_tracks.update(by_track)
    rows = _ordered_tracks(all_tracks, tracks)
    if not rows and not any(series for _, _, series in bands):
        wanted = f" among tracks {', '.join(tracks)}" if tracks else ""
        raise TraceError(f"nothing to draw: the traces have no spans, instants or counters{wanted}")

    timestamps = []
    for _, by_track, series in bands:
        for track in rows:
            for e in by_track.get(track, []):
                timestamps.append(float(e["ts"]))
                timestamps.append(float(e["ts"]) + float(e.get("dur", 0) or 0))
        for _, points in series:
            timestamps.extend(ts for ts, _ in points)
    origin_us = min(timestamps) if timestamps else 0.0
    if window_us is not None:
        origin_us = window_us[0]

    n_rows = max(1, len(rows)) * len(bands)
    fig_height = min(40.0, 1.8 + 0.28 * n_rows + 2.2)
    fig, (gantt, lower) = plt.subplots(
        2, 1, sharex=True, figsize=(14, fig_height),
        gridspec_kw={"height_ratios": [max(2.0, 0.28 * n_rows), 2.2]})

    yticks, ylabels = [], []
    y = 0.0
    for band_index, (label, by_track, _) in enumerate(bands):
        band_top = y
        for track in rows:
            color = _TRACK_COLORS.get(track, "#393b79")
            spans = [((float(e["ts"]) - origin_us) / 1e3, max(float(e.get("dur", 0) or 0) / 1e3, 1e-4))
                     for e in by_track.get(track, []) if e.get("ph") == "X"]
            instants = [(float(e["ts"]) - origin_us) / 1e3
                        for e in by_track.get(track, []) if e.get("ph") in ("i", "I")]
            if spans:
                gantt.broken_barh(spans, (y + 0.1, 0.8), facecolors=color, edgecolors="none",
                                  alpha=0.9)
            if instants:
                gantt.plot(instants, [y + 0.5] * len(instants), linestyle="none", marker="|",
                           markersize=9, color=color)
            yticks.append(y + 0.5)
            ylabels.append(f"{label} · {track}")
            y += 1.0
        if band_index % 2 == 1:
            gantt.axhspan(band_top, y, color="#f2f2f2", zorder=-1)
        gantt.axhline(y, color="#999999", linewidth=0.8)
    gantt.set_ylim(y, 0)  # first worker, first track at the top
    gantt.set_yticks(yticks)
    gantt.set_yticklabels(ylabels, fontsize=8)
    gantt.set_title(title or f"prophet_tf timeline: {len(bands)} worker(s)")
    gantt.grid(axis="x", color="#dddddd", linewidth=0.5)

    drew_counter = False
    for _, _, series in bands:
        for label, points in series:
            xs = [(ts - origin_us) / 1e3 for ts, _ in points]
            ys = [value for _, value in points]
            lower.step(xs, ys, where="post", label=label, linewidth=1.2)
            drew_counter = True
    if drew_counter:
        lower.legend(fontsize=7, loc="upper right")
        lower.set_ylabel("counter (bandwidth MB/s)", fontsize=8)
    else:
        lower.text(0.5, 0.5, "no counter samples (bandwidth) in these traces",
                   ha="center", va="center", transform=lower.transAxes, color="#777777")
    lower.grid(color="#dddddd", linewidth=0.5)
    lower.set_xlabel("time (ms)")
    if start_ms is not None or end_ms is not None:
        gantt.set_xlim(left=start_ms, right=end_ms)

    output = Path(output)
    fig.tight_layout()
    try:
        fig.savefig(output, dpi=dpi)
    except OSError as e:
        raise TraceError(f"cannot write {str(output)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return output


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prophet_tf.timeline",
        description="Draw prophet_tf Chrome-trace timelines (one file per worker) as a PNG: one "
                    "band per worker, one row per track, bandwidth below.")
    p.add_argument("traces", nargs="+", metavar="TRACE.json", help="trace files, one per worker")
    p.add_argument("-o", "--output", default="timeline.png", help="PNG to write (default: %(default)s)")
    p.add_argument("--tracks", default=None,
                   help="comma-separated rows in order (default: "
                        f"{','.join(DEFAULT_TRACKS)}, then any other track present)")
    p.add_argument("--title", default=None)
    p.add_argument("--start-ms", type=float, default=None, help="crop: first millisecond shown")
    p.add_argument("--end-ms", type=float, default=None, help="crop: last millisecond shown")
    p.add_argument("--step", type=int, default=None, metavar="K",
                   help="show only training step K (0 = the first \"step\" span of the first "
                        "trace), from its start to the next step's start")
    p.add_argument("--dpi", type=int, default=120)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    tracks = [t.strip() for t in args.tracks.split(",") if t.strip()] if args.tracks else None
    try:
        traces = [load_trace(path) for path in args.traces]
        window = None if args.step is None else step_window(traces[0], args.step)
        output = plot_timeline(traces, args.output, tracks=tracks, title=args.title,
                               start_ms=args.start_ms, end_ms=args.end_ms, dpi=args.dpi,
                               window_us=window)
    except TraceError as e:
        print(f"prophet_tf.timeline: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
