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

from prophet_tf._library import c_api, runtime_constants
from prophet_tf.cluster import check_distinct_addresses
from prophet_tf.errors import ProphetError

#: Set to 1 to run a multi-worker job without a job token (see ``allow_no_token``).
ALLOW_NO_TOKEN_ENV = "PROPHET_ALLOW_NO_TOKEN"
#: Address to listen on instead of the host of this worker's own address (see ``bind_host``).
BIND_HOST_ENV = "PROPHET_BIND_HOST"

_config: Optional[dict[str, Any]] = None


class RuntimeInitError(ProphetError):
    """The runtime could not start: the message says why (port in use, peer unreachable, ...)."""


def schedules() -> tuple[str, ...]:
    """The scheduling policies the runtime knows (``prophet``, ``priority``, ``fifo``, and the
    published ``bytescheduler`` and ``p3`` for comparison)."""
    return tuple(runtime_constants()["schedules"])


def schedule_traits() -> dict[str, dict[str, Any]]:
    """What each schedule asks of the runtime where the options leave it to the schedule
    (ops/core/schedule_traits.h): ``{name: {"partition_bytes", "exact_partitions", "credit_bytes",
    "automatic_fusion"}}``; ``credit_bytes`` 0 is the runtime's rule."""
    return {k: dict(v) for k, v in runtime_constants()["schedule_traits"].items()}


def defaults() -> dict[str, Any]:
    """The runtime's default settings: what :func:`init` uses for an option left as ``None``."""
    return dict(runtime_constants()["defaults"])


def control_priority() -> int:
    """Priorities at or above this are control traffic (metrics, loss-scale flags): sent before
    every gradient and never profiled as one."""
    return int(runtime_constants()["control_priority"])


def check_schedule(schedule: Optional[str]) -> str:
    """Returns the policy ``schedule`` names (``None``: the default); ValueError if unknown."""
    if schedule is None:
        return defaults()["schedule"]
    if schedule not in schedules():
        raise ValueError(f"schedule must be one of {schedules()}, got {schedule!r}")
    return schedule


def init(
    rank: int,
    world_size: int,
    addresses: Sequence[str] = (),
    token: Optional[str] = None,
    *,
    schedule: Optional[str] = None,
    partition_bytes: Optional[int] = None,
    credit_bytes: Optional[int] = None,
    timeout_s: Optional[float] = None,
    replan_threshold: Optional[float] = None,
    connect_timeout_s: Optional[float] = None,
    heartbeat_s: Optional[float] = None,
    socket_buffer_bytes: Optional[int] = None,
    socket_unsent_bytes: Optional[int] = None,
    max_early_bytes: Optional[int] = None,
    timeline_path: Optional[str] = None,
    allow_no_token: Optional[bool] = None,
    bind_host: Optional[str] = None,
    hierarchical: Optional[str] = None,
    hosts: Optional[Sequence[str]] = None,
) -> None:
    """Starts the runtime: listens on ``addresses[rank]`` and connects to every other worker.

    Options left as ``None`` take the runtime's defaults (:func:`defaults`; the schedule is
    ``prophet``).

    Args:
      rank: this worker's index in ``[0, world_size)``.
      world_size: number of workers; 1 needs no addresses and opens no socket.
      addresses: ``host:port`` of every worker, in rank order, identical on all workers.
      token: job token every worker must share (default: ``$PROPHET_JOB_TOKEN``). Workers prove
        to each other that they hold it (HMAC-SHA256 over fresh nonces; it never travels).
      schedule: one of :func:`schedules`.
      partition_bytes: tensors are cut into partitions of at most this size (0, the default:
        the schedule's, :func:`schedule_traits`: 4 MiB; ByteScheduler's 4,000,000 bytes and P3's
        160,000, which alone cut a tensor).
      credit_bytes: bytes of released partitions that may wait to leave this worker at once
        (0, the default: max(16 MiB, (world_size - 1) x partition_bytes); ``bytescheduler``:
        16,000,000, which also bound its partitions whose sums have not come back).
      replan_threshold: the ``prophet`` policy re-plans when the measured bandwidth or a stage
        interval moves by more than this fraction.
      timeout_s: an operation not completed within this time fails instead of hanging
        (default ``$PROPHET_TIMEOUT_S``, else 60): every worker then asks the others whether they
        reached it and fails it with ``DeadlineExceededError`` naming the ranks that did not (or
        did not answer); every worker names the same ranks.
      connect_timeout_s: how long to wait for all peers at start-up. A peer that is seen and then
        goes away, or that cannot join (another token, world size or version), ends the start-up
        at once on every worker instead.
      heartbeat_s: when > 0, a peer from which nothing arrived for this long (a stopped or frozen
        process, an unreachable host) is declared lost and pending operations fail, naming it,
        long before ``timeout_s``. A program that is merely slow is not affected (its runtime
        thread keeps answering). Every worker must use the same value. Default 0 (off).
      socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF of each connection; 0: the kernel's autotuning,
        which sizes them for each link's bandwidth-delay product; default -1: with 3 or more
        workers each send buffer gets max(512 KiB, 4 MiB / (N - 1)) so that the kernel holds
        little ahead of an urgent gradient (docs/design.md, "Transport"), receive buffers and
        2-worker jobs the autotuning, and so does a kernel whose net.core.wmem_max is lower.
      socket_unsent_bytes: TCP_NOTSENT_LOWAT of each connection: how much data a socket may hold
        that TCP has not sent yet (0: no limit). The kernel sends what it holds in the order it
        was written, before any more urgent gradient written later; the runtime keeps the rest
        in its own priority-ordered queues.
      max_early_bytes: memory for frames that arrive before this worker submits their operation
        (a faster peer's gradients, a broadcast to a worker that starts late), and the largest
        allgather contribution accepted from a peer. Beyond it the operation fails on every worker
        with an error naming this option, and the sender's connection is dropped.
      timeline_path: write a Chrome trace of this worker there (default ``$PROPHET_TIMELINE``,
        with ``{rank}`` replaced by the rank).
      allow_no_token: a job of several workers refuses to start without a token unless this is
        true (default ``$PROPHET_ALLOW_NO_TOKEN`` = 1): then any process that can reach the
        workers' ports can join the job.
      bind_host: listen on this address instead of the host of ``addresses[rank]`` (default
        ``$PROPHET_BIND_HOST``), e.g. the pod IP or ``0.0.0.0`` in Kubernetes, where the address
        in ``TF_CONFIG`` may be a Service that no pod can bind. Without it, a worker whose own
        address is not an address of its machine listens on every interface and logs a warning.
      hierarchical: ``"off"``, ``"on"`` or ``"auto"`` (default ``$PROPHET_HIERARCHICAL``, else
        off): the two-level push_pull sums on each host first (the host's workers push to one
        leader per partition over loopback), then across hosts, so the network carries each
        host's share once. ``"auto"`` takes it when the job spans several hosts and some host has
        several workers. Every worker must use the same (checked at start-up).
      hosts: one host label per rank (ranks with equal labels share a host), for the two-level
        path; default: workers whose addresses have the same host part share a host.

    Calling it again with the same arguments does nothing; with different ones it raises.
    """
    global _config
    schedule = check_schedule(schedule)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if world_size > 1 and len(addresses) != world_size:
        raise ValueError(f"{len(addresses)} addresses given for {world_size} workers")
    if world_size > 1:
        check_distinct_addresses(list(addresses), "runtime.init")
    if allow_no_token is None:
        allow_no_token = os.environ.get(ALLOW_NO_TOKEN_ENV, "").strip().lower() in ("1", "true", "yes")
    if bind_host is None:
        bind_host = os.environ.get(BIND_HOST_ENV, "").strip() or None
    default = defaults()
    if timeout_s is None:
        timeout_s = float(os.environ.get("PROPHET_TIMEOUT_S", default["timeout_s"]))
    if hierarchical is None:
        hierarchical = os.environ.get("PROPHET_HIERARCHICAL", "").strip().lower() or default["hierarchical"]
    if hierarchical not in ("off", "on", "auto"):
        raise ValueError(f"hierarchical must be 'off', 'on' or 'auto', got {hierarchical!r}")
    if hosts is not None and len(hosts) != world_size:
        raise ValueError(f"hosts names {len(hosts)} host(s) for {world_size} workers: give one label per rank")

    def pick(value: Any, key: str) -> Any:
        return default[key] if value is None else value

    if timeline_path is None:
        timeline_path = os.environ.get("PROPHET_TIMELINE") or None
    if timeline_path:
        timeline_path = timeline_path.replace("{rank}", str(rank))
        if world_size > 1 and "{rank}" not in timeline_path and not timeline_path.endswith(f".{rank}.json"):
            root, ext = os.path.splitext(timeline_path)
            timeline_path = f"{root}.{rank}{ext or '.json'}"
    config = dict(
        rank=rank,
        world_size=world_size,
        addresses=",".join(addresses),
        token=os.environ.get("PROPHET_JOB_TOKEN", "") if token is None else token,
        schedule=schedule,
        partition_bytes=int(pick(partition_bytes, "partition_bytes")),
        credit_bytes=int(pick(credit_bytes, "credit_bytes")),
        timeout_s=float(timeout_s),
        replan_threshold=float(pick(replan_threshold, "replan_threshold")),
        connect_timeout_s=float(pick(connect_timeout_s, "connect_timeout_s")),
        heartbeat_s=float(pick(heartbeat_s, "heartbeat_s")),
        socket_buffer_bytes=int(pick(socket_buffer_bytes, "socket_buffer_bytes")),
        socket_unsent_bytes=int(pick(socket_unsent_bytes, "socket_unsent_bytes")),
        max_early_bytes=int(pick(max_early_bytes, "max_early_bytes")),
        timeline_path=timeline_path or "",
        allow_no_token=int(bool(allow_no_token)),
        bind_host=bind_host or "",
        hierarchical=hierarchical,
        hosts=",".join(hosts or ()),
    )
    for key, value in config.items():
        if "\n" in str(value):
            raise ValueError(f"runtime option {key} must not contain a newline")
    if _config is not None and c_api().prophet_is_initialized():
        if config == _config:
            return
        raise RuntimeInitError(
            "the prophet_tf runtime is already running with different settings "
            f"({_diff(_config, config)}); call prophet_tf.runtime.shutdown() first"
        )
    text = "\n".join(f"{k}={v}" for k, v in config.items() if v != "" or k == "token")
    error = ctypes.create_string_buffer(2048)
    code = c_api().prophet_init(text.encode(), error, len(error))
    if code != 0:
        raise RuntimeInitError(error.value.decode(errors="replace"))
    _config = config


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
    """The settings the runtime was started with (token omitted)."""
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
