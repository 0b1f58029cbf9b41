"""Starting and stopping the communication runtime of this process.

`ProphetStrategy` calls :func:`init` for you; call it yourself only to use `prophet_tf.ops`
without the strategy.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from prophet_tf._library import c_api, call_returning_text, predict_api, runtime_constants
from prophet_tf._options import RuntimeOption, from_environment, runtime_options, to_text, user_options
from prophet_tf.cluster import check_distinct_addresses
from prophet_tf.errors import ProphetError

_config: Optional[dict[str, Any]] = None


class RuntimeInitError(ProphetError):
    """The runtime could not start: the message says why (port in use, peer unreachable, ...)."""


class RuntimeOptionError(RuntimeInitError, ValueError):
    """An option of the runtime is unknown or has a value the runtime does not accept; the
    message names the option, what it accepts and what came. Also a ``ValueError``: the problem
    is in what the caller gave."""


def schedules() -> tuple[str, ...]:
    """The scheduling policies the runtime knows (``prophet``, ``priority``, ``fifo``, and the
    published ``bytescheduler`` and ``p3`` for comparison)."""
    return tuple(runtime_constants()["schedules"])


def schedule_traits() -> dict[str, dict[str, Any]]:
    """What each schedule asks of the runtime where the options leave it to the schedule
    (ops/core/schedule_traits.h): ``{name: {"partition_bytes", "exact_partitions", "credit_bytes",
    "automatic_fusion"}}``; ``credit_bytes`` 0 is the runtime's rule."""
    return {k: dict(v) for k, v in runtime_constants()["schedule_traits"].items()}


def options() -> dict[str, RuntimeOption]:
    """The runtime's options that :func:`init` takes by keyword (name, type, default, what it
    accepts, its environment variable, one line of meaning), from the runtime's own table."""
    return user_options()


def defaults() -> dict[str, Any]:
    """The runtime's default settings: what :func:`init` uses for an option left out."""
    return {name: option.default for name, option in options().items()}


def control_priority() -> int:
    """Priorities at or above this are control traffic (metrics, loss-scale flags): sent before
    every gradient and never profiled as one."""
    return int(runtime_constants()["control_priority"])


def init(rank: int, world_size: int, addresses: Sequence[str] = (), token: Optional[str] = None,
         **settings: Any) -> None:
    """Starts the runtime: listens on ``addresses[rank]`` and connects to every other worker.

    Args:
      rank: this worker's index in ``[0, world_size)``.
      world_size: number of workers; 1 needs no addresses and opens no socket.
      addresses: ``host:port`` of every worker, in rank order, identical on all workers.
      token: job token every worker must share (default: ``$PROPHET_JOB_TOKEN``). Workers prove
        to each other that they hold it (HMAC-SHA256 over fresh nonces; it never travels).
      **settings: the runtime's options (:func:`options`; the README's table of the runtime's
        options lists each with its default and meaning), e.g. ``schedule``,
        ``partition_bytes``, ``credit_bytes``, ``timeout_s``, ``socket_buffer_bytes``,
        ``hierarchical``. An option left out (or None) takes its environment variable where it
        has one (``$PROPHET_TIMEOUT_S``, ``$PROPHET_TIMELINE``, ``$PROPHET_HIERARCHICAL``,
        ``$PROPHET_BIND_HOST``, ``$PROPHET_ALLOW_NO_TOKEN``), else the runtime's default; only
        the options set travel to the runtime. In ``timeline_path``, ``{rank}`` is replaced by
        the rank (with several workers and no ``{rank}``, the rank goes before the extension).

    Calling it again with the same settings does nothing; with different ones it raises.

    Raises:
      TypeError: an option the runtime does not have.
      RuntimeOptionError: an option's value is not one the runtime accepts (before anything
        starts).
      RuntimeInitError: the runtime could not start.
    """
    global _config
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if world_size > 1 and len(addresses) != world_size:
        raise ValueError(f"{len(addresses)} addresses given for {world_size} workers")
    if world_size > 1:
        check_distinct_addresses(list(addresses), "runtime.init")
    text = _settings_text(rank, world_size, addresses, token, settings)
    config = _resolve(text)
    if _config is not None and c_api().prophet_is_initialized():
        if config == _config:
            return
        raise RuntimeInitError(
            "the prophet_tf runtime is already running with different settings "
            f"({_diff(_config, config)}); call prophet_tf.runtime.shutdown() first"
        )
    error = ctypes.create_string_buffer(2048)
    code = c_api().prophet_init(text.encode(), error, len(error))
    if code != 0:
        raise RuntimeInitError(error.value.decode(errors="replace"))
    _config = config


def _settings_text(rank: int, world_size: int, addresses: Sequence[str], token: Optional[str],
                   settings: dict[str, Any]) -> str:
    """The runtime's "key=value" lines: the job's identity, and the options the caller or the
    environment set (nothing else: the runtime has its defaults)."""
    known = options()
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(f"unknown runtime option(s) {', '.join(unknown)}; the runtime's options are "
                        f"{', '.join(known)}")
    given: dict[str, Any] = {"rank": rank, "world_size": world_size}
    if addresses:
        given["addresses"] = list(addresses)
    token = from_environment("token") if token is None else token
    if token is not None:
        given["token"] = token
    for name in known:
        value = settings.get(name)
        given[name] = from_environment(name) if value is None else value
    path = given.get("timeline_path")
    if path:
        path = os.fspath(path).replace("{rank}", str(rank))
        if world_size > 1 and "{rank}" not in os.fspath(given["timeline_path"]) and \
                not path.endswith(f".{rank}.json"):
            root, ext = os.path.splitext(path)
            path = f"{root}.{rank}{ext or '.json'}"
        given["timeline_path"] = path
    return "".join(f"{name}={to_text(name, value)}\n" for name, value in given.items()
                   if value is not None)


def _resolve(text: str) -> dict[str, Any]:
    """Every option's value with the settings ``text`` gives, checked by the runtime's own parser
    (in the TensorFlow-free library: a bad option fails before TensorFlow loads)."""
    code, answer = call_returning_text(predict_api().prophet_runtime_resolve, text)
    if code != 0:
        raise RuntimeOptionError(answer + _environment_note(answer))
    return json.loads(answer)


def _environment_note(message: str) -> str:
    """Where a refused value came from the environment, says so."""
    notes = [f"${o.env}={os.environ[o.env]!r}" for name, o in runtime_options().items()
             if o.env and f"option {name} " in message and from_environment(name) is not None]
    return f" (set by {', '.join(notes)})" if notes else ""


def _diff(old: dict[str, Any], new: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if k != "token" and old.get(k) != new[k])


def shutdown() -> None:
    """Stops the runtime; pending operations fail. Safe to call when not running."""
    global _config
    if _config is not None or _loaded():
        c_api().prophet_shutdown()
    _config = None


def _loaded() -> bool:
    return c_api.cache_info().currsize > 0


def is_initialized() -> bool:
    return _config is not None and bool(c_api().prophet_is_initialized())


def _require() -> None:
    if not is_initialized():
        raise ProphetError(
            "the prophet_tf runtime is not initialised: create a prophet_tf.ProphetStrategy() or call "
            "prophet_tf.runtime.init() first"
        )


def rank() -> int:
    _require()
    return int(c_api().prophet_rank())


def size() -> int:
    _require()
    return int(c_api().prophet_world_size())


def config() -> dict[str, Any]:
    """Every setting the runtime runs with, those left to their defaults included (token
    omitted)."""
    _require()
    assert _config is not None
    return {k: v for k, v in _config.items() if k != "token"}


def stats() -> dict[str, Any]:
    """Counters of the running engine: bytes sent and received, operations done and failed."""
    _require()
    buf = ctypes.create_string_buffer(4096)
    c_api().prophet_stats(buf, len(buf))
    return json.loads(buf.value.decode())


def set_schedule(schedule: str) -> None:
    """Schedules with ``schedule`` (one of :func:`schedules`) from the next moment no partition is
    queued (between training steps); the bandwidth measured so far carries over."""
    _require()
    if schedule not in schedules():
        raise ValueError(f"schedule must be one of {schedules()}, got {schedule!r}")
    error = ctypes.create_string_buffer(1024)
    if c_api().prophet_set_schedule(schedule.encode(), error, len(error)) != 0:
        raise ProphetError(error.value.decode(errors="replace"))


def set_io_threads(lanes: int) -> None:
    """Moves the bytes on ``lanes`` of the lanes connected (``stats()["lanes"]``; the runtime's
    ``io_threads``) from the next submission on. Every worker must call it at the same point of
    its program, between steps (the strategy does after its start-up probe, for ``io_threads``
    auto); else the slices of a tensor differ across workers and its push_pull fails."""
    _require()
    error = ctypes.create_string_buffer(1024)
    if c_api().prophet_set_io_threads(int(lanes), error, len(error)) != 0:
        raise ProphetError(error.value.decode(errors="replace"))


def set_two_level(on: bool) -> None:
    """Sends push_pulls on the two-level path (``on``) or the flat one from the next submission
    on. Only where ``hierarchical`` is auto and the hosts allow the two-level path
    (``stats()["path_choosable"]``): the strategy's start-up probe measures both and keeps the
    faster. Every worker must call it at the same point of its program, as
    :func:`set_io_threads`.

    Raises:
      ProphetError: the path is fixed (``hierarchical`` on or off, or hosts that do not allow
        the two-level path).
    """
    _require()
    error = ctypes.create_string_buffer(1024)
    if c_api().prophet_set_two_level(1 if on else 0, error, len(error)) != 0:
        raise ProphetError(error.value.decode(errors="replace"))


@dataclasses.dataclass(frozen=True)
class FusedTensor:
    """One push_pull a fusion declaration announces (every field as the push_pull will have it)."""

    name: str
    dtype: str          # the wire dtype's name: float32, float16, bfloat16, float64, int32, int64
    shape: tuple        # its dimensions
    bytes: int
    priority: int
    average: bool = False
    compression: Optional[str] = None


#: The link rate (Gbit/s per host and direction) automatic fusion sizes buckets for; the same on
#: every worker (the launcher passes one environment). Unset: ProphetStrategy measures the link
#: at start-up (prophet_tf/_link_probe.py); runtime.declare_fusion alone assumes 10 Gbit/s.
LINK_GBPS_ENV = "PROPHET_LINK_GBPS"


def fusion_link_bps() -> float:
    """The link rate in bytes/s that ``declare_fusion(bucket_bytes=-1)`` sizes buckets for when
    given none (``$PROPHET_LINK_GBPS``); 0.0 when unset (the runtime then assumes 10 Gbit/s)."""
    text = os.environ.get(LINK_GBPS_ENV, "").strip()
    if not text:
        return 0.0
    try:
        gbps = float(text)
    except ValueError:
        gbps = -1.0
    if not gbps > 0:
        raise ValueError(f"${LINK_GBPS_ENV}={text!r}: expected the link rate in Gbit/s, e.g. 25")
    return gbps * 1e9 / 8


def declare_fusion(group: str, tensors: Sequence[FusedTensor], bucket_bytes: int = -1, *,
                   link_Bps: Optional[float] = None) -> None:
    """From now on, the push_pulls of ``tensors`` travel fused into buckets (docs/design.md,
    "Fusion"): each waits until every member of its bucket is submitted, then they travel as one.

    Every worker must declare the same tensors with the same ``bucket_bytes`` (-1: sized from the
    workers and the link rate; 0: none fused) and, with -1, the same ``link_Bps`` before
    submitting them (in any order, under any group name); where they differ, the fused
    push_pulls fail on every worker within seconds, naming the first tensor that differs. A
    declaration replaces the previous one of ``group``. ``link_Bps``: the link rate in bytes/s
    per direction that -1 sizes buckets for (ProphetStrategy passes the rate its start-up probe
    agreed on); None: ``$PROPHET_LINK_GBPS`` (:func:`fusion_link_bps`), else 10 Gbit/s.

    Raises:
      ValueError: ``link_Bps`` is not a positive finite number.
      ProphetError: the runtime refuses the declaration.
    """
    _require()
    if link_Bps is None:
        link_Bps = fusion_link_bps()
    elif not (0 < link_Bps < float("inf")):
        raise ValueError(f"link_Bps must be a positive number of bytes/s, got {link_Bps!r}")
    lines = []
    for t in tensors:
        if any(c in t.name for c in "\n\r"):
            raise ValueError(f"tensor name {t.name!r} has a line break")
        shape = ",".join(str(int(d)) for d in t.shape) or "-"
        lines.append(f"{t.dtype} {shape} {int(t.bytes)} {int(t.priority)} {int(bool(t.average))} "
                     f"{t.compression or 'none'} {t.name}")
    error = ctypes.create_string_buffer(1024)
    if c_api().prophet_declare_fusion(group.encode(), "\n".join(lines).encode(), int(bucket_bytes),
                                      float(link_Bps), error, len(error)) != 0:
        raise ProphetError(error.value.decode(errors="replace"))


def scheduler_state() -> dict[str, Any]:
    """The scheduling policy's state: ``{"schedule", "bandwidth_Bps" (the link's rate
    while this worker's sockets were full; before any filled, the goodput of completed pushes),
    "bandwidth_drained" (whether it is the former), "bandwidth_samples", "planned_blocks" (blocks of prophet's current plan, 0 before
    the first; -1 for the other policies), "profile"}``; ``profile`` (prophet only, else None) holds
    ``steps_observed``, ``step_origin_ns`` (first gradient of the open step, CLOCK_MONOTONIC) and
    ``tensors``: ``[{"name", "priority", "bytes", "ready_offset_ns"}]`` (median offsets from each
    step's first gradient)."""
    _require()
    size = 1 << 18
    while True:
        buf = ctypes.create_string_buffer(size)
        needed = c_api().prophet_scheduler_state(buf, size)
        if needed < size:
            return json.loads(buf.value.decode())
        size = needed + 1


def timeline_enabled() -> bool:
    """Whether this worker writes a timeline (cheap; check it before building event names)."""
    return is_initialized() and bool(c_api().prophet_timeline_enabled())


def timeline_event(track: str, name: str, start_ns: int, end_ns: Optional[int] = None) -> None:
    """Adds a span (or, without ``end_ns``, an instant) to this worker's timeline.

    Times are ``time.monotonic_ns()`` values, the clock the runtime's own events use.
    """
    if is_initialized():
        c_api().prophet_timeline_event(track.encode(), name.encode(), int(start_ns), int(end_ns or 0))


def timeline_flush() -> None:
    """Writes out the events the timeline has buffered (it flushes by itself every second of
    events and at shutdown; a process that leaves through ``os._exit`` calls this first)."""
    if is_initialized():
        c_api().prophet_timeline_flush()


atexit.register(shutdown)
