"""The training benchmark's command line: its flags, how they resolve into the sweep's options
(``--quick``, ``--full``, the default grid), and ``main``."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Any, Optional, Sequence

from prophet_tf.bench.emulated import DEFAULT_ACCELERATOR_TFLOPS
from prophet_tf.bench.models import COMPUTE_MODES, MODEL_NAMES
from prophet_tf.bench.train.report import BOUNDS_TEXT, format_markdown, merge_results
from prophet_tf.bench.train.settings import (DEFAULT_BATCH, DEFAULT_LINK_BUDGET_BPS,
                                             DEFAULT_MODELS, DEFAULT_RATIOS, EMULATED_BATCH,
                                             EMULATED_DEFAULT_GRID, EMULATED_DEFAULT_MODELS,
                                             EMULATED_FULL_RATIOS, EMULATED_QUICK_MODEL,
                                             EMULATED_RATIOS, EMULATED_STEPS, EMULATED_WARMUP,
                                             MAX_WORKERS, NETNS_PREFIX, QUICK_MODEL,
                                             SweepOptions, sweep_cells)
from prophet_tf.bench.train.sweep import format_plan, run_sweep
from prophet_tf.bench.train.systems import (COMPRESSION_OPTION, EMULATED_DEFAULT_SYSTEMS,
                                            QUICK_SYSTEMS, SYSTEMS, parse_systems,
                                            with_compressions)
from prophet_tf.bench.train.worker import run_worker

__all__ = ["define_flags", "options_from_flags", "worker_or_bad_arguments", "main"]


def define_flags() -> Any:
    """Defines the command line's flags (absl); returns ``absl.flags.FLAGS``."""
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
                  f"comm/comp {','.join(f'{r:g}' for r in EMULATED_FULL_RATIOS)}, every base "
                  "system), many hours.")
    f.DEFINE_bool("quick", False,
                  "One model, 2 workers, the setting where communication = computation, no "
                  f"contended-compute run (about 3 minutes): {QUICK_MODEL} with real compute, "
                  f"{EMULATED_QUICK_MODEL} with emulated compute.")
    f.DEFINE_list("models", None, f"Models among {', '.join(MODEL_NAMES)} (default: "
                  f"{','.join(DEFAULT_MODELS)} with real compute; emulated: see --full and the "
                  "module docstring; emulated without --workers and --ratios: the default "
                  "sweep's settings of these models).")
    f.DEFINE_list("workers", None, "Worker counts, 2-8 (default: 2; the emulated default sweep: "
                  "2, 4, 8).")
    f.DEFINE_integer("batch", None, "Per-worker batch size; the global batch is N times this "
                     f"(default per model: {DEFAULT_BATCH} real, {EMULATED_BATCH} emulated).")
    f.DEFINE_integer("steps", None, "Measured steps per run (default 10 real, "
                     f"{EMULATED_STEPS} emulated).")
    f.DEFINE_integer("warmup", None, "Unmeasured steps first (tracing, planning; default 3 "
                     f"real, {EMULATED_WARMUP} emulated).")
    f.DEFINE_list("ratios", None, "Communication/computation ratios that set the bandwidths "
                  f"(default: {','.join(f'{r:g}' for r in DEFAULT_RATIOS)} real, "
                  f"{','.join(f'{r:g}' for r in EMULATED_RATIOS)} emulated).")
    f.DEFINE_list("systems", None, f"Systems: {', '.join(SYSTEMS)}, or variants of the "
                  "ProphetStrategy ones with their own options, side by side in one run: "
                  "BASE[KEY=VALUE,...], e.g. 'prophet,prophet[socket_buffer_bytes=1048576]' "
                  "(prophet_tf/bench/train/systems.py). Default: all; with --quick "
                  f"{','.join(QUICK_SYSTEMS)}; emulated compute without --full "
                  f"{','.join(EMULATED_DEFAULT_SYSTEMS)}.")
    f.DEFINE_list("compression", None, "Gradient compressions (fp16, bf16): after every "
                  "ProphetStrategy system of the run, the same system compressed, named "
                  "SYSTEM+fp16 / SYSTEM+bf16 (e.g. prophet+bf16), in the same clusters; each with "
                  "its own bounds (the bytes that travel).")
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
    f.DEFINE_bool("plan", False, "Emulated compute: print every setting the flags select (time "
                  "scale, link, bounds, the systems that fit in memory) and an estimate of how "
                  "long the sweep takes, without running it (builds the layer specs if needed).")
    f.DEFINE_list("merge", None, "Run nothing: join the results.json of several runs (parts of "
                  "one sweep, e.g. one per --models) into one report in --out.")
    f.DEFINE_integer("workers_per_host", 1, "Emulated cluster: workers per host. The K workers "
                     "of a host share its network namespace and shaped link (loopback between "
                     "them); comm/comp, the time scale and the bounds are then the N/K hosts' "
                     "links'. The runtime's schedules take the two-level path there by default "
                     "(hierarchical='auto') unless the start-up probe finds the flat one faster; "
                     "compare the paths with systems 'prophet[hierarchical=off],"
                     "prophet[hierarchical=on],prophet'. Every --workers must be a multiple.")
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
    if emulated and not quick and not flags_.full and not (flags_.workers or flags_.ratios):
        # `--models X` alone is the default sweep's part for X (the sweep is measured per model
        # and joined with --merge): the same workers, ratios and systems as the whole grid.
        grid = [(m, n, tuple(r)) for m, n, r in EMULATED_DEFAULT_GRID
                if not flags_.models or m in flags_.models]
    default_ratios = (EMULATED_FULL_RATIOS if flags_.full else EMULATED_RATIOS) if emulated \
        else DEFAULT_RATIOS
    quick_model = EMULATED_QUICK_MODEL if emulated else QUICK_MODEL
    all_models = list(EMULATED_DEFAULT_MODELS if emulated else DEFAULT_MODELS)
    models = flags_.models or ([quick_model] if quick else all_models)
    bad = [m for m in models if m not in MODEL_NAMES]
    if bad:
        raise ValueError(f"unknown model(s) {bad}; choose from {', '.join(MODEL_NAMES)}")
    workers = [int(w) for w in (flags_.workers or (["2", "4", "8"] if flags_.full else ["2"]))]
    if any(not 2 <= w <= MAX_WORKERS for w in workers):
        raise ValueError(f"--workers must be between 2 and {MAX_WORKERS}, got {workers}")
    ratios = [float(r) for r in (flags_.ratios or (["1"] if quick else default_ratios))]
    if any(r <= 0 for r in ratios):
        raise ValueError(f"--ratios must be positive, got {ratios}")
    default_systems = (QUICK_SYSTEMS if quick else
                       EMULATED_DEFAULT_SYSTEMS if emulated and not flags_.full else SYSTEMS)
    systems = with_compressions(parse_systems(flags_.systems or list(default_systems)),
                                flags_.compression or [])
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
    if COMPRESSION_OPTION in prophet_options:
        raise ValueError("--prophet_options: give the compression with --compression (systems "
                         "named prophet+bf16 etc., with their own bounds), not as an option")
    per_host = flags_.workers_per_host
    if per_host < 1 or any(w % per_host or w // per_host < 2 for w in workers):
        raise ValueError(f"every --workers value must be a multiple of --workers_per_host "
                         f"{per_host}, on at least 2 hosts, got {workers}")
    if per_host > 1 and flags_.loopback:
        raise ValueError("--workers_per_host needs the emulated cluster; drop --loopback")
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
                        mwms_ratios=(1.0,) if grid is not None and not flags_.systems else None,
                        plan=flags_.plan, workers_per_host=per_host)


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
    if FLAGS.merge:
        try:
            settings = merge_results(FLAGS.merge, FLAGS.out)
        except ValueError as e:
            print(f"error: --merge: {e}", file=sys.stderr)
            return 2
        print(format_markdown(settings))
        print(f"\n{len(settings)} settings from {len(FLAGS.merge)} parts; results in {FLAGS.out}/")
        return 0
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
    print(f"{'Plan of the t' if opts.plan else 'T'}raining benchmark on {where}, {compute}: "
          f"{grid}; systems "
          f"{', '.join(s.name for s in opts.systems)}; {opts.steps} steps after {opts.warmup} "
          "warm-up; "
          f"output in {opts.out}/", flush=True)
    t0 = time.monotonic()
    try:
        settings = run_sweep(opts)
    except (NetemUnavailableError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print("\ninterrupted: workers stopped, namespaces deleted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    print()
    if opts.plan:
        print(format_plan(opts.meta.get("plan", []), opts.meta.get("skipped", [])))
        return 0
    print(format_markdown(settings))
    print(BOUNDS_TEXT)
    for note in sorted({n for st in settings for n in st.get("notes", [])}):
        print(f"- {note}")
    for why in opts.meta.get("skipped", []):
        print(f"- {why}")
    print(f"\ndone in {time.monotonic() - t0:.0f} s; results in {opts.out}/ (results.md, "
          f"results.csv, results.json, results.png)")
    failed = [(st["model"], s) for st in settings for s, r in st["results"].items()
              if r.get("step_s_median") is None]
    return 1 if failed or not settings else 0
