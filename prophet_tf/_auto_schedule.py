"""``ProphetStrategy(schedule="auto")``: the schedule the predictor expects to be fastest.

The runtime starts with ``prophet``, whose policy profiles when every gradient becomes ready and
measures the link. At training step :data:`FIRST_DECISION_STEP` (counted in calls of Keras'
train function) the strategy

1. lets that step start only once every pending update is applied, so that its forward pass is
   not held back at the gates: the time from its start to its first gradient is the compute's;
2. on rank 0, builds a profile from what the runtime measured (ready offsets and bytes of every
   gradient, that forward time, the step's tail and the gap between steps), finds the link rate
   at which the simulated runtime, with the schedule in use, takes the step time measured with
   it (the median of the steps since the last switch; without two such steps, the link rate at
   which the simulated runtime measures the bandwidth estimate the real one measured), and predicts the step
   time of ``prophet``, ``priority`` and ``fifo`` (with the strategy's barrier crossing and its
   gradient compression: the profile has the tensors' bytes, the predictor sends the compressed
   gradients in half of them) on this many workers at that link rate (:mod:`prophet_tf.predict`);
3. sends rank 0's choice to every worker (a control-priority collective, so that every worker
   runs the same schedule) and switches the runtime to it between steps (``runtime.set_schedule``).

Every :data:`CHECK_EVERY_STEPS` steps after that the workers exchange rank 0's choice again;
rank 0 predicts again only when the measured bandwidth (the median of the runtime's estimate
over those steps) moved by more than the runtime's ``replan_threshold`` since the last decision,
as the prophet policy re-plans. Each decision is
logged (logger ``prophet_tf``, INFO) with the predicted step time of every candidate and kept in
:attr:`AutoSchedule.decisions`.

Decisions need Keras' ``fit`` (its train function marks the steps); custom training loops keep
``prophet``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from typing import Any, Mapping, Optional, Sequence

from prophet_tf import runtime
from prophet_tf._options import predicted_options
from prophet_tf.predict import (PredictError, PredictOptions, ProfiledTensor,
                                kernel_autotuned_socket_buffer, kernel_socket_buffer_cap, predict,
                                profile_from_ready_times)

logger = logging.getLogger("prophet_tf")

__all__ = ["AUTO", "CANDIDATES", "FIRST_DECISION_STEP", "CHECK_EVERY_STEPS", "Decision",
           "AutoSchedule", "link_rate_matching"]

#: The schedule name that asks for this.
AUTO = "auto"
#: What it chooses among (the runtime's policies).
CANDIDATES = ("prophet", "priority", "fifo")
#: Steps 0..2 trace the function, warm the profiler up and give it a first profiled step.
FIRST_DECISION_STEP = 4
CHECK_EVERY_STEPS = 10
#: The schedule in use is kept unless another is predicted faster by more than this fraction.
KEEP_MARGIN = 0.01
#: Simulated steps per prediction here (fewer than the command line's: rank 0 makes them while
#: the other workers wait for its choice).
STEPS, WARMUP_STEPS = 8, 4


@dataclasses.dataclass
class Decision:
    """One decision of rank 0 (other ranks record the schedule they switched to)."""

    step: int
    schedule: str
    predicted_s: dict[str, float]   # per candidate; empty on ranks other than 0
    link_bps: float                 # the link rate the predictions assumed
    goodput_Bps: float              # what the runtime measured
    reason: str


def link_rate_matching(value_at: Any, target: float, low_bps: float, high_bps: float,
                       rounds: int = 14) -> float:
    """The link rate (bit/s) in [low_bps, high_bps] at which the simulated quantity
    ``value_at(rate)`` equals ``target``: bisection on log(rate). ``value_at`` must be monotonic
    in the rate (a step time falls as the link gets faster, a goodput rises); a target beyond its
    range gives the nearer end. ``value_at`` returning None counts as infinitely slow."""
    def at(rate: float) -> float:
        value = value_at(rate)
        return math.nan if value is None else value

    lo_value, hi_value = at(low_bps), at(high_bps)
    if math.isnan(lo_value) or math.isnan(hi_value):
        return high_bps
    rising = hi_value >= lo_value
    if (target >= hi_value) == rising:
        return high_bps
    if (target <= lo_value) == rising:
        return low_bps
    low, high = math.log(low_bps), math.log(high_bps)
    for _ in range(rounds):
        middle = (low + high) / 2
        value = at(math.exp(middle))
        if math.isnan(value) or (value < target) == rising:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2)


def _modelled(name: str) -> bool:
    """Whether the predictions take option ``name`` from the running runtime: the options the
    predictor models, but the two-level path (the predictions place one worker per host)."""
    return name in predicted_options() and name != "hierarchical"


class AutoSchedule:
    """Per-worker state of ``schedule="auto"``; the strategy calls :meth:`before_step` and
    :meth:`after_step` around every call of the train function.

    ``runtime_options`` are the runtime's settings (``runtime.config()``); predictions simulate
    the runtime with those the predictor models, the defaults otherwise."""

    def __init__(self, extended: Any, replan_threshold: float,
                 candidates: Sequence[str] = CANDIDATES,
                 runtime_options: Optional[Mapping[str, Any]] = None) -> None:
        self._extended = extended
        self._threshold = float(replan_threshold)
        self._runtime_options = {k: v for k, v in (runtime_options or {}).items() if _modelled(k)}
        self._candidates = tuple(candidates)
        self.current = "prophet"
        self.decisions: list[Decision] = []
        self._gaps: list[float] = []
        self._last_end_ns: Optional[int] = None
        self._last_begin_ns: Optional[int] = None
        self._periods: list[float] = []    # rank 0: step periods since the last switch
        self._goodputs: list[float] = []   # rank 0: the runtime's estimate after each step
        self._compute: Optional[dict[str, Any]] = None  # profile inputs measured in a clean step
        self._measure_at = FIRST_DECISION_STEP          # rank 0's next clean step, until measured
        self._goodput_at_decision: Optional[float] = None

    # ---- hooks ---------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        if self._extended._rank == 0 and step == self._measure_at and self._extended._cross_barrier:
            from prophet_tf import _crossing  # loads TensorFlow, which a decision does not need
            _crossing.wait_all()  # this step's forward pass must not wait at the gates

    def after_step(self, step: int, begin_ns: int, end_ns: int) -> None:
        if self._last_end_ns is not None:
            self._gaps.append((begin_ns - self._last_end_ns) / 1e9)
        # Step 0 traces the function; the clean step waited for the updates before it began.
        if self._last_begin_ns is not None and step > 1 and step - 1 != self._measure_at:
            self._periods.append((begin_ns - self._last_begin_ns) / 1e9)
        self._last_begin_ns, self._last_end_ns = begin_ns, end_ns
        state = runtime.scheduler_state() if self._extended._rank == 0 else {}
        if state.get("bandwidth_samples"):
            self._goodputs = (self._goodputs + [float(state["bandwidth_Bps"])])[-CHECK_EVERY_STEPS:]
        if step < FIRST_DECISION_STEP or (step - FIRST_DECISION_STEP) % CHECK_EVERY_STEPS:
            return
        if self._extended._rank == 0 and step == self._measure_at:
            self._compute = self._measure_compute(state, begin_ns, end_ns)
            if self._compute is None:  # no profile yet: measure again at the next check
                self._measure_at = step + CHECK_EVERY_STEPS
        choice = self._decide(step) if self._extended._rank == 0 else None
        self._apply(step, self._exchange(step, choice))

    # ---- rank 0 -------------------------------------------------------------------------------
    def _measure_compute(self, state: dict, begin_ns: int, end_ns: int) -> Optional[dict]:
        profile = state.get("profile")
        if not profile or profile.get("step_origin_ns", -1) < 0:
            return None
        offsets = [t["ready_offset_ns"] for t in profile["tensors"]]
        origin = profile["step_origin_ns"]
        last_ready = origin + max(offsets)
        return {"tensors": profile["tensors"],
                "forward_s": max(0.0, (origin - begin_ns) / 1e9),
                "tail_s": max(0.0, (end_ns - last_ready) / 1e9)}

    def _decide(self, step: int) -> Optional[str]:
        """Rank 0: the schedule to use from now on, or None to keep the current one."""
        goodput = statistics.median(self._goodputs) if self._goodputs else 0.0
        if self._compute is None or goodput <= 0:
            return None
        if (self._goodput_at_decision is not None and
                abs(goodput - self._goodput_at_decision) <= self._threshold * self._goodput_at_decision):
            return None
        profile = self._profile()
        workers = self._extended._world_size
        measured = statistics.median(self._periods) if len(self._periods) >= 2 else None
        if measured is not None:
            # The link at which the model takes the step measured with the schedule in use.
            link = link_rate_matching(lambda rate: self._predict(profile, self.current, rate),
                                      measured, goodput * 8 / 4, goodput * 8 * 64)
            basis = f"its step with {self.current} measured {measured * 1e3:.1f} ms"
        else:
            # The simulator replays the same bandwidth monitor: the link at which the simulated
            # runtime measures what this one measured.
            link = link_rate_matching(lambda rate: self._simulated_goodput(profile, rate),
                                      goodput, goodput * 8 / 4, goodput * 8 * 64)
            basis = f"the runtime measured {goodput * 8 / 1e9:.3g} Gbit/s goodput"
        predicted: dict[str, float] = {}
        failures: dict[str, str] = {}
        for schedule in self._candidates:
            try:
                predicted[schedule] = self._prediction(profile, schedule, link).step_s
            except PredictError as e:  # a predicted deadlock, or a profile the model rejects
                failures[schedule] = str(e).split(":", 1)[-1].strip()[:160]
        if not predicted:
            return None
        best = min(predicted, key=predicted.get)
        keep = self.current in predicted and predicted[self.current] <= predicted[best] * (1 + KEEP_MARGIN)
        chosen = self.current if keep else best
        reason = (f"{workers} workers, link {link / 1e9:.3g} Gbit/s ({basis}); predicted step "
                  + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in sorted(predicted.items(),
                                                                        key=lambda kv: kv[1]))
                  + "".join(f"; {s} not predicted ({why})" for s, why in failures.items())
                  + (f"; keeping {self.current} (within {KEEP_MARGIN:.0%} of the best)" if keep and chosen != best else ""))
        self.decisions.append(Decision(step, chosen, predicted, link, goodput, reason))
        self._goodput_at_decision = goodput
        if chosen != self.current:
            self._periods = []
        logger.info("schedule=auto at step %d: %s (%s)", step, chosen, reason)
        return chosen

    def _profile(self) -> Any:
        measured = self._compute
        assert measured is not None
        origin = min(t["ready_offset_ns"] for t in measured["tensors"])
        tensors = [ProfiledTensor(t["name"], int(t["bytes"]), int(t["priority"]),
                                  (t["ready_offset_ns"] - origin) / 1e9,
                                  element_size=4 if int(t["bytes"]) % 4 == 0 else 1)
                   for t in measured["tensors"]]
        gap = statistics.median(self._gaps) if self._gaps else 0.0
        return profile_from_ready_times(tensors, measured["forward_s"], tail_s=measured["tail_s"],
                                        gap_s=max(0.0, gap), source="runtime (schedule=auto)")

    def _prediction(self, profile: Any, schedule: str, rate_bps: float) -> Any:
        name = schedule if self._extended._cross_barrier else f"{schedule}_nocross"
        # The runtime as it runs here, on this machine's kernel.
        options = PredictOptions(steps=STEPS, warmup_steps=WARMUP_STEPS,
                                 max_socket_buffer_bytes=kernel_socket_buffer_cap(),
                                 autotuned_socket_buffer_bytes=kernel_autotuned_socket_buffer(),
                                 compression=self._extended._compression,
                                 **self._runtime_options)
        return predict(profile, workers=self._extended._world_size, bandwidth_bps=rate_bps,
                       schedule=name, options=options)

    def _predict(self, profile: Any, schedule: str, rate_bps: float) -> Optional[float]:
        """Predicted step time of ``schedule`` at ``rate_bps``; None if it cannot be predicted."""
        try:
            return self._prediction(profile, schedule, rate_bps).step_s
        except PredictError:
            return None

    def _simulated_goodput(self, profile: Any, rate_bps: float) -> Optional[float]:
        try:
            return self._prediction(profile, self.current, rate_bps).bandwidth_Bps
        except PredictError:
            return None

    # ---- every worker --------------------------------------------------------------------------
    def _exchange(self, step: int, choice: Optional[str]) -> Optional[str]:
        """Every worker learns rank 0's choice (a sum in which only rank 0 contributes)."""
        import tensorflow as tf
        code = self._candidates.index(choice) + 1 if choice in self._candidates else 0
        total = self._extended.collectives.push_pull(tf.constant(code, tf.int32), f"auto_schedule/{step}",
                                          runtime.control_priority(), False)
        value = int(total.numpy())
        return self._candidates[value - 1] if 0 < value <= len(self._candidates) else None

    def _apply(self, step: int, schedule: Optional[str]) -> None:
        if schedule is None or schedule == self.current:
            return
        runtime.set_schedule(schedule)
        self._periods = []
        if self._extended._rank != 0:
            self.decisions.append(Decision(step, schedule, {}, 0.0, 0.0, "rank 0's decision"))
        self.current = schedule

