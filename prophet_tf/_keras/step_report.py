"""Where the time goes, for users: how long each training step of ``fit`` waited for gradients.

During ``model.fit`` under a :class:`~prophet_tf.ProphetStrategy` (``step_report=True``, the
default) every call of Keras's train function is a measured step. The runtime's kernels time what
the step waits for (``ops/core/step_meter.h``; nothing runs in Python per operation), and this
module turns that into:

* epoch logs, so into ``History``, ``CSVLogger``, the standard ``TensorBoard`` callback (group
  ``epoch_prophet``) and any callback that reads logs. Every worker gets the same keys with the
  same values (the mean over the workers, exchanged in one small collective per epoch):

  ========================  ================================================================
  ``prophet/step_ms``       wall time of a step (a call of the train function), mean over the
                            epoch's steps
  ``prophet/wait_ms``       time a step waited for gradients (below)
  ``prophet/compute_ms``    ``step_ms - wait_ms``: computation, input and framework time
  ``prophet/link_gbps``     bits this worker sent to its peers per second of the epoch's
                            training (from its first step's start to its last step's end)
  ``prophet/schedule``      the schedule in use at the end of the epoch, as its index in
                            ``prophet_tf.runtime.schedules()`` (0 prophet, 1 priority, 2 fifo)
  ``prophet/plan_blocks``   blocks of the prophet policy's current plan on rank 0 (0 for other
                            schedules and before the first plan)
  ========================  ================================================================

* one line per epoch on rank 0 (after Keras's progress bar; not with ``fit(verbose=0)``; off with
  ``ProphetStrategy(report_every_epoch=False)`` or ``PROPHET_REPORT_EVERY_EPOCH=0``)::

      step 446 ms: waiting for gradients 30 ms (7%), link 1.9 Gbit/s, schedule prophet (7 blocks)

* :meth:`ProphetStrategy.step_report`: the same figures for this worker alone, since the start
  of the current (or last) epoch, and the last step's.

**Waiting for gradients** answers "how much faster would my step be with an infinitely fast
network": the time the step could do nothing but wait for communication. It is the sum of two
parts that never overlap in time (the exact rules, and why, are in ``ops/core/step_meter.h`` and
docs/design.md, "Where the time goes"):

* the *gate wait*: how much later the forward pass handed off its first gradient than its
  computation alone takes, because it waited at the gates of variables whose previous update was
  not applied yet (crossing the barrier) or for a collective it needed; kept between the first
  layer's gate wait (a sure stall) and the union of the waits (all of them stalls at most);
* the *barrier wait*: from the step's last gradient hand-off to its end, the union of the time it
  waited for synchronous sums, metric sums and updates (with ``cross_barrier=False`` this is the
  barrier at the end of every step).

It includes waiting for a slower worker's gradients (an infinitely fast network would not remove
that part). Where the forward pass stalls inside, it is an estimate: the forward pass's compute is
taken from reference steps (see :data:`REFERENCE_STEP`), which start only once every pending
update is applied, and from any faster forward pass seen since.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
import os
import re
import time
from typing import Any, Optional

from prophet_tf import runtime
from prophet_tf._keras.host import host_of
from prophet_tf._library import c_api

__all__ = ["LOG_PREFIX", "LOG_KEYS", "REPORT_EVERY_EPOCH_ENV", "StepTimes", "StepReport",
           "StepReporter", "is_report_key"]

#: Every key this module adds to the epoch logs starts with this; no Keras metric name does.
LOG_PREFIX = "prophet/"
STEP_MS = LOG_PREFIX + "step_ms"
WAIT_MS = LOG_PREFIX + "wait_ms"
COMPUTE_MS = LOG_PREFIX + "compute_ms"
LINK_GBPS = LOG_PREFIX + "link_gbps"
SCHEDULE = LOG_PREFIX + "schedule"
PLAN_BLOCKS = LOG_PREFIX + "plan_blocks"
LOG_KEYS = (STEP_MS, WAIT_MS, COMPUTE_MS, LINK_GBPS, SCHEDULE, PLAN_BLOCKS)
#: ``0``/``false``/``no`` turns the per-epoch line off (``report_every_epoch=None``).
REPORT_EVERY_EPOCH_ENV = "PROPHET_REPORT_EVERY_EPOCH"

#: With barrier crossing, step REFERENCE_STEP of every fit (steps 0 and 1 trace and warm up) and
#: every REFERENCE_EVERY-th step after it starts only once every pending update is applied: its
#: forward pass then waits at no gate, and its time to the first gradient is the forward compute
#: the next steps are compared with (ops/core/step_meter.h). What it waited before it starts is
#: its barrier wait. The cost: the overlap of one step in REFERENCE_EVERY.
REFERENCE_STEP, REFERENCE_EVERY = 2, 256

#: Each measured step's figures are an instant on this timeline track, at the step's end.
TIMELINE_TRACK = "report"
_LABEL = re.compile(r"waited ([-\d.]+) ms: gates ([-\d.]+) \(within ([-\d.]+)-([-\d.]+)\), "
                    r"barrier ([-\d.]+)$")

# prophet_step_end's fields, in its order (ops/tf/c_api.cc).
_FIELDS = ("step_ns", "wait_ns", "gate_wait_ns", "barrier_wait_ns", "gate_lower_ns", "gate_upper_ns",
           "first_gradient_ns", "forward_reference_ns")


def is_report_key(key: str) -> bool:
    """Whether an epoch-log key is one of the runtime's (to leave out when comparing logs with a
    run without ProphetStrategy)."""
    return key.startswith(LOG_PREFIX)


def report_every_epoch_default() -> bool:
    """``$PROPHET_REPORT_EVERY_EPOCH``, true unless set to 0/false/no/off."""
    value = os.environ.get(REPORT_EVERY_EPOCH_ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """One step of this worker (one call of the train function), in milliseconds."""

    step_ms: float
    wait_ms: float          #: gate_wait_ms + barrier_wait_ms
    gate_wait_ms: float     #: the forward pass's stall (estimate within gate_wait_bounds_ms)
    barrier_wait_ms: float  #: after the last gradient hand-off
    gate_wait_bounds_ms: tuple[float, float]  #: (first layer's gate wait, union of the waits)

    @property
    def compute_ms(self) -> float:
        return self.step_ms - self.wait_ms


@dataclasses.dataclass(frozen=True)
class StepReport:
    """Where the time of the steps went (see the module docstring for the definitions)."""

    steps: int                #: steps measured
    step_ms: float            #: mean wall time of a step
    wait_ms: float            #: mean time a step waited for gradients
    gate_wait_ms: float       #: part of wait_ms: the forward pass at the gates
    barrier_wait_ms: float    #: part of wait_ms: after the last gradient
    link_gbps: float          #: bits sent per second of training, Gbit/s (0 with one worker)
    schedule: str             #: the schedule in use
    plan_blocks: Optional[int]  #: blocks of Prophet's current plan (None: not prophet)
    workers: int              #: number of workers (1: no link)
    last_step: Optional[StepTimes] = None  #: this worker's last step
    #: the bandwidth monitor's estimate, Gbit/s: the link's rate while this worker's sockets were
    #: full (before any filled: the pushes' goodput, whose round trips also last while owners wait)
    goodput_gbps: float = 0.0

    @property
    def compute_ms(self) -> float:
        """``step_ms - wait_ms``: computation, input pipeline and framework time."""
        return self.step_ms - self.wait_ms

    @property
    def wait_fraction(self) -> float:
        return self.wait_ms / self.step_ms if self.step_ms > 0 else 0.0

    def line(self) -> str:
        """The line rank 0 prints after every epoch."""
        link = "no link (one worker)" if self.workers <= 1 else f"link {_bit_rate(self.link_gbps)}"
        schedule = f"schedule {self.schedule}"
        if self.plan_blocks is not None and self.workers > 1:
            blocks = f"{self.plan_blocks} block" + ("s" if self.plan_blocks > 1 else "")
            schedule += f" ({blocks})" if self.plan_blocks > 0 else " (no plan yet)"
        return (f"step {self.step_ms:.0f} ms: waiting for gradients {self.wait_ms:.0f} ms "
                f"({self.wait_fraction:.0%}), {link}, {schedule}")


def timeline_label(step: StepTimes) -> str:
    """The name of a step's instant on the timeline's "report" track."""
    lower, upper = step.gate_wait_bounds_ms
    return (f"waited {step.wait_ms:.1f} ms: gates {step.gate_wait_ms:.1f} (within {lower:.1f}-"
            f"{upper:.1f}), barrier {step.barrier_wait_ms:.1f}")


def parse_timeline_label(label: str) -> Optional[StepTimes]:
    """The figures of a "report" instant (step_ms is not in it: 0), or None."""
    match = _LABEL.match(label)
    if match is None:
        return None
    wait, gates, lower, upper, barrier = map(float, match.groups())
    return StepTimes(0.0, wait, gates, barrier, (lower, upper))



class StepReporter:
    """Per-strategy state: the current epoch's measured steps."""

    def __init__(self, extended: Any, report_every_epoch: bool) -> None:
        self._extended = extended
        self._lib = c_api()  # the runtime is up: its library is loaded
        self.report_every_epoch = bool(report_every_epoch)
        self._buffer = (ctypes.c_longlong * len(_FIELDS))()
        self._timeline = False  # add each step's figures to the timeline (read at fit's start)
        # Reference steps (below) only where the forward pass may wait at gates.
        self._crossing = bool(extended._cross_barrier and extended._multi)
        self._fit_step = 0
        self._held_ns = 0
        self._begin_epoch()
        self._pending_line: Optional[str] = None

    # ---- fit's lifecycle (the callback) -----------------------------------------------------------
    def begin_fit(self) -> None:
        self._lib.prophet_step_meter_reset()  # the forward-pass reference is per fit
        self._timeline = runtime.timeline_enabled()
        self._fit_step = 0
        self._begin_epoch()

    def _begin_epoch(self) -> None:
        # Sums over the epoch's steps (not a list: train_on_batch loops have no epochs).
        self._count = 0
        self._sums = {"step_ms": 0.0, "wait_ms": 0.0, "gate_wait_ms": 0.0, "barrier_wait_ms": 0.0}
        self._last: Optional[StepTimes] = None
        self._first_step_ns: Optional[int] = None
        self._first_bytes = 0
        self._last_step_end_ns = 0
        self._last_bytes = 0

    # ---- every step (the train function's wrapper; a few microseconds) ---------------------------
    def begin_step(self) -> None:
        c_api = self._lib
        if self._first_step_ns is None:
            self._first_bytes = int(c_api.prophet_bytes_sent())
            self._first_step_ns = time.monotonic_ns()
        step, self._fit_step = self._fit_step, self._fit_step + 1
        self._held_ns = 0
        if self._crossing and step >= REFERENCE_STEP and (step - REFERENCE_STEP) % REFERENCE_EVERY == 0:
            # A reference step: its forward pass waits at no gate, so its time to the first
            # gradient is the compute the meter compares the next steps' with.
            start = time.monotonic_ns()
            from prophet_tf import _crossing  # loads TensorFlow: not for the report's parsers
            _crossing.wait_all()
            self._held_ns = time.monotonic_ns() - start
            c_api.prophet_step_meter_reset()
        c_api.prophet_step_begin()

    def end_step(self) -> None:
        c_api = self._lib
        n = c_api.prophet_step_end(self._buffer, len(_FIELDS))
        values = dict(zip(_FIELDS[:n], self._buffer[:n]))
        self._last_step_end_ns = time.monotonic_ns()
        self._last_bytes = int(c_api.prophet_bytes_sent())
        ms, held = 1e-6, self._held_ns  # a reference step's wait for the updates before it
        step = StepTimes(
            step_ms=(values["step_ns"] + held) * ms, wait_ms=(values["wait_ns"] + held) * ms,
            gate_wait_ms=values["gate_wait_ns"] * ms, barrier_wait_ms=(values["barrier_wait_ns"] + held) * ms,
            gate_wait_bounds_ms=(values["gate_lower_ns"] * ms, values["gate_upper_ns"] * ms))
        self._count += 1
        for key in self._sums:
            self._sums[key] += getattr(step, key)
        self._last = step
        if self._timeline:  # an instant at the step's end on the "report" track
            runtime.timeline_event(TIMELINE_TRACK, timeline_label(step), self._last_step_end_ns)

    # ---- reports ------------------------------------------------------------------------------
    def report(self) -> StepReport:
        """This worker's figures for the steps of the current (or last) epoch."""
        mean = {key: total / self._count if self._count else 0.0 for key, total in self._sums.items()}
        strategy = self._extended._container_strategy()
        state = self._scheduler_state()
        blocks = int(state.get("planned_blocks", -1))
        return StepReport(
            steps=self._count,
            **mean,
            link_gbps=self._link_gbps(),
            schedule=strategy.schedule_in_use,
            plan_blocks=blocks if blocks >= 0 else None,
            workers=self._extended._world_size,
            last_step=self._last,
            goodput_gbps=float(state.get("bandwidth_Bps", 0.0)) * 8 / 1e9)

    def end_epoch(self, logs: dict) -> StepReport:
        """Adds the job's figures for this epoch to ``logs`` (the same on every worker) and keeps
        the line to print once every callback has seen them."""
        local = self.report()
        job = self._job_report(local)
        logs.update({
            STEP_MS: job.step_ms, WAIT_MS: job.wait_ms, COMPUTE_MS: job.compute_ms,
            LINK_GBPS: job.link_gbps,
            SCHEDULE: float(runtime.schedules().index(job.schedule)),
            PLAN_BLOCKS: float(job.plan_blocks or 0)})
        self._pending_line = job.line() if self.report_every_epoch and self._extended._rank == 0 else None
        return job

    def print_pending_line(self) -> None:
        line, self._pending_line = self._pending_line, None
        if line:
            from keras.src.utils import io_utils
            io_utils.print_msg(line)

    def _job_report(self, local: StepReport) -> StepReport:
        """The mean over the workers of ``local``'s times and link rates, and rank 0's plan: one
        float64 sum in which every worker contributes value / N (rank 0 alone the plan)."""
        ext = self._extended
        if not ext._multi:
            return local
        import tensorflow as tf
        n = ext._world_size
        rank0 = 1.0 if ext._rank == 0 else 0.0
        contribution = [local.step_ms / n, local.wait_ms / n, local.gate_wait_ms / n,
                        local.barrier_wait_ms / n, local.link_gbps / n,
                        rank0 * (local.plan_blocks if local.plan_blocks is not None else -1)]
        summed = ext.collectives.push_pull(tf.constant(contribution, tf.float64), ext.collectives.site("step_report"),
                                runtime.control_priority(), False).numpy().tolist()
        blocks = int(round(summed[5]))
        return dataclasses.replace(
            local, step_ms=summed[0], wait_ms=summed[1], gate_wait_ms=summed[2],
            barrier_wait_ms=summed[3], link_gbps=summed[4], plan_blocks=blocks if blocks >= 0 else None)

    def _link_gbps(self) -> float:
        if self._first_step_ns is None or self._last_step_end_ns <= self._first_step_ns:
            return 0.0
        seconds = (self._last_step_end_ns - self._first_step_ns) / 1e9
        return (self._last_bytes - self._first_bytes) * 8 / seconds / 1e9

    @staticmethod
    def _scheduler_state() -> dict:
        """The policy's state (planned_blocks, bandwidth_Bps; one round trip to the runtime)."""
        try:
            return runtime.scheduler_state()
        except Exception:  # noqa: BLE001 - a stopped runtime has no plan to show
            return {}


def _bit_rate(gbps: float) -> str:
    """'1.9 Gbit/s', '350 Mbit/s', '170 kbit/s'."""
    for scale, unit in ((1.0, "Gbit/s"), (1e-3, "Mbit/s")):
        if gbps >= scale:
            return f"{gbps / scale:.3g} {unit}"
    return f"{gbps / 1e-6:.3g} kbit/s"


# ---- Keras hooks (installed by prophet_tf._keras.patches) ------------------------------------------

def reporter_of(model: Any) -> Optional[StepReporter]:
    """The step reporter of the ProphetStrategy ``model`` trains under, if it reports."""
    try:
        strategy = model.distribute_strategy
    except Exception:  # noqa: BLE001 - not a TF trainer
        return None
    host = host_of(strategy)
    return getattr(host, "_step_reporter", None) if host is not None else None


def _report_callback(reporter: StepReporter) -> Any:
    import keras

    class StepReportCallback(keras.callbacks.Callback):
        """Put first among fit's callbacks: the epoch logs it adds are seen by all the others."""

        _prophet_step_report = True

        def on_train_begin(self, logs: Optional[dict] = None) -> None:
            reporter.begin_fit()

        def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
            reporter._begin_epoch()

        def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
            if logs is not None:
                reporter.end_epoch(logs)
            if (self.params or {}).get("verbose", 1) == 0:
                reporter._pending_line = None

        def after_every_callback(self) -> None:
            reporter.print_pending_line()

    return StepReportCallback()


def fit_with_report(original: Any, model: Any, args: tuple, kwargs: dict) -> Any:
    """``model.fit(*args, **kwargs)`` with the step report's callback first among its callbacks."""
    reporter = reporter_of(model)
    if reporter is None:
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    callbacks = bound.arguments.get("callbacks")
    callback = _report_callback(reporter)
    from keras.src.callbacks.callback_list import CallbackList
    if isinstance(callbacks, CallbackList):  # used as given by fit: add ours for this call only
        callback.set_model(model)
        callbacks.callbacks.insert(0, callback)
        try:
            return original(*bound.args, **bound.kwargs)
        finally:
            callbacks.callbacks.remove(callback)
    bound.arguments["callbacks"] = [callback] + list(callbacks or [])
    return original(*bound.args, **bound.kwargs)


def after_epoch_end(callback_list: Any) -> None:
    """Called once every callback's ``on_epoch_end`` ran: prints the pending line (so that it
    follows the progress bar's)."""
    for callback in callback_list.callbacks:
        if getattr(callback, "_prophet_step_report", False):
            callback.after_every_callback()
