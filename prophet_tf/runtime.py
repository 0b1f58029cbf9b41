"""Starting and stopping the communication runtime of this process.

`ProphetStrategy` calls :func:`init` for you; call it yourself only to use `prophet_tf.ops`
without the strategy.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
from typing import Any, Optional, Sequence

from prophet_tf._library import c_api
from prophet_tf.errors import ProphetError

SCHEDULES = ("fifo", "priority", "prophet")

_config: Optional[dict[str, Any]] = None


class RuntimeInitError(ProphetError):
    """The runtime could not start: the message says why (port in use, peer unreachable, ...)."""


def init(
    rank: int,
    world_size: int,
    addresses: Sequence[str] = (),
    token: Optional[str] = None,
    *,
    schedule: str = "priority",
    partition_bytes: int = 4 << 20,
    credit_bytes: int = 16 << 20,
    timeout_s: Optional[float] = None,
    replan_threshold: float = 0.2,
    connect_timeout_s: float = 60.0,
    socket_buffer_bytes: int = 4 << 20,
    timeline_path: Optional[str] = None,
) -> None:
    """Starts the runtime: listens on ``addresses[rank]`` and connects to every other worker.

    Args:
      rank: this worker's index in ``[0, world_size)``.
      world_size: number of workers; 1 needs no addresses and opens no socket.
      addresses: ``host:port`` of every worker, in rank order, identical on all workers.
      token: job token every worker must share (default: ``$PROPHET_JOB_TOKEN``).
      schedule: ``fifo``, ``priority`` or ``prophet``.
      partition_bytes: tensors are cut into partitions of at most this size.
      credit_bytes: bytes of partitions that may be in flight at once.
      replan_threshold: the ``prophet`` policy re-plans when the measured bandwidth or a stage
        interval moves by more than this fraction.
      timeout_s: an operation not completed within this time fails instead of hanging
        (default ``$PROPHET_TIMEOUT_S`` or 60).
      connect_timeout_s: how long to wait for all peers at start-up.
      socket_buffer_bytes: SO_SNDBUF/SO_RCVBUF of each connection (0: kernel autotuning).
      timeline_path: write a Chrome trace of this worker there (default ``$PROPHET_TIMELINE``,
        with ``{rank}`` replaced by the rank).

    Calling it again with the same arguments does nothing; with different ones it raises.
    """
    global _config
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if world_size > 1 and len(addresses) != world_size:
        raise ValueError(f"{len(addresses)} addresses given for {world_size} workers")
    if timeout_s is None:
        timeout_s = float(os.environ.get("PROPHET_TIMEOUT_S", "60"))
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
        partition_bytes=int(partition_bytes),
        credit_bytes=int(credit_bytes),
        timeout_s=float(timeout_s),
        replan_threshold=float(replan_threshold),
        connect_timeout_s=float(connect_timeout_s),
        socket_buffer_bytes=int(socket_buffer_bytes),
        timeline_path=timeline_path or "",
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


def timeline_enabled() -> bool:
    """Whether this worker writes a timeline (cheap; check it before building event names)."""
    return is_initialized() and bool(c_api().prophet_timeline_enabled())


def timeline_event(track: str, name: str, start_ns: int, end_ns: Optional[int] = None) -> None:
    """Adds a span (or, without ``end_ns``, an instant) to this worker's timeline.

    Times are ``time.monotonic_ns()`` values, the clock the runtime's own events use.
    """
    if is_initialized():
        c_api().prophet_timeline_event(track.encode(), name.encode(), int(start_ns), int(end_ns or 0))


atexit.register(shutdown)
