"""Training step time of prophet_tf's schedules vs TensorFlow's MultiWorkerMirroredStrategy.

    python -m prophet_tf.bench.train [--compute real|emulated] [--quick | --full]
        [--models resnet50,vgg16,transformer,bert_base] [--workers 2,4,8] [--ratios 0.5,1]
        [--systems prophet,prophet_nocross,priority,fifo,auto,mwms] [--batch 64] [--steps 20]
        [--warmup 5] [--accelerator_tflops 100] [--time_scale 28] [--out bench_out/]
        [--json PATH] [--timeline DIR] [--rate_change STEP:FACTOR] [--loopback]

Two ways for the workers to compute (``--compute``):

* ``real`` (default): this machine's CPU runs the models (small inputs: 32x32 images, a small
  Transformer). Compute, summation and TCP copies then share the same cores, which on this
  2-core machine sets the step time more than any schedule does.
* ``emulated``: every layer keeps its real variables (real shapes and dtypes, so gradient bytes,
  count and order are those of the real model: ResNet50 and VGG16 at 224x224 with 1000 classes,
  a BERT-base-sized encoder) but its forward and backward passes take a fixed time on an
  emulated accelerator that uses no CPU (:mod:`prophet_tf.bench.emulated`): layer time = FLOPs x
  batch / ``--accelerator_tflops`` (backward: twice the forward). Everything else is real
  training: ``ProphetStrategy`` with ``model.fit``, MultiWorkerMirroredStrategy on the same
  model. Real accelerators are so fast that comm/comp 1 needs tens of Gbit/s per host, more than
  one machine's CPU can push through emulated links, so every compute time runs ``time_scale``
  times slower and every link as much slower (all ratios unchanged); by default the time scale
  puts the N links at comm/comp 1 together at ``--link_budget_gbps`` (4 Gbit/s).

For every model and worker count N (2-8):

1. **compute time** (``compute_s``). Real: the model with the per-worker batch (``--batch``)
   trains in one process alone, without any strategy; with ``--contended`` (default with real
   compute, not with ``--quick``) N such uncoupled processes also run at once
   (``compute_contended_s``, in parentheses; not used for the bound). Emulated: the emulated
   accelerator's time per step (the sum of all layers' forward and backward times), a true lower
   bound that does not depend on this machine's load; ``--alone`` also times one worker alone.
2. **bandwidths**: for every ratio r in ``--ratios`` (communication time / compute time), the
   per-host link rate is ``2(N-1)/N * gradient_bytes * 8 / (r * compute_s)`` bit/s: moving the
   all-reduce optimum of 2(N-1)/N of the gradient bytes at that rate takes r times the compute
   time.
3. **systems**: for every bandwidth an emulated cluster of N hosts is built
   (:class:`~prophet_tf.bench.netem.EmulatedCluster`: a network namespace per host, ``tbf`` on
   each host's NIC; names start with ``--netns_prefix``), and each system is a separate launch
   of N worker processes inside it (``prophet_tf.launch.launch(..., hosts=...,
   wrap_argv=cluster.exec_argv)``), on the same model and global batch (N x ``--batch``):
   ``ProphetStrategy`` with ``schedule="prophet"``, ``"priority"`` and ``"fifo"``; ``prophet``
   with barrier crossing off (``prophet_nocross``: ``cross_barrier=False``, passed only when the
   constructor has that parameter, otherwise the run equals ``prophet`` and the output says so);
   ``auto`` (``schedule="auto"``: the schedule the predictor expects to be fastest, chosen by
   the runtime after a few steps; the JSON says which one it ran, ``schedule_in_use``);
   and TensorFlow's ``tf.distribute.MultiWorkerMirroredStrategy`` (``mwms``: RING collectives on
   CPU, cluster from the launcher's ``TF_CONFIG``).
4. Each worker trains on synthetic data with ``model.fit``; ``mwms`` uses the same train step as
   a custom loop, because Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy
   (keras-team/keras#20585). A Keras callback timestamps every ``on_train_batch_begin``; a step's
   time is the interval to the next step's start; rank 0 reports the median over ``--steps``
   steps after ``--warmup`` steps.

Per setting: each system's median step time and samples/s, speed-up over ``mwms``, the lower
bound ``max(compute_s, 2(N-1)/N * gradient_bytes * 8 / bandwidth)`` and each system's ratio to
it. Outputs in ``--out`` (default ``bench_out/``): ``results.md`` (Markdown table),
``results.csv``, ``results.json`` (``"compute": "real"|"emulated"`` per setting; emulated
settings add ``"emulation"``: time scale, accelerator times, modelled link rate), ``results.png``
(chart) and ``logs/`` (every launch's output); ``--json PATH`` also writes the JSON list there.
``--timeline DIR`` (or ``$PROPHET_TIMELINE``) writes a Chrome trace per ProphetStrategy launch
and worker and draws one measured step of each (``DIR/<launch>.step<K>.png``; emulated compute
adds the layers' forward and backward spans).

``--rate_change STEP:FACTOR``: at the start of training step STEP every worker sets its own host's
link to FACTOR times the setting's rate (``tc`` inside its namespace), to watch Prophet re-plan:
the output gives the step times before, around and after the change against both bounds, and
``--timeline`` draws the steps around it (the re-plans are marked on the ``block`` track, the
change on the ``bench`` track).

Noise and CPU limits: the machine's CPU time outside the workers during the measured steps is
recorded per launch (``foreign_cores``); a launch disturbed by other programs (more than
``--noise_cores``) is run again up to ``--retries`` times and the quietest attempt kept; the
table flags those that stayed noisy, and those during which the machine's cores were at least
85% busy ("CPU-limited": then this machine, not the modelled cluster, set the step time). Every
worker pins TensorFlow to 1 intra-op and 2 inter-op threads (``--intra_threads``,
``--inter_threads``).

The emulated cluster needs root (network namespaces, tc); without it the program says so and
``--loopback`` runs the workers on 127.0.0.1 without shaping (one setting per model and N).
Namespaces are deleted and every worker process is killed at the end, on errors and on
Ctrl-C/SIGTERM (exit status 128 + signal).

Grids. Real compute: ``--models`` x ``--workers`` x ``--ratios`` (default VGG16 and the
Transformer, N=2, comm/comp 0.3, 1, 3). Emulated compute: by default
:data:`EMULATED_DEFAULT_GRID` with :data:`EMULATED_DEFAULT_SYSTEMS`, ``mwms`` only at comm/comp 1
(estimated from measured launch times to fit in 25 minutes on an idle 2-core machine);
``--full``: every model x N = 2, 4, 8 x comm/comp 0.5, 1, 1.5, 2 (several hours); any of ``--models``,
``--workers``, ``--ratios`` makes a grid of their product instead.

``--quick``: one model, 2 workers, comm/comp = 1, no contended run, no ``auto`` (it runs one of
the other schedules) and no retries (a disturbed launch is flagged, not run twice): the small
Transformer with real compute, ResNet50 with emulated compute (expected to take about 3 minutes
on an idle 2-core machine, estimated from measured launch times; start-up and the first step's
tracing are about 11 s of each launch there).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import io
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Sequence, TextIO

from prophet_tf.bench.emulated import DEFAULT_ACCELERATOR_TFLOPS
from prophet_tf.bench.models import COMPUTE_MODES, MODEL_NAMES

__all__ = [
    "SYSTEMS", "ALL_SYSTEMS", "comm_bytes", "comm_time_s", "lower_bound_s", "choose_bandwidth",
    "choose_bandwidths", "step_periods", "median", "make_setting", "validate_settings",
    "write_json", "format_markdown", "write_csv", "plot", "SweepOptions", "run_sweep", "main",
    "rate_change_summary",
]

#: Multi-worker systems compared in every setting (the keys of ``results`` in the JSON output).
SYSTEMS = ("prophet", "prophet_nocross", "priority", "fifo", "auto", "mwms")
#: ``--quick``'s systems: ``auto`` runs one of the others (the one the predictor picks), so the
#: quick run leaves it out unless ``--systems`` names it; one launch less.
QUICK_SYSTEMS = ("prophet", "prophet_nocross", "priority", "fifo", "mwms")
#: The emulated-compute sweeps' systems without ``--full``: what the goals compare (prophet
#: against priority, fifo and MultiWorkerMirroredStrategy); ``prophet_nocross`` and ``auto`` add a
#: launch per setting each and come with ``--full`` or ``--systems``. With all six the default
#: sweep would not fit in 25 minutes on a 2-core machine (docs/benchmarks.md).
EMULATED_DEFAULT_SYSTEMS = ("prophet", "priority", "fifo", "mwms")
#: SYSTEMS plus the single-worker compute-time run.
ALL_SYSTEMS = SYSTEMS + ("single",)
#: ProphetStrategy schedule and barrier crossing of each prophet_tf system.
PROPHET_SYSTEMS = {
    "prophet": ("prophet", True),
    "prophet_nocross": ("prophet", False),
    "priority": ("priority", True),
    "fifo": ("fifo", True),
    "auto": ("auto", True),   # the schedule the predictor expects to be fastest (rank 0 decides)
}
DEFAULT_MODELS = ("vgg16", "transformer")
QUICK_MODEL = "transformer"
DEFAULT_RATIOS = (0.3, 1.0, 3.0)
#: ``--compute emulated`` defaults (see the module docstring for how they were chosen).
EMULATED_DEFAULT_MODELS = ("resnet50", "bert_base", "vgg16")
EMULATED_QUICK_MODEL = "resnet50"
EMULATED_RATIOS = (0.5, 1.0, 1.5, 2.0)
#: The default emulated sweep (model, workers, ratios), with EMULATED_DEFAULT_SYSTEMS and
#: ``mwms`` only at comm/comp 1 (where the goals compare with it; it is the slowest system):
#: estimated from measured launch times to take 17-23 minutes on an idle 2-core machine.
EMULATED_DEFAULT_GRID = (
    ("resnet50", 2, EMULATED_RATIOS),
    ("bert_base", 2, (1.0,)),
    ("resnet50", 4, (1.0,)),
)
EMULATED_STEPS = 20
EMULATED_WARMUP = 5
MAX_WORKERS = 8
NETNS_PREFIX = "ptfbench"
#: A measurement during which other programs used more cores than this is flagged in the table.
NOISY_CORES = 0.3
#: A launch during which the machine's cores were busier than this fraction is flagged as limited
#: by this machine's CPU (the workers' own work, the kernel's network stack, other programs).
CPU_LIMITED_FRACTION = 0.85
#: Default aggregate egress of all emulated hosts at comm/comp 1 under emulated compute, bit/s;
#: sets the time scale (see :func:`emulated_time_scale`).
DEFAULT_LINK_BUDGET_BPS = 4e9
_RESULT_RE = re.compile(r"^\[rank (\d+)\] RESULT (\{.*\})\s*$")


# ------------------------------------------------------------------------------------------------
# Pure helpers (unit-tested)


def comm_bytes(gradient_bytes: float, workers: int) -> float:
    """Bytes each worker must send (and receive) per step at the all-reduce optimum: 2(N-1)/N."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return 2.0 * (workers - 1) / workers * float(gradient_bytes)


def comm_time_s(gradient_bytes: float, workers: int, bandwidth_bps: Optional[float]) -> float:
    """Seconds to move :func:`comm_bytes` at ``bandwidth_bps``; 0 when unshaped (None/0)."""
    if not bandwidth_bps:
        return 0.0
    if bandwidth_bps < 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bps}")
    return comm_bytes(gradient_bytes, workers) * 8.0 / float(bandwidth_bps)


def lower_bound_s(compute_s: float, gradient_bytes: float, workers: int,
                  bandwidth_bps: Optional[float]) -> float:
    """``max(compute, comm)``: no system can step faster than its compute or its link allows.

    Communication is taken at the all-reduce optimum (2(N-1)/N of the gradient bytes per worker)
    and at the full link rate (no header overhead). With an unshaped link (``bandwidth_bps``
    None or 0) the bound is the compute time.
    """
    return max(float(compute_s), comm_time_s(gradient_bytes, workers, bandwidth_bps))


def choose_bandwidth(gradient_bytes: float, workers: int, compute_s: float, ratio: float) -> float:
    """Link rate (bit/s) at which communication takes ``ratio`` times the compute time."""
    if ratio <= 0 or compute_s <= 0:
        raise ValueError(f"ratio and compute time must be positive, got {ratio}, {compute_s}")
    if workers < 2:
        raise ValueError("a bandwidth only matters for 2 or more workers")
    return comm_bytes(gradient_bytes, workers) * 8.0 / (ratio * compute_s)


def choose_bandwidths(gradient_bytes: float, workers: int, compute_s: float,
                      ratios: Iterable[float]) -> list[float]:
    """:func:`choose_bandwidth` for every ratio, rounded to whole bit/s (``tc`` takes integers)."""
    return [float(round(choose_bandwidth(gradient_bytes, workers, compute_s, r)))
            for r in ratios]


def emulated_time_scale(gradient_bytes: float, workers: int, accelerator_s: float,
                        link_budget_bps: float) -> float:
    """How many times slower than the modelled accelerator and links the emulation runs.

    Moving the all-reduce optimum of ``gradient_bytes`` in one step of ``accelerator_s`` (the
    modelled accelerator's compute time) takes links of ``comm_bytes * 8 / accelerator_s`` bit/s
    per host at comm/comp 1: tens of Gbit/s for these models, far more than one machine's CPU can
    push through emulated links. Scaling every compute time up and every link rate down by the
    same factor keeps every ratio (comm/comp, step/bound, speed-ups) of the modelled cluster. The
    factor puts the N hosts' links at comm/comp 1 together at ``link_budget_bps``; it is rounded
    up to two significant digits and never below 1.
    """
    if accelerator_s <= 0 or link_budget_bps <= 0:
        raise ValueError(f"accelerator time and link budget must be positive, got "
                         f"{accelerator_s}, {link_budget_bps}")
    per_host = link_budget_bps / workers
    scale = comm_bytes(gradient_bytes, workers) * 8.0 / (accelerator_s * per_host)
    if scale <= 1:
        return 1.0
    digits = 10 ** (math.floor(math.log10(scale)) - 1)
    return float(math.ceil(scale / digits - 1e-9) * digits)


def cpu_fraction(results: Mapping[int, Mapping[str, Any]], cores: int) -> tuple[Optional[float],
                                                                               Optional[float]]:
    """``(machine, workers)``: share of this machine's ``cores`` that were busy during rank 0's
    measured window, in total and with the workers' own processes."""
    r0 = results.get(0, {})
    window, busy = r0.get("window_s"), r0.get("window_machine_busy_s")
    own = [r.get("window_cpu_s") for r in results.values()]
    if not window or cores < 1:
        return None, None
    machine = None if busy is None else busy / window / cores
    workers = None if any(o is None for o in own) else sum(own) / window / cores
    return machine, workers


def step_periods(begin_times: Sequence[float], warmup: int) -> list[float]:
    """Intervals between consecutive step starts, dropping the first ``warmup`` steps.

    ``begin_times[i]`` is when step i started; step i's period is ``begin_times[i+1] -
    begin_times[i]``, which includes everything the step made the next one wait for.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    return [b - a for a, b in zip(begin_times[warmup:], begin_times[warmup + 1:])]


def median(values: Sequence[float]) -> float:
    """Median, NaN for an empty sequence."""
    return float(statistics.median(values)) if values else float("nan")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def make_setting(model: str, workers: int, bandwidth_bps: Optional[float], compute_s: float,
                 gradient_bytes: int, batch_per_worker: int,
                 step_s: Mapping[str, Optional[float]], *, ratio: Optional[float] = None,
                 extra: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 notes: Sequence[str] = (), compute: str = "real") -> dict[str, Any]:
    """One output object (one model, worker count and bandwidth) in the JSON schema.

    Args:
      step_s: median step time of each system that ran (None for a system that failed).
      extra: more per-system fields (e.g. ``schedule_effective``, ``error``) merged into
        ``results[SYSTEM]``.
      compute: ``"real"`` or ``"emulated"`` (how the workers computed).

    Returns ``{"model", "workers", "bandwidth_bps", "compute_s", "lower_bound_s", "compute",
    "results": {SYSTEM: {"step_s_median", "samples_per_s", "speedup_vs_mwms",
    "ratio_to_lower_bound", ...}}, ...}`` plus context fields (``comm_compute_ratio``,
    ``global_batch``, ``gradient_bytes``, ``comm_s``, ``notes``).
    """
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    global_batch = batch_per_worker * workers
    lb = lower_bound_s(compute_s, gradient_bytes, workers, bandwidth_bps)
    mwms = step_s.get("mwms")
    results: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        if system not in step_s:
            continue
        s = step_s[system]
        ok = _finite(s) and s > 0
        entry: dict[str, Any] = {
            "step_s_median": float(s) if ok else None,
            "samples_per_s": global_batch / s if ok else None,
            "speedup_vs_mwms": (mwms / s) if ok and _finite(mwms) and mwms > 0 else None,
            "ratio_to_lower_bound": (s / lb) if ok and lb > 0 else None,
        }
        if extra and system in extra:
            entry.update(extra[system])
        results[system] = entry
    return {
        "model": model,
        "workers": int(workers),
        "bandwidth_bps": float(bandwidth_bps) if bandwidth_bps else None,
        "compute_s": float(compute_s),
        "lower_bound_s": lb,
        "compute": compute,
        "results": results,
        "comm_compute_ratio": ratio if ratio is not None else (
            comm_time_s(gradient_bytes, workers, bandwidth_bps) / compute_s
            if compute_s and bandwidth_bps else None),
        "comm_s": comm_time_s(gradient_bytes, workers, bandwidth_bps),
        "global_batch": global_batch,
        "gradient_bytes": int(gradient_bytes),
        "notes": list(notes),
    }


def validate_settings(settings: Sequence[Mapping[str, Any]]) -> None:
    """Raises ``ValueError`` unless ``settings`` follows the output schema."""
    if not isinstance(settings, (list, tuple)):
        raise ValueError("the output must be a list of settings")
    for i, st in enumerate(settings):
        where = f"setting {i}"
        for key, kind in (("model", str), ("workers", int), ("compute_s", (int, float)),
                          ("lower_bound_s", (int, float)), ("results", dict)):
            if key not in st:
                raise ValueError(f"{where}: missing {key!r}")
            if not isinstance(st[key], kind) or isinstance(st[key], bool):
                raise ValueError(f"{where}: {key!r} has type {type(st[key]).__name__}")
        if st.get("compute") not in COMPUTE_MODES:
            raise ValueError(f"{where}: 'compute' must be one of {COMPUTE_MODES}, got "
                             f"{st.get('compute')!r}")
        if "bandwidth_bps" not in st:
            raise ValueError(f"{where}: missing 'bandwidth_bps'")
        bw = st["bandwidth_bps"]
        if bw is not None and not (_finite(bw) and bw > 0):
            raise ValueError(f"{where}: bandwidth_bps must be a positive number or null, "
                             f"got {bw!r}")
        for system, res in st["results"].items():
            if system not in SYSTEMS:
                raise ValueError(f"{where}: unknown system {system!r} (expected one of {SYSTEMS})")
            for key in ("step_s_median", "samples_per_s"):
                if key not in res:
                    raise ValueError(f"{where}: results[{system!r}] has no {key!r}")
                if res[key] is not None and not _finite(res[key]):
                    raise ValueError(f"{where}: results[{system!r}][{key!r}] = {res[key]!r}")


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: str, settings: Sequence[Mapping[str, Any]]) -> None:
    """Validates ``settings`` and writes them as a JSON list (NaN/inf become null)."""
    settings = _json_safe(list(settings))
    validate_settings(settings)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


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
    return "n/a" if x is None or not _finite(x) else f"{x:{spec}}{suffix}"


def format_markdown(settings: Sequence[Mapping[str, Any]]) -> str:
    """One Markdown table: a row per (setting, system), setting columns filled on its first row.

    Columns: model, N (workers), global batch, comm/compute ratio, link rate (emulated compute:
    in parentheses the modelled link, time scale x rate), compute ms (real: one worker alone, in
    parentheses N uncoupled workers at once when measured; emulated: the accelerator's time, in
    parentheses one worker alone when measured),
    lower bound ms, system, median step ms, samples/s, speed-up over mwms, step / lower bound.
    A system is flagged when other programs disturbed it or when the machine's CPU was the limit.
    """
    head = ("| model | N | batch | comm/comp | link | compute ms | bound ms | system | step ms | "
            "samples/s | vs mwms | step/bound |")
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
            if _finite(noise) and noise > NOISY_CORES:
                label += f" (noisy: other programs used {noise:.1f} cores)"
            busy = res.get("machine_cpu")
            if _finite(busy) and busy >= CPU_LIMITED_FRACTION:
                label += f" (CPU-limited: cores {busy:.0%} busy)"
            compute = _fmt(st["compute_s"] * 1e3, ".0f")
            emulation = st.get("emulation") or {}
            alone = (st.get("compute_single") or {}).get("step_s_median")
            if st.get("compute_contended_s"):
                compute += f" ({st['compute_contended_s'] * 1e3:.0f})"
            elif emulation and _finite(alone):
                compute += f" (alone {alone * 1e3:.0f})"
            link = format_bandwidth(st["bandwidth_bps"])
            if _finite(emulation.get("modelled_bandwidth_bps")):
                link += f" ({format_bandwidth(emulation['modelled_bandwidth_bps'])})"
            cells = [st["model"], str(st["workers"]), str(st.get("global_batch", "")),
                     _fmt(ratio, ".2g"), link,
                     compute, _fmt(st["lower_bound_s"] * 1e3, ".0f")]
            if not first:
                cells = [""] * len(cells)
            step = res.get("step_s_median")
            cells += [label, _fmt(step * 1e3 if step is not None else None, ".0f"),
                      _fmt(res.get("samples_per_s"), ".1f"),
                      _fmt(res.get("speedup_vs_mwms"), ".2f", "x"),
                      _fmt(res.get("ratio_to_lower_bound"), ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
            first = False
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("model", "workers", "global_batch", "compute", "comm_compute_ratio",
              "bandwidth_bps", "gradient_bytes", "compute_s", "compute_contended_s",
              "lower_bound_s", "time_scale", "accelerator_tflops", "accelerator_s",
              "modelled_bandwidth_bps", "system", "step_s_median", "samples_per_s",
              "speedup_vs_mwms", "ratio_to_lower_bound", "schedule_effective", "cross_barrier",
              "foreign_cores", "machine_cpu", "workers_cpu", "attempts", "note", "error")


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

    A dashed line marks mwms / lower bound (the best possible speed-up); a dotted one the same
    with the compute time of N workers sharing the machine, when it was measured.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for st in settings:
        groups.setdefault((st["model"], st["workers"]), []).append(st)
    if not groups:
        return
    systems = [s for s in SYSTEMS if any(s in st["results"] for st in settings)]
    colors = {"prophet": "#d62728", "prophet_nocross": "#ff9896", "priority": "#1f77b4",
              "fifo": "#7f7f7f", "auto": "#9467bd", "mwms": "#2ca02c"}
    fig, axes = plt.subplots(1, len(groups), figsize=(max(5.5, 4.8 * len(groups)), 4.2),
                             squeeze=False)
    width = 0.8 / max(1, len(systems))
    for ax, ((model, n), sts) in zip(axes[0], groups.items()):
        for j, system in enumerate(systems):
            ys = [st["results"].get(system, {}).get("speedup_vs_mwms") for st in sts]
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(sts))]
            ax.bar(xs, [y if y is not None else 0 for y in ys], width, label=system,
                   color=colors.get(system))
        for i, st in enumerate(sts):
            m = st["results"].get("mwms", {}).get("step_s_median")
            if m and st["lower_bound_s"]:
                ax.hlines(m / st["lower_bound_s"], i - 0.45, i + 0.45, colors="black",
                          linestyles="dashed", label="bound" if i == 0 else None)
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


# ------------------------------------------------------------------------------------------------
# Worker side (runs inside the launched processes)


def machine_busy_s() -> Optional[float]:
    """CPU seconds all cores of this machine have spent busy since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]      # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def foreign_cores(results: Mapping[int, Mapping[str, Any]]) -> Optional[float]:
    """Average number of cores busy with work other than the workers', during rank 0's window.

    ``machine busy time - sum of the workers' own CPU time``, over the window, divided by its
    length. Includes the kernel's network processing that is not charged to the workers (small).
    """
    r0 = results.get(0, {})
    window, busy = r0.get("window_s"), r0.get("window_machine_busy_s")
    own = [r.get("window_cpu_s") for r in results.values()]
    if not window or busy is None or any(o is None for o in own):
        return None
    return max(0.0, (busy - sum(own)) / window)


def _set_thread_env(intra: int, inter: int) -> None:
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(intra)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(inter)
    os.environ["OMP_NUM_THREADS"] = str(intra)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _make_strategy(system: str, tf: Any, prophet_options: Mapping[str, Any]) -> tuple[Any, dict]:
    """The strategy of ``system`` (None for ``single``) and facts about it for the report."""
    facts: dict[str, Any] = {}
    if system == "single":
        return None, facts
    if system == "mwms":
        impl = tf.distribute.experimental.CommunicationImplementation.RING
        comm = tf.distribute.experimental.CommunicationOptions(implementation=impl)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm), facts
    import inspect

    from prophet_tf.strategy import ProphetStrategy
    schedule, cross = PROPHET_SYSTEMS[system]
    kwargs = dict(prophet_options)
    supported = "cross_barrier" in inspect.signature(ProphetStrategy.__init__).parameters
    facts["cross_barrier_supported"] = supported
    if supported:
        kwargs["cross_barrier"] = cross
        facts["cross_barrier"] = cross
    else:
        facts["cross_barrier"] = None  # the strategy's only behaviour
    strategy = ProphetStrategy(schedule=schedule, **kwargs)
    facts["schedule_effective"] = strategy.schedule
    return strategy, facts


def _model_config(config: Mapping[str, Any]) -> Any:
    from prophet_tf.bench import models
    fields = {k: v for k, v in config["model"].items() if k != "name"}
    return models.config_for(config["model"]["name"], config.get("compute", "real"), **fields)


def _layer_specs(config: Mapping[str, Any]) -> list:
    """The emulated model's layer specs: from ``config["spec_path"]`` or from the real model."""
    from prophet_tf.bench import emulated, models
    cfg = _model_config(config)
    return emulated.load_or_make_specs(config.get("spec_path"), lambda: models.build_model(cfg))


def describe_model(config: Mapping[str, Any]) -> None:
    """Worker task ``specs``: stores the layer specs at ``config["spec_path"]``."""
    _set_thread_env(config["intra_threads"], config["inter_threads"])
    specs = _layer_specs(config)
    print("RESULT " + json.dumps({"system": "specs", "rank": 0, "layers": len(specs)}),
          flush=True)


def describe_specs(specs: Sequence[Any], batch: int, tflops: float) -> dict[str, Any]:
    """What the orchestrator needs from a model's layer specs: gradient bytes and count,
    parameters, FLOPs per step and the accelerator's time per step (time scale 1)."""
    from prophet_tf.bench import emulated
    grads = [w for s in specs for w in s.weights if w.trainable]
    return {"layers": len(specs), "num_gradients": len(grads),
            "gradient_bytes": sum(s.gradient_bytes() for s in specs),
            "params": sum(math.prod(w.shape) for w in grads),
            "step_flops": emulated.step_flops(specs, batch),
            "accelerator_s": emulated.accelerator_step_s(specs, batch, tflops)}


def _build_model(config: Mapping[str, Any], cfg: Any,
                 specs: Optional[Sequence[Any]]) -> tuple[Any, Any]:
    """The model to train and its loss: the real model, or (with ``specs``) its emulated twin."""
    from prophet_tf.bench import emulated, models
    if specs is None:
        return models.build_model(cfg), models.loss_name(cfg)
    import keras
    model = emulated.build_emulated_model(specs, int(config["batch_per_worker"]),
                                          config["accelerator_tflops"], config["time_scale"],
                                          cfg.classes, name=f"{cfg.name}_emulated")
    return model, keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _training_data(config: Mapping[str, Any], cfg: Any, global_batch: int) -> tuple[Any, Any]:
    import numpy as np

    from prophet_tf.bench import models
    if config.get("compute", "real") == "emulated":
        # The emulated layers ignore their input: a [batch, 1] placeholder and real labels.
        labels = np.random.default_rng(1).integers(0, cfg.classes, size=(global_batch,))
        return np.zeros((global_batch, 1), np.float32), labels.astype(np.int32)
    return models.synthetic_batch(cfg, global_batch, seed=1)


def run_worker(config: Mapping[str, Any]) -> None:
    """Trains ``config["model"]`` with ``config["system"]`` and prints ``RESULT {json}``.

    Config keys: system, model (a :class:`ModelConfig` dict), batch_per_worker, steps, warmup,
    intra_threads, inter_threads, prophet_options; compute (``real``/``emulated``) and, for
    emulated compute, accelerator_tflops, time_scale and spec_path (layer specs shared by the
    workers). System ``specs`` only writes the layer specs (:func:`describe_model`).
    """
    t_start = time.perf_counter()
    system = config["system"]
    if system == "specs":
        describe_model(config)
        return
    if system == "single":
        os.environ.pop("TF_CONFIG", None)
    _set_thread_env(config["intra_threads"], config["inter_threads"])
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(config["intra_threads"])
    tf.config.threading.set_inter_op_parallelism_threads(config["inter_threads"])
    import keras

    from prophet_tf.bench import models

    strategy, facts = _make_strategy(system, tf, config.get("prophet_options") or {})
    if strategy is None:
        rank, world = 0, 1
    elif system == "mwms":
        resolver = strategy.cluster_resolver
        rank, world = int(resolver.task_id), strategy.num_replicas_in_sync
    else:
        rank, world = strategy.rank, strategy.world_size
    cfg = _model_config(config)
    per_worker = int(config["batch_per_worker"])
    global_batch = per_worker * world
    # Any real model the specs need is built here, outside the strategy's scope.
    specs = _layer_specs(config) if config.get("compute", "real") == "emulated" else None

    scope = strategy.scope() if strategy is not None else _null_context()
    with scope:
        model, loss = _build_model(config, cfg, specs)
        model.compile(optimizer=models.make_optimizer(), loss=loss)
    x, y = _training_data(config, cfg, global_batch)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().with_options(options)

    local_batch = global_batch
    if strategy is not None:
        # Check the per-worker batch the strategy hands to each replica (global batch / N).
        element = next(iter(strategy.experimental_distribute_dataset(dataset)))
        local_batch = int(strategy.experimental_local_results(element[0])[0].shape[0])
        if local_batch != per_worker:
            raise RuntimeError(f"{system}: every worker should get {per_worker} examples per step, "
                               f"got {local_batch}")

    class StepTimes(keras.callbacks.Callback):
        """Timestamps the start and end of every training step."""

        def __init__(self) -> None:
            super().__init__()
            self.begin: list[float] = []
            self.end: list[float] = []
            self.cpu: list[float] = []
            self.machine: list[Optional[float]] = []
            self.first_step_cpu: Optional[float] = None

        def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
            if rate_change and len(self.begin) == rate_change["step"]:
                _change_link_rate(rate_change, strategy if system in PROPHET_SYSTEMS else None)
            self.begin.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.machine.append(machine_busy_s())

        def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            self.end.append(time.perf_counter())
            if len(self.end) == 1:
                self.first_step_cpu = time.process_time() - self.cpu[0]

    rate_change = config.get("rate_change")
    warmup, steps = int(config["warmup"]), int(config["steps"])
    timer = StepTimes()
    t_fit = time.perf_counter()
    startup_cpu = time.process_time()
    total = warmup + steps + 1
    if system == "mwms":
        # Keras 3 `fit` cannot run under MultiWorkerMirroredStrategy (its symbolic build calls
        # strategy.reduce on the (x, y) tuple of PerReplica values and fails: keras-team/keras
        # #20585): the same train step as `fit`, as a custom loop with the same callback.
        _custom_loop(strategy, model, dataset, total, timer, tf)
    else:
        model.fit(dataset, epochs=1, steps_per_epoch=total, callbacks=[timer], verbose=0)
    t_done = time.perf_counter()
    periods = step_periods(timer.begin, warmup)[:steps]
    busy = [e - b for b, e in zip(timer.begin, timer.end)][warmup:warmup + steps]
    cpu = timer.cpu[warmup:warmup + steps + 1]
    busy_machine = timer.machine[warmup:warmup + steps + 1]
    window = timer.begin[warmup:warmup + steps + 1]
    result = {
        "system": system, "rank": rank, "workers": world, "model": cfg.name,
        "batch_per_worker": per_worker, "local_batch": local_batch,
        "step_s_median": median(periods), "step_s": periods,
        "busy_s_median": median(busy),
        # CPU seconds (all threads of this process) per measured step
        "cpu_s_per_step": (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None,
        # the measured window: its length, this process's CPU time, the whole machine's busy time
        "window_s": window[-1] - window[0] if len(window) > 1 else None,
        "window_cpu_s": cpu[-1] - cpu[0] if len(cpu) > 1 else None,
        "window_machine_busy_s": (busy_machine[-1] - busy_machine[0]
                                  if len(busy_machine) > 1 and busy_machine[0] is not None
                                  and busy_machine[-1] is not None else None),
        "first_step_s": (timer.end[0] - timer.begin[0]) if timer.end else None,
        "startup_s": t_fit - t_start, "fit_s": t_done - t_fit,
        # CPU seconds of this process before training and in the first step (tracing): what
        # start-up costs on a machine that gives every worker a core of its own
        "startup_cpu_s": startup_cpu, "first_step_cpu_s": timer.first_step_cpu,
        "params": models.parameter_count(model), "gradient_bytes": models.gradient_bytes(model),
        "num_gradients": len(model.trainable_weights),
        "max_rss_bytes": _max_rss_bytes(),
        **facts,
    }
    if strategy is not None and hasattr(strategy, "schedule_in_use"):
        result["schedule_in_use"] = strategy.schedule_in_use
        result["schedule_decisions"] = [dict(step=d.step, schedule=d.schedule, reason=d.reason)
                                        for d in strategy.schedule_decisions]
    print("RESULT " + json.dumps(_json_safe(result)), flush=True)
    _fast_exit(strategy, system, tf)


def _change_link_rate(change: Mapping[str, Any], strategy: Any) -> None:
    """Sets this worker's host link to ``change["bandwidth_bps"]`` (``tc`` inside the host's
    namespace) and marks the moment on the timeline's "bench" track."""
    subprocess.run(change["argv"], check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if strategy is not None:
        from prophet_tf import runtime
        runtime.timeline_event("bench", f"tc rate -> {format_bandwidth(change['bandwidth_bps'])}",
                               time.monotonic_ns())


def _max_rss_bytes() -> Optional[int]:
    try:
        import resource
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024   # KiB on Linux
    except (ImportError, OSError):
        return None


def worker_memory_bytes(gradient_bytes: float) -> float:
    """Rough peak memory of one worker: TensorFlow and Keras (~1.2 GB) plus about 6 copies of
    the gradient bytes (weights, optimizer slot, gradients, summed gradients, runtime buffers)."""
    return 1.2e9 + 6.0 * float(gradient_bytes)


def available_memory_bytes() -> Optional[float]:
    """``MemAvailable`` of this machine (``/proc/meminfo``), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fast_exit(strategy: Any, system: str, tf: Any) -> None:
    """Exits right away once every worker is done (TensorFlow's teardown takes seconds).

    A final collective makes sure no worker still needs a peer; if it fails, the worker returns
    and exits normally.
    """
    try:
        if system == "mwms":
            one = strategy.run(lambda: tf.constant(1.0))
            strategy.reduce(tf.distribute.ReduceOp.SUM, one, axis=None).numpy()
        elif strategy is not None:
            strategy.barrier()
    except Exception as e:  # noqa: BLE001 - fall back to a normal exit
        print(f"final barrier failed ({type(e).__name__}: {e}); exiting normally", flush=True)
        return
    if system in PROPHET_SYSTEMS:
        from prophet_tf import runtime
        runtime.timeline_flush()   # os._exit skips the shutdown that would write it out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _custom_loop(strategy: Any, model: Any, dataset: Any, steps: int, timer: Any, tf: Any) -> None:
    """``fit``'s train step as a loop: forward, loss / N, gradients, ``apply_gradients``.

    The optimizer all-reduces the gradients inside ``apply_gradients`` exactly as under ``fit``
    (``TFOptimizer`` -> ``ReplicaContext.all_reduce``). ``timer`` gets the same
    ``on_train_batch_begin``/``end`` calls as under ``fit``; the loss is fetched every step, as
    ``fit`` does for callbacks that need logs.
    """
    optimizer = model.optimizer
    loss_fn = model.loss
    if isinstance(loss_fn, str):
        import keras
        loss_fn = keras.losses.get(loss_fn)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    replicas = strategy.num_replicas_in_sync
    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def step_fn(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            pred = model(x, training=True)
            loss = tf.reduce_mean(loss_fn(y, pred)) / replicas
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train_step(it: Any) -> Any:
        x, y = next(it)
        per_replica = strategy.run(step_fn, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    for i in range(steps):
        timer.on_train_batch_begin(i)
        float(train_step(iterator).numpy())
        timer.on_train_batch_end(i)


class _null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


# ------------------------------------------------------------------------------------------------
# Orchestrator


@dataclasses.dataclass
class SweepOptions:
    """Everything the sweep needs (the command-line flags, resolved)."""

    models: list[str]
    workers: list[int]
    ratios: list[float]
    systems: list[str]
    batch: Optional[int] = None           # per-worker batch; None = the model's default
    steps: int = 10
    warmup: int = 3
    loopback: bool = False
    out: str = "bench_out"
    json_path: Optional[str] = None
    intra_threads: int = 1
    inter_threads: int = 2
    launch_timeout: float = 600.0
    verbose: bool = False
    prophet_options: dict = dataclasses.field(default_factory=dict)
    model_overrides: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    contended: bool = True                # also time N independent workers at once
    meta: dict = dataclasses.field(default_factory=dict)   # filled by run_sweep
    retries: int = 1                      # re-runs of a launch disturbed by other programs
    noise_cores: float = 0.3              # ... i.e. that used more than this many cores
    compute: str = "real"                 # "real" (this machine's CPU) or "emulated"
    accelerator_tflops: float = 100.0     # emulated accelerator rate
    time_scale: Optional[float] = None    # emulated: None = emulated_time_scale per model and N
    link_budget_bps: float = DEFAULT_LINK_BUDGET_BPS
    netns_prefix: str = NETNS_PREFIX
    timeline: Optional[str] = None        # write a timeline per ProphetStrategy launch
    alone: bool = False                   # emulated: also time one worker alone
    grid: Optional[list] = None           # [(model, workers, ratios)]; None: the cartesian
                                          # product of models, workers and ratios
    rate_change: Optional[tuple[int, float]] = None  # (step K, factor): every host's link rate
                                          # becomes factor x the setting's rate at step K
    mwms_ratios: Optional[tuple[float, ...]] = None  # mwms runs only at these comm/comp ratios
                                          # (None: at all)


#: Default per-worker batch of each model under real compute (0.3-0.6 s per step here).
DEFAULT_BATCH = {"resnet50": 16, "vgg16": 16, "transformer": 16, "bert_base": 16}
#: Default per-worker batch under emulated compute (typical per-GPU batches of these models).
EMULATED_BATCH = {"resnet50": 64, "vgg16": 64, "transformer": 32, "bert_base": 32}


def default_batch(model: str, compute: str) -> int:
    """The per-worker batch of ``model`` when ``--batch`` is not given."""
    return (EMULATED_BATCH if compute == "emulated" else DEFAULT_BATCH)[model]


class _Tee(io.TextIOBase):
    """Collects launcher output (and echoes it when verbose)."""

    def __init__(self, echo: Optional[TextIO]) -> None:
        super().__init__()
        self.lines: list[str] = []
        self._buf = ""
        self._echo = echo
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._buf += s
            *done, self._buf = self._buf.split("\n")
            self.lines.extend(done)
            if self._echo is not None:
                self._echo.write(s)
                self._echo.flush()
        return len(s)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.lines + ([self._buf] if self._buf else []))


class LaunchFailed(RuntimeError):
    """A system's launch did not produce a result."""


class Interrupted(KeyboardInterrupt):
    """The sweep was stopped by SIGINT/SIGTERM (workers and namespaces are cleaned up)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


def parse_results(lines: Iterable[str]) -> dict[int, dict]:
    """``{rank: result}`` from ``[rank i] RESULT {json}`` launcher output lines."""
    out: dict[int, dict] = {}
    for line in lines:
        m = _RESULT_RE.match(line.strip())
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def _leftover_namespace_pids(cluster: Any) -> list[int]:
    pids: list[int] = []
    for ns in getattr(cluster, "namespaces", []):
        r = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        pids += [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]
    return pids


def _reap_namespaces(cluster: Any) -> int:
    """Kills any process still inside the cluster's namespaces; returns how many there were."""
    pids = _leftover_namespace_pids(cluster)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def timeline_pattern(base: str, launch_name: str) -> str:
    """Where a launch writes its timeline (``{rank}`` = the worker's rank).

    ``base`` is a directory, or a ``.json`` path whose stem then prefixes every launch's files.
    """
    if base.endswith(".json"):
        return f"{base[:-len('.json')]}.{launch_name}.{{rank}}.json"
    return os.path.join(base, f"{launch_name}.{{rank}}.json")


def worker_config(system: str, cfg: Mapping[str, Any], batch: int, opts: SweepOptions,
                  emulation: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The configuration a worker of ``system`` gets (see :func:`run_worker`)."""
    return {"system": system, "model": dict(cfg), "batch_per_worker": batch,
            "steps": opts.steps, "warmup": opts.warmup, "intra_threads": opts.intra_threads,
            "inter_threads": opts.inter_threads, "prophet_options": opts.prophet_options,
            **(emulation or {"compute": "real"})}


def _launch_system(system: str, n: int, cluster: Any, cfg: Mapping[str, Any], batch: int,
                   opts: SweepOptions, timeout: float, log_name: str = "",
                   emulation: Optional[Mapping[str, Any]] = None) -> dict[int, dict]:
    """Runs one system as ``n`` worker processes; returns ``{rank: result}`` (rank 0 always).

    ``emulation``: the worker-config keys of emulated compute (``compute``, ``time_scale``, ...);
    None = real compute. The workers' output goes to ``OUT/logs/LOG_NAME.log``.
    """
    from prophet_tf.launch import launch

    log_name = log_name or f"{cfg['name']}_{system}_n{n}"
    config = worker_config(system, cfg, batch, opts, emulation)
    argv = ["-m", "prophet_tf.bench.train", "--worker", json.dumps(config)]
    timeline = (timeline_pattern(opts.timeline, log_name)
                if opts.timeline and system in PROPHET_SYSTEMS else "")
    if timeline:
        os.makedirs(os.path.dirname(os.path.abspath(timeline)), exist_ok=True)
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (repo_root(), os.environ.get("PYTHONPATH"))
                                         if p),
           # gRPC (mwms) must not try a proxy from inside the namespaces
           "no_proxy": "*", "NO_PROXY": "*", "grpc_proxy": "", "http_proxy": "",
           "https_proxy": "",
           # One trace per launch (an inherited PROPHET_TIMELINE would be overwritten by each)
           "PROPHET_TIMELINE": timeline}
    kwargs: dict[str, Any] = {}
    if cluster is not None and n > 1 and not opts.loopback:
        kwargs = {"hosts": [cluster.host_address(i) for i in range(n)],
                  "wrap_argv": cluster.exec_argv}
        if opts.rate_change is not None:
            step, factor = opts.rate_change
            # Each worker changes its own host's link at the start of step K (all hosts within
            # one step of each other), so the change lands at a known point of training.
            new_bps = cluster.bandwidth_bps * factor
            argv[-1] = json.dumps({**config, "rate_change": {
                "step": step, "bandwidth_bps": new_bps,
                "argv": cluster.rate_change_argv(new_bps)}})
    tee = _Tee(sys.stderr if opts.verbose else None)
    t_launch = time.monotonic()
    try:
        code = launch(argv, n, timeout=timeout, env=env, threads=None, stdout=tee, stderr=tee,
                      grace=3.0, **kwargs)
    finally:
        _save_log(opts, log_name, tee.text(), time.monotonic() - t_launch)
    if cluster is not None and not opts.loopback and n > 1:
        left = _reap_namespaces(cluster)
        if left:
            sys.stderr.write(f"  (killed {left} process(es) left in the namespaces)\n")
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        raise Interrupted(f"interrupted during {system}", code - 128)
    results = parse_results(tee.lines + [tee.text().rsplit("\n", 1)[-1]])
    if code != 0 or 0 not in results:
        tail = "\n".join(tee.text().splitlines()[-25:])
        raise LaunchFailed(f"{system}: launcher exit status {code}"
                           f"{' (timeout)' if code == 124 else ''}; last output:\n{tail}")
    return results


def _save_log(opts: SweepOptions, name: str, text: str, seconds: float) -> None:
    try:
        d = os.path.join(opts.out, "logs")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".log"), "w") as f:
            f.write(text)
            f.write(f"\n[bench] launch took {seconds:.1f} s\n")
    except OSError:
        pass


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source_state() -> str:
    """``commit`` plus the files that differ from it (the tree may be edited while we run)."""
    root = repo_root()
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10)
        st = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    changed = [line[3:] for line in st.stdout.splitlines() if line.strip()]
    return head.stdout.strip() + (f" with local changes in {', '.join(changed)}" if changed else "")


def _make_cluster(n: int, bandwidth_bps: Optional[float], loopback: bool,
                  prefix: str = NETNS_PREFIX) -> Any:
    from prophet_tf.bench.netem import EmulatedCluster, LoopbackCluster
    if loopback:
        return LoopbackCluster(n)
    return EmulatedCluster(n, bandwidth_bps=bandwidth_bps, prefix=prefix)


class _Progress:
    """Progress lines on stdout: ``[k/total] elapsed ... what``."""

    def __init__(self, total: int, stream: TextIO = sys.stdout) -> None:
        self.total, self.done, self.t0, self.stream = total, 0, time.monotonic(), stream

    def start(self, what: str) -> None:
        el = time.monotonic() - self.t0
        self.stream.write(f"[{self.done + 1}/{self.total}  {el:5.0f} s] {what} ... ")
        self.stream.flush()

    def finish(self, text: str) -> None:
        self.done += 1
        self.stream.write(text + "\n")
        self.stream.flush()


def _measure(system: str, n: int, cluster: Any, cfg: Any, batch: int, opts: SweepOptions,
             timeout: float, log: str, progress: _Progress,
             emulation: Optional[Mapping[str, Any]] = None) -> tuple[dict[int, dict], dict]:
    """One launch of ``system``, repeated (up to ``opts.retries`` times) while other programs
    used more than ``opts.noise_cores`` cores during the measured steps; keeps the quietest.

    Returns ``({rank: result}, facts)`` with facts ``foreign_cores``, ``attempts``, ``launch_s``.
    Raises :class:`LaunchFailed` when no attempt produced a result.
    """
    best: Optional[tuple[dict[int, dict], dict]] = None
    for attempt in range(1 + max(0, opts.retries)):
        t0 = time.monotonic()
        runs = _launch_system(system, n, cluster, cfg.to_dict(), batch, opts, timeout,
                              log + (f"_retry{attempt}" if attempt else ""), emulation)
        foreign = foreign_cores(runs)
        machine_cpu, workers_cpu = cpu_fraction(runs, os.cpu_count() or 1)
        facts = {"foreign_cores": foreign, "attempts": attempt + 1,
                 "launch_s": time.monotonic() - t0, "machine_cpu": machine_cpu,
                 "workers_cpu": workers_cpu}
        kept = None if best is None else best[1]["foreign_cores"]
        if best is None or (foreign is not None and (kept is None or foreign < kept)):
            best = (runs, facts)
        best[1]["attempts"] = attempt + 1
        if foreign is None or foreign <= opts.noise_cores or attempt >= opts.retries:
            break
        progress.stream.write(f"(other programs used {foreign:.2f} cores: again) ")
        progress.stream.flush()
    assert best is not None
    return best


def sweep_cells(opts: SweepOptions) -> list[tuple[str, list[tuple[int, tuple[float, ...]]]]]:
    """``[(model, [(workers, ratios), ...]), ...]`` in the order they run: ``opts.grid`` grouped
    by model, or every model x worker count with all of ``opts.ratios``."""
    if opts.grid:
        by_model: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
        for model, n, ratios in opts.grid:
            by_model.setdefault(model, []).append((int(n), tuple(float(r) for r in ratios)))
        return list(by_model.items())
    return [(m, [(n, tuple(opts.ratios)) for n in opts.workers]) for m in opts.models]


def run_sweep(opts: SweepOptions) -> list[dict]:
    """Runs every setting; returns the list of setting objects (see :func:`make_setting`)."""
    from prophet_tf.bench import models as models_mod

    if not opts.loopback:
        from prophet_tf.bench.netem import EmulatedCluster
        EmulatedCluster.check_available()   # NetemUnavailableError says: root or --loopback
    opts.meta.update(started=datetime.datetime.now().isoformat(timespec="seconds"),
                     loadavg_start=os.getloadavg(), t0=time.monotonic(), source=_source_state())
    multi = [s for s in opts.systems if s in SYSTEMS]
    emulated = opts.compute == "emulated"
    cells = sweep_cells(opts)

    def systems_at(ratio: Optional[float]) -> list[str]:
        return [s for s in multi if s != "mwms" or opts.mwms_ratios is None or ratio is None
                or ratio in opts.mwms_ratios]

    def per_n(ratios: Sequence[float]) -> int:
        # [one worker alone (emulated, with --alone: its time scale depends on N)], [N uncoupled
        # workers], the settings
        return ((1 if emulated and opts.alone else 0) + (1 if opts.contended else 0)
                + (len(multi) if opts.loopback else sum(len(systems_at(r)) for r in ratios)))

    progress = _Progress(sum(1 + sum(per_n(r) for _, r in runs) for _, runs in cells))
    settings: list[dict] = []
    for model, runs in cells:
        cfg = models_mod.config_for(model, opts.compute, **opts.model_overrides.get(model, {}))
        batch = opts.batch or default_batch(model, opts.compute)
        single: Optional[tuple[float, int, dict]] = None
        described: Optional[dict] = None
        # Per model: the layer specs (emulated) or one worker alone (real).
        if emulated:
            described = _describe(model, cfg, batch, opts, progress)
        else:
            single = _measure_single(model, 1, cfg, batch, opts, progress, None)
        if (described if emulated else single) is None:
            progress.done += sum(per_n(r) for _, r in runs)
            continue
        for n, ratios in runs:
            gbytes_known = (described or {}).get("gradient_bytes") or (single or (0, 0))[1]
            need, have = n * worker_memory_bytes(gbytes_known), available_memory_bytes()
            if have is not None and need > 0.9 * have:
                why = (f"{model} with {n} workers skipped: they need about {need / 1e9:.0f} GB of "
                       f"memory, {have / 1e9:.0f} GB are available")
                print(f"  ({why})", flush=True)
                opts.meta.setdefault("skipped", []).append(why)
                progress.done += per_n(ratios)
                continue
            emulation: Optional[dict] = None
            if described is not None:
                scale = opts.time_scale or emulated_time_scale(
                    described["gradient_bytes"], n, described["accelerator_s"],
                    opts.link_budget_bps)
                emulation = {"compute": "emulated", "accelerator_tflops": opts.accelerator_tflops,
                             "time_scale": scale, "spec_path": described["spec_path"]}
                # The bound's and the bandwidths' compute time is the emulated accelerator's:
                # no system can be faster, and it does not depend on this machine's load.
                single = (described["accelerator_s"] * scale, int(described["gradient_bytes"]),
                          {})
                if opts.alone:
                    alone = _measure_single(model, n, cfg, batch, opts, progress, emulation)
                    if alone is not None:
                        single[2].update(alone[2], step_s_median=alone[0])
            assert single is not None
            compute_s, gbytes, single_info = single
            contended, contended_info = (_measure_contended(model, n, cfg, batch, opts, progress,
                                                            emulation)
                                         if opts.contended else (None, {}))
            if opts.loopback:
                plan: list[tuple[Optional[float], Optional[float]]] = [(None, None)]
            else:
                bws = choose_bandwidths(gbytes, n, compute_s, ratios)
                plan = list(zip(ratios, bws))
            for ratio, bw in plan:
                st = _run_setting(model, n, cfg, batch, ratio, bw, compute_s, gbytes,
                                  systems_at(ratio), opts, progress, emulation)
                st["compute_contended_s"] = contended
                # The same bound with the compute time of N workers sharing this machine.
                st["lower_bound_contended_s"] = (None if contended is None else
                                                 lower_bound_s(contended, gbytes, n, bw))
                st["compute_single"] = single_info
                st["compute_contended"] = contended_info
                if emulation is not None and described is not None:
                    st["emulation"] = _emulation_facts(described, emulation, bw)
                settings.append(st)
                _write_outputs(settings, opts, final=False)
    _write_outputs(settings, opts, final=True)
    return settings


def _emulation_facts(described: Mapping[str, Any], emulation: Mapping[str, Any],
                     bw: Optional[float]) -> dict[str, Any]:
    """What an emulated setting stands for: the modelled accelerator's step and link rate."""
    scale = float(emulation["time_scale"])
    return {"time_scale": scale, "accelerator_tflops": emulation["accelerator_tflops"],
            "spec_path": emulation["spec_path"],
            "accelerator_s": described["accelerator_s"] * scale,
            "modelled_accelerator_s": described["accelerator_s"],
            "modelled_bandwidth_bps": bw * scale if bw else None,
            "step_flops": described["step_flops"], "layers": described["layers"],
            "num_gradients": described["num_gradients"]}


def _describe(model: str, cfg: Any, batch: int, opts: SweepOptions,
              progress: _Progress) -> Optional[dict]:
    """Emulated compute: the model's layer specs (built once from the real model, by a worker
    process, and kept in ``OUT/specs/`` under a name that depends on the model's configuration)
    and what the orchestrator needs from them (gradient bytes, accelerator time...)."""
    from prophet_tf.bench import emulated
    key = hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    spec_path = os.path.abspath(os.path.join(opts.out, "specs", f"{model}-{key}.json"))
    progress.start(f"{model}: layer specs from the real model (variables, FLOPs)")
    if not os.path.exists(spec_path):
        emulation = {"compute": "emulated", "accelerator_tflops": opts.accelerator_tflops,
                     "time_scale": 1.0, "spec_path": spec_path}
        try:
            _launch_system("specs", 1, None, cfg.to_dict(), batch, opts, opts.launch_timeout,
                           f"{model}_specs", emulation)
        except LaunchFailed as e:
            progress.finish("FAILED")
            sys.stderr.write(f"{e}\n")
            return None
    with open(spec_path) as f:
        specs = emulated.specs_from_json(f.read())
    info = dict(describe_specs(specs, batch, opts.accelerator_tflops), spec_path=spec_path)
    progress.finish(f"{info['params'] / 1e6:.1f}M parameters in {info['num_gradients']} tensors "
                    f"({info['gradient_bytes'] / 1e6:.1f} MB of gradients), {info['layers']} "
                    f"layers, {info['step_flops'] / 1e12:.2f} TFLOP per step = "
                    f"{info['accelerator_s'] * 1e3:.1f} ms at {opts.accelerator_tflops:g} TFLOP/s")
    return info


def _measure_single(model: str, n: int, cfg: Any, batch: int, opts: SweepOptions,
                    progress: _Progress, emulation: Optional[Mapping[str, Any]]
                    ) -> Optional[tuple[float, int, dict]]:
    """One worker alone, no strategy: ``(compute_s, gradient_bytes, facts)`` or None."""
    what = f"{model}: one worker alone, batch {batch} (compute time"
    log = f"{model}_single"
    if emulation is not None:
        what += f" for N={n}: emulated, time scale {emulation['time_scale']:g}"
        log = f"{model}_n{n}_single"
    progress.start(what + ")")
    try:
        runs, facts = _measure("single", 1, None, cfg, batch, opts, opts.launch_timeout, log,
                               progress, emulation)
    except LaunchFailed as e:
        progress.finish("FAILED")
        sys.stderr.write(f"{e}\n")
        return None
    single = runs[0]
    compute_s, gbytes = single["step_s_median"], int(single["gradient_bytes"])
    progress.finish(f"{compute_s * 1e3:.0f} ms/step, {single['params'] / 1e6:.1f}M "
                    f"parameters in {single['num_gradients']} tensors, {gbytes / 1e6:.1f} MB "
                    f"of gradients{_noise_text(facts)}")
    info = {k: single.get(k) for k in ("step_s", "params", "num_gradients", "busy_s_median",
                                       "cpu_s_per_step")}
    info.update(facts)
    return compute_s, gbytes, info


def _measure_contended(model: str, n: int, cfg: Any, batch: int, opts: SweepOptions,
                       progress: _Progress, emulation: Optional[Mapping[str, Any]]
                       ) -> tuple[Optional[float], dict]:
    """N uncoupled single workers at once: the compute time when N workers share this machine."""
    progress.start(f"{model}: {n} independent workers at once (compute time when sharing the "
                   "machine, no communication)")
    try:
        runs, facts = _measure("single", n, None, cfg, batch, opts, opts.launch_timeout,
                               f"{model}_contended_n{n}", progress, emulation)
    except LaunchFailed as e:
        progress.finish("FAILED")
        sys.stderr.write(f"{e}\n")
        return None, {}
    contended = median([r["step_s_median"] for r in runs.values()])
    info = {"step_s_medians": [runs[r]["step_s_median"] for r in sorted(runs)],
            "cpu_s_per_step": [runs[r].get("cpu_s_per_step") for r in sorted(runs)], **facts}
    progress.finish(f"{contended * 1e3:.0f} ms/step{_noise_text(facts)}")
    return contended, info


def _launch_text(launch_s: float, result: Mapping[str, Any]) -> str:
    """``"44 s: start-up 10 s (CPU 6 s), first step 12 s (CPU 7 s)"``: where a launch's time
    went, from rank 0's result (the CPU seconds are what a worker with a core of its own needs)."""
    text = f"{launch_s:.0f} s"
    parts = []
    for what, wall, cpu in (("start-up", "startup_s", "startup_cpu_s"),
                            ("first step", "first_step_s", "first_step_cpu_s")):
        if _finite(result.get(wall)):
            part = f"{what} {result[wall]:.0f} s"
            if _finite(result.get(cpu)):
                part += f" (CPU {result[cpu]:.0f} s)"
            parts.append(part)
    return text + (": " + ", ".join(parts) if parts else "")


def _noise_text(facts: Mapping[str, Any]) -> str:
    f = facts.get("foreign_cores")
    text = "" if f is None or f < 0.1 else f" [other programs: {f:.2f} cores]"
    busy = facts.get("machine_cpu")
    if _finite(busy) and busy >= CPU_LIMITED_FRACTION:
        text += f" [CPU-limited: the machine's cores were {busy:.0%} busy]"
    return text


def _run_setting(model: str, n: int, cfg: Any, batch: int, ratio: Optional[float],
                 bw: Optional[float], compute_s: float, gbytes: int, systems: Sequence[str],
                 opts: SweepOptions, progress: _Progress,
                 emulation: Optional[Mapping[str, Any]] = None) -> dict:
    step_s: dict[str, Optional[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    where = f"{model}, N={n}, " + (f"comm/comp {ratio:g} at {format_bandwidth(bw)}" if bw
                                   else "loopback (unshaped)")
    # Worst case of the slowest system, plus start-up; generous.
    expected = compute_s * (1 + (ratio or 0)) * (opts.warmup + opts.steps + 1)
    timeout = min(opts.launch_timeout, max(300.0, 120.0 + 4.0 * expected))
    with _make_cluster(n, bw, opts.loopback, opts.netns_prefix) as cluster:
        for system in systems:
            progress.start(f"{where}: {system}")
            load_before = os.getloadavg()[0]
            log = f"{model}_n{n}_" + (f"ratio{ratio:g}" if ratio else "loopback") + f"_{system}"
            try:
                runs, facts = _measure(system, n, cluster, cfg, batch, opts, timeout, log,
                                       progress, emulation)
            except LaunchFailed as e:
                progress.finish("FAILED")
                sys.stderr.write(f"{e}\n")
                step_s[system] = None
                extra[system] = {"error": str(e).splitlines()[0]}
                continue
            res = runs[0]
            step_s[system] = res["step_s_median"]
            info: dict[str, Any] = {"step_s_all": res.get("step_s"),
                                    "busy_s_median": res.get("busy_s_median"),
                                    "startup_s": res.get("startup_s"),
                                    "first_step_s": res.get("first_step_s"),
                                    "startup_cpu_s": res.get("startup_cpu_s"),
                                    "first_step_cpu_s": res.get("first_step_cpu_s"),
                                    "fit_s": res.get("fit_s"),
                                    "cpu_s_per_step": res.get("cpu_s_per_step"),
                                    "loadavg_1m_before": load_before, **facts}
            if system in PROPHET_SYSTEMS:
                info["schedule_effective"] = res.get("schedule_effective")
                info["cross_barrier"] = res.get("cross_barrier")
                if system == "auto" and res.get("schedule_in_use"):
                    info["schedule_in_use"] = res["schedule_in_use"]
                    info["schedule_decisions"] = res.get("schedule_decisions")
                    info["note"] = f"ran {res['schedule_in_use']}"
                if not res.get("cross_barrier_supported"):
                    if system == "prophet_nocross":
                        info["note"] = "= prophet: no cross_barrier option yet"
                    note = ("ProphetStrategy has no cross_barrier option yet: prophet_nocross "
                            "runs the same configuration as prophet")
                    if note not in notes:
                        notes.append(note)
                want = PROPHET_SYSTEMS[system][0]
                if res.get("schedule_effective") not in (None, want):
                    info["note"] = f"ran {res.get('schedule_effective')}"
                if opts.timeline:
                    info["timeline"] = timeline_pattern(
                        opts.timeline, log + (f"_retry{facts['attempts'] - 1}"
                                              if facts["attempts"] > 1 else ""))
                    picture = _draw_one_step(info["timeline"], n, opts.warmup + opts.steps // 2,
                                             f"{where}: {system}, one measured step")
                    if picture:
                        info["timeline_png"] = picture
                    if opts.rate_change is not None and bw:
                        k = opts.rate_change[0]
                        info["timeline_png_rate_change"] = [
                            p for s in (k - 1, k, k + 1, k + 2, opts.warmup + opts.steps - 1)
                            if (p := _draw_one_step(info["timeline"], n, s,
                                                    f"{where}: {system}, step {s} (link rate "
                                                    f"changes at step {k})"))]
            extra[system] = info
            lb = lower_bound_s(compute_s, gbytes, n, bw)
            after = ""
            if opts.rate_change is not None and bw:
                info["rate_change"] = rate_change_summary(
                    res.get("step_s") or [], opts.warmup, opts.rate_change, compute_s, gbytes, n,
                    bw)
                after = " " + info["rate_change"]["text"]
            progress.finish(f"{res['step_s_median'] * 1e3:.0f} ms/step (bound {lb * 1e3:.0f} ms; "
                            f"launch {_launch_text(facts['launch_s'], res)}){after}"
                            f"{_noise_text(facts)}")
    return make_setting(model, n, bw, compute_s, gbytes, batch, step_s, ratio=ratio, extra=extra,
                        notes=notes, compute=opts.compute)


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


def _draw_one_step(pattern: str, n: int, step: int, title: str) -> Optional[str]:
    """Draws step ``step`` of a launch's timeline (all workers) next to its files; returns the
    PNG's path, or None when the traces cannot be drawn (the reason goes to stderr)."""
    from prophet_tf import timeline
    paths = [pattern.replace("{rank}", str(r)) for r in range(n)]
    out = pattern.replace(".{rank}.json", f".step{step}.png")
    try:
        traces = [timeline.load_trace(p) for p in paths]
        window = timeline.step_window(traces[0], step)
        timeline.plot_timeline(traces, out, title=title, window_us=window)
    except (timeline.TraceError, ImportError) as e:
        sys.stderr.write(f"  (no timeline picture: {e})\n")
        return None
    return out


def compute_summary(settings: Sequence[Mapping[str, Any]], opts: SweepOptions) -> str:
    """One paragraph saying how the workers computed (and, emulated, what the times model)."""
    if opts.compute != "emulated":
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
    return (f"Compute: emulated (an accelerator at {opts.accelerator_tflops:g} TFLOP/s; every "
            "time x the time scale, every link / the time scale; link column: tc rate "
            "(modelled rate)); compute ms = the emulated accelerator's time per step (in "
            "parentheses: one worker alone, no strategy, when measured). "
            + "; ".join(parts) + ".")


def _write_outputs(settings: Sequence[dict], opts: SweepOptions, final: bool) -> None:
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
        f.write(table)
        if notes:
            f.write("\n" + "\n".join(f"- {n}" for n in notes) + "\n")
    write_csv(os.path.join(opts.out, "results.csv"), settings)
    if settings:
        plot(settings, os.path.join(opts.out, "results.png"), title=opts.label)


# ------------------------------------------------------------------------------------------------
# Command line


def _define_flags() -> Any:
    from absl import flags
    f = flags
    f.DEFINE_enum("compute", "real", list(COMPUTE_MODES),
                  "real: this machine's CPU runs the models (small inputs); emulated: every "
                  "layer keeps its real variables but its forward and backward passes take a "
                  "fixed time on an emulated accelerator that uses no CPU (real model sizes).")
    f.DEFINE_float("accelerator_tflops", DEFAULT_ACCELERATOR_TFLOPS,
                   "Emulated compute: sustained accelerator rate in TFLOP/s that turns each "
                   "layer's FLOPs into its time.")
    f.DEFINE_alias("accelerator-tflops", "accelerator_tflops")
    f.DEFINE_float("time_scale", None, "Emulated compute: run every time this many times "
                   "slower than the modelled accelerator, and every link as much slower (default: "
                   "per model and N, so that the links at comm/comp 1 add up to "
                   "--link_budget_gbps).")
    f.DEFINE_float("link_budget_gbps", DEFAULT_LINK_BUDGET_BPS / 1e9,
                   "Emulated compute: the N hosts' links together at comm/comp 1 (sets the "
                   "default time scale; what this machine's CPU can move through the emulated "
                   "network).")
    f.DEFINE_bool("alone", False, "Emulated compute: also time one worker alone (no strategy) "
                  "per model and N: the accelerator time plus what the CPU adds (optimizer, "
                  "framework).")
    f.DEFINE_bool("full", False, "Emulated compute: the full grid (every model, 2/4/8 workers, "
                  f"comm/comp {','.join(f'{r:g}' for r in EMULATED_RATIOS)}), several hours.")
    f.DEFINE_bool("quick", False,
                  "One model, 2 workers, the setting where communication = computation, no "
                  f"contended-compute run (about 3 minutes): {QUICK_MODEL} with real compute, "
                  f"{EMULATED_QUICK_MODEL} with emulated compute.")
    f.DEFINE_list("models", None, f"Models among {', '.join(MODEL_NAMES)} (default: "
                  f"{','.join(DEFAULT_MODELS)} with real compute; emulated: see --full and the "
                  "module docstring).")
    f.DEFINE_list("workers", None, "Worker counts, 2-8 (default: 2).")
    f.DEFINE_integer("batch", None, "Per-worker batch size; the global batch is N times this "
                     f"(default per model: {DEFAULT_BATCH} real, {EMULATED_BATCH} emulated).")
    f.DEFINE_integer("steps", None, "Measured steps per run (default 10 real, "
                     f"{EMULATED_STEPS} emulated).")
    f.DEFINE_integer("warmup", None, "Unmeasured steps first (tracing, planning; default 3 "
                     f"real, {EMULATED_WARMUP} emulated).")
    f.DEFINE_list("ratios", None, "Communication/computation ratios that set the bandwidths "
                  f"(default: {','.join(f'{r:g}' for r in DEFAULT_RATIOS)} real, "
                  f"{','.join(f'{r:g}' for r in EMULATED_RATIOS)} emulated).")
    f.DEFINE_list("systems", None, f"Systems among {', '.join(SYSTEMS)} (default: all; with "
                  f"--quick {','.join(QUICK_SYSTEMS)}; emulated compute without --full "
                  f"{','.join(EMULATED_DEFAULT_SYSTEMS)}).")
    f.DEFINE_bool("loopback", False, "Run on plain loopback (no root needed, no bandwidth "
                  "shaping: one setting per model and worker count).")
    f.DEFINE_string("out", "bench_out", "Output directory (results.md, .csv, .json, .png).")
    f.DEFINE_string("json", None, "Also write the JSON list of settings to this path.")
    f.DEFINE_integer("intra_threads", 1, "TF intra-op threads per worker.")
    f.DEFINE_integer("inter_threads", 2, "TF inter-op threads per worker.")
    f.DEFINE_float("launch_timeout", 600.0, "Upper limit in seconds for one launch.")
    f.DEFINE_string("prophet_options", "{}", "JSON object of extra ProphetStrategy keyword "
                    "arguments (runtime options such as partition_bytes, credit_bytes).")
    f.DEFINE_string("model_options", "{}", 'JSON {model: {field: value}} overriding model sizes, '
                    'e.g. {"transformer": {"blocks": 2}} (see prophet_tf/bench/models.py).')
    f.DEFINE_bool("contended", None, "Also time N uncoupled single workers running at once "
                  "(compute time when N workers share this machine's cores; not in the bound). "
                  "Default: on, off with --quick.")
    f.DEFINE_integer("retries", None, "Run a launch again (keeping the quietest attempt) when "
                     "other programs used more than --noise_cores cores during its measured "
                     "steps (default 1; 0 with --quick, which flags a disturbed launch instead "
                     "of doubling its time).")
    f.DEFINE_float("noise_cores", 0.3, "See --retries.")
    f.DEFINE_string("netns_prefix", NETNS_PREFIX, "Name prefix of the emulated cluster's "
                    "network namespaces (one per concurrent benchmark run).")
    f.DEFINE_string("timeline", None, "Write a timeline per ProphetStrategy launch into this "
                    "directory (or next to this .json path; default $PROPHET_TIMELINE) and draw "
                    "one measured step of each (PNG next to the traces).")
    f.DEFINE_string("rate_change", None, "STEP:FACTOR: at the start of training step STEP (0 = "
                    "the first, warm-up included) every host's link rate becomes FACTOR times "
                    "the setting's rate (e.g. 15:0.5), to watch Prophet re-plan; the output "
                    "gives the step times before and after, and --timeline draws the steps "
                    "around it. Needs the emulated cluster (not --loopback).")
    f.DEFINE_bool("verbose", False, "Echo the workers' output.")
    f.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")
    return flags.FLAGS


def options_from_flags(flags_: Any) -> SweepOptions:
    """Resolves the command-line flags (and ``--quick`` defaults) into :class:`SweepOptions`."""
    quick = flags_.quick
    emulated = flags_.compute == "emulated"
    if flags_.full and (quick or not emulated):
        raise ValueError("--full is the emulated-compute grid: use it with --compute emulated "
                         "and without --quick")
    grid: Optional[list] = None
    if emulated and not quick and not flags_.full and not (
            flags_.models or flags_.workers or flags_.ratios):
        grid = [(m, n, tuple(r)) for m, n, r in EMULATED_DEFAULT_GRID]
    quick_model = EMULATED_QUICK_MODEL if emulated else QUICK_MODEL
    all_models = list(EMULATED_DEFAULT_MODELS if emulated else DEFAULT_MODELS)
    models = flags_.models or ([quick_model] if quick else all_models)
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; choose from {', '.join(MODEL_NAMES)}")
    workers = [int(w) for w in (flags_.workers or (["2", "4", "8"] if flags_.full else ["2"]))]
    if any(not 2 <= w <= MAX_WORKERS for w in workers):
        raise ValueError(f"--workers must be between 2 and {MAX_WORKERS}, got {workers}")
    default_ratios = EMULATED_RATIOS if emulated else DEFAULT_RATIOS
    ratios = [float(r) for r in (flags_.ratios or (["1"] if quick else default_ratios))]
    if any(r <= 0 for r in ratios):
        raise ValueError(f"--ratios must be positive, got {ratios}")
    default_systems = (QUICK_SYSTEMS if quick else
                       EMULATED_DEFAULT_SYSTEMS if emulated and not flags_.full else SYSTEMS)
    systems = list(flags_.systems or default_systems)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    steps = flags_.steps if flags_.steps is not None else (EMULATED_STEPS if emulated else 10)
    warmup = flags_.warmup if flags_.warmup is not None else (EMULATED_WARMUP if emulated
                                                              else 3)
    if not (flags_.accelerator_tflops > 0 and math.isfinite(flags_.accelerator_tflops)):
        raise ValueError(f"--accelerator_tflops must be positive, got {flags_.accelerator_tflops}")
    if flags_.time_scale is not None and not flags_.time_scale >= 1:
        raise ValueError(f"--time_scale must be >= 1, got {flags_.time_scale}")
    if not flags_.link_budget_gbps > 0:
        raise ValueError(f"--link_budget_gbps must be positive, got {flags_.link_budget_gbps}")
    if steps < 1 or warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    if flags_.batch is not None and flags_.batch < 1:
        raise ValueError("--batch must be >= 1")
    prophet_options = json.loads(flags_.prophet_options or "{}")
    model_overrides = json.loads(flags_.model_options or "{}")
    if not isinstance(prophet_options, dict) or not isinstance(model_overrides, dict):
        raise ValueError("--prophet_options and --model_options must be JSON objects")
    rate_change: Optional[tuple[int, float]] = None
    if flags_.rate_change:
        try:
            k, factor = flags_.rate_change.split(":")
            rate_change = (int(k), float(factor))
        except ValueError:
            raise ValueError(f"--rate_change must be STEP:FACTOR (e.g. 15:0.5), got "
                             f"{flags_.rate_change!r}") from None
        if not (0 < rate_change[0] < warmup + steps and rate_change[1] > 0):
            raise ValueError(f"--rate_change: STEP must be in 1..{warmup + steps - 1} (the "
                             f"steps run) and FACTOR positive, got {flags_.rate_change!r}")
        if flags_.loopback:
            raise ValueError("--rate_change needs the emulated cluster; drop --loopback")
    return SweepOptions(models=models, workers=workers, ratios=ratios, systems=systems,
                        batch=flags_.batch, steps=steps, warmup=warmup, loopback=flags_.loopback,
                        out=flags_.out, json_path=flags_.json,
                        intra_threads=flags_.intra_threads, inter_threads=flags_.inter_threads,
                        launch_timeout=flags_.launch_timeout, verbose=flags_.verbose,
                        prophet_options=prophet_options, model_overrides=model_overrides,
                        contended=((not quick and not emulated) if flags_.contended is None
                                   else flags_.contended),
                        retries=(flags_.retries if flags_.retries is not None
                                 else 0 if quick else 1),
                        noise_cores=flags_.noise_cores,
                        label=" ".join(["python -m prophet_tf.bench.train", *sys.argv[1:]]),
                        compute=flags_.compute, accelerator_tflops=flags_.accelerator_tflops,
                        time_scale=flags_.time_scale,
                        link_budget_bps=flags_.link_budget_gbps * 1e9,
                        netns_prefix=flags_.netns_prefix, alone=flags_.alone,
                        timeline=flags_.timeline or os.environ.get("PROPHET_TIMELINE") or None,
                        grid=grid, rate_change=rate_change,
                        mwms_ratios=(1.0,) if grid is not None and not flags_.systems else None)


def worker_or_bad_arguments(argv: Sequence[str], flags_: Any) -> Optional[int]:
    """The exit status when this process is done before orchestrating anything: a worker task
    (``--worker``, run here) or stray positional arguments; None otherwise."""
    if len(argv) > 1:
        print(f"unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    if flags_.worker:
        run_worker(json.loads(flags_.worker))
        return 0
    return None


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags
    FLAGS = flags.FLAGS
    done = worker_or_bad_arguments(argv, FLAGS)
    if done is not None:
        return done
    try:
        opts = options_from_flags(FLAGS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from prophet_tf.bench.netem import NetemUnavailableError
    where = "loopback (no shaping)" if opts.loopback else "an emulated cluster (netns + tbf)"
    grid = "; ".join(
        f"{model} N={','.join(str(n) for n, _ in runs)}"
        + ("" if opts.loopback else
           f" comm/comp {','.join(f'{r:g}' for r in sorted({r for _, rs in runs for r in rs}))}")
        for model, runs in sweep_cells(opts))
    compute = ("real compute (this machine's CPU)" if opts.compute == "real" else
               f"emulated compute ({opts.accelerator_tflops:g} TFLOP/s accelerator)")
    print(f"Training benchmark on {where}, {compute}: {grid}; systems "
          f"{', '.join(opts.systems)}; {opts.steps} steps after {opts.warmup} warm-up; "
          f"output in {opts.out}/", flush=True)
    t0 = time.monotonic()
    try:
        settings = run_sweep(opts)
    except NetemUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("\ninterrupted: workers stopped, namespaces deleted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    print()
    print(format_markdown(settings))
    for note in sorted({n for st in settings for n in st.get("notes", [])}):
        print(f"- {note}")
    for why in opts.meta.get("skipped", []):
        print(f"- {why}")
    print(f"\ndone in {time.monotonic() - t0:.0f} s; results in {opts.out}/ (results.md, "
          f"results.csv, results.json, results.png)")
    failed = [(st["model"], s) for st in settings for s, r in st["results"].items()
              if r.get("step_s_median") is None]
    return 1 if failed or not settings else 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
