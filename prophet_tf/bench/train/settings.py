"""What a setting of the training benchmark is: the grids, the bounds, the link rates, the time
scale, and the JSON object each setting becomes (pure functions, unit-tested)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import statistics
from typing import Any, Iterable, Mapping, Optional, Sequence

from prophet_tf.bench.models import COMPUTE_MODES
from prophet_tf.bench.train.systems import System, parse_system

__all__ = [
    "DEFAULT_MODELS", "QUICK_MODEL", "DEFAULT_RATIOS", "EMULATED_DEFAULT_MODELS",
    "EMULATED_QUICK_MODEL", "EMULATED_RATIOS", "EMULATED_FULL_RATIOS", "EMULATED_DEFAULT_GRID",
    "EMULATED_STEPS", "EMULATED_WARMUP", "MAX_WORKERS", "NETNS_PREFIX", "NOISY_CORES",
    "CPU_LIMITED_FRACTION", "DEFAULT_LINK_BUDGET_BPS", "DEFAULT_BATCH", "EMULATED_BATCH",
    "comm_bytes", "comm_time_s", "lower_bound_s", "ideal_bound", "choose_bandwidth",
    "choose_bandwidths", "emulated_time_scale", "step_periods", "median", "make_setting",
    "finite", "validate_settings", "json_safe", "write_json", "SweepOptions", "default_batch",
    "sweep_cells", "spec_path", "worker_memory_bytes", "available_memory_bytes",
]

DEFAULT_MODELS = ("vgg16", "transformer")
QUICK_MODEL = "transformer"
DEFAULT_RATIOS = (0.3, 1.0, 3.0)
#: ``--compute emulated`` defaults (see the package docstring for how they were chosen).
EMULATED_DEFAULT_MODELS = ("resnet50", "vgg16", "bert_base")
EMULATED_QUICK_MODEL = "resnet50"
#: The default sweep's comm/comp ratios, and ``--full``'s.
EMULATED_RATIOS = (0.5, 1.0, 2.0)
EMULATED_FULL_RATIOS = (0.5, 1.0, 1.5, 2.0)
#: The default emulated sweep (model, workers, ratios): every model x N = 2, 4, 8 x
#: :data:`EMULATED_RATIOS`, with ``EMULATED_DEFAULT_SYSTEMS`` and ``mwms`` only at comm/comp 1
#: (where the goals compare with it; it is the slowest system). Settings whose workers would not
#: fit in this machine's memory are skipped with a message (:func:`worker_memory_bytes`).
EMULATED_DEFAULT_GRID = tuple((model, n, EMULATED_RATIOS)
                              for model in EMULATED_DEFAULT_MODELS for n in (2, 4, 8))
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
#: Default per-worker batch of each model under real compute (0.3-0.6 s per step here).
DEFAULT_BATCH = {"resnet50": 16, "vgg16": 16, "transformer": 16, "bert_base": 16}
#: Default per-worker batch under emulated compute (typical per-GPU batches of these models).
EMULATED_BATCH = {"resnet50": 64, "vgg16": 64, "transformer": 32, "bert_base": 32}


# ------------------------------------------------------------------------------------------------
# Bounds and link rates


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


def ideal_bound(profile: Any, workers: int, bandwidth_bps: Optional[float],
                payload_efficiency: float, compression: Optional[str] = None,
                workers_per_host: int = 1) -> Any:
    """The ideal bound (:func:`prophet_tf.predict.ideal_bound`) of ``workers`` workers running
    ``profile``'s step (the layers' compute and gradients) on links of ``bandwidth_bps``, of
    which ``payload_efficiency`` carries payload; with ``compression`` (``"fp16"``, ``"bf16"``)
    the gradients take the bytes they travel in (half; its ``gradient_bytes``). Unshaped links
    (None or 0): no communication limit, the bound is the profile's compute.
    ``workers_per_host``: the workers share their host's link (traffic inside a host is free)."""
    from prophet_tf.predict import PredictOptions
    from prophet_tf.predict import ideal_bound as predictor_ideal_bound
    options = PredictOptions(payload_efficiency=payload_efficiency, compression=compression,
                             workers_per_host=workers_per_host)
    if not bandwidth_bps:
        return predictor_ideal_bound(profile, workers=1, bandwidth_bps=None, options=options)
    return predictor_ideal_bound(profile, workers=workers, bandwidth_bps=bandwidth_bps,
                                 options=options)


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


# ------------------------------------------------------------------------------------------------
# Step times


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


def finite(x: Any) -> bool:
    """A real number (not bool, not NaN or infinite)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# ------------------------------------------------------------------------------------------------
# The JSON object of a setting


def make_setting(model: str, workers: int, bandwidth_bps: Optional[float], compute_s: float,
                 gradient_bytes: int, batch_per_worker: int,
                 step_s: Mapping[str, Optional[float]], *, ratio: Optional[float] = None,
                 extra: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 notes: Sequence[str] = (), compute: str = "real",
                 ideal_bound_s: Optional[float] = None,
                 ideal: Optional[Mapping[str, Any]] = None,
                 compressed: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 workers_per_host: int = 1) -> dict[str, Any]:
    """One output object (one model, worker count and bandwidth) in the JSON schema.

    Args:
      step_s: median step time of each system that ran (None for a system that failed), keyed
        by the system's name (:mod:`prophet_tf.bench.train.systems`), in table order.
      extra: more per-system fields (e.g. ``schedule_effective``, ``error``) merged into
        ``results[SYSTEM]``.
      compute: ``"real"`` or ``"emulated"`` (how the workers computed).
      ideal_bound_s: the ideal bound (None: not known); ``ideal``: how it was made.
      compressed: per gradient compression of the systems that use one (``"bf16"``), the bytes
        their gradients take on the wire (``"gradient_bytes"``; None: not known) and their ideal
        bound (``"ideal_bound_s"``, ``"ideal"``). Such a system's ``lower_bound_s`` and
        ``ideal_bound_s`` are its own, in its ``results`` entry, and its ratios are to those:
        no schedule of the compressed bytes can beat them, while the uncompressed bounds can be
        beaten. The setting keeps them under ``"compressed_bounds"``.

    Returns ``{"model", "workers", "bandwidth_bps", "compute_s", "lower_bound_s",
    "ideal_bound_s", "compute", "results": {SYSTEM: {"step_s_median", "samples_per_s",
    "speedup_vs_mwms", "ratio_to_lower_bound", "ratio_to_ideal_bound", ...}}, ...}`` plus context
    fields (``comm_compute_ratio``, ``global_batch``, ``gradient_bytes``, ``comm_s``, ``ideal``,
    ``notes``, ``compressed_bounds``, ``workers_per_host``). With ``workers_per_host`` K > 1
    the bounds and the communication time are those of the workers / K hosts' links (the
    all-reduce optimum between hosts; traffic inside a host is free).
    """
    if compute not in COMPUTE_MODES:
        raise ValueError(f"compute must be one of {COMPUTE_MODES}, got {compute!r}")
    global_batch = batch_per_worker * workers
    links = max(1, workers // max(1, workers_per_host))
    lb = lower_bound_s(compute_s, gradient_bytes, links, bandwidth_bps)
    ib = _positive(ideal_bound_s)
    bounds: dict[str, dict[str, Any]] = {}
    for compression, c in (compressed or {}).items():
        wire = c.get("gradient_bytes")
        bounds[compression] = {
            "gradient_bytes": int(wire) if finite(wire) else None,
            "lower_bound_s": (lower_bound_s(compute_s, wire or 0, links, bandwidth_bps)
                              if finite(wire) or not bandwidth_bps else None),
            "ideal_bound_s": _positive(c.get("ideal_bound_s")),
            "ideal": dict(c["ideal"]) if c.get("ideal") else None}
    mwms = step_s.get("mwms")
    results: dict[str, dict[str, Any]] = {}
    for system, s in step_s.items():
        parsed = parse_system(system)
        ok = finite(s) and s > 0
        own_lb, own_ib = lb, ib
        entry: dict[str, Any] = {}
        if parsed.compression is not None:
            own = bounds.get(parsed.compression) or {}
            own_lb, own_ib = own.get("lower_bound_s"), own.get("ideal_bound_s")
            entry.update(lower_bound_s=own_lb, ideal_bound_s=own_ib)
        entry.update({
            "step_s_median": float(s) if ok else None,
            "samples_per_s": global_batch / s if ok else None,
            "speedup_vs_mwms": (mwms / s) if ok and finite(mwms) and mwms > 0 else None,
            "ratio_to_lower_bound": (s / own_lb) if ok and own_lb else None,
            "ratio_to_ideal_bound": (s / own_ib) if ok and own_ib else None,
        })
        if extra and system in extra:
            entry.update(extra[system])
        results[parsed.name] = entry
    return {
        "model": model,
        "workers": int(workers),
        "bandwidth_bps": float(bandwidth_bps) if bandwidth_bps else None,
        "compute_s": float(compute_s),
        "lower_bound_s": lb,
        "ideal_bound_s": ib,
        "compute": compute,
        "results": results,
        "comm_compute_ratio": ratio if ratio is not None else (
            comm_time_s(gradient_bytes, links, bandwidth_bps) / compute_s
            if compute_s and bandwidth_bps else None),
        "comm_s": comm_time_s(gradient_bytes, links, bandwidth_bps),
        "workers_per_host": int(workers_per_host),
        "global_batch": global_batch,
        "gradient_bytes": int(gradient_bytes),
        "ideal": dict(ideal) if ideal else None,
        "compressed_bounds": bounds or None,
        "notes": list(notes),
    }


def _positive(x: Any) -> Optional[float]:
    return float(x) if finite(x) and x > 0 else None


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
        for key in ("bandwidth_bps", "ideal_bound_s"):
            if key not in st:
                raise ValueError(f"{where}: missing {key!r}")
            if st[key] is not None and not (finite(st[key]) and st[key] > 0):
                raise ValueError(f"{where}: {key} must be a positive number or null, got "
                                 f"{st[key]!r}")
        for system, res in st["results"].items():
            try:
                parsed = parse_system(system)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if parsed.name != system:
                raise ValueError(f"{where}: system {system!r} is not in its canonical form "
                                 f"{parsed.name!r}")
            for key in ("step_s_median", "samples_per_s"):
                if key not in res:
                    raise ValueError(f"{where}: results[{system!r}] has no {key!r}")
                if res[key] is not None and not finite(res[key]):
                    raise ValueError(f"{where}: results[{system!r}][{key!r}] = {res[key]!r}")


def json_safe(x: Any) -> Any:
    """``x`` with NaN and infinities replaced by None (JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(path: str, settings: Sequence[Mapping[str, Any]]) -> None:
    """Validates ``settings`` and writes them as a JSON list (NaN/inf become null)."""
    settings = json_safe(list(settings))
    validate_settings(settings)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(settings, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------
# The sweep's options and cells


@dataclasses.dataclass
class SweepOptions:
    """Everything the sweep needs (the command-line flags, resolved)."""

    models: list[str]
    workers: list[int]
    ratios: list[float]
    systems: list[System]
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
    plan: bool = False                    # only say what would run and how long it would take
    workers_per_host: int = 1             # emulated cluster: workers sharing one host (its
                                          # namespace and shaped link; loopback between them)

    def __post_init__(self) -> None:
        self.systems = [s if isinstance(s, System) else parse_system(s) for s in self.systems]


def default_batch(model: str, compute: str) -> int:
    """The per-worker batch of ``model`` when ``--batch`` is not given."""
    return (EMULATED_BATCH if compute == "emulated" else DEFAULT_BATCH)[model]


def sweep_cells(opts: SweepOptions) -> list[tuple[str, list[tuple[int, tuple[float, ...]]]]]:
    """``[(model, [(workers, ratios), ...]), ...]`` in the order they run: ``opts.grid`` grouped
    by model, or every model x worker count with all of ``opts.ratios``."""
    if opts.grid:
        by_model: dict[str, list[tuple[int, tuple[float, ...]]]] = {}
        for model, n, ratios in opts.grid:
            by_model.setdefault(model, []).append((int(n), tuple(float(r) for r in ratios)))
        return list(by_model.items())
    return [(m, [(n, tuple(opts.ratios)) for n in opts.workers]) for m in opts.models]


def spec_path(out: str, model: str, cfg: Any) -> str:
    """Where the layer specs of ``model`` with configuration ``cfg`` (a ``ModelConfig``) are kept
    below the output directory ``out``: built once, shared by every run that uses that ``out``."""
    key = hashlib.sha1(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return os.path.abspath(os.path.join(out, "specs", f"{model}-{key}.json"))


# ------------------------------------------------------------------------------------------------
# What fits on this machine


def worker_memory_bytes(gradient_bytes: float, system: Any = "prophet") -> float:
    """Peak memory of one worker of ``system`` (a :class:`System` or a base name): TensorFlow and
    Keras (~1.2 GB) plus copies of the gradient bytes (weights, optimizer slot, gradients, sums,
    buffers): 6 under ProphetStrategy, 10 under mwms. Measured peak RSS (emulated compute, N=2,
    2026-11-26): ResNet50 (102 MB of gradients) 1.33-1.42 GB with ProphetStrategy, 1.89 GB with
    mwms; VGG16 (553 MB) 4.07-4.51 GB and 6.55 GB; BERT-base (438 MB) 2.75-3.02 GB and 5.07 GB."""
    base = system.base if isinstance(system, System) else str(system)
    copies = 10.0 if base == "mwms" else 6.0
    return 1.2e9 + copies * float(gradient_bytes)


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
