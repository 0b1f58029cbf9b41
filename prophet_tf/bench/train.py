"""Training step time of prophet_tf's schedules vs TensorFlow's MultiWorkerMirroredStrategy.

    python -m prophet_tf.bench.train [--quick] [--models vgg16,transformer] [--workers 2]
        [--ratios 0.3,1,3] [--systems prophet,prophet_nocross,priority,fifo,mwms]
        [--batch 16] [--steps 10] [--warmup 3] [--out bench_out/] [--json PATH] [--loopback]

For every model (``--models``: ``vgg16``, ``transformer``, ``resnet50``; see
:mod:`prophet_tf.bench.models`) and worker count N (``--workers``, 2-4):

1. **compute time** (``compute_s``): the model with the per-worker batch (``--batch``) trains
   in one process alone, without any strategy. The run also reports the gradient bytes. With
   ``--contended`` (default, not with ``--quick``) N such uncoupled processes also run at
   once: the compute time when N workers share this machine's cores (``compute_contended_s``,
   shown in parentheses; not used for the bound).
2. **bandwidths**: for every ratio r in ``--ratios`` (communication time / compute time), the
   per-host link rate is ``2(N-1)/N * gradient_bytes * 8 / (r * compute_s)`` bit/s: moving the
   all-reduce optimum of 2(N-1)/N of the gradient bytes at that rate takes r times the compute
   time.
3. **systems**: for every bandwidth an emulated cluster of N hosts is built
   (:class:`~prophet_tf.bench.netem.EmulatedCluster`: a network namespace per host, ``tbf`` on
   each host's NIC), and each system is a separate launch of N worker processes inside it
   (``prophet_tf.launch.launch(..., hosts=..., wrap_argv=cluster.exec_argv)``), on the same model
   and global batch (N x ``--batch``): ``ProphetStrategy`` with ``schedule="prophet"``,
   ``"priority"`` and ``"fifo"``; ``prophet`` with barrier crossing off (``prophet_nocross``:
   ``cross_barrier=False``, passed only when the constructor has that parameter, otherwise the
   run equals ``prophet`` and the output says so); and TensorFlow's
   ``tf.distribute.MultiWorkerMirroredStrategy`` (``mwms``: RING collectives on CPU, cluster
   from the launcher's ``TF_CONFIG``).
4. Each worker trains on synthetic data with ``model.fit``; ``mwms`` uses the same train step as
   a custom loop, because Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy
   (keras-team/keras#20585). A Keras callback timestamps every ``on_train_batch_begin``; a step's
   time is the interval to the next step's start; rank 0 reports the median over ``--steps``
   steps after ``--warmup`` steps.

Per setting: each system's median step time and samples/s, speed-up over ``mwms``, the lower
bound ``max(compute_s, 2(N-1)/N * gradient_bytes * 8 / bandwidth)`` and each system's ratio to
it. Outputs in ``--out`` (default ``bench_out/``): ``results.md`` (Markdown table),
``results.csv``, ``results.json``, ``results.png`` (chart) and ``logs/`` (every launch's
output); ``--json PATH`` also writes the JSON list there.

Noise: the machine's CPU time outside the workers during the measured steps is recorded per
launch (``foreign_cores``); a launch disturbed by other programs (more than ``--noise_cores``)
is run again up to ``--retries`` times and the quietest attempt kept; the table flags those that
stayed noisy. Every worker pins TensorFlow to 1 intra-op and 2 inter-op threads
(``--intra_threads``, ``--inter_threads``).

The emulated cluster needs root (network namespaces, tc); without it the program says so and
``--loopback`` runs the workers on 127.0.0.1 without shaping (one setting per model and N).
Namespaces are deleted and every worker process is killed at the end, on errors and on
Ctrl-C/SIGTERM (exit status 128 + signal).

``--quick``: the Transformer, 2 workers, comm/comp = 1, no contended run (about 2-3 minutes).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
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

__all__ = [
    "SYSTEMS", "ALL_SYSTEMS", "comm_bytes", "comm_time_s", "lower_bound_s", "choose_bandwidth",
    "choose_bandwidths", "step_periods", "median", "make_setting", "validate_settings",
    "write_json", "format_markdown", "write_csv", "plot", "SweepOptions", "run_sweep", "main",
]

#: Multi-worker systems compared in every setting (the keys of ``results`` in the JSON output).
SYSTEMS = ("prophet", "prophet_nocross", "priority", "fifo", "mwms")
#: SYSTEMS plus the single-worker compute-time run.
ALL_SYSTEMS = SYSTEMS + ("single",)
#: ProphetStrategy schedule and barrier crossing of each prophet_tf system.
PROPHET_SYSTEMS = {
    "prophet": ("prophet", True),
    "prophet_nocross": ("prophet", False),
    "priority": ("priority", True),
    "fifo": ("fifo", True),
}
DEFAULT_MODELS = ("vgg16", "transformer")
QUICK_MODEL = "transformer"
DEFAULT_RATIOS = (0.3, 1.0, 3.0)
NETNS_PREFIX = "ptfbench"
#: A measurement during which other programs used more cores than this is flagged in the table.
NOISY_CORES = 0.3
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
                 notes: Sequence[str] = ()) -> dict[str, Any]:
    """One output object (one model, worker count and bandwidth) in the JSON schema.

    Args:
      step_s: median step time of each system that ran (None for a system that failed).
      extra: more per-system fields (e.g. ``schedule_effective``, ``error``) merged into
        ``results[SYSTEM]``.

    Returns ``{"model", "workers", "bandwidth_bps", "compute_s", "lower_bound_s", "results":
    {SYSTEM: {"step_s_median", "samples_per_s", "speedup_vs_mwms", "ratio_to_lower_bound",
    ...}}, ...}`` plus context fields (``comm_compute_ratio``, ``global_batch``,
    ``gradient_bytes``, ``comm_s``, ``notes``).
    """
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

    Columns: model, N (workers), global batch, comm/compute ratio, link rate, compute ms (one
    worker alone; in parentheses N uncoupled workers at once, when measured), lower bound ms,
    system, median step ms, samples/s, speed-up over mwms, step / lower bound.
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
            compute = _fmt(st["compute_s"] * 1e3, ".0f")
            if st.get("compute_contended_s"):
                compute += f" ({st['compute_contended_s'] * 1e3:.0f})"
            cells = [st["model"], str(st["workers"]), str(st.get("global_batch", "")),
                     _fmt(ratio, ".2g"), format_bandwidth(st["bandwidth_bps"]),
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


CSV_FIELDS = ("model", "workers", "global_batch", "comm_compute_ratio", "bandwidth_bps",
              "gradient_bytes", "compute_s", "compute_contended_s", "lower_bound_s", "system",
              "step_s_median", "samples_per_s", "speedup_vs_mwms", "ratio_to_lower_bound", "schedule_effective",
              "cross_barrier", "foreign_cores", "attempts", "note", "error")


def write_csv(path: str, settings: Sequence[Mapping[str, Any]]) -> None:
    """One CSV row per (setting, system), columns :data:`CSV_FIELDS`."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for st in settings:
            for system, res in st["results"].items():
                row = {k: st.get(k) for k in CSV_FIELDS}
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
              "fifo": "#7f7f7f", "mwms": "#2ca02c"}
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


def run_worker(config: Mapping[str, Any]) -> None:
    """Trains ``config["model"]`` with ``config["system"]`` and prints ``RESULT {json}``.

    Config keys: system, model (a :class:`ModelConfig` dict), batch_per_worker, steps, warmup,
    intra_threads, inter_threads, prophet_options.
    """
    t_start = time.perf_counter()
    system = config["system"]
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
    cfg = models.config_for(config["model"]["name"], **{k: v for k, v in config["model"].items()
                                                         if k != "name"})
    per_worker = int(config["batch_per_worker"])
    global_batch = per_worker * world

    scope = strategy.scope() if strategy is not None else _null_context()
    with scope:
        model = models.build_model(cfg)
        model.compile(optimizer=models.make_optimizer(), loss=models.loss_name(cfg))
    x, y = models.synthetic_batch(cfg, global_batch, seed=1)
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

        def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
            self.begin.append(time.perf_counter())
            self.cpu.append(time.process_time())
            self.machine.append(machine_busy_s())

        def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
            self.end.append(time.perf_counter())

    warmup, steps = int(config["warmup"]), int(config["steps"])
    timer = StepTimes()
    t_fit = time.perf_counter()
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
        "params": models.parameter_count(model), "gradient_bytes": models.gradient_bytes(model),
        "num_gradients": len(model.trainable_weights),
        **facts,
    }
    print("RESULT " + json.dumps(_json_safe(result)), flush=True)
    _fast_exit(strategy, system, tf)


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


#: Default per-worker batch of each model (compute of roughly 0.3-0.6 s per step here).
DEFAULT_BATCH = {"resnet50": 16, "vgg16": 16, "transformer": 16}


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


def _launch_system(system: str, n: int, cluster: Any, cfg: Mapping[str, Any], batch: int,
                   opts: SweepOptions, timeout: float, log_name: str = "") -> dict[int, dict]:
    """Runs one system as ``n`` worker processes; returns ``{rank: result}`` (rank 0 always).

    The workers' output goes to ``OUT/logs/LOG_NAME.log``.
    """
    from prophet_tf.launch import launch

    config = {"system": system, "model": dict(cfg), "batch_per_worker": batch,
              "steps": opts.steps, "warmup": opts.warmup, "intra_threads": opts.intra_threads,
              "inter_threads": opts.inter_threads, "prophet_options": opts.prophet_options}
    argv = ["-m", "prophet_tf.bench.train", "--worker", json.dumps(config)]
    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (_repo_root(), os.environ.get("PYTHONPATH"))
                                         if p),
           # gRPC (mwms) must not try a proxy from inside the namespaces
           "no_proxy": "*", "NO_PROXY": "*", "grpc_proxy": "", "http_proxy": "",
           "https_proxy": ""}
    kwargs: dict[str, Any] = {}
    if cluster is not None and n > 1 and not opts.loopback:
        kwargs = {"hosts": [cluster.host_address(i) for i in range(n)],
                  "wrap_argv": cluster.exec_argv}
    tee = _Tee(sys.stderr if opts.verbose else None)
    t_launch = time.monotonic()
    try:
        code = launch(argv, n, timeout=timeout, env=env, threads=None, stdout=tee, stderr=tee,
                      grace=3.0, **kwargs)
    finally:
        _save_log(opts, log_name or f"{cfg['name']}_{system}_n{n}", tee.text(),
                  time.monotonic() - t_launch)
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


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _source_state() -> str:
    """``commit`` plus the files that differ from it (the tree may be edited while we run)."""
    root = _repo_root()
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


def _make_cluster(n: int, bandwidth_bps: Optional[float], loopback: bool) -> Any:
    from prophet_tf.bench.netem import EmulatedCluster, LoopbackCluster
    if loopback:
        return LoopbackCluster(n)
    return EmulatedCluster(n, bandwidth_bps=bandwidth_bps, prefix=NETNS_PREFIX)


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
             timeout: float, log: str, progress: _Progress) -> tuple[dict[int, dict], dict]:
    """One launch of ``system``, repeated (up to ``opts.retries`` times) while other programs
    used more than ``opts.noise_cores`` cores during the measured steps; keeps the quietest.

    Returns ``({rank: result}, facts)`` with facts ``foreign_cores``, ``attempts``, ``launch_s``.
    Raises :class:`LaunchFailed` when no attempt produced a result.
    """
    best: Optional[tuple[dict[int, dict], dict]] = None
    for attempt in range(1 + max(0, opts.retries)):
        t0 = time.monotonic()
        runs = _launch_system(system, n, cluster, cfg.to_dict(), batch, opts, timeout,
                              log + (f"_retry{attempt}" if attempt else ""))
        foreign = foreign_cores(runs)
        facts = {"foreign_cores": foreign, "attempts": attempt + 1,
                 "launch_s": time.monotonic() - t0}
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


def run_sweep(opts: SweepOptions) -> list[dict]:
    """Runs every setting; returns the list of setting objects (see :func:`make_setting`)."""
    from prophet_tf.bench import models as models_mod

    if not opts.loopback:
        from prophet_tf.bench.netem import EmulatedCluster
        EmulatedCluster.check_available()   # NetemUnavailableError says: root or --loopback
    opts.meta.update(started=datetime.datetime.now().isoformat(timespec="seconds"),
                     loadavg_start=os.getloadavg(), t0=time.monotonic(), source=_source_state())
    multi = [s for s in opts.systems if s in SYSTEMS]
    n_ratios = 1 if opts.loopback else len(opts.ratios)
    per_n = (1 if opts.contended else 0) + n_ratios * len(multi)
    progress = _Progress(len(opts.models) * (1 + len(opts.workers) * per_n))
    settings: list[dict] = []
    for model in opts.models:
        cfg = models_mod.config_for(model, **opts.model_overrides.get(model, {}))
        batch = opts.batch or DEFAULT_BATCH[model]
        progress.start(f"{model}: one worker alone, batch {batch} (compute time)")
        try:
            runs, single_facts = _measure("single", 1, None, cfg, batch, opts,
                                          opts.launch_timeout, f"{model}_single", progress)
        except LaunchFailed as e:
            progress.finish("FAILED")
            sys.stderr.write(f"{e}\n")
            progress.done += len(opts.workers) * per_n
            continue
        single = runs[0]
        compute_s, gbytes = single["step_s_median"], int(single["gradient_bytes"])
        progress.finish(f"{compute_s * 1e3:.0f} ms/step, {single['params'] / 1e6:.1f}M "
                        f"parameters in {single['num_gradients']} tensors, {gbytes / 1e6:.1f} MB "
                        f"of gradients{_noise_text(single_facts)}")
        single_info = {k: single.get(k) for k in ("step_s", "params", "num_gradients",
                                                  "busy_s_median", "cpu_s_per_step")}
        single_info.update(single_facts)
        for n in opts.workers:
            contended: Optional[float] = None
            contended_info: dict[str, Any] = {}
            if opts.contended:
                progress.start(f"{model}: {n} independent workers at once (compute time when "
                               "sharing the machine, no communication)")
                try:
                    runs, facts = _measure("single", n, None, cfg, batch, opts,
                                           opts.launch_timeout, f"{model}_contended_n{n}",
                                           progress)
                    contended = median([r["step_s_median"] for r in runs.values()])
                    contended_info = {"step_s_medians": [runs[r]["step_s_median"]
                                                         for r in sorted(runs)],
                                      "cpu_s_per_step": [runs[r].get("cpu_s_per_step")
                                                         for r in sorted(runs)], **facts}
                    progress.finish(f"{contended * 1e3:.0f} ms/step{_noise_text(facts)}")
                except LaunchFailed as e:
                    progress.finish("FAILED")
                    sys.stderr.write(f"{e}\n")
            if opts.loopback:
                plan: list[tuple[Optional[float], Optional[float]]] = [(None, None)]
            else:
                bws = choose_bandwidths(gbytes, n, compute_s, opts.ratios)
                plan = list(zip(opts.ratios, bws))
            for ratio, bw in plan:
                st = _run_setting(model, n, cfg, batch, ratio, bw, compute_s, gbytes, multi,
                                  opts, progress)
                st["compute_contended_s"] = contended
                # The same bound with the compute time of N workers sharing this machine.
                st["lower_bound_contended_s"] = (None if contended is None else
                                                 lower_bound_s(contended, gbytes, n, bw))
                st["compute_single"] = single_info
                st["compute_contended"] = contended_info
                settings.append(st)
                _write_outputs(settings, opts, final=False)
    _write_outputs(settings, opts, final=True)
    return settings


def _noise_text(facts: Mapping[str, Any]) -> str:
    f = facts.get("foreign_cores")
    return "" if f is None or f < 0.1 else f" [other programs: {f:.2f} cores]"


def _run_setting(model: str, n: int, cfg: Any, batch: int, ratio: Optional[float],
                 bw: Optional[float], compute_s: float, gbytes: int, systems: Sequence[str],
                 opts: SweepOptions, progress: _Progress) -> dict:
    step_s: dict[str, Optional[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    where = f"{model}, N={n}, " + (f"comm/comp {ratio:g} at {format_bandwidth(bw)}" if bw
                                   else "loopback (unshaped)")
    # Worst case of the slowest system, plus start-up; generous.
    expected = compute_s * (1 + (ratio or 0)) * (opts.warmup + opts.steps + 1)
    timeout = min(opts.launch_timeout, max(180.0, 60.0 + 4.0 * expected))
    with _make_cluster(n, bw, opts.loopback) as cluster:
        for system in systems:
            progress.start(f"{where}: {system}")
            load_before = os.getloadavg()[0]
            log = f"{model}_n{n}_" + (f"ratio{ratio:g}" if ratio else "loopback") + f"_{system}"
            try:
                runs, facts = _measure(system, n, cluster, cfg, batch, opts, timeout, log,
                                       progress)
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
                                    "cpu_s_per_step": res.get("cpu_s_per_step"),
                                    "loadavg_1m_before": load_before, **facts}
            if system in PROPHET_SYSTEMS:
                info["schedule_effective"] = res.get("schedule_effective")
                info["cross_barrier"] = res.get("cross_barrier")
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
            extra[system] = info
            lb = lower_bound_s(compute_s, gbytes, n, bw)
            progress.finish(f"{res['step_s_median'] * 1e3:.0f} ms/step (bound {lb * 1e3:.0f} ms, "
                            f"{facts['launch_s']:.0f} s){_noise_text(facts)}")
    return make_setting(model, n, bw, compute_s, gbytes, batch, step_s, ratio=ratio, extra=extra,
                        notes=notes)


def _write_outputs(settings: Sequence[dict], opts: SweepOptions, final: bool) -> None:
    os.makedirs(opts.out, exist_ok=True)
    write_json(os.path.join(opts.out, "results.json"), settings)
    if opts.json_path:
        write_json(opts.json_path, settings)
    if not final:
        return
    table = format_markdown(settings)
    notes = sorted({n for st in settings for n in st.get("notes", [])})
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
    f.DEFINE_bool("quick", False,
                  f"One model ({QUICK_MODEL}), 2 workers, the setting where communication = "
                  "computation, no contended-compute run (about 3 minutes).")
    f.DEFINE_list("models", None, f"Models among {', '.join(('resnet50', 'vgg16', 'transformer'))} "
                  f"(default: {','.join(DEFAULT_MODELS)}).")
    f.DEFINE_list("workers", None, "Worker counts, 2-4 (default: 2).")
    f.DEFINE_integer("batch", None, "Per-worker batch size; the global batch is N times this "
                     f"(default per model: {DEFAULT_BATCH}).")
    f.DEFINE_integer("steps", None, "Measured steps per run (default 10).")
    f.DEFINE_integer("warmup", None, "Unmeasured steps first (tracing, planning; default 3).")
    f.DEFINE_list("ratios", None, "Communication/computation ratios that set the bandwidths "
                  f"(default: {','.join(f'{r:g}' for r in DEFAULT_RATIOS)}).")
    f.DEFINE_list("systems", None, f"Systems among {', '.join(SYSTEMS)} (default: all).")
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
    f.DEFINE_integer("retries", 1, "Run a launch again (keeping the quietest attempt) when other "
                     "programs used more than --noise_cores cores during its measured steps.")
    f.DEFINE_float("noise_cores", 0.3, "See --retries.")
    f.DEFINE_bool("verbose", False, "Echo the workers' output.")
    f.DEFINE_string("worker", None, "Internal: run as a worker with this JSON configuration.")
    return flags.FLAGS


def options_from_flags(flags_: Any) -> SweepOptions:
    """Resolves the command-line flags (and ``--quick`` defaults) into :class:`SweepOptions`."""
    from prophet_tf.bench.models import MODEL_NAMES
    quick = flags_.quick
    models = flags_.models or ([QUICK_MODEL] if quick else list(DEFAULT_MODELS))
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; choose from {', '.join(MODEL_NAMES)}")
    workers = [int(w) for w in (flags_.workers or ["2"])]
    if any(not 2 <= w <= 4 for w in workers):
        raise ValueError(f"--workers must be between 2 and 4, got {workers}")
    ratios = [float(r) for r in (flags_.ratios or (["1"] if quick else DEFAULT_RATIOS))]
    if any(r <= 0 for r in ratios):
        raise ValueError(f"--ratios must be positive, got {ratios}")
    systems = list(flags_.systems or SYSTEMS)
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    steps = flags_.steps if flags_.steps is not None else 10
    warmup = flags_.warmup if flags_.warmup is not None else 3
    if steps < 1 or warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    if flags_.batch is not None and flags_.batch < 1:
        raise ValueError("--batch must be >= 1")
    prophet_options = json.loads(flags_.prophet_options or "{}")
    model_overrides = json.loads(flags_.model_options or "{}")
    if not isinstance(prophet_options, dict) or not isinstance(model_overrides, dict):
        raise ValueError("--prophet_options and --model_options must be JSON objects")
    return SweepOptions(models=models, workers=workers, ratios=ratios, systems=systems,
                        batch=flags_.batch, steps=steps, warmup=warmup, loopback=flags_.loopback,
                        out=flags_.out, json_path=flags_.json,
                        intra_threads=flags_.intra_threads, inter_threads=flags_.inter_threads,
                        launch_timeout=flags_.launch_timeout, verbose=flags_.verbose,
                        prophet_options=prophet_options, model_overrides=model_overrides,
                        contended=(not quick) if flags_.contended is None else flags_.contended,
                        retries=flags_.retries, noise_cores=flags_.noise_cores,
                        label=" ".join(["python -m prophet_tf.bench.train", *sys.argv[1:]]))


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags
    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    if FLAGS.worker:
        run_worker(json.loads(FLAGS.worker))
        return 0
    try:
        opts = options_from_flags(FLAGS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from prophet_tf.bench.netem import NetemUnavailableError
    where = "loopback (no shaping)" if opts.loopback else "an emulated cluster (netns + tbf)"
    print(f"Training benchmark on {where}: models {', '.join(opts.models)}; workers "
          f"{', '.join(map(str, opts.workers))}; comm/comp ratios "
          f"{'n/a' if opts.loopback else ', '.join(f'{r:g}' for r in opts.ratios)}; systems "
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
    print(f"\ndone in {time.monotonic() - t0:.0f} s; results in {opts.out}/ (results.md, "
          f"results.csv, results.json, results.png)")
    failed = [(st["model"], s) for st in settings for s, r in st["results"].items()
              if r.get("step_s_median") is None]
    return 1 if failed or not settings else 0


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
