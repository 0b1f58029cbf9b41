"""Predicted step time of N workers from a one-worker profile: Python side of the simulator.

The simulation itself is ``ops/sim/simulator.cc`` (driving the runtime's own scheduling
policies, partitioning and owner assignment with simulated time), reached through the predictor's
C entry points (``_prophet_predict.so``, no TensorFlow needed). This module turns a
:class:`~prophet_tf.predict.profile.Profile` and a cluster description into a request and the
answer into a :class:`Prediction`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional, Sequence, Union

from prophet_tf._library import call_returning_text, predict_api
from prophet_tf._options import predicted_options, to_text
from prophet_tf.errors import ProphetError
from prophet_tf.predict.profile import Profile

__all__ = ["SCHEDULES", "FIXED_SCHEDULES", "PredictOptions", "Prediction", "PredictError",
           "SimulatedDeadlock", "IdealBound", "kernel_autotuned_socket_buffer",
           "kernel_socket_buffer_cap", "parse_schedule", "predict", "predict_many", "ideal_bound"]

#: The schedules the predictor knows: the runtime's policies with barrier crossing (their default)
#: or without (``_nocross``), and TensorFlow's MultiWorkerMirroredStrategy as the baseline.
SCHEDULES = ("prophet", "prophet_nocross", "priority", "priority_nocross", "fifo", "fifo_nocross",
             "bytescheduler", "bytescheduler_nocross", "p3", "p3_nocross", "mwms")
#: ProphetStrategy's fixed schedules (what ``schedule="auto"`` chooses among).
FIXED_SCHEDULES = ("prophet", "priority", "fifo")
_NOCROSS = "_nocross"


class PredictError(ProphetError, ValueError):
    """A prediction cannot be made: the message names the bad input."""


class SimulatedDeadlock(PredictError):
    """The simulated runtime stops for good in this setting (the real one would time out): the
    message says where every worker waits."""


# Status code of a simulation that deadlocked (common.h: Code::kFailedPrecondition).
_FAILED_PRECONDITION = 9


def _read_sysctl_field(path: str, field: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[field])
    except (OSError, ValueError, IndexError):
        return 0


def kernel_socket_buffer_cap() -> int:
    """This machine's cap on a socket buffer request (``net.core.wmem_max``), for
    :attr:`PredictOptions.max_socket_buffer_bytes` when the workers run on this machine's kernel;
    0 when it cannot be read."""
    return _read_sysctl_field("/proc/sys/net/core/wmem_max", 0)


def kernel_autotuned_socket_buffer() -> int:
    """This machine's limit of the send buffer's autotuning (``net.ipv4.tcp_wmem``'s maximum), for
    :attr:`PredictOptions.autotuned_socket_buffer_bytes`; Linux's default (4 MiB) when it cannot be
    read."""
    return _read_sysctl_field("/proc/sys/net/ipv4/tcp_wmem", 2) or (4 << 20)


def parse_schedule(schedule: str) -> tuple[str, bool]:
    """``"priority_nocross"`` -> ``("priority", False)``; ``"mwms"`` -> ``("mwms", False)``."""
    if schedule not in SCHEDULES:
        raise PredictError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if schedule == "mwms":
        return "mwms", False
    if schedule.endswith(_NOCROSS):
        return schedule[:-len(_NOCROSS)], False
    return schedule, True


@dataclasses.dataclass
class PredictOptions:
    """How the cluster and the runtime are modelled, apart from N, the link rate and the schedule.

    The runtime's options among these are those its option table marks as predicted
    (``prophet_tf._options.predicted_options()``); each is sent to the predictor only when set.

    Attributes:
      latency_s: one-way latency per frame.
      ingress_limited: every host also receives at most the link rate (a real NIC). False: only
        egress is limited, as on the benchmark's emulated cluster (tbf on each host's egress).
      payload_efficiency: share of the link rate left for data: TCP over Ethernet carries 1448
        payload bytes per 1538 on the wire (preamble, headers, inter-frame gap).
      frame_overhead_bytes: the runtime's frame header, tensor name and shape.
      socket_buffer_bytes, socket_unsent_bytes: the runtime's socket options (SO_SNDBUF, 0: the
        kernel's autotuning, -1: sized for the workers; TCP_NOTSENT_LOWAT, 0: none); None: the
        runtime's defaults. A connection commits what the kernel
        lets its socket hold ahead of the NIC, and frames queued later cannot overtake those
        bytes (``KernelSendBufferBytes`` in ops/sim/simulator.h): Linux doubles an SO_SNDBUF
        request (socket(7)), so a 4 MiB buffer commits up to 8 MiB; with TCP_NOTSENT_LOWAT the
        socket holds that much unsent plus what TCP keeps queued below it (``sender_queue_s``).
      max_socket_buffer_bytes: the kernel's cap on an SO_SNDBUF request on the workers' hosts
        (``net.core.wmem_max``, :func:`kernel_socket_buffer_cap` for this machine); 0: none (the
        runtime gets what it asks for).
      autotuned_socket_buffer_bytes: the send buffer's autotuning limit on the workers' hosts
        (``net.ipv4.tcp_wmem``'s maximum, :func:`kernel_autotuned_socket_buffer` for this
        machine); 0 with ``socket_buffer_bytes=0`` models a kernel that holds nothing.
      sender_queue_s: what TCP keeps queued below the socket (qdisc, NIC), as time at the link
        rate (TCP small queues: about 1 ms of the pacing rate).
      sum_bps: an owner's summation rate in bytes per second (0: instant).
      partition_bytes, credit_bytes, replan_threshold: the runtime's options (None: the
        runtime's defaults; partition_bytes and credit_bytes 0, their defaults: the schedule's,
        as the engine resolves them: ops/core/schedule_traits.h).
      heartbeat_s: the runtime's ``heartbeat_s`` (None or 0: off): every ``heartbeat_s`` / 4 each
        lane of every worker sends a frame to every peer, which costs the I/O threads their
        per-message CPU (``message_send_s``, ``message_receive_s``) and counts in
        ``Prediction.messages_per_step``.
      apply_threads: threads running optimizer updates (TensorFlow's inter-op pool).
      ring_message_s: mwms: time each ring message costs on arrival (gRPC).
      workers_per_host: workers placed on each host (N workers on N / workers_per_host hosts):
        they share the host's NIC (egress and ingress), and traffic between them goes over
        loopback at ``loopback_bytes_per_s``, shared by the host's connections between its own
        workers. 1: every worker has a host of its own (the default, and all runs here).
      loopback_bytes_per_s: that loopback rate in bytes per second; default 12.5e9 (100
        Gbit/s), an assumption: about what several TCP streams over Linux loopback move
        together on a current multi-core server (one stream about 30-50 Gbit/s, bounded by the
        kernel's copies); shared memory would be faster.
      hierarchical: the runtime's ``hierarchical`` option, ``"off"``, ``"on"`` or ``"auto"``
        (``True``/``False``: on/off; None: the runtime's default, auto): the two-level path (``RuntimeModel::hierarchical`` in
        ops/sim/simulator.h, the engine's ops/core/two_level.h): every partition is summed on
        each host first (by the partition's leader there, over loopback), then across hosts
        between the leaders (the runtime's push_pull, under its policy and credit), and the sum
        goes back to each host's workers from their leader. ``"auto"``, with several hosts of
        several workers, predicts both paths and keeps the two-level one unless the flat one is
        more than 5% faster, the rule of the engine's start-up probe (ops/core/hosts.h,
        ChooseTwoLevel). ``mwms`` ignores it (its ring stays flat).
      warmup_steps, steps: simulated steps not measured, then measured (median).
      compression: ``ProphetStrategy(compression=...)``: None, ``"fp16"`` or ``"bf16"``. The
        gradients of 4-byte elements travel in half the bytes (pushes, sums, the credit, the
        bandwidth estimate and the plan count those), control collectives exactly; the profile
        keeps the tensors' bytes (``CompressGradients`` in ops/sim/simulator.h). ``mwms`` never
        compresses. The ideal bound counts the compressed bytes too.
      fusion_bytes: small gradients travel fused into buckets (ops/core/fusion.h): -1 (the
        default, as ``ProphetStrategy``'s) sizes the
        buckets from the workers and the link rate (``FusionBucketBytes``), 0 sends every tensor
        on its own, otherwise the bucket size in bytes. Control collectives and ``mwms`` never
        fuse.
      message_send_s, message_receive_s: CPU time of one frame on a worker's one I/O thread,
        sending and receiving (``NetworkModel::message_send_ns`` in ops/sim/simulator.h); 0
        (the default): free. ``python -m prophet_tf.predict calibrate`` measures them (and the
        costs per byte) on the machine at hand.
      send_byte_s, receive_byte_s, sum_byte_s, cast_byte_s, copy_byte_s: CPU time per byte on
        that thread (``NetworkModel::send_byte_ns`` ...): a payload's copy into its socket and
        out of it, adding a contribution into a sum, converting float32 to or from 16 bits
        (per float32 byte), a memory copy (fusion's packing). 0 (the default): free.
      shared_cores: > 0: every worker's I/O thread and updates run on one pool of this many
        cores (workers on one machine, as the replay and emulated training benchmarks run them);
        0: a core each.
      io_threads: I/O threads (lanes, the runtime's ``io_threads``) per worker, each frame's CPU
        on its lane's thread, routed as the runtime routes (a push_pull of at least
        io_threads x max(256 KiB, N x 64 KiB) in slices, one per lane, each cut on its own;
        fused buckets dealt as the runtime deals them; other tensors by name); the lanes' schedulers are
        modelled as one.
      small_allreduce: small control collectives by recursive doubling where the engine's rule
        takes them (ops/core/small_allreduce.h), as the engine sends them (True, the default).
        False predicts the owner path for every tensor, ``"always"`` the exchange for every
        tensor that fits (where the rule would not take it), both for comparisons.
    """

    latency_s: float = 0.0
    ingress_limited: bool = True
    payload_efficiency: float = 1448.0 / 1538.0
    frame_overhead_bytes: int = 96
    socket_buffer_bytes: Optional[int] = None
    max_socket_buffer_bytes: int = 0
    autotuned_socket_buffer_bytes: int = 4 << 20
    socket_unsent_bytes: Optional[int] = None
    sender_queue_s: float = 1e-3
    sum_bps: float = 0.0
    partition_bytes: Optional[int] = None
    credit_bytes: Optional[int] = None
    replan_threshold: Optional[float] = None
    heartbeat_s: Optional[float] = None
    apply_threads: int = 2
    ring_message_s: float = 0.0
    workers_per_host: int = 1
    loopback_bytes_per_s: float = 12.5e9
    hierarchical: Union[None, bool, str] = None
    warmup_steps: int = 5
    steps: int = 20
    compression: Optional[str] = None
    fusion_bytes: int = -1
    message_send_s: float = 0.0
    message_receive_s: float = 0.0
    send_byte_s: float = 0.0
    receive_byte_s: float = 0.0
    sum_byte_s: float = 0.0
    cast_byte_s: float = 0.0
    copy_byte_s: float = 0.0
    shared_cores: int = 0
    io_threads: int = 1
    small_allreduce: Union[bool, str] = True


@dataclasses.dataclass
class Prediction:
    """The simulator's answer for one (schedule, workers, bandwidth)."""

    schedule: str
    workers: int
    bandwidth_bps: float
    step_s: float                 # median step time
    single_step_s: float          # one worker (the profile)
    overlap: float                # share of the communication hidden behind compute
    comm_s: float                 # worker 0's NIC busy sending, per step
    wire_bytes_per_step: float
    gate_wait_s: float            # forward passes waiting for updates, per step
    bandwidth_Bps: float          # the simulated runtime's bandwidth estimate (worker 0, median
                                  # over the measured steps' beginnings)
    policy: str                   # the policy's state at the end (worker 0)
    messages_per_step: float      # frames worker 0 sent per step
    exchanged_per_step: float     # collectives per step by exchange (ops/core/small_allreduce.h)
    periods_s: list[float]
    tensor_times: list[dict[str, Any]]
    # Worker 0's I/O thread busy with the charged CPU per step (0 without CPU costs); above
    # step_s one thread cannot keep up.
    io_busy_s: float = 0.0
    # That estimate at each measured step's beginning (how steady it is).
    bandwidth_samples_Bps: list[float] = dataclasses.field(default_factory=list)
    # Times the workers' policies broke their own flow control to end a wait that looked like a
    # deadlock, summed over the workers and the whole simulated run (bytescheduler's stall
    # breaks; 0 for the others).
    stall_breaks: int = 0

    @property
    def speedup(self) -> float:
        """Throughput over one worker: N x (one worker's step time) / (this step time)."""
        return self.workers * self.single_step_s / self.step_s if self.step_s > 0 else math.nan

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["speedup"] = self.speedup
        return data


@dataclasses.dataclass
class IdealBound:
    """The best step time any schedule could reach on a setting (``ops/sim/ideal_bound.h``;
    docs/design.md, "The ideal bound"): the profile's compute, with every gradient's all-reduce
    as a fluid on the pooled links, served in the order the next forward pass needs it, without
    per-message costs or update times."""

    workers: int
    bandwidth_bps: float
    step_s: float                 # the bound
    compute_s: float              # the profile's step without any waiting
    comm_s: float                 # every gradient's 2(N-1)/N share of the link, at the payload rate
    wait_s: float                 # step_s - compute_s
    gradient_bytes: int           # the gradients' bytes as they travel (compressed: half)
    binding_layer: Optional[str]  # the last layer whose gradients the bound waits for
    layer_done_s: list[Optional[float]]  # per layer: its gradients all-reduced, from the backward start

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _call(entry: str, request: str, what: str) -> dict[str, Any]:
    """Runs a C entry point of the predictor library on ``request``; its JSON answer."""
    code, text = call_returning_text(getattr(predict_api(), entry), request)
    if code != 0:
        kind = SimulatedDeadlock if code == _FAILED_PRECONDITION else PredictError
        raise kind(f"{what}: {text}")
    return json.loads(text)


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _small_allreduce_mode(setting: Union[bool, str]) -> str:
    """PredictOptions.small_allreduce as the simulator's setting (RuntimeModel::small_allreduce)."""
    if setting is True or setting is False:
        return "auto" if setting else "never"
    if setting in ("never", "auto", "always"):
        return str(setting)
    raise PredictError("small_allreduce must be True, False, 'never', 'auto' or 'always', got "
                       f"{setting!r}")


def simulation_request(profile: Profile, workers: int, bandwidth_bps: float, schedule: str,
                       options: PredictOptions, timeline_path: Optional[str],
                       timeline_workers: int) -> str:
    """The text the C++ simulator reads (ops/sim/simulation_request.h): the options, the
    profile's layers and gradients, and where to write a timeline of the first
    ``timeline_workers`` workers. The replay benchmark sends its workers the same request."""
    base, cross = parse_schedule(schedule)
    layer_index = {layer.name: i for i, layer in enumerate(profile.layers)}
    lines = [
        f"option workers={workers}",
        f"option workers_per_host={int(options.workers_per_host)}",
        f"option loopback_Bps={float(options.loopback_bytes_per_s)!r}",
        f"option link_Bps={bandwidth_bps / 8.0!r}",
        f"option ingress_limited={int(options.ingress_limited)}",
        f"option latency_ns={_ns(options.latency_s)}",
        f"option payload_efficiency={options.payload_efficiency!r}",
        f"option frame_overhead_bytes={int(options.frame_overhead_bytes)}",
        f"option max_socket_buffer_bytes={int(options.max_socket_buffer_bytes)}",
        f"option autotuned_socket_buffer_bytes={int(options.autotuned_socket_buffer_bytes)}",
        f"option sender_queue_s={float(options.sender_queue_s)!r}",
        f"option sum_Bps={float(options.sum_bps)!r}",
        f"option schedule={base}",
        f"option cross_barrier={int(cross)}",
        f"option apply_threads={int(options.apply_threads)}",
        f"option ring_message_ns={_ns(options.ring_message_s)}",
        f"option warmup_steps={int(options.warmup_steps)}",
        f"option steps={int(options.steps)}",
        f"option compression={options.compression or 'none'}",
        f"option fusion_bytes={int(options.fusion_bytes)}",
        f"option message_send_ns={_ns(options.message_send_s)}",
        f"option message_receive_ns={_ns(options.message_receive_s)}",
        f"option send_byte_ns={float(options.send_byte_s) * 1e9!r}",
        f"option receive_byte_ns={float(options.receive_byte_s) * 1e9!r}",
        f"option sum_byte_ns={float(options.sum_byte_s) * 1e9!r}",
        f"option cast_byte_ns={float(options.cast_byte_s) * 1e9!r}",
        f"option copy_byte_ns={float(options.copy_byte_s) * 1e9!r}",
        f"option shared_cores={int(options.shared_cores)}",
        f"option io_threads={int(options.io_threads)}",
        f"option small_allreduce={_small_allreduce_mode(options.small_allreduce)}",
        f"option launch_ns={_ns(profile.launch_s)}",
        f"option backward_ns={_ns(profile.backward_s)}",
        f"option tail_ns={_ns(profile.tail_s)}",
        f"option gap_ns={_ns(profile.gap_s)}",
    ]
    # The runtime's options the predictor models, where set (the simulator has the runtime's
    # defaults); mwms keeps its flat ring.
    for name in predicted_options():
        value = getattr(options, name)
        if value is not None and not (name == "hierarchical" and base == "mwms"):
            try:
                lines.append(f"option {name}={to_text(name, value)}")
            except ValueError as e:
                raise PredictError(str(e)) from None
    if timeline_path:
        lines.append(f"option timeline_path={timeline_path}")
        lines.append(f"option timeline_workers={int(timeline_workers)}")
    for layer in profile.layers:
        lines.append(f"layer {_ns(layer.forward_s)} {_ns(layer.backward_s)} {layer.name}")
    for t in profile.tensors:
        layer = layer_index.get(t.layer, -1) if t.layer is not None else -1
        lines.append(f"tensor {t.bytes} {t.element_size} {t.priority} {layer} "
                     f"{min(_ns(t.ready_s), _ns(profile.backward_s))} {_ns(t.apply_s)} {t.name}")
    return "\n".join(lines) + "\n"


def predict(profile: Profile, *, workers: int, bandwidth_bps: float, schedule: str = "prophet",
            options: Optional[PredictOptions] = None, timeline_path: Optional[str] = None,
            timeline_workers: int = 2) -> Prediction:
    """Simulates ``workers`` workers training with ``profile``'s step on links of
    ``bandwidth_bps`` bit/s per host and direction, scheduled by ``schedule`` (:data:`SCHEDULES`).

    ``timeline_path``: also write the synthetic timeline of the first ``timeline_workers``
    workers, one Chrome trace each (``{rank}`` in the path is replaced by the rank; without it,
    ``.RANK`` goes before the extension, as the runtime does).

    Raises:
      SimulatedDeadlock: the runtime would stop for good in this setting.
      PredictError: bad arguments or a simulation that cannot run (the message says why).
    """
    options = options or PredictOptions()
    if workers < 1:
        raise PredictError(f"workers must be at least 1, got {workers}")
    if workers > 1 and not (bandwidth_bps > 0 and math.isfinite(bandwidth_bps)):
        raise PredictError(f"the link rate must be a positive number of bit/s, got {bandwidth_bps!r}")
    if timeline_path and "{rank}" not in timeline_path:
        root, dot, ext = timeline_path.rpartition(".")
        timeline_path = f"{root}.{{rank}}.{ext}" if dot and "/" not in ext else f"{timeline_path}.{{rank}}.json"
    profile.validate()
    request = simulation_request(profile, workers, bandwidth_bps if workers > 1 else 1.0,
                                 schedule, options, timeline_path, timeline_workers)
    data = _call("prophet_predict", request,
                 f"{schedule}, {workers} workers, {bandwidth_bps:g} bit/s")
    times = [{k: (v if not isinstance(v, (int, float)) or v >= 0 else None) for k, v in t.items()}
             for t in data["tensor_times"]]
    return Prediction(schedule=schedule, workers=workers, bandwidth_bps=float(bandwidth_bps),
                      step_s=data["step_s"], single_step_s=data["single_step_s"],
                      overlap=data["overlap"], comm_s=data["comm_s"],
                      wire_bytes_per_step=data["wire_bytes_per_step"],
                      gate_wait_s=data["gate_wait_s"], bandwidth_Bps=data["bandwidth_Bps"],
                      policy=data["policy"], messages_per_step=data["messages_per_step"],
                      exchanged_per_step=data["exchanged_per_step"],
                      periods_s=list(data["periods_s"]), tensor_times=times,
                      io_busy_s=data.get("io_busy_s", 0.0),
                      bandwidth_samples_Bps=list(data.get("bandwidth_samples_Bps", [])),
                      stall_breaks=int(data.get("stall_breaks", 0)))


def predict_many(profile: Profile, *, workers: Sequence[int], bandwidths_bps: Sequence[float],
                 schedules: Sequence[str], options: Optional[PredictOptions] = None) -> list[Prediction]:
    """:func:`predict` for every (bandwidth, workers, schedule), in that nesting order."""
    return [predict(profile, workers=n, bandwidth_bps=bw, schedule=s, options=options)
            for bw in bandwidths_bps for n in workers for s in schedules]


def ideal_bound(profile: Profile, *, workers: int, bandwidth_bps: Optional[float],
                options: Optional[PredictOptions] = None) -> IdealBound:
    """The ideal bound of ``workers`` workers training with ``profile``'s step on links of
    ``bandwidth_bps`` bit/s per host (None or 0 with one worker: no link). Uses the options'
    ``payload_efficiency`` and ``latency_s`` (one way); the runtime's options play no part.

    Raises:
      PredictError: bad arguments (the message says which).
    """
    options = options or PredictOptions()
    if workers < 1:
        raise PredictError(f"workers must be at least 1, got {workers}")
    if workers > 1 and not (bandwidth_bps and bandwidth_bps > 0 and math.isfinite(bandwidth_bps)):
        raise PredictError(f"the link rate must be a positive number of bit/s, got "
                           f"{bandwidth_bps!r}")
    profile.validate()
    request = simulation_request(profile, workers, bandwidth_bps if workers > 1 else 1.0,
                                 "prophet", options, None, 0)
    data = _call("prophet_predict_ideal", request, f"ideal bound, {workers} workers, "
                 f"{bandwidth_bps or 0:g} bit/s")
    binding = data["binding_layer"]
    return IdealBound(workers=workers, bandwidth_bps=float(bandwidth_bps or 0.0),
                      step_s=data["step_s"], compute_s=data["compute_s"], comm_s=data["comm_s"],
                      wait_s=data["wait_s"], gradient_bytes=int(data["gradient_bytes"]),
                      binding_layer=profile.layers[binding].name if binding >= 0 else None,
                      layer_done_s=list(data["done_s"]))
