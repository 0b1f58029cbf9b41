"""Predicted scaling to 256 workers: step time and scaling efficiency per model, link and schedule.

    python -m prophet_tf.bench.scaling [--out bench_out] [--models resnet50,vgg16,bert_base]
        [--bandwidth 10G,25G,100G] [--workers 2,4,8,16,32,64,128,256]
        [--schedules prophet,priority,fifo,mwms] [--accelerator_tflops 100]
        [--workers_per_host 1] [--hierarchical] [--costs costs.json [--cost_scale F]
        [--io_threads auto|T]]

PREDICTIONS ONLY: nothing here runs on a network. Every setting is predicted by
``prophet_tf.predict`` (the runtime's own policies replayed over a model of the links) from the
emulated benchmark's step of each model on the modelled accelerator itself (time scale 1:
``--accelerator_tflops``, default 100 TFLOP/s, layer times from FLOPs, backward = 2 x forward,
each layer's gradients ready when its backward pass ends, the training benchmark's per-worker
batch, updates free; :func:`prophet_tf.bench.emulated.emulated_profile`), so the step times are
those of real accelerators, not of this machine's emulation. Each worker has a host of its own
(``--workers_per_host`` places several on one host, where the runtime's default
``hierarchical="auto"`` takes the faster of the two-level and the flat path; ``--hierarchical``
predicts the flat path under each schedule's name and the two-level path beside it) whose NIC carries the link rate both
ways, 1448 payload bytes per 1538 on the wire.

``--costs`` (``python -m prophet_tf.predict calibrate --out FILE``) charges each worker's CPU:
per frame and per byte (socket copies, sums, casts, fusion's copies) on its runtime's I/O
threads, the ring's (``mwms``) alike; ``--cost_scale`` multiplies every cost (a stated faster or
slower machine than the calibrated one). ``--io_threads`` gives each worker that many I/O threads,
or ``auto``: the fewest that keep pace with the link (:func:`io_threads_for`); each cell then
also gives worker 0's I/O work per step (``io`` in the JSON).

Scaling efficiency = throughput at N / (N x one worker's throughput) = one worker's step / the
step at N. The ideal bound (docs/design.md) is the best step any schedule could reach; its
efficiency is the ceiling. Outputs in ``OUT/scaling/``: ``scaling.md`` (a table per model and the
settings where a schedule falls below 90% efficiency, or behind the ring), ``scaling.json``,
``scaling.png`` (efficiency against N). ``--merge DIR,...`` joins earlier runs (e.g. one per
model, run apart) into one table and chart without predicting again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Optional, Sequence

from prophet_tf import _link_probe

__all__ = ["ScalingPoint", "io_threads_for", "scaling_points", "format_tables", "shortfalls",
           "load_points", "plot", "main"]

DEFAULT_MODELS = ("resnet50", "vgg16", "bert_base")
DEFAULT_BANDWIDTHS = ("10G", "25G", "100G")
DEFAULT_WORKERS = ("2", "4", "8", "16", "32", "64", "128", "256")
DEFAULT_SCHEDULES = ("prophet", "priority", "fifo", "mwms")
#: The issue's goal: at least this efficiency wherever the ideal bound allows it.
EFFICIENCY_GOAL = 0.9
HIERARCHICAL_SUFFIX = " 2-level"


@dataclasses.dataclass
class ScalingPoint:
    """One (model, link, N): each schedule's predicted step (None: a simulated deadlock), one
    worker's step and the ideal bound."""

    model: str
    bandwidth_bps: float
    workers: int
    single_s: float
    ideal_s: float
    step_s: dict[str, Optional[float]]
    cpu_s: float = 0.0
    io_busy_s: dict[str, Optional[float]] = dataclasses.field(default_factory=dict)
    io_threads: int = 1

    def efficiency(self, schedule: str) -> Optional[float]:
        s = self.step_s.get(schedule)
        return self.single_s / s if s else None

    @property
    def ideal_efficiency(self) -> float:
        return self.single_s / self.ideal_s if self.ideal_s > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["efficiency"] = {s: self.efficiency(s) for s in self.step_s}
        data["ideal_efficiency"] = self.ideal_efficiency
        return data


def io_threads_for(link_bps: float, options: Any) -> int:
    """The fewest I/O threads whose charged CPU keeps pace with a link of ``link_bps`` per
    direction under ``options``' costs, by the runtime's own rule (io_threads auto,
    :func:`prophet_tf._link_probe.lanes_for`): each byte a worker sends costs its sending,
    receiving as much, and adding about half of that (the pushes it owns); at most the lanes
    auto connects."""
    from prophet_tf._library import runtime_constants

    per_byte = options.send_byte_s + options.receive_byte_s + options.sum_byte_s / 2
    return _link_probe.lanes_for(link_bps / 8, per_byte, int(runtime_constants()["auto_lanes"]))


def scaling_points(profiles: dict[str, Any], bandwidths: Sequence[float], workers: Sequence[int],
                   schedules: Sequence[str], options: Any, hierarchical: bool = False,
                   threads: int = 0, progress: Any = None,
                   io_threads: Optional[int] = 1) -> list[ScalingPoint]:
    """Predicts every (model, link, N) for every schedule as the runtime runs it by default (with
    ``hierarchical``: the flat path, and the two-level path of each runtime schedule beside it,
    named ``"<schedule> 2-level"``). ``io_threads``:
    I/O threads per worker, None: :func:`io_threads_for` each link."""
    from prophet_tf.predict import SimulatedDeadlock, ideal_bound, predict
    two_level = dataclasses.replace(options, hierarchical=True)
    # Side by side, the schedule's own name is the flat path; alone, the runtime's default.
    flat = dataclasses.replace(options, hierarchical=False) if hierarchical else options
    variants = [(s, flat) for s in schedules]
    if hierarchical:
        variants += [(s + HIERARCHICAL_SUFFIX, two_level) for s in schedules if s != "mwms"]
    # One job per simulation, the largest N first, so that both cores stay busy to the end.
    jobs = [(m, bw, n, name, opts) for n in sorted(workers, reverse=True) for m in profiles
            for bw in bandwidths for name, opts in variants]

    def threads_for(bw: float) -> int:
        return io_threads if io_threads is not None else io_threads_for(bw, options)

    def one(job: tuple) -> tuple[tuple, Optional[float], Optional[float], float]:
        model, bw, n, name, opts = job
        schedule = name[:-len(HIERARCHICAL_SUFFIX)] if name.endswith(HIERARCHICAL_SUFFIX) else name
        t0 = time.thread_time()
        try:
            p = predict(profiles[model], workers=n, bandwidth_bps=bw, schedule=schedule,
                        options=dataclasses.replace(opts, io_threads=threads_for(bw)))
            step, io = p.step_s, p.io_busy_s
        except SimulatedDeadlock:
            step, io = None, None
        if progress is not None:
            progress(job)
        return job, step, io, time.thread_time() - t0

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads or os.cpu_count() or 1) as pool:
        results = list(pool.map(one, jobs))
    points: dict[tuple, ScalingPoint] = {}
    for (model, bw, n, name, _), step, io, cpu in results:
        key = (model, bw, n)
        if key not in points:
            p = profiles[model]
            bound = ideal_bound(p, workers=n, bandwidth_bps=bw, options=options)
            points[key] = ScalingPoint(model, bw, n, p.step_s, bound.step_s, {},
                                       io_threads=threads_for(bw))
        points[key].step_s[name] = step
        points[key].io_busy_s[name] = io
        points[key].cpu_s += cpu
    return sorted(points.values(), key=lambda q: (list(profiles).index(q.model), q.bandwidth_bps,
                                                   q.workers))


def _rate(bps: float) -> str:
    from prophet_tf.predict.cli import format_rate
    return format_rate(bps)


def format_tables(points: Sequence[ScalingPoint], names: Sequence[str]) -> str:
    """Markdown, one table per model: a row per (link, N), a column per schedule with the
    predicted step and, in parentheses, the scaling efficiency; last the ideal bound."""
    out = []
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model]
        out.append(f"**{model}** (one worker: {mine[0].single_s * 1e3:.1f} ms per step)\n")
        threads = any(p.io_threads != 1 for p in mine)
        out.append("| link | N | " + ("I/O threads | " if threads else "") + " | ".join(names)
                   + " | ideal |")
        out.append("|---|---|" + ("---|" if threads else "") + "---|" * (len(names) + 1))
        for p in mine:
            cells = []
            for name in names:
                s, e = p.step_s.get(name), p.efficiency(name)
                cells.append("deadlock" if s is None else f"{s * 1e3:.1f} ({100 * e:.0f}%)")
            cells.append(f"{p.ideal_s * 1e3:.1f} ({100 * p.ideal_efficiency:.0f}%)")
            out.append(f"| {_rate(p.bandwidth_bps)} | {p.workers} | "
                       + (f"{p.io_threads} | " if threads else "") + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _grouped(items: Sequence[tuple[ScalingPoint, float]], unit: str) -> str:
    """``model link: N=a (x), N=b (y)`` per (model, link), for the compact shortfall lines."""
    groups: dict[tuple[str, float], list[str]] = {}
    for p, value in items:
        groups.setdefault((p.model, p.bandwidth_bps), []).append(f"{p.workers} ({value:{unit}})")
    return "; ".join(f"{m} {_rate(bw)}: N = " + ", ".join(v) for (m, bw), v in groups.items())


def shortfalls(points: Sequence[ScalingPoint], names: Sequence[str]) -> list[str]:
    """Where each runtime schedule falls short, in lines: below :data:`EFFICIENCY_GOAL` where
    the ideal bound reaches it (the issue's goal); more than 1 / :data:`EFFICIENCY_GOAL` times the
    ideal bound's step (below 90% of what any schedule could reach); slower than the ring."""
    lines = []
    for name in names:
        if name == "mwms":
            continue
        below, far, behind, stuck = [], [], [], []
        for p in points:
            s, e = p.step_s.get(name), p.efficiency(name)
            if s is None:
                stuck.append(f"{p.model} {_rate(p.bandwidth_bps)} N={p.workers}")
                continue
            if e < EFFICIENCY_GOAL <= p.ideal_efficiency:
                below.append((p, 100 * e))
            if s * EFFICIENCY_GOAL > p.ideal_s:
                far.append((p, s / p.ideal_s))
            ring = p.step_s.get("mwms")
            if ring and s > ring * 1.01:
                behind.append((p, s / ring))
        lines.append(f"{name}: below {EFFICIENCY_GOAL:.0%} efficiency where the ideal bound "
                     f"reaches it: {len(below)} settings" +
                     (" (efficiency %): " + _grouped(below, ".0f") if below else ""))
        lines.append(f"{name}: step more than {1 / EFFICIENCY_GOAL:.2f}x the ideal bound: "
                     f"{len(far)} settings" + (" (x the ideal): " + _grouped(far, ".2f") if far else ""))
        lines.append(f"{name}: slower than the ring (mwms) by more than 1%: {len(behind)} settings" +
                     (" (x the ring): " + _grouped(behind, ".2f") if behind else ""))
        if stuck:
            lines.append(f"{name}: simulated deadlock: " + "; ".join(stuck))
    return lines


def load_points(path: str) -> list[ScalingPoint]:
    """The points a run wrote to ``OUT/scaling/scaling.json``."""
    with open(path) as f:
        data = json.load(f)
    fields = {f.name for f in dataclasses.fields(ScalingPoint)}
    return [ScalingPoint(**{k: v for k, v in p.items() if k in fields}) for p in data["points"]]


def plot(points: Sequence[ScalingPoint], names: Sequence[str], path: str) -> None:
    """Scaling efficiency against N: a panel per model and link, a line per schedule, the ideal
    bound dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(p.model for p in points))
    bws = sorted({p.bandwidth_bps for p in points})
    fig, axes = plt.subplots(len(models), len(bws), squeeze=False, sharex=True, sharey=True,
                             figsize=(3.6 * len(bws) + 0.5, 2.6 * len(models) + 0.8))
    cmap = plt.get_cmap("tab10")
    for i, model in enumerate(models):
        for j, bw in enumerate(bws):
            ax = axes[i][j]
            mine = sorted((p for p in points if p.model == model and p.bandwidth_bps == bw),
                          key=lambda p: p.workers)
            xs = [p.workers for p in mine]
            for k, name in enumerate(names):
                ys = [p.efficiency(name) for p in mine]
                ax.plot(xs, [math.nan if y is None else 100 * y for y in ys], marker="o",
                        markersize=2.5, color=cmap(k % 10), label=name,
                        linestyle=":" if name.endswith(HIERARCHICAL_SUFFIX) else "-")
            ax.plot(xs, [100 * p.ideal_efficiency for p in mine], color="black", linestyle="--",
                    linewidth=0.8, label="ideal bound")
            ax.axhline(100 * EFFICIENCY_GOAL, color="#999999", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 105)
            ax.set_title(f"{model}, {_rate(bw)}", fontsize=8)
            ax.grid(color="#dddddd", linewidth=0.5)
            if i == len(models) - 1:
                ax.set_xlabel("workers", fontsize=7)
            if j == 0:
                ax.set_ylabel("scaling efficiency %", fontsize=7)
    axes[0][-1].legend(fontsize=6)
    fig.suptitle("PREDICTED scaling efficiency (throughput at N / N x one worker); no multi-host "
                 "run", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_list("models", list(DEFAULT_MODELS), "Models (prophet_tf/bench/models.py).")
    flags.DEFINE_list("bandwidth", list(DEFAULT_BANDWIDTHS), "Link rates per host and direction.")
    flags.DEFINE_list("workers", list(DEFAULT_WORKERS), "Worker counts.")
    flags.DEFINE_list("schedules", list(DEFAULT_SCHEDULES), "Schedules (prophet_tf.predict).")
    flags.DEFINE_float("accelerator_tflops", 100.0, "The modelled accelerator's TFLOP/s.")
    flags.DEFINE_integer("workers_per_host", 1, "Workers per host (sharing its NIC).")
    flags.DEFINE_bool("hierarchical", False, "Predict the flat path (hierarchical='off') under "
                      "each schedule's name and the two-level path ('on') beside it; unset: the "
                      "runtime's default, auto.")
    flags.DEFINE_string("fusion", "auto", "Fusion of small gradients (ProphetStrategy's fusion): "
                        "auto (the default), off or a bucket size in bytes.")
    flags.DEFINE_string("costs", None, "Charge the CPU costs of this file (python -m "
                        "prophet_tf.predict calibrate --out FILE) on every worker, the ring's too.")
    flags.DEFINE_float("cost_scale", 1.0, "Multiplies every cost of --costs.")
    flags.DEFINE_string("io_threads", "1", "I/O threads per worker, or auto: the fewest whose "
                        "charged CPU keeps pace with the link.")
    flags.DEFINE_integer("steps", 5, "Measured simulated steps per setting (median).")
    flags.DEFINE_integer("warmup", 4, "Simulated steps before those (Prophet plans after two).")
    flags.DEFINE_integer("threads", 0, "Simulations at once (0: one per core).")
    flags.DEFINE_string("out", "bench_out", "Output directory (tables go to OUT/scaling).")
    flags.DEFINE_list("merge", [], "Instead of predicting, join the scaling.json of these earlier "
                      "runs (e.g. one per model, run apart) into one table and chart in OUT.")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags

    from prophet_tf.bench.schedule_map import check_models, emulated_profiles
    from prophet_tf.predict import SCHEDULES, PredictOptions
    from prophet_tf.predict.cli import parse_fusion, parse_rate
    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    try:
        check_models(FLAGS.models)
        bad = [s for s in FLAGS.schedules if s not in SCHEDULES]
        if bad:
            raise ValueError(f"unknown schedule(s) {bad}; choose from {', '.join(SCHEDULES)}")
        workers = [int(w) for w in FLAGS.workers]
        k = FLAGS.workers_per_host
        if k < 1 or any(n < 2 or n % k for n in workers):
            raise ValueError(f"--workers must be at least 2 and multiples of --workers_per_host "
                             f"({k}), got {FLAGS.workers}")
        bandwidths = [parse_rate(b) for b in FLAGS.bandwidth]
        fusion_bytes = parse_fusion(FLAGS.fusion)
        costs = None
        if FLAGS.costs:
            from prophet_tf.predict.costs import load_costs
            costs = load_costs(FLAGS.costs)
        io_threads = None if FLAGS.io_threads == "auto" else int(FLAGS.io_threads)
        if io_threads is not None and io_threads < 1:
            raise ValueError(f"--io_threads must be auto or at least 1, got {FLAGS.io_threads}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = os.path.join(FLAGS.out, "scaling")
    os.makedirs(out, exist_ok=True)
    if FLAGS.merge:
        return _merge(FLAGS.merge, out)
    t0 = time.monotonic()
    profiles = emulated_profiles(FLAGS.models, FLAGS.out, FLAGS.accelerator_tflops, None)
    from prophet_tf.predict.costs import apply_costs, describe
    options = apply_costs(PredictOptions(steps=FLAGS.steps, warmup_steps=FLAGS.warmup,
                                         workers_per_host=k, fusion_bytes=fusion_bytes),
                          costs, FLAGS.cost_scale)
    names = list(FLAGS.schedules) + ([s + HIERARCHICAL_SUFFIX for s in FLAGS.schedules
                                      if s != "mwms"] if FLAGS.hierarchical else [])
    total = len(profiles) * len(bandwidths) * len(workers) * len(names)
    done = [0]

    def progress(job: tuple) -> None:
        done[0] += 1
        if done[0] % max(1, total // 10) == 0 or done[0] == total:
            print(f"  {done[0]}/{total} simulations ({time.monotonic() - t0:.0f} s)", flush=True)

    print(f"predicting {total} simulations ...", flush=True)
    points = scaling_points(profiles, bandwidths, workers, FLAGS.schedules, options,
                            FLAGS.hierarchical, FLAGS.threads, progress, io_threads)
    wall = time.monotonic() - t0
    tables = format_tables(points, names)
    lines = shortfalls(points, names)
    command = " ".join(["python -m prophet_tf.bench.scaling", *sys.argv[1:]])
    placement = (f"{k} workers per host" if k > 1 else "one worker per host")
    placement += f", fusion {FLAGS.fusion}"
    if costs:
        placement += (f", CPU charged ({describe(costs)}; x {FLAGS.cost_scale:g}), I/O threads "
                      + ("per link: " + ", ".join(f"{_rate(bw)} {io_threads_for(bw, options)}"
                                                  for bw in bandwidths)
                         if io_threads is None else str(io_threads)))
    else:
        placement += ", CPU not charged"
    header = (f"# Predicted scaling ({command})\n\nPREDICTIONS, not measurements: {placement}, "
              f"{FLAGS.accelerator_tflops:g} TFLOP/s accelerators, {FLAGS.warmup} + {FLAGS.steps} "
              "simulated steps. Each cell: predicted step ms and, in parentheses, scaling "
              "efficiency (one worker's step / the step at N).\n\n")
    with open(os.path.join(out, "scaling.md"), "w") as f:
        f.write(header + tables + "\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump({"command": command, "options": dataclasses.asdict(options), "costs": costs,
                   "cost_scale": FLAGS.cost_scale,
                   "points": [p.to_json() for p in points], "shortfalls": lines,
                   "wall_s": wall}, f, indent=1)
    plot(points, names, os.path.join(out, "scaling.png"))
    print()
    print(tables)
    print("\n".join(lines))
    cpu = sum(p.cpu_s for p in points)
    print(f"\ndone in {wall:.0f} s ({cpu:.0f} s of simulation CPU); {out}/ (scaling.md, "
          "scaling.json, scaling.png)")
    return 0


def _merge(paths: Sequence[str], out: str) -> int:
    """Joins earlier runs' points (their own order kept, a model once) into ``out``."""
    points: list[ScalingPoint] = []
    commands = []
    for path in paths:
        path = path if path.endswith(".json") else os.path.join(path, "scaling", "scaling.json")
        try:
            with open(path) as f:
                commands.append(json.load(f)["command"])
            points += load_points(path)
        except (OSError, KeyError, TypeError, ValueError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
    seen = {(p.model, p.bandwidth_bps, p.workers) for p in points}
    if len(seen) != len(points):
        print("error: the runs predict some settings twice", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(n for p in points for n in p.step_s))
    tables = format_tables(points, names)
    lines = shortfalls(points, names)
    with open(os.path.join(out, "scaling.md"), "w") as f:
        f.write("# Predicted scaling (joined: " + "; ".join(commands) + ")\n\nPREDICTIONS, not "
                "measurements. Each cell: predicted step ms and, in parentheses, scaling "
                "efficiency (one worker's step / the step at N).\n\n" + tables + "\n"
                + "\n".join(lines) + "\n")
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump({"command": "; ".join(commands), "points": [p.to_json() for p in points],
                   "shortfalls": lines}, f, indent=1)
    plot(points, names, os.path.join(out, "scaling.png"))
    print(tables)
    print("\n".join(lines))
    print(f"\n{out}/ (scaling.md, scaling.json, scaling.png)")
    return 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
