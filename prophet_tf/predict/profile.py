"""One worker's training step, as the predictor needs it: the profile.

A profile says, for one worker training alone:

* the layers in forward order with their forward (and backward) time;
* every collective the step makes (gradients, and control collectives such as the metrics'),
  with its bytes, priority, the layer whose forward pass reads it (gradients), the time after the
  backward pass's start at which it is handed to the runtime, and its optimizer update's time;
* the step's other times: launch (step begins -> first forward), tail (last work -> the train
  function returns) and gap (-> the next step begins).

How to get one: run the training script on ONE worker with ``PROPHET_PROFILE=trace.json`` (or
``ProphetStrategy(profile_path=...)``). That run writes its runtime timeline (a Chrome trace) and
goes through the multi-worker code path with a world of one, so every gradient is handed to the
runtime (which returns it at once) and appears on the trace with its ready time, bytes and
priority, and every update with its duration. The timeline of worker 0 of a multi-worker run
(``PROPHET_TIMELINE``) is accepted too; its ready offsets are those of the backward pass, but its
gaps include waiting for the network.

:func:`load_profile` reads either a trace or a profile saved by :meth:`Profile.save` (JSON with
``"format": "prophet_tf.profile"``).

Forward times per layer: traces of accelerator-emulated models (``prophet_tf.bench.train --compute
emulated``) carry "forward"/"backward" spans per layer and the profile uses them
(``forward == "measured"``). Real models have no per-layer forward marks; then the profile
estimates them (``forward == "estimated"``): the forward pass is a third of the time from the
step's begin to its last gradient (backward = 2 x forward, the usual ratio of FLOPs), split among
layers in proportion to the gaps between their gradients' ready times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from prophet_tf import timeline
from prophet_tf.errors import ProphetError
from prophet_tf.runtime import control_priority

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "EMULATION_TRACK", "ProfileError", "ProfiledLayer",
           "ProfiledTensor", "Profile", "emulation_record", "load_profile", "profile_from_ready_times",
           "profile_from_trace"]

PROFILE_FORMAT = "prophet_tf.profile"
#: The trace's track where an emulated benchmark worker records its time scale
#: (:func:`emulation_record`); :func:`profile_from_trace` reads it into ``Profile.emulation``.
EMULATION_TRACK = "emulation"
PROFILE_VERSION = 1
#: Ready offsets from this many first steps of a trace are not used (tracing, allocation).
SKIP_STEPS = 1
_GRADIENT_PREFIX = "grad/"
#: Names of fused buckets on a trace (kFusedPrefix, ops/core/fusion.h).
FUSED_PREFIX = "fused:"
_REPEAT_SUFFIX = re.compile(r"@\d+$")


class ProfileError(ProphetError, ValueError):
    """A profile or trace cannot be used: the message names the file and what is missing."""


@dataclasses.dataclass
class ProfiledLayer:
    """A layer with variables, in forward order."""

    name: str
    forward_s: float
    backward_s: float = 0.0


@dataclasses.dataclass
class ProfiledTensor:
    """A collective the step makes: a gradient, or a control collective (``layer`` None,
    ``priority`` at or above :func:`control_priority`)."""

    name: str
    bytes: int
    priority: int
    ready_s: float                # after the backward pass's start
    layer: Optional[str] = None   # the layer whose forward pass reads it
    apply_s: float = 0.0          # its optimizer update
    element_size: int = 4


@dataclasses.dataclass
class Profile:
    """One worker's step; see the module docstring."""

    layers: list[ProfiledLayer]
    tensors: list[ProfiledTensor]
    launch_s: float = 0.0
    backward_s: float = 0.0
    tail_s: float = 0.0
    gap_s: float = 0.0
    forward: str = "measured"      # or "estimated"
    source: str = ""
    steps: int = 0                 # steps the medians come from
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The emulated benchmark's record, when the run was one (``time_scale``: every time of the
    #: run was that many times the modelled accelerator cluster's; ``accelerator_tflops``).
    emulation: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def forward_s(self) -> float:
        return sum(layer.forward_s for layer in self.layers)

    @property
    def step_s(self) -> float:
        """The one-worker step time this profile describes."""
        return self.launch_s + self.forward_s + self.backward_s + self.tail_s + self.gap_s

    @property
    def gradient_bytes(self) -> int:
        limit = control_priority()
        return sum(t.bytes for t in self.tensors if t.priority < limit)

    def scaled(self, time_scale: float) -> "Profile":
        """This profile with every time divided by ``time_scale``: an emulated run's profile
        (compute slowed ``time_scale`` times, ``python -m prophet_tf.bench.train --compute
        emulated``) as the modelled accelerator cluster runs it.

        Every time is divided, the accelerator's (forward and backward passes, ready offsets)
        and the host's (updates, launch, tail, gap) alike: that is the benchmark's definition of
        the modelled cluster (its comm/comp ratios and speed-ups are those of a cluster S times
        faster in everything; the host's work, which the emulation does not slow, then counts S
        times less than in the run, as on an accelerator that runs its optimizer itself). Bytes
        and priorities are unchanged. The result records the time scale left (1 after dividing
        by the run's own)."""
        if not (_finite(time_scale) and time_scale > 0):
            raise ProfileError(f"time scale must be a positive number, got {time_scale!r}")
        f = 1.0 / time_scale
        note = (f"times divided by {time_scale:g} (time scale of the emulated run) to give the "
                "modelled accelerator's")
        return dataclasses.replace(
            self,
            layers=[dataclasses.replace(l, forward_s=l.forward_s * f, backward_s=l.backward_s * f)
                    for l in self.layers],
            tensors=[dataclasses.replace(t, ready_s=t.ready_s * f, apply_s=t.apply_s * f)
                     for t in self.tensors],
            launch_s=self.launch_s * f, backward_s=self.backward_s * f, tail_s=self.tail_s * f,
            gap_s=self.gap_s * f, notes=list(self.notes) + [note],
            emulation=dict(self.emulation,
                           time_scale=float(self.emulation.get("time_scale", time_scale)) / time_scale))

    def validate(self, where: str = "profile") -> None:
        """Raises :class:`ProfileError` unless every field is usable by the simulator."""
        if not self.layers:
            raise ProfileError(f"{where}: no layer")
        names = set()
        for layer in self.layers:
            if not (_finite(layer.forward_s) and layer.forward_s >= 0):
                raise ProfileError(f"{where}: layer {layer.name!r} has forward time "
                                   f"{layer.forward_s!r}")
            names.add(layer.name)
        for key in ("launch_s", "backward_s", "tail_s", "gap_s"):
            value = getattr(self, key)
            if not (_finite(value) and value >= 0):
                raise ProfileError(f"{where}: {key} = {value!r}, expected a number >= 0")
        seen = set()
        for t in self.tensors:
            if t.name in seen:
                raise ProfileError(f"{where}: tensor {t.name!r} appears twice")
            seen.add(t.name)
            if "\n" in t.name or not t.name.strip():
                raise ProfileError(f"{where}: tensor name {t.name!r} is empty or has a newline")
            if t.bytes < 0 or t.element_size < 1 or t.bytes % t.element_size:
                raise ProfileError(f"{where}: tensor {t.name!r} has {t.bytes} bytes of "
                                   f"{t.element_size}-byte elements")
            if t.layer is not None and t.layer not in names:
                raise ProfileError(f"{where}: tensor {t.name!r} names layer {t.layer!r}, which "
                                   "is not among the profile's layers")
            if not (_finite(t.ready_s) and t.ready_s <= self.backward_s + 1e-12):
                raise ProfileError(f"{where}: tensor {t.name!r} is ready at {t.ready_s!r} s, "
                                   f"after the backward pass ends ({self.backward_s} s)")
            if not (_finite(t.apply_s) and t.apply_s >= 0):
                raise ProfileError(f"{where}: tensor {t.name!r} has update time {t.apply_s!r}")

    def to_json(self) -> dict[str, Any]:
        data = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        data.update(dataclasses.asdict(self))
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> "Profile":
        if data.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"{where}: not a prophet_tf profile (\"format\" is "
                               f"{data.get('format')!r}, expected {PROFILE_FORMAT!r})")
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{where}: profile version {data.get('version')!r}; this "
                               f"prophet_tf reads version {PROFILE_VERSION}")
        try:
            layers = [ProfiledLayer(**layer) for layer in data["layers"]]
            tensors = [ProfiledTensor(**tensor) for tensor in data["tensors"]]
            fields = {k: data[k] for k in ("launch_s", "backward_s", "tail_s", "gap_s", "forward",
                                           "source", "steps", "notes", "emulation") if k in data}
        except (KeyError, TypeError) as e:
            raise ProfileError(f"{where}: malformed profile ({e})") from None
        profile = cls(layers=layers, tensors=tensors, **fields)
        profile.validate(where)
        return profile

    def save(self, path: Union[str, Path]) -> None:
        """Writes the profile as JSON (what :func:`load_profile` reads back)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def load_profile(path: Union[str, Path], *, worker: Optional[int] = None) -> Profile:
    """A profile from a saved profile or from a runtime trace (Chrome trace JSON).

    Args:
      path: a file written by :meth:`Profile.save`, or a trace written by a run with
        ``PROPHET_PROFILE``/``PROPHET_TIMELINE``.
      worker: the pid (rank) to read from a trace holding several workers (default: the lowest).

    Raises:
      ProfileError: the file is neither, or lacks what the predictor needs (the message says what
        to record).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"cannot read profile {str(path)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "format" in data:
        return Profile.from_json(data, where=str(path))
    try:
        events = timeline.load_trace(path)
    except timeline.TraceError as e:
        raise ProfileError(f"{e}; expected a prophet_tf profile or a runtime trace") from None
    return profile_from_trace(events, worker=worker, source=str(path))


def emulation_record(time_scale: float, accelerator_tflops: float) -> str:
    """The name of the instant an emulated worker puts on :data:`EMULATION_TRACK`."""
    return f"time_scale={time_scale!r} accelerator_tflops={accelerator_tflops!r}"


def _parse_emulation(names: Sequence[str], source: str) -> dict[str, float]:
    record: dict[str, float] = {}
    for name in names:
        for item in name.split():
            key, _, value = item.partition("=")
            try:
                record[key] = float(value)
            except ValueError:
                raise ProfileError(f"{source}: unreadable emulation record {name!r}") from None
    if record and not (record.get("time_scale", 0) > 0):
        raise ProfileError(f"{source}: emulation record {names[0]!r} has no positive time_scale")
    return record


def _covered(intervals: Sequence[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of [lo, hi] the union of ``intervals`` covers."""
    covered, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            covered += end - start
            reach = end
    return covered


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _layer_of(tensor: str) -> str:
    """``grad/dense_1/kernel@1`` -> ``dense_1`` (the variable's path without its last part)."""
    path = _REPEAT_SUFFIX.sub("", tensor[len(_GRADIENT_PREFIX):])
    return path.rsplit("/", 1)[0] if "/" in path else path


def profile_from_trace(events: Sequence[dict], *, worker: Optional[int] = None,
                       source: str = "trace", skip_steps: int = SKIP_STEPS) -> Profile:
    """Builds a profile from one worker's runtime trace (see the module docstring).

    Uses the "step" spans (train function calls), "ready" instants and "op" spans (bytes,
    priority) of the runtime, "apply" spans of the updates and, when present, "forward" and
    "backward" spans per layer. Every step but the first ``skip_steps`` and the last (whose gap is
    unknown) contributes; each time is the median over those steps.
    """
    pids = sorted({int(e.get("pid", 0)) for e in events if e.get("ph") in ("X", "i", "I")})
    if not pids:
        raise ProfileError(f"{source}: the trace has no events")
    pid = pids[0] if worker is None else worker
    if pid not in pids:
        raise ProfileError(f"{source}: no worker {worker} in the trace (workers: {pids})")
    tracks = timeline.events_by_track(events, pid)

    def spans(track: str) -> list[tuple[float, float, str, dict]]:
        out = []
        for e in tracks.get(track, []):
            if e.get("ph") == "X":
                start = float(e["ts"]) / 1e6
                out.append((start, start + float(e.get("dur", 0) or 0) / 1e6, str(e.get("name")),
                            e.get("args") if isinstance(e.get("args"), dict) else {}))
        return sorted(out)

    steps = spans("step")
    usable = len(steps) - skip_steps - 1
    if usable < 1:
        raise ProfileError(
            f"{source}: {len(steps)} step marks on worker {pid}'s trace; a profile needs at least "
            f"{skip_steps + 2}. Record a run of several steps of model.fit with PROPHET_PROFILE="
            "PATH on one worker (the step marks come from Keras fit's train function).")
    # A fused bucket's own events (a fused run's trace) are transport, not a gradient: its
    # members have "ready" and "op" events of their own.
    readies = sorted((float(e["ts"]) / 1e6, str(e.get("name")))
                     for e in tracks.get("ready", []) if e.get("ph") in ("i", "I")
                     and not str(e.get("name")).startswith(FUSED_PREFIX))
    if not readies:
        raise ProfileError(f"{source}: no \"ready\" events on worker {pid}'s trace: the run did "
                           "not hand any tensor to the runtime. A one-worker run records them only "
                           "with PROPHET_PROFILE (or ProphetStrategy(profile_path=...)).")
    op_bytes: dict[str, int] = {}
    op_priority: dict[str, int] = {}
    for _, _, name, args in spans("op"):
        if name.startswith(FUSED_PREFIX):
            continue
        if isinstance(args.get("bytes"), (int, float)):
            op_bytes[name] = int(args["bytes"])
        if isinstance(args.get("priority"), (int, float)):
            op_priority[name] = int(args["priority"])
    applies: dict[str, list[float]] = {}
    for start, end, name, _ in spans("apply"):
        applies.setdefault(name, []).append(end - start)
    forwards, backwards = spans("forward"), spans("backward")
    measured = bool(forwards)
    emulation = _parse_emulation([str(e.get("name")) for e in tracks.get(EMULATION_TRACK, [])
                                  if e.get("ph") in ("i", "I")], source)

    gates = [(s, e) for s, e, _, _ in spans("gate")]

    def is_gradient(name: str) -> bool:
        if name in op_priority:
            return op_priority[name] < control_priority()
        return name.startswith(_GRADIENT_PREFIX)

    def forward_spans(j: int) -> list[tuple[float, float, str, dict]]:
        return [s for s in forwards if steps[j][0] <= s[0] <= steps[j][1]]

    per_step: list[dict[str, Any]] = []
    for i in range(skip_steps, len(steps) - 1):
        begin, end = steps[i][0], steps[i][1]
        next_begin = steps[i + 1][0]
        fwd = forward_spans(i) if measured else []
        if measured and not fwd:
            continue
        # The step's gradients: from its backward pass's start to the next step's. The last
        # gradient can be handed over after the train function has returned (BERT's word
        # embedding, ResNet50's first convolution: in many steps a few ms after the return),
        # i.e. inside the next step's span; taking the step's span as the window gives such a
        # gradient the previous step's ready time (before the backward pass: clamped to its
        # start, no exposed all-reduce at all). Control collectives (the loss tracker's) are
        # handed over during the forward pass: the step's span.
        grad_lo, grad_hi = begin, end
        if measured:
            following = forward_spans(i + 1)
            grad_lo = fwd[-1][1]
            grad_hi = following[-1][1] if following else steps[i + 1][1]
        ready: dict[str, float] = {}
        for ts, name in readies:
            lo, hi = (grad_lo, grad_hi) if is_gradient(name) else (begin, end)
            if lo <= ts <= hi and name not in ready:
                ready[name] = ts
        if not ready:
            continue
        step: dict[str, Any] = {"begin": begin, "end": end, "next": next_begin, "ready": ready}
        if measured:
            bwd = [s for s in backwards if begin <= s[0] <= end]
            step["forward"] = {name: e - s for s, e, name, _ in fwd}
            step["order"] = [name for _, _, name, _ in fwd]
            step["backward"] = {name: e - s for s, e, name, _ in bwd}
            step["backward_start"] = fwd[-1][1]
            # Launch: the step's begin to its first forward span, less the time the first layer
            # waited at its gate for the previous step's updates (the simulator makes that wait
            # itself: counting it in the launch too would hide as much of the all-reduce).
            step["launch"] = fwd[0][0] - begin - _covered(gates, begin, fwd[0][0])
            step["backward_end"] = max([e for _, e, _, _ in bwd] + list(ready.values()))
        per_step.append(step)
    if not per_step:
        raise ProfileError(f"{source}: no step of worker {pid} has both step marks and ready "
                           "events" + (" and forward spans" if measured else ""))

    names = sorted({n for s in per_step for n in s["ready"]})
    limit = control_priority()
    missing = [n for n in names if n not in op_bytes]
    if missing:
        raise ProfileError(f"{source}: no \"op\" span with the bytes of {missing[:3]} on worker "
                           f"{pid}'s trace (was the run stopped early?)")
    notes: list[str] = []
    # Priorities: from the runtime's op spans; traces that lack them get the strategy's rule
    # (gradients in reverse ready order, first layer most urgent; other collectives are control).
    if all(n in op_priority for n in names):
        priority = {n: op_priority[n] for n in names}
    else:
        notes.append("priorities inferred (trace without them): gradients in reverse order of "
                     "readiness, collectives not named grad/... are control collectives")
        first_ready = {n: _median([s["ready"][n] - s["begin"] for s in per_step if n in s["ready"]])
                       for n in names}
        grads = sorted((n for n in names if n.startswith(_GRADIENT_PREFIX)),
                       key=lambda n: (first_ready[n], n))
        priority = {n: i + 1 for i, n in enumerate(grads)}
        priority.update({n: limit for n in names if not n.startswith(_GRADIENT_PREFIX)})
    gradients = [n for n in names if priority[n] < limit]

    if measured:
        order = per_step[-1]["order"]
        layer_names = list(dict.fromkeys(order))
        forward_s = {name: _median([s["forward"][name] for s in per_step if name in s["forward"]])
                     for name in layer_names}
        backward_s = {name: _median([s["backward"][name] for s in per_step
                                     if name in s["backward"]] or [0.0]) for name in layer_names}
        for s in per_step:
            s["origin"] = s["backward_start"]
        launch = _median([s["launch"] for s in per_step])
    else:
        # The forward pass: a third of the time to the last gradient (backward = 2 x forward).
        for s in per_step:
            last = max(s["ready"][n] for n in gradients if n in s["ready"]) if gradients else s["end"]
            s["origin"] = s["begin"] + (last - s["begin"]) / 3.0
            s["backward_end"] = last
        launch = 0.0

    ready_s = {n: _median([s["ready"][n] - s["origin"] for s in per_step if n in s["ready"]])
               for n in names}
    backward = _median([s["backward_end"] - s["origin"] for s in per_step])
    backward = max([backward] + list(ready_s.values()))
    tail = _median([max(0.0, s["end"] - max([s["backward_end"]] + list(s["ready"].values())))
                    for s in per_step])
    gap = _median([max(0.0, s["next"] - s["end"]) for s in per_step])
    if not applies and gradients:
        notes.append("no update spans on the trace (recorded without crossing the barrier): "
                     "updates take no time")
    tensors = []
    for n in sorted(names, key=lambda n: (ready_s[n], -priority[n])):
        size = op_bytes[n]
        tensors.append(ProfiledTensor(
            name=n, bytes=size, priority=priority[n], ready_s=min(max(ready_s[n], 0.0), backward),
            apply_s=_median(applies[n]) if priority[n] < limit and n in applies else 0.0,
            element_size=4 if size % 4 == 0 else (2 if size % 2 == 0 else 1)))
    if not measured:
        forward_total = _median([s["origin"] - s["begin"] for s in per_step])
        return profile_from_ready_times(tensors, forward_total, backward_s=backward, tail_s=tail,
                                        gap_s=gap, source=source, steps=len(per_step), notes=notes)
    layer_set = set(layer_names)
    for t in tensors:
        if t.priority < limit and _layer_of(t.name) in layer_set:
            t.layer = _layer_of(t.name)
    unmatched = [t.name for t in tensors if t.priority < limit and t.layer is None]
    if unmatched:
        notes.append(f"{len(unmatched)} gradient(s) match no layer and wait for no update "
                     f"(e.g. {unmatched[0]})")
    profile = Profile(
        layers=[ProfiledLayer(name, forward_s[name], backward_s.get(name, 0.0)) for name in layer_names],
        tensors=tensors, launch_s=launch, backward_s=backward, tail_s=tail, gap_s=gap,
        forward="measured", source=source, steps=len(per_step), notes=notes, emulation=emulation)
    profile.validate(source)
    return profile


def profile_from_ready_times(tensors: Sequence[ProfiledTensor], forward_s: float, *,
                             backward_s: Optional[float] = None, launch_s: float = 0.0,
                             tail_s: float = 0.0, gap_s: float = 0.0, source: str = "",
                             steps: int = 0, notes: Sequence[str] = ()) -> Profile:
    """A profile when only the ready times are known, not the layers' forward times.

    ``tensors`` carry their ready times from the backward pass's start (their ``layer`` is
    ignored). Layers are the gradients' variable paths without their last part, first layer
    (highest priority) first; each gradient's forward pass reads its layer. The forward pass of
    ``forward_s`` is split among the layers in proportion to the gaps between their gradients'
    ready times (a layer's backward time, which is about twice its forward time).
    """
    limit = control_priority()
    tensors = [dataclasses.replace(t, layer=None) for t in tensors]
    gradients = [t for t in tensors if t.priority < limit]
    keys = sorted({_layer_of(t.name) for t in gradients},
                  key=lambda k: -max(t.priority for t in gradients if _layer_of(t.name) == k))
    ready = {k: min(t.ready_s for t in gradients if _layer_of(t.name) == k) for k in keys}
    gaps, previous = {}, 0.0
    for k in sorted(keys, key=lambda k: ready[k]):  # backward order: last layer first
        gaps[k] = max(0.0, ready[k] - previous)
        previous = max(previous, ready[k])
    total = sum(gaps.values())
    layers = [ProfiledLayer(k, forward_s * (gaps[k] / total if total > 0 else 1.0 / len(keys)),
                            gaps[k]) for k in keys]
    for t in gradients:
        t.layer = _layer_of(t.name)
    if backward_s is None:
        backward_s = max([t.ready_s for t in tensors] + [0.0])
    profile = Profile(layers=layers or [ProfiledLayer("forward", forward_s)], tensors=tensors,
                      launch_s=launch_s, backward_s=backward_s, tail_s=tail_s, gap_s=gap_s,
                      forward="estimated", source=source, steps=steps,
                      notes=list(notes) + ["forward times estimated: forward = 1/3 of the time "
                                           "to the last gradient, split by the gaps between the "
                                           "layers' gradients"])
    profile.validate(source or "profile")
    return profile
