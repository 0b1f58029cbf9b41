"""Training step time of prophet_tf's schedules vs TensorFlow's MultiWorkerMirroredStrategy.

    python -m prophet_tf.bench.train [--compute real|emulated] [--quick | --full]
        [--models resnet50,vgg16,transformer,bert_base] [--workers 2,4,8] [--ratios 0.5,1]
        [--systems prophet,prophet_nocross,priority,fifo,bytescheduler,p3,auto,mwms,'prophet[KEY=VALUE]']
        [--compression fp16,bf16]
        [--batch 64] [--steps 20]
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
   ``ProphetStrategy`` with ``schedule="prophet"``, ``"priority"`` and ``"fifo"``; the published
   schedulers ByteScheduler and P3 as their code defines them (``bytescheduler``, ``p3``: their
   own partitions, credit and flow control, docs/design.md); ``prophet``
   with barrier crossing off (``prophet_nocross``: ``cross_barrier=False``, passed only when the
   constructor has that parameter, otherwise the run equals ``prophet`` and the output says so);
   ``auto`` (``schedule="auto"``: the schedule the predictor expects to be fastest, chosen by
   the runtime after a few steps; the JSON says which one it ran, ``schedule_in_use``);
   and TensorFlow's ``tf.distribute.MultiWorkerMirroredStrategy`` (``mwms``: RING collectives on
   CPU, cluster from the launcher's ``TF_CONFIG``). Variants of the ProphetStrategy systems run
   side by side in the same clusters: ``prophet[socket_buffer_bytes=1048576]`` is ``prophet``
   with that option over ``--prophet_options`` (:mod:`prophet_tf.bench.train.systems`); each
   variant is a system of its own in the table and in the JSON ``results``. ``--compression
   fp16,bf16`` adds, after every ProphetStrategy system, the same system with
   ``compression="fp16"`` / ``"bf16"``, named ``prophet+fp16`` / ``prophet+bf16``.
4. Each worker trains on synthetic data with ``model.fit``; ``mwms`` uses the same train step as
   a custom loop, because Keras 3's ``fit`` fails under MultiWorkerMirroredStrategy
   (keras-team/keras#20585). A Keras callback timestamps every ``on_train_batch_begin``; a step's
   time is the interval to the next step's start; rank 0 reports the median over ``--steps``
   steps after ``--warmup`` steps.

Per setting: each system's median step time and samples/s, speed-up over ``mwms``, two bounds
and each system's ratio to both (``step/bound``, ``step/ideal``):

* the lower bound ``max(compute_s, 2(N-1)/N * gradient_bytes * 8 / bandwidth)``
  (``lower_bound_s``);
* the ideal bound (``ideal_bound_s``): the shortest step that any schedule could reach on the
  same layers and links (:func:`prophet_tf.predict.ideal_bound`; docs/design.md, "The ideal
  bound"): the layers' forward and backward times (emulated: the accelerator's, exactly; real:
  the measured step split among the layers by their FLOPs, an estimate), every gradient's
  all-reduce as a fluid on the links from the moment it is ready, in the order the next forward
  pass needs them, at the link's payload rate (1448 of every 1514 bytes tbf counts). It exceeds
  the lower bound where the gradients the next step needs first are produced last.

A compressed system (``prophet+bf16``) has both bounds of its own, in its ``results`` entry
(``lower_bound_s``, ``ideal_bound_s``; the setting's ``compressed_bounds``) and on its table row:
the same bounds with the bytes its gradients travel in (float32 gradients in half their bytes,
``IdealBound.gradient_bytes``), so that its ``step/bound`` and ``step/ideal`` say how close it
comes to what any schedule of those bytes could reach. The link rates (comm/comp) are the
setting's, from the uncompressed gradient bytes.

Outputs in ``--out`` (default ``bench_out/``): ``results.md`` (Markdown table), ``results.csv``,
``results.json`` (``"compute": "real"|"emulated"`` per setting; emulated settings add
``"emulation"``: time scale, accelerator times, modelled link rate; ``"ideal"`` says what the
ideal bound is made of; ``"run"`` the run's steps, threads and options), ``results.png`` (chart)
and ``logs/`` (every launch's output); ``--json PATH`` also writes the JSON list there.
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
:data:`~prophet_tf.bench.train.settings.EMULATED_DEFAULT_GRID` (ResNet50, VGG16 and BERT-base x
N = 2, 4, 8 x comm/comp 0.5, 1, 2) with :data:`~prophet_tf.bench.train.systems.
EMULATED_DEFAULT_SYSTEMS`, ``mwms`` only at comm/comp 1; settings whose workers would not fit
in this machine's memory are skipped with a message (docs/benchmarks.md gives what fits and how
long the sweep takes); ``--full``: every model x N = 2, 4, 8 x comm/comp 0.5, 1, 1.5, 2 with
every base system; ``--models`` alone keeps the default grid's settings of those models (so
the sweep can be measured one model at a time and joined with ``--merge``); ``--workers`` or
``--ratios`` makes a grid of the product of ``--models``, ``--workers`` and ``--ratios``
instead.

``--quick``: one model, 2 workers, comm/comp = 1, no contended run, no ``auto`` (it runs one of
the other schedules) and no retries (a disturbed launch is flagged, not run twice): the small
Transformer with real compute, ResNet50 with emulated compute (expected to take about 3 minutes
on an idle 2-core machine, estimated from measured launch times; start-up and the first step's
tracing are about 11 s of each launch there).

The package, by concern: :mod:`~prophet_tf.bench.train.settings` (grids, bounds, link rates,
the JSON of a setting), :mod:`~prophet_tf.bench.train.systems` (the systems and their names),
:mod:`~prophet_tf.bench.train.worker` (what runs in each launched process),
:mod:`~prophet_tf.bench.train.sweep` (clusters, launches, retries), :mod:`~prophet_tf.bench.
train.report` (table, CSV, chart, files) and :mod:`~prophet_tf.bench.train.cli` (flags, main).
"""

from __future__ import annotations

from prophet_tf.bench.models import COMPUTE_MODES, MODEL_NAMES
from prophet_tf.bench.train.cli import (define_flags, main, options_from_flags,
                                        worker_or_bad_arguments)
from prophet_tf.bench.train.report import (CSV_FIELDS, compute_summary, format_bandwidth,
                                           format_markdown, launch_text, noise_text, plot,
                                           merge_results, rate_change_summary, write_csv,
                                           write_outputs)
from prophet_tf.bench.train.settings import (CPU_LIMITED_FRACTION, DEFAULT_BATCH,
                                             DEFAULT_LINK_BUDGET_BPS, DEFAULT_MODELS,
                                             DEFAULT_RATIOS, EMULATED_BATCH,
                                             EMULATED_DEFAULT_GRID, EMULATED_DEFAULT_MODELS,
                                             EMULATED_FULL_RATIOS, EMULATED_QUICK_MODEL,
                                             EMULATED_RATIOS, EMULATED_STEPS, EMULATED_WARMUP,
                                             MAX_WORKERS, NETNS_PREFIX, NOISY_CORES, QUICK_MODEL,
                                             SweepOptions, available_memory_bytes,
                                             choose_bandwidth, choose_bandwidths, comm_bytes,
                                             comm_time_s, default_batch, emulated_time_scale,
                                             ideal_bound, lower_bound_s, make_setting, median,
                                             spec_path, step_periods, sweep_cells,
                                             validate_settings,
                                             worker_memory_bytes, write_json)
from prophet_tf.bench.train.sweep import (Interrupted, LaunchFailed, cpu_fraction, foreign_cores,
                                          parse_results, repo_root, run_sweep, safe_name,
                                          timeline_pattern, worker_config)
from prophet_tf.bench.train.systems import (BASE_SYSTEMS, EMULATED_DEFAULT_SYSTEMS, MODIFIERS,
                                            PROPHET_BASES, QUICK_SYSTEMS, SYSTEMS, System,
                                            parse_system, parse_systems)
from prophet_tf.bench.train.worker import machine_busy_s, run_worker

__all__ = [
    "COMPUTE_MODES", "MODEL_NAMES", "define_flags", "main", "options_from_flags",
    "worker_or_bad_arguments", "CSV_FIELDS", "compute_summary", "format_bandwidth",
    "format_markdown", "launch_text", "noise_text", "plot", "rate_change_summary", "write_csv",
    "write_outputs", "merge_results", "CPU_LIMITED_FRACTION", "DEFAULT_BATCH", "DEFAULT_LINK_BUDGET_BPS",
    "DEFAULT_MODELS", "DEFAULT_RATIOS", "EMULATED_BATCH", "EMULATED_DEFAULT_GRID",
    "EMULATED_DEFAULT_MODELS", "EMULATED_FULL_RATIOS", "EMULATED_QUICK_MODEL", "EMULATED_RATIOS",
    "EMULATED_STEPS", "EMULATED_WARMUP", "MAX_WORKERS", "NETNS_PREFIX", "NOISY_CORES",
    "QUICK_MODEL", "SweepOptions", "available_memory_bytes", "choose_bandwidth",
    "choose_bandwidths", "comm_bytes", "comm_time_s", "default_batch", "emulated_time_scale",
    "ideal_bound", "lower_bound_s", "make_setting", "median", "spec_path", "step_periods",
    "sweep_cells",
    "validate_settings", "worker_memory_bytes", "write_json", "Interrupted", "LaunchFailed",
    "cpu_fraction", "foreign_cores", "parse_results", "repo_root", "run_sweep", "safe_name",
    "timeline_pattern", "worker_config", "BASE_SYSTEMS", "EMULATED_DEFAULT_SYSTEMS", "MODIFIERS",
    "PROPHET_BASES", "QUICK_SYSTEMS", "SYSTEMS", "System", "parse_system", "parse_systems",
    "machine_busy_s", "run_worker",
]
