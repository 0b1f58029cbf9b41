"""The training benchmark's report: the Markdown table, CSV, chart and the files in ``--out``,
and the texts of the progress lines."""

from __future__ import annotations

import csv
import os
import time
from typing import Any, Mapping, Optional, Sequence

from prophet_tf.bench.train.settings import (CPU_LIMITED_FRACTION, NOISY_CORES, SweepOptions,
                                             finite, lower_bound_s, median, write_json)
from prophet_tf.bench.train.systems import parse_system

__all__ = ["format_bandwidth", "format_markdown", "CSV_FIELDS", "BOUNDS_TEXT", "write_csv", "plot",
           "launch_text", "noise_text", "rate_change_summary", "compute_summary",
           "write_outputs", "merge_results"]


def format_bandwidth(bps: Optional[float]) -> str:
    """``1.23 Gbit/s``, ``456 Mbit/s``; ``unshaped`` for None/0."""
    if not bps:
        return "unshaped"
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            v = bps / scale
            return f"{v:.3g} {unit}"
    return f"{bps:.0f} bit/s"


def _fmt(x: Optional[float], spec: str, suffix: str = "") -> str:
    return "n/a" if x is None or not finite(x) else f"{x:{spec}}{suffix}"


def format_markdown(settings: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown table: a row per (setting, system), setting columns filled on its first row.

    Columns: model, N (workers), global batch, comm/compute ratio, link rate (emulated compute:
    in parentheses the modelled link, time scale x rate), compute ms (real: one worker alone, in
    parentheses N uncoupled workers at once when measured; emulated: the accelerator's time, in
    parentheses one worker alone when measured),
    lower bound ms, ideal bound ms, system, median step ms, samples/s, speed-up over mwms, step /
    lower bound, step / ideal bound. A compressed system (``prophet+bf16``) has bounds of its own
    (the bytes that travel): its row fills the bound columns with them.
    A system is flagged when other programs disturbed it or when the machine's CPU was the limit.
    """
    head = ("| model | N | batch | comm/comp | link | compute ms | bound ms | ideal ms | system | "
            "step ms | samples/s | vs mwms | step/bound | step/ideal |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for st in settings:
        first = True
        ratio = st.get("comm_compute_ratio")
        for system, res in st["results"].items():
            label = system
            if res.get("note"):
                label += f" ({res['note']})"
            if res.get("error"):
                label += " (failed)"
            noise = res.get("foreign_cores")
            if finite(noise) and noise > NOISY_CORES:
                label += f" (noisy: other programs used {noise:.1f} cores)"
            busy = res.get("machine_cpu")
            if finite(busy) and busy >= CPU_LIMITED_FRACTION:
                label += f" (CPU-limited: cores {busy:.0%} busy)"
            compute = _fmt(st["compute_s"] * 1e3, ".0f")
            emulation = st.get("emulation") or {}
            alone = (st.get("compute_single") or {}).get("step_s_median")
            if st.get("compute_contended_s"):
                compute += f" ({st['compute_contended_s'] * 1e3:.0f})"
            elif emulation and finite(alone):
                compute += f" (alone {alone * 1e3:.0f})"
            link = format_bandwidth(st["bandwidth_bps"])
            if finite(emulation.get("modelled_bandwidth_bps")):
                link += f" ({format_bandwidth(emulation['modelled_bandwidth_bps'])})"
            ideal = st.get("ideal_bound_s")
            cells = [st["model"], str(st["workers"]), str(st.get("global_batch", "")),
                     _fmt(ratio, ".2g"), link,
                     compute, _fmt(st["lower_bound_s"] * 1e3, ".0f"),
                     _fmt(ideal * 1e3 if ideal else None, ".0f")]
            if not first:
                cells = [""] * len(cells)
            if "lower_bound_s" in res:   # a compressed system's own bounds
                own_lb, own_ib = res.get("lower_bound_s"), res.get("ideal_bound_s")
                cells[-2] = _fmt(own_lb * 1e3 if own_lb else None, ".0f")
                cells[-1] = _fmt(own_ib * 1e3 if own_ib else None, ".0f")
            step = res.get("step_s_median")
            cells += [label, _fmt(step * 1e3 if step is not None else None, ".0f"),
                      _fmt(res.get("samples_per_s"), ".1f"),
                      _fmt(res.get("speedup_vs_mwms"), ".2f", "x"),
                      _fmt(res.get("ratio_to_lower_bound"), ".2f"),
                      _fmt(res.get("ratio_to_ideal_bound"), ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("model", "workers", "global_batch", "compute", "comm_compute_ratio",
              "bandwidth_bps", "gradient_bytes", "compute_s", "compute_contended_s",
              "lower_bound_s", "ideal_bound_s", "time_scale", "accelerator_tflops",
              "accelerator_s", "modelled_bandwidth_bps", "system", "step_s_median",
              "samples_per_s", "speedup_vs_mwms", "ratio_to_lower_bound", "ratio_to_ideal_bound",
              "schedule_effective", "cross_barrier", "stall_breaks", "foreign_cores",
              "machine_cpu", "workers_cpu", "attempts", "note", "error")


def write_csv(path: str, settings: Sequence[Mapping[str, Any]]) -> None:
    """One CSV row per (setting, system), columns :data:`CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for st in settings:
            for system, res in st["results"].items():
                row = {k: st.get(k) for k in CSV_FIELDS}
                row.update({k: v for k, v in (st.get("emulation") or {}).items()
                            if k in CSV_FIELDS})
                row.update({k: v for k, v in res.items() if k in CSV_FIELDS})
                row["system"] = system
                w.writerow({k: ("" if v is None else v) for k, v in row.items()})


def plot(settings: Sequence[Mapping[str, Any]], path: str, title: str = "") -> None:
    """Bar chart: speed-up over mwms per system and setting.

    A dashed line marks mwms / lower bound, a solid grey one mwms / ideal bound (the best
    speed-up any schedule could reach); a dotted one mwms / lower bound with the compute time of
    N workers sharing the machine, when it was measured. Variants of a system (options or
    modifiers) are hatched in their base system's colour.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for st in settings:
        groups.setdefault((st["model"], st["workers"]), []).append(st)
    if not groups:
        return
    systems = list(dict.fromkeys(s for st in settings for s in st["results"]))
    colors = {"prophet": "#d62728", "prophet_nocross": "#ff9896", "priority": "#1f77b4",
              "fifo": "#7f7f7f", "auto": "#9467bd", "mwms": "#2ca02c",
              "bytescheduler": "#ff7f0e", "p3": "#8c564b"}
    variants = [s for s in systems if parse_system(s).is_variant]
    fig, axes = plt.subplots(1, len(groups), figsize=(max(5.5, 4.8 * len(groups)), 4.2),
                             squeeze=False)
    width = 0.8 / max(1, len(systems))
    for ax, ((model, n), sts) in zip(axes[0], groups.items()):
        for j, system in enumerate(systems):
            ys = [st["results"].get(system, {}).get("speedup_vs_mwms") for st in sts]
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(sts))]
            variant = system in variants
            ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=system,
                   color=colors.get(parse_system(system).base), alpha=0.55 if variant else 1.0,
                   hatch="//" if variant else None, edgecolor="black" if variant else None,
                   linewidth=0.4)
        for i, st in enumerate(sts):
            m = st["results"].get("mwms", {}).get("step_s_median")
            if m and st["lower_bound_s"]:
                ax.hlines(m / st["lower_bound_s"], i - 0.45, i + 0.45, colors="black",
                          linestyles="dashed", label="bound" if i == 0 else None)
            ib = st.get("ideal_bound_s")
            if m and ib:
                ax.hlines(m / ib, i - 0.45, i + 0.45, colors="#555555", linestyles="solid",
                          linewidth=0.8, label="ideal" if i == 0 else None)
            lbc = st.get("lower_bound_contended_s")
            if m and lbc:
                ax.hlines(m / lbc, i - 0.45, i + 0.45, colors="black", linestyles="dotted",
                          label="bound, N workers' compute" if i == 0 else None)
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_xticks(range(len(sts)))
        ax.set_xticklabels([f"comm/comp {_fmt(st.get('comm_compute_ratio'), '.2g')}\n"
                            f"{format_bandwidth(st['bandwidth_bps'])}" for st in sts], fontsize=8)
        ax.set_ylabel("speed-up over mwms (step time ratio)")
        ax.set_title(f"{model}, {n} workers, global batch {sts[0].get('global_batch')}")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def launch_text(launch_s: float, result: Mapping[str, Any]) -> str:
    """``"44 s: start-up 10 s (CPU 6 s), first step 12 s (CPU 7 s)"``: where a launch's time
    went, from rank 0's result (the CPU seconds are what a worker with a core of its own needs)."""
    text = f"{launch_s:.0f} s"
    parts = []
    for what, wall, cpu in (("start-up", "startup_s", "startup_cpu_s"),
                            ("first step", "first_step_s", "first_step_cpu_s")):
        if finite(result.get(wall)):
            part = f"{what} {result[wall]:.0f} s"
            if finite(result.get(cpu)):
                part += f" (CPU {result[cpu]:.0f} s)"
            parts.append(part)
    return text + (": " + ", ".join(parts) if parts else "")


def noise_text(facts: Mapping[str, Any]) -> str:
    f = facts.get("foreign_cores")
    text = "" if f is None or f < 0.1 else f" [other programs: {f:.2f} cores]"
    busy = facts.get("machine_cpu")
    if finite(busy) and busy >= CPU_LIMITED_FRACTION:
        text += f" [CPU-limited: the machine's cores were {busy:.0%} busy]"
    return text


def rate_change_summary(periods: Sequence[float], warmup: int, rate_change: tuple[int, float],
                        compute_s: float, gradient_bytes: int, workers: int,
                        bandwidth_bps: float) -> dict[str, Any]:
    """Step times around a mid-run link-rate change at step K: the median before it (measured
    steps before K), each of the 5 steps from K on, the median of the rest, and both bounds.

    ``periods[i]`` is step ``warmup + i`` (see :func:`step_periods`).
    """
    step, factor = rate_change
    steps = {warmup + i: p for i, p in enumerate(periods)}
    before = [p for s, p in steps.items() if s < step]
    around = [steps[s] for s in range(step, step + 5) if s in steps]
    rest = [p for s, p in steps.items() if s >= step + 5]
    bound_before = lower_bound_s(compute_s, gradient_bytes, workers, bandwidth_bps)
    bound_after = lower_bound_s(compute_s, gradient_bytes, workers, bandwidth_bps * factor)
    text = (f"[link x{factor:g} at step {step}: before {median(before) * 1e3:.0f} ms "
            f"(bound {bound_before * 1e3:.0f}), steps {step}-{step + len(around) - 1}: "
            + "/".join(f"{p * 1e3:.0f}" for p in around)
            + f" ms, after {median(rest) * 1e3:.0f} ms (bound {bound_after * 1e3:.0f})]")
    return {"step": step, "factor": factor, "median_before_s": median(before),
            "first_steps_after_s": around, "median_after_s": median(rest),
            "lower_bound_before_s": bound_before, "lower_bound_after_s": bound_after,
            "text": text}


#: What the two bounds of every row are (results.md).
BOUNDS_TEXT = ("bound ms: max(compute, 2(N-1)/N x gradient bytes at the link rate); ideal ms: the "
               "best step any schedule could reach on the same layers and links (every "
               "gradient's all-reduce as a fluid from the moment it is ready, in the order the "
               "next forward pass needs them, at tbf's payload rate; docs/design.md, \"The ideal "
               "bound\"); step/bound and step/ideal: each system's median step over them. A "
               "compressed system (SYSTEM+fp16, SYSTEM+bf16) has its own bounds on its row: the "
               "same with the bytes its gradients travel in (half).")


def compute_summary(settings: Sequence[Mapping[str, Any]], opts: SweepOptions) -> str:
    """One paragraph saying how the workers computed (and, emulated, what the times model)."""
    return _compute_text(settings, opts.compute, opts.accelerator_tflops)


def _compute_text(settings: Sequence[Mapping[str, Any]], compute: str,
                  accelerator_tflops: float) -> str:
    if compute != "emulated":
        return ("Compute: real (this machine's CPU runs the model); compute ms = one worker "
                "alone, in parentheses N uncoupled workers at once.")
    parts = []
    seen: set[tuple] = set()
    for st in settings:
        em = st.get("emulation") or {}
        key = (st["model"], st["workers"])
        if not em or key in seen:
            continue
        seen.add(key)
        parts.append(f"{st['model']} N={st['workers']}: time scale {em['time_scale']:g}, "
                     f"accelerator {em['modelled_accelerator_s'] * 1e3:.1f} ms per step "
                     f"({em['accelerator_s'] * 1e3:.0f} ms scaled)")
    return (f"Compute: emulated (an accelerator at {accelerator_tflops:g} TFLOP/s; every "
            "time x the time scale, every link / the time scale; link column: tc rate "
            "(modelled rate)); compute ms = the emulated accelerator's time per step (in "
            "parentheses: one worker alone, no strategy, when measured). "
            + "; ".join(parts) + ".")


def write_outputs(settings: Sequence[dict], opts: SweepOptions, final: bool) -> None:
    os.makedirs(opts.out, exist_ok=True)
    write_json(os.path.join(opts.out, "results.json"), settings)
    if opts.json_path:
        write_json(opts.json_path, settings)
    if not final:
        return
    table = format_markdown(settings)
    notes = sorted({n for st in settings for n in st.get("notes", [])})
    notes += opts.meta.get("skipped", [])
    with open(os.path.join(opts.out, "results.md"), "w") as f:
        f.write(f"# Training benchmark ({opts.label or 'prophet_tf.bench.train'})\n\n")
        meta = opts.meta
        elapsed = time.monotonic() - meta.get("t0", time.monotonic())
        la0 = " ".join(f"{x:.2f}" for x in meta.get("loadavg_start", ()))
        la1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
        f.write(f"Started {meta.get('started', '?')}, took {elapsed:.0f} s; {os.cpu_count()} "
                f"cores; {'loopback (unshaped)' if opts.loopback else 'emulated cluster (tbf)'}; "
                f"{opts.steps} measured steps after {opts.warmup} warm-up steps; TF threads "
                f"intra {opts.intra_threads} / inter {opts.inter_threads} per worker; load "
                f"average (1/5/15 min) {la0} at the start, {la1} at the end; source "
                f"{meta.get('source', 'unknown')}.\n\n")
        f.write(compute_summary(settings, opts) + "\n\n")
        f.write(BOUNDS_TEXT + "\n\n")
        f.write(table)
        if notes:
            f.write("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    write_csv(os.path.join(opts.out, "results.csv"), settings)
    if settings:
        plot(settings, os.path.join(opts.out, "results.png"), title=opts.label)


def merge_results(paths: Sequence[str], out: str) -> list[dict]:
    """Joins the ``results.json`` of several runs of the benchmark into one report in ``out``
    (results.md, .csv, .json, .png), so that a sweep longer than one sitting can be measured in
    parts (``--models resnet50 --out part1``, ...). Every part must come from runs with the same
    steps, threads and options and of the same compute mode, and no setting may appear twice:
    otherwise the table would put numbers measured differently side by side. results.md keeps
    each part's own header line (when, how long, the load, the source) below the table's title.
    Raises ``ValueError`` naming the part at fault."""
    from prophet_tf.bench.train.settings import validate_settings
    import json
    settings: list[dict] = []
    headers: list[str] = []
    seen: dict[tuple, str] = {}
    runs: dict[str, str] = {}
    for path in paths:
        try:
            with open(path) as f:
                part = json.load(f)
            validate_settings(part)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None
        for st in part:
            key = (st["model"], st["workers"], st.get("comm_compute_ratio"), st.get("compute"),
                   st.get("bandwidth_bps"))
            where = f"{st['model']} N={st['workers']} comm/comp {st.get('comm_compute_ratio')}"
            if key in seen:
                raise ValueError(f"{where} is in both {seen[key]} and {path}: give each setting "
                                 "once")
            seen[key] = path
            facts = json.dumps({"compute": st.get("compute"), **(st.get("run") or {})},
                               sort_keys=True)
            runs.setdefault(facts, path)
            if len(runs) > 1:
                raise ValueError(f"{where} ({path}) was measured with other steps, threads, "
                                 f"options or compute mode than {next(iter(runs.values()))}: "
                                 "merge only parts of one sweep")
        settings.extend(part)
        header = "(no results.md beside it)"
        md = os.path.join(os.path.dirname(path), "results.md")
        if os.path.exists(md):
            with open(md) as f:
                header = next((ln.strip() for ln in f if ln.startswith("Started ")), header)
        headers.append(f"- `{path}` ({len(part)} settings): {header}")
    if not settings:
        raise ValueError("the parts hold no setting")
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "results.json"), settings)
    tflops = next((st["emulation"]["accelerator_tflops"] for st in settings
                   if st.get("emulation")), 0.0)
    notes = sorted({n for st in settings for n in st.get("notes", [])})
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("# Training benchmark (merged)\n\nParts:\n" + "\n".join(headers) + "\n\n")
        f.write(_compute_text(settings, settings[0].get("compute", "real"), tflops) + "\n\n")
        f.write(BOUNDS_TEXT + "\n\n")
        f.write(format_markdown(settings))
        if notes:
            f.write("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    write_csv(os.path.join(out, "results.csv"), settings)
    plot(settings, os.path.join(out, "results.png"), title="merged")
    return settings
