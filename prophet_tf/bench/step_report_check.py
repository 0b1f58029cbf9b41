"""The step report against the emulated accelerator: does "waiting for gradients" say the truth?

    python -m prophet_tf.bench.train --compute emulated --systems prophet,prophet_nocross \\
        --timeline DIR ...
    python -m prophet_tf.bench.step_report_check DIR/*.json [--skip 4]

With ``--compute emulated`` the emulated accelerator is a worker's only compute and its trace has
every layer's "forward" and "backward" span, so what the step report estimates can be measured:

* in the forward pass (a step's start to its last forward span), the accelerator's idle time is
  the stall, whatever caused it: compare the report's gate wait with it;
* after the backward pass (its last span to the step's end) the step only waits: compare the
  report's barrier wait with it.

Both truths also contain what no network would remove: the CPU that TensorFlow needs to start the
next operation, on a loaded machine (the report should stay below them by about that). Per trace,
per step after ``--skip``, and the medians; the last line reads ``step report vs emulated
accelerator: median |gate wait - forward idle| X ms, median |barrier wait - idle after the
backward pass| Y ms``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Optional, Sequence

from absl import app, flags

from prophet_tf import timeline
from prophet_tf._keras.step_report import TIMELINE_TRACK, parse_timeline_label

FLAGS = flags.FLAGS
flags.DEFINE_integer("skip", 4, "Steps left out at the start of every trace (tracing, warm-up).")

# An instant belongs to the step it follows by at most this much (it is added at the step's end).
_INSTANT_SLACK_US = 50_000


def _busy_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def check(path: str, skip: int) -> list[dict]:
    """One row per step of the trace at ``path`` that has the report's instant and spans."""
    tracks = timeline.events_by_track(timeline.load_trace(path))

    def spans(track: str) -> list[tuple[float, float]]:
        return [(e["ts"], e["ts"] + e["dur"]) for e in tracks.get(track, []) if e.get("ph") == "X"]

    forward, backward = spans("forward"), spans("backward")
    reports = sorted((e["ts"], e["name"]) for e in tracks.get(TIMELINE_TRACK, []))
    rows = []
    for index, (start, end) in enumerate(sorted(spans("step"))):
        if index < skip:
            continue
        fw = [s for s in forward if start <= s[0] < end]
        bw = [s for s in backward if start <= s[0] < end]
        figures = [parse_timeline_label(name) for ts, name in reports
                   if end - 1_000 <= ts <= end + _INSTANT_SLACK_US]
        figures = [f for f in figures if f is not None]
        if not fw or not bw or not figures:
            continue
        forward_end = max(b for _, b in fw)
        rows.append({
            "step": index,
            "step_ms": (end - start) / 1e3,
            "forward_idle_ms": ((forward_end - start) - _busy_us(fw)) / 1e3,
            "tail_idle_ms": (end - max(b for _, b in bw)) / 1e3,
            "gate_wait_ms": figures[0].gate_wait_ms,
            "gate_bounds_ms": figures[0].gate_wait_bounds_ms,
            "barrier_wait_ms": figures[0].barrier_wait_ms,
        })
    return rows


def _median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def main(argv: Sequence[str]) -> int:
    paths = argv[1:]
    if not paths:
        sys.stderr.write("give the traces of a `bench.train --compute emulated --timeline DIR` run\n")
        return 2
    gate_errors, barrier_errors = [], []
    for path in paths:
        rows = check(path, FLAGS.skip)
        print(f"{path}: {len(rows)} steps")
        for r in rows:
            lower, upper = r["gate_bounds_ms"]
            print(f"  step {r['step']:3d} {r['step_ms']:7.0f} ms: gates {r['gate_wait_ms']:6.0f} ms "
                  f"[{lower:.0f}, {upper:.0f}] vs forward idle {r['forward_idle_ms']:6.0f} ms; barrier "
                  f"{r['barrier_wait_ms']:6.0f} ms vs idle after the backward pass "
                  f"{r['tail_idle_ms']:6.0f} ms")
        if rows:
            print("  median: step {:.0f} ms, gates {:.0f} ms vs forward idle {:.0f} ms, barrier {:.0f} ms "
                  "vs idle after the backward pass {:.0f} ms".format(
                      *(_median([r[k] for r in rows]) for k in
                        ("step_ms", "gate_wait_ms", "forward_idle_ms", "barrier_wait_ms", "tail_idle_ms"))))
        gate_errors += [abs(r["gate_wait_ms"] - r["forward_idle_ms"]) for r in rows]
        barrier_errors += [abs(r["barrier_wait_ms"] - r["tail_idle_ms"]) for r in rows]
    if not gate_errors:
        print("no step with the step report's figures and the emulated accelerator's spans")
        return 1
    print(f"step report vs emulated accelerator: median |gate wait - forward idle| "
          f"{_median(gate_errors):.0f} ms, median |barrier wait - idle after the backward pass| "
          f"{_median(barrier_errors):.0f} ms ({len(gate_errors)} steps)")
    return 0


if __name__ == "__main__":
    app.run(main)
