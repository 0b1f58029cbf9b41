"""The predictor's command line (``python -m prophet_tf.predict``, whose usage its
``__main__`` states): the flags, :func:`main`, and the parsers and formatters of rates,
durations and fusion settings that the benchmarks share."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import sys
from typing import Optional, Sequence

from prophet_tf._library import runtime_constants
from prophet_tf._options import predicted_options, runtime_options
from prophet_tf.predict.model import (SCHEDULES, IdealBound, PredictError, Prediction,
                                      PredictOptions, SimulatedDeadlock, ideal_bound, predict)
from prophet_tf.predict.profile import Profile, ProfileError, load_profile

__all__ = ["parse_rate", "parse_time_scale", "parse_duration", "format_rate", "format_table", "plot", "main"]

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)(?:bit|b|bps|bit/s)?\s*$")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|µs|ns)?\s*$")
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNIT_S = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """``"10G"``, ``"2.5Gbit"``, ``"100M"``, ``"1e9"`` -> bits per second."""
    m = _RATE.match(text)
    if not m:
        raise ValueError(f"link rate {text!r}: expected a number of bit/s with an optional "
                         "k/M/G/T prefix, e.g. 10G or 2.5Gbit")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"link rate {text!r} must be positive")
    return value


def parse_time_scale(text: str) -> float:
    """``"28"`` -> 28.0; a positive number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"time scale {text!r}: expected a positive number or 'profile'")
    return value


def parse_duration(text: str) -> float:
    """``"50us"``, ``"0.2ms"``, ``"0"`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"duration {text!r}: expected a number with an optional unit s, ms, us "
                         "or ns, e.g. 50us")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_fusion(text: str) -> int:
    """``--fusion``: off -> 0, auto -> -1 (sized by the simulator), or a positive byte count."""
    if text == "off":
        return 0
    if text == "auto":
        return -1
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"--fusion {text!r}: expected off, auto or a positive number of bytes")
    return value


def format_rate(bps: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def format_table(predictions: Sequence[Prediction], schedules: Sequence[str],
                 deadlocks: Sequence[tuple[str, int, float]] = (),
                 ideals: Sequence[IdealBound] = ()) -> str:
    """Markdown: a row per (link rate, workers), a column per schedule with the predicted step
    time and the speed-up over one worker; ``*`` marks the fastest schedule, ``deadlock`` a
    setting (schedule, workers, link rate) in which the simulated runtime stops for good. With
    ``ideals``, a last column gives the ideal bound (the best any schedule could do) and, in
    parentheses, the fastest schedule's step over it."""
    ideal = {(b.bandwidth_bps, b.workers): b for b in ideals}
    rows: dict[tuple[float, int], dict[str, Prediction]] = {}
    stuck = {(s, n, bw) for s, n, bw in deadlocks}
    for s, n, bw in deadlocks:
        rows.setdefault((bw, n), {})
    for p in predictions:
        rows.setdefault((p.bandwidth_bps, p.workers), {})[p.schedule] = p
    head = "| link | N | " + " | ".join(schedules) + " |" + (" ideal |" if ideals else "")
    lines = [head, "|---|---|" + "---|" * (len(schedules) + (1 if ideals else 0))]
    for (bw, n), by_schedule in sorted(rows.items(), key=lambda item: item[0]):
        best = min((p.step_s for p in by_schedule.values()), default=math.nan)
        cells = []
        for s in schedules:
            p = by_schedule.get(s)
            if p is None:
                cells.append("deadlock" if (s, n, bw) in stuck else "")
                continue
            mark = "*" if p.step_s <= best * (1 + 1e-9) else ""
            cells.append(f"{p.step_s * 1e3:.1f} ms{mark} ({p.speedup:.2f}x)")
        if ideals:
            b = ideal.get((bw, n))
            cells.append("" if b is None else f"{b.step_s * 1e3:.1f} ms" + (
                f" ({best / b.step_s:.2f})" if math.isfinite(best) and b.step_s > 0 else ""))
        lines.append(f"| {format_rate(bw)} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(predictions: Sequence[Prediction], path: str, title: str = "") -> None:
    """Step time and speed-up over one worker against workers: a line per schedule and link."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    bandwidths = sorted({p.bandwidth_bps for p in predictions})
    schedules = list(dict.fromkeys(p.schedule for p in predictions))
    styles = ["-", "--", ":", "-."]
    cmap = plt.get_cmap("tab10")
    for i, s in enumerate(schedules):
        for j, bw in enumerate(bandwidths):
            points = sorted((p.workers, p) for p in predictions if p.schedule == s and p.bandwidth_bps == bw)
            if not points:
                continue
            xs = [n for n, _ in points]
            label = f"{s}, {format_rate(bw)}"
            kwargs = dict(color=cmap(i % 10), linestyle=styles[j % len(styles)], marker="o",
                          markersize=3, label=label)
            left.plot(xs, [p.step_s * 1e3 for _, p in points], **kwargs)
            right.plot(xs, [p.speedup for _, p in points], **kwargs)
    if predictions:
        xs = sorted({p.workers for p in predictions})
        right.plot(xs, xs, color="black", linewidth=0.6, label="linear")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.grid(color="#dddddd", linewidth=0.5)
    left.set_ylabel("predicted step time (ms)")
    right.set_ylabel("speed-up over one worker (throughput)")
    right.legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def define_flags() -> None:
    """Defines the flags of ``python -m prophet_tf.predict`` (absl)."""
    from absl import flags
    flags.DEFINE_list("workers", ["2", "4", "8", "16", "64"], "Worker counts.")
    flags.DEFINE_list("bandwidth", ["1G", "10G", "25G"],
                      "Link rates per host and direction (bit/s, k/M/G/T prefixes).")
    flags.DEFINE_list("schedule", ["all"], f"Schedules among {', '.join(SCHEDULES)}, or all.")
    flags.DEFINE_string("latency", "0", "One-way latency per message, e.g. 50us.")
    flags.DEFINE_bool("egress_only", False, "Hosts receive without limit (an emulated cluster "
                      "that shapes only egress); default: the link rate limits both directions.")
    defaults = PredictOptions()
    # The runtime's options the predictor models, from the runtime's option table; unset, the
    # runtime's defaults. --hierarchical, below, is a switch.
    for option in runtime_options().values():
        if option.predicted and option.name != "hierarchical":
            define = {"float": flags.DEFINE_float, "int": flags.DEFINE_integer,
                      "uint": flags.DEFINE_integer}.get(option.type, flags.DEFINE_string)
            accepts = f"; {option.accepts}" if option.accepts else ""
            define(option.name, None, f"Runtime option: {option.doc}{accepts} (unset: the "
                   f"runtime's default, {option.default}).")
    flags.DEFINE_integer("max_socket_buffer_bytes", 0, "net.core.wmem_max of the workers' hosts, "
                         "which caps socket_buffer_bytes (0: no cap).")
    flags.DEFINE_integer("autotuned_socket_buffer_bytes", defaults.autotuned_socket_buffer_bytes,
                         "net.ipv4.tcp_wmem's maximum on the workers' hosts: the autotuning's "
                         "limit.")
    flags.DEFINE_float("payload_efficiency", defaults.payload_efficiency,
                       "Share of the link rate that carries data (Ethernet + TCP/IP headers).")
    flags.DEFINE_string("time_scale", "1", "Divide every time of the profile by this (an emulated "
                        "run's time scale gives the modelled accelerator's step times), or "
                        "'profile': by the time scale the emulated run recorded in the profile.")
    flags.DEFINE_integer("workers_per_host", 1, "Workers per host: they share the host's NIC and "
                         "talk over loopback (--loopback); every --workers value must be a "
                         "multiple.")
    flags.DEFINE_string("loopback", "100G", "Loopback rate between the workers of one host (bit/s), "
                        "shared by the host's local connections.")
    flags.DEFINE_bool("hierarchical", None, "The two-level path for prophet/priority/fifo (the "
                      "runtime's hierarchical='on'): sum on each host, then across hosts, then "
                      "back (mwms keeps its flat ring). --nohierarchical: the flat path; unset: "
                      "the runtime's default, auto (where a host has several workers, the faster "
                      "path by the start-up probe's rule).")
    flags.DEFINE_string("compression", "none", "Gradient compression of ProphetStrategy: none, "
                        "fp16 or bf16 (float32 gradients travel in half the bytes; mwms never "
                        "compresses).")
    flags.DEFINE_string("fusion", "auto", "Fusion of small gradients into buckets: auto (the "
                        "runtime's default: bucket size from the workers and the link rate), off "
                        "or a bucket size in bytes.")
    flags.DEFINE_string("message_cost", "0", "CPU time of one frame on a worker's I/O thread: "
                        "SEND,RECEIVE or one value for both (e.g. 10us,15us); 0: free. See "
                        "PredictOptions.message_send_s for the value measured here.")
    flags.DEFINE_string("costs", None, "Charge the CPU costs of this file (python -m "
                        "prophet_tf.predict calibrate --out FILE): per frame and per byte on each "
                        "worker's I/O thread; overrides --message_cost.")
    flags.DEFINE_float("cost_scale", 1.0, "Multiplies every cost of --costs (0.5: a machine whose "
                       "I/O thread is twice as fast as the calibrated one).")
    flags.DEFINE_bool("small_allreduce", True, "Small control collectives by recursive doubling "
                      "where the engine takes them (ops/core/small_allreduce.h), as it does; "
                      "--nosmall_allreduce predicts the owner path for every tensor, for "
                      "comparisons.")
    flags.DEFINE_integer("steps", defaults.steps, "Measured simulated steps (median).")
    flags.DEFINE_integer("warmup", defaults.warmup_steps, "Simulated steps before those.")
    flags.DEFINE_string("output", "predict.png", "PNG to draw (empty: none).")
    flags.DEFINE_string("json", None, "Write every prediction as JSON here.")
    flags.DEFINE_string("save_profile", None, "Write the profile read from PROFILE here (JSON).")
    flags.DEFINE_string("timeline", None, "Write the synthetic timeline of the one selected "
                        "setting (one workers value, link rate and schedule) here.")
    flags.DEFINE_integer("timeline_workers", 2, "Workers drawn on --timeline.")
    flags.DEFINE_integer("worker", None, "Which worker of a trace with several to read.")


def _describe(profile: Profile) -> str:
    return (f"profile {profile.source or '?'}: {len(profile.layers)} layers, {len(profile.tensors)} "
            f"collectives ({profile.gradient_bytes / 1e6:.1f} MB of gradients), one worker "
            f"{profile.step_s * 1e3:.1f} ms/step (forward {profile.forward_s * 1e3:.1f} ms, "
            f"{profile.forward}; backward {profile.backward_s * 1e3:.1f} ms; median of "
            f"{profile.steps} steps)")


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags
    FLAGS = flags.FLAGS
    if len(argv) != 2:
        print("usage: python -m prophet_tf.predict PROFILE.json [flags] (see --help)",
              file=sys.stderr)
        return 2
    try:
        workers = [int(w) for w in FLAGS.workers]
        if any(n < 1 for n in workers):
            raise ValueError(f"--workers must be at least 1, got {FLAGS.workers}")
        bandwidths = [parse_rate(b) for b in FLAGS.bandwidth]
        schedules = list(SCHEDULES) if FLAGS.schedule == ["all"] else list(FLAGS.schedule)
        bad = [s for s in schedules if s not in SCHEDULES]
        if bad:
            raise ValueError(f"unknown schedule(s) {bad}; choose from {', '.join(SCHEDULES)} or all")
        known = ("none",) + tuple(runtime_constants()["compressions"])
        if FLAGS.compression not in known:
            raise ValueError(f"--compression must be one of {', '.join(known)}, got "
                             f"{FLAGS.compression!r}")
        if FLAGS.workers_per_host < 1 or any(n % FLAGS.workers_per_host for n in workers):
            raise ValueError(f"every --workers value must be a multiple of --workers_per_host "
                             f"({FLAGS.workers_per_host}), got {FLAGS.workers}")
        time_scale = (None if FLAGS.time_scale == "profile"
                      else parse_time_scale(FLAGS.time_scale))
        message_cost = [parse_duration(v) for v in FLAGS.message_cost.split(",")]
        if len(message_cost) not in (1, 2) or any(c < 0 for c in message_cost):
            raise ValueError(f"--message_cost: expected SEND,RECEIVE or one duration, got "
                             f"{FLAGS.message_cost!r}")
        options = PredictOptions(latency_s=parse_duration(FLAGS.latency),
                                 message_send_s=message_cost[0],
                                 message_receive_s=message_cost[-1],
                                 small_allreduce=FLAGS.small_allreduce,
                                 workers_per_host=FLAGS.workers_per_host,
                                 loopback_bytes_per_s=parse_rate(FLAGS.loopback) / 8.0,
                                 hierarchical=FLAGS.hierarchical,
                                 ingress_limited=not FLAGS.egress_only,
                                 max_socket_buffer_bytes=FLAGS.max_socket_buffer_bytes,
                                 autotuned_socket_buffer_bytes=FLAGS.autotuned_socket_buffer_bytes,
                                 payload_efficiency=FLAGS.payload_efficiency,
                                 steps=FLAGS.steps, warmup_steps=FLAGS.warmup,
                                 compression=(None if FLAGS.compression == "none"
                                              else FLAGS.compression),
                                 fusion_bytes=parse_fusion(FLAGS.fusion),
                                 **{name: getattr(FLAGS, name) for name in predicted_options()
                                    if name != "hierarchical"})
        if FLAGS.costs:
            from prophet_tf.predict.costs import apply_costs, load_costs
            options = apply_costs(options, load_costs(FLAGS.costs), FLAGS.cost_scale)
        if FLAGS.timeline and (len(workers), len(bandwidths), len(schedules)) != (1, 1, 1):
            raise ValueError("--timeline draws one setting: give one value each to --workers, "
                             "--bandwidth and --schedule")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        profile = load_profile(argv[1], worker=FLAGS.worker)
        if time_scale is None:
            if not profile.emulation.get("time_scale"):
                raise ProfileError(f"{argv[1]}: --time_scale profile, but the profile has no "
                                   "emulation record (only emulated benchmark runs recorded "
                                   "since this option have one); give the time scale as a number")
            time_scale = float(profile.emulation["time_scale"])
        if time_scale != 1.0:
            profile = profile.scaled(time_scale)
        print(_describe(profile) + (f"; gradients compressed as {options.compression}"
                                    if options.compression else ""))
        for note in profile.notes:
            print(f"  note: {note}")
        if options.workers_per_host > 1:
            print(f"  {options.workers_per_host} workers per host (loopback "
                  f"{format_rate(options.loopback_bytes_per_s * 8)})")
        if options.hierarchical:
            print("  two-level path (--hierarchical, the runtime's hierarchical='on'); mwms "
                  "keeps its flat ring")
        elif options.hierarchical is None and options.workers_per_host > 1:
            print("  the faster of the two-level and the flat path, as the start-up probe chooses "
                  "(the runtime's default, hierarchical='auto'; --hierarchical: two-level, "
                  "--nohierarchical: flat); mwms keeps its flat ring")
        if FLAGS.save_profile:
            profile.save(FLAGS.save_profile)
            print(f"wrote {FLAGS.save_profile}")
        settings = [(bw, n, s) for bw in bandwidths for n in workers for s in schedules]

        def one(setting: tuple[float, int, str]) -> Prediction | SimulatedDeadlock:
            bw, n, s = setting
            try:
                return predict(profile, workers=n, bandwidth_bps=bw, schedule=s, options=options,
                               timeline_path=FLAGS.timeline,
                               timeline_workers=FLAGS.timeline_workers)
            except SimulatedDeadlock as e:
                return e

        # The simulations run in the library without the GIL (ctypes releases it): one per core.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            outcomes = list(pool.map(one, settings))
        predictions = [o for o in outcomes if isinstance(o, Prediction)]
        ideals = [ideal_bound(profile, workers=n, bandwidth_bps=bw, options=options)
                  for bw in bandwidths for n in workers]
        deadlocks = [(s, n, bw, str(o)) for (bw, n, s), o in zip(settings, outcomes)
                     if isinstance(o, SimulatedDeadlock)]
    except (ProfileError, PredictError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(format_table(predictions, schedules, [d[:3] for d in deadlocks], ideals))
    print("step time per schedule (* fastest) and, in parentheses, throughput over one worker; "
          "ideal: the best step any schedule could reach (docs/design.md) and, in parentheses, "
          "the fastest schedule's step over it")
    for _, _, _, why in deadlocks:
        # Every worker's plan (one entry per Prophet block) is in --json; here, where they wait.
        print(f"deadlock: {re.sub(r'[[][^]]*[]]', '[...]', why)}")
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump({"profile": profile.to_json(), "options": vars(options),
                       "predictions": [p.to_json() for p in predictions],
                       "ideal_bounds": [b.to_json() for b in ideals],
                       "deadlocks": [{"schedule": s, "workers": n, "bandwidth_bps": bw,
                                      "why": why} for s, n, bw, why in deadlocks]}, f, indent=1)
        print(f"wrote {FLAGS.json}")
    if FLAGS.output:
        plot(predictions, FLAGS.output, title=f"predicted from {profile.source}")
        print(f"wrote {FLAGS.output}")
    if FLAGS.timeline:
        print(f"wrote the synthetic timeline: {FLAGS.timeline} (one file per worker)")
    return 0

