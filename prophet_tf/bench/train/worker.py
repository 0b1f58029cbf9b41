"""The training benchmark's worker: what runs inside each launched process
(``python -m prophet_tf.bench.train --worker CONFIG``): it trains the setting's model with one
system and prints ``RESULT {json}`` (rank 0's step times, CPU and memory, facts about the
strategy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

from prophet_tf.bench.train.report import format_bandwidth
from prophet_tf.bench.train.settings import json_safe, median, step_periods
from prophet_tf.bench.train.systems import parse_system

__all__ = ["run_worker", "machine_busy_s", "make_strategy", "describe_model", "change_link_rate"]


#: TensorFlow's switch to its pooled (BFC) CPU allocator, read when it makes that allocator.
_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


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


def _set_thread_env(intra: int, inter: int) -> None:
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(intra)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(inter)
    os.environ["OMP_NUM_THREADS"] = str(intra)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def make_strategy(system: str, tf: Any, prophet_options: Mapping[str, Any]) -> tuple[Any, dict]:
    """The strategy of ``system`` (a system name, or ``single``: None) and facts about it for the
    report. A ProphetStrategy system gets ``prophet_options`` with its own over them."""
    facts: dict[str, Any] = {}
    if system == "single":
        return None, facts
    spec = parse_system(system)
    if spec.base == "mwms":
        impl = tf.distribute.experimental.CommunicationImplementation.RING
        comm = tf.distribute.experimental.CommunicationOptions(implementation=impl)
        return tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm), facts
    from prophet_tf.strategy import ProphetStrategy
    kwargs = {"cross_barrier": spec.cross_barrier, **spec.strategy_options(prophet_options)}
    strategy = ProphetStrategy(schedule=spec.schedule, **kwargs)
    facts["schedule_effective"] = strategy.schedule
    facts["cross_barrier"] = bool(kwargs["cross_barrier"])
    facts["compression"] = strategy.compression
    from prophet_tf import runtime
    started = runtime.config()
    # The runtime options this system set, as the runtime was started with them.
    facts["runtime_options"] = {k: started[k] for k, _ in spec.options if k in started}
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


def _record_emulation(config: Mapping[str, Any]) -> None:
    """Puts the emulation's time scale and accelerator rate on this worker's timeline (an instant
    on the "emulation" track), so that a profile recorded from it knows how much slower than the
    modelled accelerator it ran (``prophet_tf.predict --time_scale profile``)."""
    from prophet_tf import runtime
    from prophet_tf.predict.profile import EMULATION_TRACK, emulation_record
    if runtime.timeline_enabled():
        runtime.timeline_event(EMULATION_TRACK, emulation_record(float(config["time_scale"]),
                                                                 float(config["accelerator_tflops"])),
                               time.monotonic_ns())


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
    is_mwms = system != "single" and parse_system(system).base == "mwms"
    is_prophet = system != "single" and parse_system(system).is_prophet
    _set_thread_env(config["intra_threads"], config["inter_threads"])
    if config.get("compute") == "emulated":
        # The emulated accelerator's memory is pooled, as TensorFlow's GPU allocator (BFC) pools
        # a GPU's. With the host's default allocator every large temporary of the optimizer's
        # update is a fresh mmap that faults on every page: VGG16's fc1 update took 1.26 s
        # instead of 0.58 s, on the critical path of the next forward pass, where a GPU has none
        # of that cost. Read when TensorFlow makes its CPU allocator, so set before it is imported.
        os.environ.setdefault(_BFC_ENV, "true")
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(config["intra_threads"])
    tf.config.threading.set_inter_op_parallelism_threads(config["inter_threads"])
    import keras

    from prophet_tf.bench import models

    strategy, facts = make_strategy(system, tf, config.get("prophet_options") or {})
    if strategy is None:
        rank, world = 0, 1
    elif is_mwms:
        resolver = strategy.cluster_resolver
        rank, world = int(resolver.task_id), strategy.num_replicas_in_sync
    else:
        rank, world = strategy.rank, strategy.world_size
    cfg = _model_config(config)
    per_worker = int(config["batch_per_worker"])
    global_batch = per_worker * world
    # Any real model the specs need is built here, outside the strategy's scope.
    specs = _layer_specs(config) if config.get("compute", "real") == "emulated" else None
    if specs is not None and is_prophet:
        _record_emulation(config)

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
                change_link_rate(rate_change, strategy if is_prophet else None)
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
    if is_mwms:
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
        # TensorFlow's host allocator: "bfc" (pooled) or "default" (malloc)
        "cpu_allocator": ("bfc" if os.environ.get(_BFC_ENV, "").lower() in ("1", "true")
                          else "default"),
        **facts,
    }
    if strategy is not None and hasattr(strategy, "schedule_in_use"):
        from prophet_tf import runtime
        # Times the policy broke its flow control for a wait taken for a deadlock (bytescheduler;
        # over the whole launch, warm-up included).
        result["stall_breaks"] = runtime.scheduler_state().get("stall_breaks")
        result["schedule_in_use"] = strategy.schedule_in_use
        result["schedule_decisions"] = [dict(step=d.step, schedule=d.schedule, reason=d.reason)
                                        for d in strategy.schedule_decisions]
    print("RESULT " + json.dumps(json_safe(result)), flush=True)
    _fast_exit(strategy, is_mwms, is_prophet, tf)


def change_link_rate(change: Mapping[str, Any], strategy: Any) -> None:
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


def _fast_exit(strategy: Any, is_mwms: bool, is_prophet: bool, tf: Any) -> None:
    """Exits right away once every worker is done (TensorFlow's teardown takes seconds).

    A final collective makes sure no worker still needs a peer; if it fails, the worker returns
    and exits normally.
    """
    try:
        if is_mwms:
            one = strategy.run(lambda: tf.constant(1.0))
            strategy.reduce(tf.distribute.ReduceOp.SUM, one, axis=None).numpy()
        elif strategy is not None:
            strategy.barrier()
    except Exception as e:  # noqa: BLE001 - fall back to a normal exit
        print(f"final barrier failed ({type(e).__name__}: {e}); exiting normally", flush=True)
        return
    if is_prophet:
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

