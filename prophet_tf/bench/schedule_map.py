"""Where Prophet's blocks beat priority order and the published schedulers, and by how much: a
map made by the predictor.

    python -m prophet_tf.bench.schedule_map [--models resnet50,vgg16,bert_base]
        [--workers 2,4,8,16] [--bandwidth 1G,2.5G,10G,25G,100G] [--rtt 50us,200us,1ms,3ms,10ms]
        [--schedules prophet,priority,bytescheduler,p3] [--accelerator_tflops 100]
        [--out bench_out] [--prophet_options JSON]

This machine's kernel has no ``sch_netem``, so the emulated cluster cannot add delay; the
predictor (``prophet_tf.predict``: the runtime's own policies replayed over a model of the
links) can. For every model, worker count N, link rate and round-trip time it predicts the step
time of every schedule of ``--schedules`` (default ``prophet``, ``priority`` and the published
``bytescheduler`` and ``p3``, each with its own partitions and credit; ``fifo`` and ``mwms``, the
ring, on request; all but ``mwms`` crossing the barrier; the runtime's default options or
``--prophet_options``) and the ideal bound (docs/design.md, "The ideal bound"), and reports each
other schedule's step over prophet's (``priority / prophet``: above 1, Prophet's blocks are
faster) and prophet's step over the ideal. ``--bytescheduler_credits 1,2,4,8,16`` also predicts
``bytescheduler`` with each of those credits (millions of float32 parameters; ByteScheduler's
tuner searches 1-16 for a parameter server) and reports the best of them as
``bytescheduler_tuned``: what its auto-tuning could find at best.

The modelled cluster: each worker's step is the emulated accelerator's (``--accelerator_tflops``,
default 100 TFLOP/s; layer times from FLOPs, backward = 2 x forward, each layer's gradients ready
when its backward pass ends; :func:`prophet_tf.bench.emulated.emulated_profile`) with the
benchmark's per-worker batch; every host has one NIC limited to the link rate both ways; TCP over
Ethernet carries 1448 payload bytes per 1538 on the wire; a frame arrives one one-way latency
(RTT / 2) after its last byte left, so a sum comes back one RTT after its push was sent at the
earliest (``bytescheduler``'s credit waits for it); updates take no time. Not modelled: TCP's congestion window (the kernel's send window is
assumed to cover the bandwidth-delay product), the host CPU.

The layer specs are built once per model from the real Keras model (one TensorFlow process) and
kept in ``OUT/specs/`` (shared with ``python -m prophet_tf.bench.train --out OUT``). Outputs in
``OUT/schedule_map/``: ``map.md`` (a table per model: rows N x link rate, columns RTT), ``map.json``
(every prediction), ``map.png`` (a heat map of priority / prophet per model and N) and
``map_OTHER.png`` for each other schedule.

Every setting is also appended to ``OUT/schedule_map/points.jsonl`` as soon as it is predicted. A
map that was stopped keeps what it had, and running the same command again predicts only the
settings that are missing. The file's first line records what the points depend on: the options,
the accelerator, each model's emulated step and the predictor library's hash. A re-run that
differs in any of them starts the file over (``--noresume`` always does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
import time
from typing import Any, Optional, Sequence

__all__ = ["MapPoint", "PointLog", "map_points", "format_tables", "summary_lines", "plot", "main"]

DEFAULT_MODELS = ("resnet50", "vgg16", "bert_base")
DEFAULT_WORKERS = ("2", "4", "8", "16")
DEFAULT_BANDWIDTHS = ("1G", "2.5G", "10G", "25G", "100G")
DEFAULT_RTTS = ("50us", "200us", "1ms", "3ms", "10ms")
#: The schedules the map predicts by default; prophet is what the others are compared with.
SCHEDULES = ("prophet", "priority", "bytescheduler", "p3")
#: Every schedule a map may name (``mwms``: TensorFlow's ring, without barrier crossing).
KNOWN_SCHEDULES = ("prophet", "priority", "fifo", "bytescheduler", "p3", "mwms")
#: The best of the ``bytescheduler`` credits predicted (``--bytescheduler_credits``).
TUNED = "bytescheduler_tuned"
#: Prophet counts as faster (or slower) than another schedule beyond this relative difference.
MARGIN = 0.02
#: The ratio the summary counts settings at (the seed paper's claim, checked).
CLAIM = 1.2


def credit_key(millions: float) -> str:
    """The ``step_s`` key of ``bytescheduler`` with a credit of ``millions`` float32 parameters."""
    return f"bytescheduler[credit={millions:g}M]"


@dataclasses.dataclass
class MapPoint:
    """One setting of the map: the predicted step of each schedule (None: the simulated runtime
    deadlocked) and the ideal bound."""

    model: str
    workers: int
    bandwidth_bps: float
    rtt_s: float
    compute_s: float
    ideal_s: float
    step_s: dict[str, Optional[float]]

    @property
    def speedup(self) -> Optional[float]:
        """priority / prophet: above 1, Prophet's blocks are faster."""
        return self.ratio("priority")

    def ratio(self, other: str) -> Optional[float]:
        """``other``'s step over prophet's (above 1: prophet is faster); None when either
        deadlocked or was not predicted."""
        prophet, theirs = self.step_s.get("prophet"), self.step_s.get(other)
        return theirs / prophet if prophet and theirs else None

    def others(self) -> list[str]:
        """The schedules compared with prophet, in the order predicted (the credits searched
        for ``bytescheduler_tuned`` count as that one)."""
        return [s for s in self.step_s if s != "prophet" and not s.startswith("bytescheduler[")]

    def over_ideal(self, schedule: str) -> Optional[float]:
        s = self.step_s.get(schedule)
        return s / self.ideal_s if s and self.ideal_s > 0 else None

    @property
    def setting(self) -> tuple[str, int, float, float]:
        """(model, N, link rate, RTT): what the map predicts this point for."""
        return self.model, self.workers, self.bandwidth_bps, self.rtt_s

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["speedup_prophet_over_priority"] = self.speedup
        data["prophet_speedup"] = {s: self.ratio(s) for s in self.others()}
        data["over_ideal"] = {s: self.over_ideal(s) for s in self.step_s}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MapPoint":
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


class PointLog:
    """``points.jsonl``: a header line, then one predicted :class:`MapPoint` per line, appended
    (and flushed) as each is predicted. Opening it keeps the points of an earlier run when its
    header equals ``header`` and ``resume`` is set; otherwise the file starts over."""

    def __init__(self, path: str, header: dict[str, Any], resume: bool = True) -> None:
        self.path = path
        header = json.loads(json.dumps(header))  # as it reads back (tuples become lists)
        self.kept: list[MapPoint] = []
        self.why_not_kept = ""
        if resume and os.path.exists(path):
            self.kept, self.why_not_kept = self._read(path, header)
        elif os.path.exists(path):
            self.why_not_kept = "--noresume"
        self._lock = threading.Lock()
        self._file = open(path, "w")
        self._write({"header": header})
        for p in self.kept:
            self._write(p.to_json())

    @staticmethod
    def _read(path: str, header: dict[str, Any]) -> tuple[list[MapPoint], str]:
        with open(path) as f:
            lines = f.read().splitlines()
        try:
            first = json.loads(lines[0])["header"] if lines else None
        except (ValueError, KeyError, TypeError):
            first = None
        if first != header:
            changed = sorted(k for k in set(header) | set(first or {})
                             if (first or {}).get(k) != header.get(k))
            return [], f"it was predicted with another {', '.join(changed) or 'header'}"
        points = {}
        for line in lines[1:]:
            try:
                p = MapPoint.from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # the line being written when the run was stopped
            points[p.setting] = p
        return list(points.values()), ""

    def _write(self, data: dict[str, Any]) -> None:
        self._file.write(json.dumps(data) + "\n")
        self._file.flush()

    def add(self, point: MapPoint) -> None:
        """Appends ``point``; safe from several threads."""
        with self._lock:
            self._write(point.to_json())

    def close(self) -> None:
        self._file.close()


def map_points(profiles: dict[str, Any], workers: Sequence[int], bandwidths: Sequence[float],
               rtts: Sequence[float], options: Any, threads: int = 0,
               progress: Any = None, known: Sequence[MapPoint] = (),
               on_point: Any = None, schedules: Sequence[str] = SCHEDULES,
               bytescheduler_credits: Sequence[float] = ()) -> list[MapPoint]:
    """Predicts every (model, N, link rate, RTT) of the map; ``profiles``: model -> Profile,
    ``options``: the :class:`prophet_tf.predict.PredictOptions` apart from the latency,
    ``schedules``: what to predict (prophet first), ``bytescheduler_credits``: credits in
    millions of float32 parameters to predict ``bytescheduler`` with, the best of which becomes
    :data:`TUNED`. The simulations run on ``threads`` threads (0: one per core; ctypes releases
    the GIL). Settings of ``known`` are taken from there, not predicted again; ``on_point`` is
    called with each point as soon as it is predicted (from the simulation threads)."""
    from prophet_tf.predict import SimulatedDeadlock, ideal_bound, predict
    cells = [(m, n, bw, rtt) for m in profiles for n in workers for bw in bandwidths
             for rtt in rtts]
    known_points = {p.setting: p for p in known}
    runs = [(s, s, None) for s in schedules]
    runs += [(credit_key(c), "bytescheduler", int(round(c * 4e6))) for c in bytescheduler_credits]

    def one(cell: tuple[str, int, float, float]) -> MapPoint:
        model, n, bw, rtt = cell
        opts = dataclasses.replace(options, latency_s=rtt / 2)
        steps: dict[str, Optional[float]] = {}
        for key, schedule, credit in runs:
            run_opts = opts if credit is None else dataclasses.replace(opts, credit_bytes=credit)
            try:
                steps[key] = predict(profiles[model], workers=n, bandwidth_bps=bw,
                                     schedule=schedule, options=run_opts).step_s
            except SimulatedDeadlock:
                steps[key] = None
        if bytescheduler_credits:
            tried = [steps[credit_key(c)] for c in bytescheduler_credits]
            steps[TUNED] = min((t for t in tried if t), default=None)
        b = ideal_bound(profiles[model], workers=n, bandwidth_bps=bw, options=opts)
        point = MapPoint(model, n, bw, rtt, b.compute_s, b.step_s, steps)
        if on_point is not None:
            on_point(point)
        if progress is not None:
            progress(cell)
        return point

    todo = [c for c in cells if c not in known_points]
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        predicted = {p.setting: p for p in pool.map(one, todo)}
    return [known_points.get(c) or predicted[c] for c in cells]


def _rate(bps: float) -> str:
    from prophet_tf.predict.cli import format_rate
    return format_rate(bps)


def _duration(s: float) -> str:
    return f"{s * 1e3:g} ms" if s >= 1e-3 else f"{s * 1e6:g} us"


def format_tables(points: Sequence[MapPoint]) -> str:
    """Markdown, one table per model: a row per (N, link rate), a column per RTT; each cell is
    every other schedule's step over prophet's, in the order predicted (``priority /
    bytescheduler / p3``; bold when prophet is faster by more than :data:`MARGIN`) and, in
    parentheses, prophet's step over the ideal bound."""
    out = []
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model]
        rtts = sorted({p.rtt_s for p in mine})
        out.append(f"**{model}** (compute {mine[0].compute_s * 1e3:.1f} ms per step)\n")
        out.append("| N | link | " + " | ".join(f"RTT {_duration(r)}" for r in rtts) + " |")
        out.append("|---|---|" + "---|" * len(rtts))
        for n, bw in sorted({(p.workers, p.bandwidth_bps) for p in mine}):
            cells = []
            for r in rtts:
                p = next(q for q in mine if (q.workers, q.bandwidth_bps, q.rtt_s) == (n, bw, r))
                cells.append(_cell(p))
            out.append(f"| {n} | {_rate(bw)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _cell(p: MapPoint) -> str:
    stuck = [s for s, v in p.step_s.items() if v is None and not s.startswith("bytescheduler[")]
    if p.step_s.get("prophet") is None or not p.others():
        return "deadlock: " + ", ".join(stuck)
    texts = []
    for other in p.others():
        r = p.ratio(other)
        if r is None:
            texts.append(f"dl {other}")
        else:
            texts.append(f"**{r:.2f}**" if r > 1 + MARGIN else f"{r:.2f}")
    return " / ".join(texts) + f" ({p.over_ideal('prophet'):.2f})"


def summary_lines(points: Sequence[MapPoint]) -> list[str]:
    """What the map says, in a few lines per other schedule: how often and where Prophet is
    faster or slower beyond :data:`MARGIN`, the largest gains, the settings where it is at least
    :data:`CLAIM` x faster, and how far the schedules stay from the ideal."""
    stuck = [p for p in points
             if any(v is None for s, v in p.step_s.items() if not s.startswith("bytescheduler["))]
    lines = [f"{len(points)} settings, {len(stuck)} with a simulated deadlock"]
    others = list(dict.fromkeys(o for p in points for o in p.others()))
    for other in others:
        ok = [p for p in points if p.ratio(other) is not None]
        if not ok:
            continue
        faster = [p for p in ok if p.ratio(other) > 1 + MARGIN]
        slower = [p for p in ok if p.ratio(other) < 1 - MARGIN]
        lines.append(f"prophet faster than {other} by more than {MARGIN:.0%}: {len(faster)} of "
                     f"{len(ok)}; slower by more than {MARGIN:.0%}: {len(slower)}; within: "
                     f"{len(ok) - len(faster) - len(slower)}")
        for p in sorted(ok, key=lambda q: -q.ratio(other))[:5]:
            lines.append(f"  largest gain {p.ratio(other):.2f}x: {p.model}, N={p.workers}, "
                         f"{_rate(p.bandwidth_bps)}, RTT {_duration(p.rtt_s)} (prophet "
                         f"{p.over_ideal('prophet'):.2f}, {other} {p.over_ideal(other):.2f} x "
                         "the ideal)")
        for p in sorted(ok, key=lambda q: q.ratio(other))[:3]:
            if p.ratio(other) < 1 - MARGIN:
                lines.append(f"  largest loss {p.ratio(other):.2f}x: {p.model}, N={p.workers}, "
                             f"{_rate(p.bandwidth_bps)}, RTT {_duration(p.rtt_s)}")
        claim = [p for p in ok if p.ratio(other) >= CLAIM]
        if claim:
            where = {}
            for p in claim:
                where.setdefault((p.model, p.workers), []).append(p)
            lines.append(f"  prophet at least {CLAIM:g}x faster than {other} in {len(claim)} "
                         "settings: " + "; ".join(
                             f"{m} N={n} ({len(ps)})" for (m, n), ps in sorted(where.items())))
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model and p.step_s.get("prophet")]
        best = [min(v for v in (p.over_ideal(s) for s in ["prophet", *p.others()]) if v)
                for p in mine]
        if best:
            lines.append(f"{model}: the best schedule within 1.05x of the ideal in "
                         f"{sum(b <= 1.05 for b in best)} of {len(mine)} settings (median "
                         f"{sorted(best)[len(best) // 2]:.2f}x, worst {max(best):.2f}x)")
    return lines


def plot(points: Sequence[MapPoint], path: str, title: str = "", other: str = "priority") -> None:
    """Heat maps of ``other`` / prophet: a row of panels per model, a panel per N; link rate
    against RTT, red where Prophet is faster, blue where ``other`` is."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    models = list(dict.fromkeys(p.model for p in points))
    workers = sorted({p.workers for p in points})
    rtts = sorted({p.rtt_s for p in points})
    bws = sorted({p.bandwidth_bps for p in points})
    # Colours by log2 of the ratio, so that 2x faster and 2x slower are equally far from white.
    values = [p.ratio(other) for p in points if p.ratio(other) is not None]
    spread = max([abs(math.log2(v)) for v in values] + [math.log2(1.1)])
    norm = TwoSlopeNorm(vmin=-spread, vcenter=0.0, vmax=spread)
    fig, axes = plt.subplots(len(models), len(workers), squeeze=False,
                             figsize=(2.9 * len(workers) + 1, 2.5 * len(models) + 0.8))
    image = None
    for i, model in enumerate(models):
        for j, n in enumerate(workers):
            ax = axes[i][j]
            grid = [[math.nan] * len(rtts) for _ in bws]
            for p in points:
                if p.model == model and p.workers == n and p.ratio(other) is not None:
                    grid[bws.index(p.bandwidth_bps)][rtts.index(p.rtt_s)] = p.ratio(other)
            image = ax.imshow([[math.log2(v) for v in row] for row in grid], origin="lower",
                              cmap="RdBu_r", norm=norm, aspect="auto")
            for y, row in enumerate(grid):
                for x, v in enumerate(row):
                    dark = not math.isnan(v) and abs(math.log2(v)) > 0.6 * spread
                    ax.text(x, y, "dl" if math.isnan(v) else f"{v:.2f}", ha="center",
                            va="center", fontsize=6.5, color="white" if dark else "black")
            ax.set_xticks(range(len(rtts)))
            ax.set_xticklabels([_duration(r).replace(" ", "") for r in rtts], fontsize=6.5)
            ax.set_yticks(range(len(bws)))
            ax.set_yticklabels([_rate(b).replace(" ", "").replace("bit/s", "")
                                for b in bws], fontsize=6.5)
            ax.set_title(f"{model}, N={n}", fontsize=8)
            if i == len(models) - 1:
                ax.set_xlabel("round trip", fontsize=7)
            if j == 0:
                ax.set_ylabel("link", fontsize=7)
    if image is not None:
        bar = fig.colorbar(image, ax=axes, shrink=0.6,
                           label=f"{other} / prophet step (>1: prophet faster)")
        ticks = [t for t in range(-4, 5) if abs(t) <= spread] or [0]
        bar.set_ticks(ticks)
        bar.set_ticklabels([f"{2.0 ** t:g}" for t in ticks])
    fig.suptitle(title or f"predicted step time, {other} / prophet (dl: a schedule deadlocked)",
                 fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def emulated_profiles(models: Sequence[str], out: str, tflops: float, batch: Optional[int]) -> dict:
    """model -> the emulated step (layer specs built once per model and kept in OUT/specs)."""
    from prophet_tf.bench import emulated
    from prophet_tf.bench import models as models_mod
    from prophet_tf.bench.train import default_batch, spec_path
    profiles = {}
    for model in models:
        cfg = models_mod.config_for(model, "emulated")
        path = spec_path(out, model, cfg)
        t0 = time.monotonic()
        specs = emulated.load_or_make_specs(path, lambda: models_mod.build_model(cfg))
        b = batch or default_batch(model, "emulated")
        profiles[model] = emulated.emulated_profile(specs, b, tflops, 1.0, source=f"{model} "
                                                    f"(emulated, batch {b}, {tflops:g} TFLOP/s)")
        p = profiles[model]
        print(f"{model}: {len(p.layers)} layers, {len(p.tensors)} gradients "
              f"({p.gradient_bytes / 1e6:.1f} MB), {p.step_s * 1e3:.1f} ms of compute per step "
              f"at batch {b} ({time.monotonic() - t0:.0f} s)", flush=True)
    return profiles


def _header(options: Any, profiles: dict[str, Any], flags_: Any) -> dict[str, Any]:
    """What a map's points depend on apart from their setting (PointLog's header)."""
    from prophet_tf._library import library_path
    with open(library_path("_prophet_predict.so"), "rb") as f:
        library = hashlib.sha256(f.read()).hexdigest()
    return {"options": dataclasses.asdict(options), "schedules": list(flags_.schedules),
            "bytescheduler_credits": [float(c) for c in flags_.bytescheduler_credits],
            "accelerator_tflops": flags_.accelerator_tflops, "batch": flags_.batch,
            "profiles": {m: [p.source, p.step_s, p.gradient_bytes, len(p.tensors)]
                         for m, p in profiles.items()},
            "predictor_library_sha256": library}


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_list("models", list(DEFAULT_MODELS), "Models (prophet_tf/bench/models.py).")
    flags.DEFINE_list("workers", list(DEFAULT_WORKERS), "Worker counts.")
    flags.DEFINE_list("bandwidth", list(DEFAULT_BANDWIDTHS), "Link rates per host and direction.")
    flags.DEFINE_list("rtt", list(DEFAULT_RTTS), "Round-trip times (one-way latency = RTT / 2).")
    flags.DEFINE_list("schedules", list(SCHEDULES), "Schedules to predict, prophet first "
                      f"({', '.join(KNOWN_SCHEDULES)}; mwms is TensorFlow's ring).")
    flags.DEFINE_list("bytescheduler_credits", [], "Also predict bytescheduler with each of these "
                      "credits (millions of float32 parameters; its tuner searches 1-16 for a "
                      f"parameter server) and report the best as {TUNED}.")
    flags.DEFINE_float("accelerator_tflops", 100.0, "The emulated accelerator's TFLOP/s.")
    flags.DEFINE_integer("batch", None, "Per-worker batch (default: the training benchmark's).")
    flags.DEFINE_string("prophet_options", "{}", "JSON of runtime options for both schedules "
                        "(those the predictor models: prophet_tf._options.predicted_options()).")
    flags.DEFINE_integer("steps", 10, "Measured simulated steps per setting (median).")
    flags.DEFINE_integer("warmup", 5, "Simulated steps before those.")
    flags.DEFINE_integer("threads", 0, "Simulations at once (0: one per core).")
    flags.DEFINE_string("out", "bench_out", "Output directory (the map goes to OUT/schedule_map).")
    flags.DEFINE_bool("resume", True, "Keep the settings OUT/schedule_map/points.jsonl already "
                      "has when it was made with the same options, profiles and predictor.")


def check_models(models: Sequence[str]) -> None:
    """Raises ``ValueError`` naming the models of ``models`` the benchmarks do not have."""
    from prophet_tf.bench.models import MODEL_NAMES
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; choose from {', '.join(MODEL_NAMES)}")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags

    from prophet_tf._options import predicted_options
    from prophet_tf.predict import PredictOptions
    from prophet_tf.predict.cli import parse_duration, parse_rate
    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    try:
        check_models(FLAGS.models)
        workers = [int(w) for w in FLAGS.workers]
        if any(n < 2 for n in workers):
            raise ValueError(f"--workers must be at least 2, got {FLAGS.workers}")
        bandwidths = [parse_rate(b) for b in FLAGS.bandwidth]
        rtts = [parse_duration(r) for r in FLAGS.rtt]
        schedules = list(FLAGS.schedules)
        if not schedules or schedules[0] != "prophet" or len(set(schedules)) != len(schedules):
            raise ValueError(f"--schedules must start with prophet and name each schedule once, "
                             f"got {FLAGS.schedules}")
        bad = [x for x in schedules if x not in KNOWN_SCHEDULES]
        if bad:
            raise ValueError(f"--schedules: unknown {bad}; choose from {', '.join(KNOWN_SCHEDULES)}")
        credits = [float(c) for c in FLAGS.bytescheduler_credits]
        if any(not c > 0 for c in credits):
            raise ValueError(f"--bytescheduler_credits must be positive, got {credits}")
        runtime = json.loads(FLAGS.prophet_options or "{}")
        if not isinstance(runtime, dict):
            raise ValueError("--prophet_options must be a JSON object")
        options = PredictOptions(steps=FLAGS.steps, warmup_steps=FLAGS.warmup)
        for key, value in runtime.items():
            if key not in predicted_options():
                raise ValueError(f"--prophet_options: {key!r} is not modelled by the predictor "
                                 f"(it models {', '.join(predicted_options())})")
            setattr(options, key, value)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = os.path.join(FLAGS.out, "schedule_map")
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    profiles = emulated_profiles(FLAGS.models, FLAGS.out, FLAGS.accelerator_tflops, FLAGS.batch)
    log = PointLog(os.path.join(out, "points.jsonl"), _header(options, profiles, FLAGS),
                   FLAGS.resume)
    if log.kept:
        print(f"resuming: {len(log.kept)} settings already predicted in {log.path}", flush=True)
    elif log.why_not_kept:
        print(f"starting {log.path} over: {log.why_not_kept}", flush=True)
    total = len(profiles) * len(workers) * len(bandwidths) * len(rtts)
    wanted = {(m, n, bw, r) for m in profiles for n in workers for bw in bandwidths for r in rtts}
    done = [sum(p.setting in wanted for p in log.kept)]

    def progress(cell: tuple) -> None:
        done[0] += 1
        if done[0] % max(1, total // 20) == 0 or done[0] == total:
            print(f"  {done[0]}/{total} settings predicted ({time.monotonic() - t0:.0f} s)",
                  flush=True)

    print(f"predicting {total} settings x {len(schedules) + len(credits)} schedules (+ the ideal "
          "bound) ...", flush=True)
    try:
        points = map_points(profiles, workers, bandwidths, rtts, options, FLAGS.threads, progress,
                            known=log.kept, on_point=log.add, schedules=schedules,
                            bytescheduler_credits=credits)
    finally:
        log.close()
    tables = format_tables(points)
    summary = summary_lines(points)
    command = " ".join(["python -m prophet_tf.bench.schedule_map", *sys.argv[1:]])
    with open(os.path.join(out, "map.md"), "w") as f:
        others = [x for x in points[0].others()] if points else []
        f.write(f"# {' / '.join(others)} over prophet, predicted ({command})\n\nEach cell: the "
                f"step of {', '.join(others)} over prophet's, in that order (bold: prophet faster "
                f"by more than {MARGIN:.0%}) and, in parentheses, prophet's step over the ideal "
                "bound.\n\n" + tables + "\n" + "\n".join(summary) + "\n")
    with open(os.path.join(out, "map.json"), "w") as f:
        json.dump({"command": command, "options": dataclasses.asdict(options),
                   "points": [p.to_json() for p in points], "summary": summary}, f, indent=1)
    for other in (points[0].others() if points else []):
        plot(points, os.path.join(out, "map.png" if other == "priority" else f"map_{other}.png"),
             other=other)
    print()
    print(tables)
    print("\n".join(summary))
    print(f"\ndone in {time.monotonic() - t0:.0f} s; {out}/ (map.md, map.json, map.png)")
    return 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
