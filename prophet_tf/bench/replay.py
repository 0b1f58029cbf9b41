"""Many real engines on one machine, driven by a recorded profile, beside the predictor.

    python -m prophet_tf.bench.replay --workers 16 [--workers_per_host 1] --model resnet50
        --schedule prophet [--bandwidth 10G] [--time_scale 50] [--byte_scale 0.01]
        [--steps 10] [--warmup 3] [--json FILE] [--loopback] [--hierarchical auto|off|on]
        [--costs costs.json] [--profile PROFILE.json]

Every list flag (``--workers``, ``--model``, ``--schedule``, ``--bandwidth``) runs each
combination. Per run, N replay workers (``ops/replay``: the real engine with its transport,
scheduler, planner, fusion with the start-up probe, credit, two-level path and heartbeats,
without TensorFlow) train the profile's step as H = N / W hosts x W workers: one network
namespace per host whose NIC sends at the emulated link rate (``tc tbf``, as
:class:`prophet_tf.bench.netem.EmulatedCluster` builds it; needs root) or, with
``--loopback``, 127.0.0.x without shaping. Each worker plays the accelerator's forward and
backward passes layer by layer on a virtual clock and pushes, pulls and sums real gradients of
the profile's sizes, checking every sum it samples against the exact sum.

**Scales.** The profile is the emulated benchmark's step of ``--model`` on the modelled
accelerator (``--accelerator_tflops``, as ``python -m prophet_tf.bench.scaling`` predicts it), or
``--profile``. It runs ``--time_scale`` S times slower, and its gradients carry ``--byte_scale``
f of their bytes (the replay moves f x the model's bytes, so that N workers fit in this machine's
memory and CPU); the emulated link then sends at ``--bandwidth`` x f / S, so every ratio of
communication to compute stays the modelled cluster's. The engine's sizes scale with the bytes
(partitions, the byte credit, the sockets' unsent limit, and with ``--fusion scaled`` the buckets,
as the modelled cluster's probe would size them), so that tensors are cut, released and fused as
there; frame headers, per-message CPU and the engine's thresholds in bytes do not
(docs/design.md). The predictor is asked about exactly what ran: the scaled profile, the emulated
rate, the engine's sizes as the workers used them, egress-only shaping and tbf's payload share,
what TCP keeps queued in the emulated hosts, this machine's socket limits, and (``--costs``) the
CPU costs of ``python -m prophet_tf.predict calibrate``.

For every run it prints the measured step (worker 0's median over the measured steps) beside the
predicted one and the ideal bound, and ``--json`` gets, per run: ``measured_step_s``,
``predicted_step_s``, ``ideal_step_s``, ``error``, ``startup_s`` (launch to every worker
connected, probe done and fusion declared: the slowest worker), ``peak_rss_bytes`` (the largest
over the workers), ``connections``, ``messages_per_worker_per_step``, ``stalls`` (a worker's
step over twice its median), ``longest_op_s``, ``cpu`` (the CPU the workers used per step and as
cores, and the machine's load), ``predicted_free_step_s`` (with ``--costs``: the prediction
without the CPU charged) and the settings. ``--merge A.json,B.json`` prints the runs of earlier
``--json`` files as one table with their prediction error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

__all__ = ["ReplayRun", "load_runs", "error_line", "STALL_FACTOR", "count_stalls", "scale_profile",
           "replay_binary", "predict_options", "tsq_queue_s", "run_replay", "main"]

#: Where ``bazel build //ops/replay:replay_worker`` puts the worker, from the source checkout.
_BINARY = pathlib.Path("bazel-bin") / "ops" / "replay" / "replay_worker"
#: Namespace prefix of the emulated hosts (netem.EmulatedCluster), distinct from the other
#: benchmarks' so that they can run at the same time.
NETNS_PREFIX = "rply"
#: First port of each host's workers (every host has its own network stack).
BASE_PORT = 29500
#: A worker's measured step longer than this many times its median step is a stall: it waited
#: for something that does not come back every step (a retransmission timeout, a peer starved
#: of CPU, a lost heartbeat).
STALL_FACTOR = 2.0


def count_stalls(periods: Sequence[float]) -> int:
    """Steps of ``periods`` longer than :data:`STALL_FACTOR` x their median."""
    if not periods:
        return 0
    median = statistics.median(periods)
    return sum(p > STALL_FACTOR * median for p in periods)


def replay_binary() -> pathlib.Path:
    """The replay worker: ``$PROPHET_REPLAY_WORKER``, else ``bazel-bin`` of the source checkout.

    Raises:
      FileNotFoundError: it is not built (the message gives the command).
    """
    if os.environ.get("PROPHET_REPLAY_WORKER"):
        path = pathlib.Path(os.environ["PROPHET_REPLAY_WORKER"])
    else:
        path = pathlib.Path(__file__).resolve().parents[2] / _BINARY
    if not path.is_file():
        # bazel-bin follows the last build's configuration: name the tree it points at, so that
        # a build with another one (a sanitizer without its own --symlink_prefix) shows.
        link = path.parents[2]
        where = (f" (bazel-bin -> {os.readlink(link)})"
                 if link.name == "bazel-bin" and link.is_symlink() else "")
        raise FileNotFoundError(f"the replay worker {path} is not built{where}: run `bazel build "
                                "//ops/replay:replay_worker` (or `bash scripts/setup.sh`) in the "
                                "source checkout, or set $PROPHET_REPLAY_WORKER")
    return path


def scale_profile(profile: Any, time_scale: float, byte_scale: float) -> Any:
    """``profile`` played ``time_scale`` times slower with ``byte_scale`` of every tensor's bytes
    (rounded to whole elements, at least one)."""
    if not (byte_scale > 0 and math.isfinite(byte_scale)):
        raise ValueError(f"the byte scale must be a positive number, got {byte_scale!r}")
    slowed = profile.scaled(1.0 / time_scale)
    tensors = [dataclasses.replace(t, bytes=max(1, round(t.bytes * byte_scale / t.element_size))
                                   * t.element_size) for t in slowed.tensors]
    return dataclasses.replace(slowed, tensors=tensors, notes=list(slowed.notes) + [
        f"replayed {time_scale:g} times slower with {byte_scale:g} of the bytes"])


def predict_options(workers_per_host: int, hierarchical: str, fusion_bytes: int, warmup: int,
                    steps: int, costs: Optional[dict] = None, runtime: Optional[dict] = None,
                    shared_cores: int = 0, mtu: int = 1500, io_threads: int = 1) -> Any:
    """How the predictor models the replay's cluster: egress-only tbf links carrying TCP's
    payload share (as ``bench.predict`` models the emulated cluster), this machine's socket
    limits, W workers per host, the workers' fusion bucket, ``runtime`` (PredictOptions fields:
    the engine's sizes as the workers used them) and ``costs`` (CPU per message and per byte,
    ``prophet_tf.predict calibrate``) on ``shared_cores`` cores (0: a core per worker), with
    ``io_threads`` lanes per worker (the replay's engines take the same)."""
    from prophet_tf.bench.netem import frame_efficiency
    from prophet_tf.predict import (PredictOptions, kernel_autotuned_socket_buffer,
                                    kernel_socket_buffer_cap)
    options = PredictOptions(ingress_limited=False, payload_efficiency=frame_efficiency(mtu),
                             workers_per_host=workers_per_host, hierarchical=hierarchical,
                             fusion_bytes=fusion_bytes, warmup_steps=warmup, steps=steps,
                             max_socket_buffer_bytes=kernel_socket_buffer_cap(),
                             autotuned_socket_buffer_bytes=kernel_autotuned_socket_buffer(),
                             shared_cores=shared_cores, io_threads=io_threads)
    options = dataclasses.replace(options, **(runtime or {}))
    from prophet_tf.predict.costs import apply_costs
    return apply_costs(options, costs)


def tsq_queue_s(workers: int, workers_per_host: int, link_bps: float, gso_max_segs: int,
                mtu: int = 1500) -> float:
    """``PredictOptions.sender_queue_s`` for the emulated hosts: TCP small queues let each busy
    socket keep two packets of ``gso_max_segs`` segments (mtu + 14 bytes on the wire each) in
    its host's qdisc; ``KernelSendBufferBytes`` (ops/sim/simulator.h) gives each of the host's
    W x (N - W) connections to other hosts 1/(W (N - W)) of ``sender_queue_s`` at the link
    rate."""
    leaving = max(1, workers_per_host * (workers - workers_per_host))
    return 2 * gso_max_segs * (mtu + 14) * leaving / (link_bps / 8)


@dataclasses.dataclass
class ReplayRun:
    """One run: its settings, what the workers measured and what the predictor said."""

    model: str
    schedule: str
    workers: int
    workers_per_host: int
    hierarchical: str
    bandwidth_bps: float          # the modelled cluster's link rate
    link_bps: float               # the emulated link rate (bandwidth x byte_scale / time_scale)
    time_scale: float
    byte_scale: float
    gradient_bytes: int           # per worker, as replayed
    measured_step_s: float
    predicted_step_s: Optional[float]
    predicted_free_step_s: Optional[float]  # the same without the CPU charged (None: not asked)
    ideal_step_s: float
    single_step_s: float          # one worker: the profile's step as replayed
    startup_s: float
    connect_s: float
    peak_rss_bytes: int
    connections: int              # sockets over the job (each worker has one per peer)
    messages_per_worker_per_step: float
    predicted_messages_per_step: Optional[float]
    stalls: int                   # steps over STALL_FACTOR x their worker's median, all workers
    longest_op_s: float           # the longest round of any worker: submission to completion
    qdisc_drops: int              # packets the hosts' tbf queues dropped (TCP then retransmits)
    ops_failed: int
    sums_checked: int
    fusion_bucket_bytes: int
    fusion_link_bps: float
    probe_agreed_bps: float
    probe_s: Optional[float]      # the slowest worker's start-up probe (0: none ran)
    probe_bytes: Optional[int]    # each probe round's push_pull, as replayed
    cpu: dict[str, Any]
    # Hosts of the two-level path as the engines resolved `hierarchical` (0: the flat path; None:
    # a run saved before this field).
    two_level_hosts: Optional[int]
    # Where the probe chose the path (hierarchical auto over hosts that allow two): whether it
    # kept the two-level one, and the slowest worker's round on each path in lockstep; None where it
    # chose none.
    probe_two_level: Optional[bool]
    probe_round_s: Optional[dict[str, float]]
    worker_steps_s: list[float]   # each worker's median step
    periods_s: list[float]        # worker 0's measured steps
    wall_s: float

    @property
    def error(self) -> Optional[float]:
        if not self.predicted_step_s:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["error"] = self.error
        return data


def _qdisc_drops(stats: str) -> int:
    """Packets a host's qdiscs dropped (``tc -s qdisc show``: "dropped N")."""
    import re
    return sum(int(m) for m in re.findall(r"dropped (\d+)", stats))


def _load() -> tuple[float, float, float]:
    return os.getloadavg()


def _machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine so far (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [float(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return sum(fields) - idle, sum(fields)


#: Full frames a sending cross-host connection may keep in its host's tbf queue, at least: flat
#: 8 hosts x 8 workers at 2 Mbit/s (single-segment packets) held 1.36-1.41 MB for its 448
#: connections, 2 frames each, with no drop; twice that leaves room. Packets of S segments (TCP
#: small queues keep two per socket) need 2 x S.
QUEUED_FRAMES_PER_CONNECTION = 4
#: Below two per connection (Reno's smallest window) the queue drops packets at every round.
MIN_QUEUED_FRAMES_PER_CONNECTION = 2


def crossing_connections(workers: int, workers_per_host: int, hierarchical: str,
                         io_threads: int) -> int:
    """The connections that carry one host's bytes across its link.

    Flat: each of the host's workers sends to every worker elsewhere, on each lane. Two-level:
    a partition's leaders have the same local rank on every host (hosts of one size), so each
    worker sends to one worker per other host. Under auto the start-up probe runs flat rounds
    and may keep the flat path: the flat count."""
    hosts = workers // workers_per_host
    two_level = hierarchical == "on"
    peers = hosts - 1 if two_level else workers - workers_per_host
    return workers_per_host * peers * max(1, io_threads)


def tbf_queue_ms(link_bps: float, connections: int, mtu: int, asked_ms: float,
                 gso_max_segs: int = 1) -> float:
    """The tbf queue (as time at ``link_bps``) for ``connections`` sending across a host's link.

    ``asked_ms`` 0: large enough for QUEUED_FRAMES_PER_CONNECTION full frames each, or two
    packets of ``gso_max_segs`` segments if more, and at least 1 s. A queue asked for that cannot hold two frames per connection raises ValueError: it drops
    packets at every round trip, and Linux ends a connection whose sends the host's own queue
    refused 15 times in a row (tcp_retries2, 0.5 s apart) with ETIMEDOUT, about 10 s in. So does
    a negative (or NaN) ``asked_ms``.
    """
    frame_bits = (mtu + 14) * 8
    def ms_for(packets: int) -> float:
        return connections * packets * frame_bits / link_bps * 1e3
    if not asked_ms >= 0:  # NaN too
        raise ValueError(f"--tbf_latency_ms {asked_ms:g}: expected 0 (sized for the crossing "
                         "connections) or a queue in milliseconds")
    if asked_ms == 0:
        return max(1000.0, ms_for(max(QUEUED_FRAMES_PER_CONNECTION, 2 * gso_max_segs)))
    if asked_ms < ms_for(MIN_QUEUED_FRAMES_PER_CONNECTION):
        raise ValueError(
            f"--tbf_latency_ms {asked_ms:g} gives each host a queue of "
            f"{link_bps / 8 * asked_ms / 1e3 / 1e6:.2f} MB at the emulated {link_bps / 1e6:.3g} "
            f"Mbit/s, less than the {MIN_QUEUED_FRAMES_PER_CONNECTION} frames each of its "
            f"{connections} crossing connections needs "
            f"({connections * MIN_QUEUED_FRAMES_PER_CONNECTION * (mtu + 14) / 1e6:.2f} MB): "
            f"its packets would be dropped at every round trip and its connections end with "
            f"ETIMEDOUT. Leave --tbf_latency_ms at 0 (sized for them: "
            f"{ms_for(max(QUEUED_FRAMES_PER_CONNECTION, 2 * gso_max_segs)):.0f} ms), or raise "
            f"the emulated rate (a smaller --time_scale or a larger --byte_scale)")
    return asked_ms


def run_replay(profile: Any, *, workers: int, workers_per_host: int, schedule: str,
               hierarchical: str, bandwidth_bps: float, time_scale: float, byte_scale: float,
               warmup: int, steps: int, loopback: bool, heartbeat_s: float, timeout_s: float,
               costs: Optional[dict], model: str, workdir: str, probe: bool = False,
               check_all: bool = False, fusion: str = "scaled", shared_cores: int = 0,
               tbf_latency_ms: float = 0.0, sysctls: Optional[dict[str, str]] = None,
               gso_max_segs: int = 4, mtu: int = 1500, io_threads: int = 1) -> ReplayRun:
    """Runs one replay (see the module docstring) and predicts it. Raises RuntimeError naming
    the first worker that failed and its error.

    ``fusion``: ``"scaled"`` sizes buckets as the modelled cluster's probe would (for
    ``bandwidth_bps`` on the 1-2-5 series) times ``byte_scale``; ``"auto"`` as the strategy does
    on the emulated link (the workers' probe); ``"off"``. ``probe``: run the strategy's start-up
    probe in any case (timed as start-up).
    """
    from prophet_tf.bench import netem
    from prophet_tf.launch import free_ports
    from prophet_tf.predict import SimulatedDeadlock, ideal_bound, predict
    from prophet_tf.predict.model import simulation_request
    if workers < 2 or workers % workers_per_host:
        raise ValueError(f"--workers ({workers}) must be at least 2 and a multiple of "
                         f"--workers_per_host ({workers_per_host})")
    from prophet_tf._link_probe import quantize_gbps
    if fusion not in ("scaled", "auto", "off"):
        raise ValueError(f"fusion must be scaled, auto or off, got {fusion!r}")
    hosts = workers // workers_per_host
    played = scale_profile(profile, time_scale, byte_scale)
    link_bps = bandwidth_bps * byte_scale / time_scale
    options = predict_options(workers_per_host, hierarchical, 0 if fusion == "off" else -1,
                              warmup, steps, costs, None, shared_cores, mtu, io_threads)
    request = simulation_request(played, workers, link_bps, schedule, options, None, 0)
    os.makedirs(workdir, exist_ok=True)
    request_path = os.path.join(workdir, "request.txt")
    with open(request_path, "w") as f:
        f.write(request)
    binary = str(replay_binary())
    cluster_cls = netem.LoopbackCluster if loopback else netem.EmulatedCluster
    # At the few Mbit/s a slowed replay runs, a host's many connections each move a few kB/s,
    # and the host's queue must hold a few packets of every one of them (tbf_queue_ms): with
    # less, drops and TCP's timeouts starve connections for seconds or end them.
    if not loopback:
        tbf_latency_ms = tbf_queue_ms(
            link_bps, crossing_connections(workers, workers_per_host, hierarchical, io_threads),
            mtu, tbf_latency_ms, gso_max_segs)
    cluster = (cluster_cls(hosts, link_bps) if loopback else
               cluster_cls(hosts, link_bps, prefix=NETNS_PREFIX, latency_ms=tbf_latency_ms,
                           gso_max_segs=gso_max_segs, sysctls=dict(sysctls or {}),
                           mtu=None if mtu == 1500 else mtu))
    token = secrets.token_hex(16)
    results: list[dict] = []
    with cluster:
        if loopback:
            ports = free_ports(workers)
        else:
            ports = [BASE_PORT + w % workers_per_host for w in range(workers)]
        addresses = [f"{cluster.host_address(w // workers_per_host)}:{ports[w]}"
                     for w in range(workers)]
        procs = []
        load0, busy0 = _load(), _machine_busy()
        launched = time.time()
        for w in range(workers):
            argv = [binary, f"--request={request_path}", f"--rank={w}",
                    f"--addresses={','.join(addresses)}", f"--token={token}",
                    f"--out={os.path.join(workdir, f'rank{w}.json')}",
                    f"--heartbeat_s={heartbeat_s:g}", f"--timeout_s={timeout_s:g}",
                    f"--launched_at={launched:.6f}"]
            argv.append(f"--byte_scale={byte_scale:.9g}")
            if fusion == "scaled":
                argv += [f"--link_gbps={quantize_gbps(bandwidth_bps / 1e9):.9g}",
                         f"--fusion_scale={byte_scale:.9g}"]
            if probe:
                argv.append("--probe")
            if check_all:
                argv.append("--check_all")
            with open(os.path.join(workdir, f"rank{w}.log"), "w") as log:
                procs.append(cluster.popen(w // workers_per_host, argv, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        limit_s = timeout_s * 3 + 60
        deadline = time.monotonic() + limit_s
        failed, timed_out = None, False
        try:
            while any(p.poll() is None for p in procs):
                bad = [w for w, p in enumerate(procs) if p.poll() not in (None, 0)]
                timed_out = not bad and time.monotonic() > deadline
                if bad or timed_out:
                    failed = bad[0] if bad else None
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
        wall = time.time() - launched
        load1, busy1 = _load(), _machine_busy()
        drops = 0 if loopback else sum(_qdisc_drops(cluster.qdisc_stats(h)) for h in range(hosts))
        if timed_out:
            raise RuntimeError(
                f"the replay did not end within {limit_s:g} s (3 x --timeout_s + 60), so its "
                f"{workers} workers were stopped (logs in {workdir}); a run this slow needs a "
                f"larger --timeout_s")
        if failed is None:
            codes = [p.returncode for p in procs]
            failed = next((w for w, c in enumerate(codes) if c != 0), None)
            if failed is None and any(c is None for c in codes):
                failed = 0
        if failed is not None or any(p.returncode != 0 for p in procs):
            w = failed if failed is not None else 0
            with open(os.path.join(workdir, f"rank{w}.log")) as f:
                tail = f.read()[-2000:]
            raise RuntimeError(f"replay worker {w} of {workers} failed (status "
                               f"{procs[w].returncode}; logs in {workdir}): {tail.strip()}")
        for w in range(workers):
            with open(os.path.join(workdir, f"rank{w}.json")) as f:
                results.append(json.load(f))
    first = results[0]
    fusion = int(first["fusion_bucket_bytes"])
    two_level_hosts = int(first.get("engine", {}).get("two_level_hosts", 0))
    chose = int(first.get("probe_two_level", -1)) >= 0
    # The path that ran: under auto the probe may have chosen the flat one over the hosts.
    ran = hierarchical if hierarchical != "auto" else ("on" if two_level_hosts else "off")
    # The prediction of what ran: the workers' bucket size (0: none fused), partitions, credit
    # and unsent limit, and what the emulated hosts queue below the sockets.
    runtime = {"partition_bytes": int(first["partition_bytes"]),
               "credit_bytes": int(first["credit_bytes"]),
               "socket_unsent_bytes": int(first["socket_unsent_bytes"])}
    if heartbeat_s > 0:  # in the replay's own (slowed) time, as the predicted step
        runtime["heartbeat_s"] = heartbeat_s
    if not loopback:
        runtime["sender_queue_s"] = tsq_queue_s(workers, workers_per_host, link_bps, gso_max_segs,
                                                mtu)
    options = predict_options(workers_per_host, ran, fusion, warmup, steps, costs,
                              runtime, shared_cores, mtu, io_threads)
    try:
        prediction = predict(played, workers=workers, bandwidth_bps=link_bps, schedule=schedule,
                             options=options)
        predicted, predicted_messages = prediction.step_s, prediction.messages_per_step
    except SimulatedDeadlock:
        predicted, predicted_messages = None, None
    free = None
    if costs:
        try:
            free = predict(played, workers=workers, bandwidth_bps=link_bps, schedule=schedule,
                           options=predict_options(workers_per_host, ran, fusion, warmup,
                                                   steps, None, runtime, 0, mtu, io_threads)).step_s
        except SimulatedDeadlock:
            free = None
    bound = ideal_bound(played, workers=workers, bandwidth_bps=link_bps, options=options)
    cpu_total = sum(r["cpu_s"] for r in results)
    measured_wall = statistics.median(r["wall_s"] for r in results)
    cores = os.cpu_count() or 1
    cpu = {
        "workers_cpu_s_per_step": cpu_total / steps,
        "workers_cores": cpu_total / measured_wall if measured_wall > 0 else math.nan,
        "machine_cores": cores,
        # Every program on the machine during the whole run (start-up included), as cores.
        "machine_busy_cores": (busy1[0] - busy0[0]) / max(1.0, busy1[1] - busy0[1]) * cores,
        "load_before": list(load0),
        "load_after": list(load1),
    }
    return ReplayRun(
        model=model, schedule=schedule, workers=workers, workers_per_host=workers_per_host,
        hierarchical=hierarchical, bandwidth_bps=bandwidth_bps, link_bps=link_bps,
        time_scale=time_scale, byte_scale=byte_scale, gradient_bytes=int(first["gradient_bytes"]),
        measured_step_s=statistics.median(first["periods_s"]), predicted_step_s=predicted,
        predicted_free_step_s=free,
        ideal_step_s=bound.step_s, single_step_s=played.step_s,
        startup_s=max(r["startup_s"] for r in results),
        connect_s=max(r["connect_s"] for r in results),
        peak_rss_bytes=max(int(r["peak_rss_bytes"]) for r in results),
        connections=sum(int(r["connections"]) for r in results),
        messages_per_worker_per_step=statistics.mean(r["frames_sent"] for r in results) / steps,
        predicted_messages_per_step=predicted_messages,
        stalls=sum(count_stalls(r["periods_s"]) for r in results),
        longest_op_s=max(float(r["longest_op_s"]) for r in results), qdisc_drops=drops,
        ops_failed=sum(int(r["ops_failed"]) for r in results),
        sums_checked=sum(int(r["sums_checked"]) for r in results),
        fusion_bucket_bytes=fusion, fusion_link_bps=float(first["fusion_link_Bps"]) * 8,
        probe_agreed_bps=float(first["probe_agreed_Bps"]) * 8,
        probe_s=max(r["probe_s"] for r in results), probe_bytes=first.get("probe_bytes"), cpu=cpu,
        two_level_hosts=two_level_hosts,
        probe_two_level=bool(first["probe_two_level"]) if chose else None,
        probe_round_s=({"two_level": float(first["probe_two_level_round_s"]),
                        "flat": float(first["probe_flat_round_s"])} if chose else None),
        worker_steps_s=[statistics.median(r["periods_s"]) for r in results],
        periods_s=list(first["periods_s"]), wall_s=wall)


def format_row(r: ReplayRun) -> str:
    """One markdown row: the setting, measured / predicted / ideal, error, start-up, memory,
    messages and CPU."""
    pred = f"{r.predicted_step_s * 1e3:.0f}" if r.predicted_step_s else "deadlock"
    err = f"{100 * r.error:+.1f}%" if r.error is not None else "-"
    placement = f"{r.workers // r.workers_per_host}x{r.workers_per_host}"
    if r.two_level_hosts or (r.two_level_hosts is None and r.hierarchical == "on"):
        placement += " 2-level" + (" (auto)" if r.hierarchical == "auto" else "")
    if r.probe_two_level is not None:
        placement += " (probe)" if r.probe_two_level else " flat (probe)"
    return (f"| {r.model} | {r.schedule} | {placement} | {r.measured_step_s * 1e3:.0f} | {pred} | "
            f"{r.ideal_step_s * 1e3:.0f} | {err} | {r.startup_s:.1f} | "
            f"{r.peak_rss_bytes / 2**20:.0f} | {r.messages_per_worker_per_step:.0f} | "
            f"{r.stalls} | {r.cpu['workers_cores']:.2f} | {r.cpu['machine_busy_cores']:.2f} |")


TABLE_HEADER = ("| model | schedule | hosts x workers | measured ms | predicted ms | ideal ms | error | "
                "start-up s | peak RSS MiB | messages/worker/step | stalls | workers' cores | "
                "machine busy cores |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _define_flags() -> None:
    from absl import flags
    flags.DEFINE_list("workers", ["8"], "Worker counts N.")
    flags.DEFINE_integer("workers_per_host", 1, "Workers per emulated host W (N / W hosts).")
    flags.DEFINE_list("model", ["resnet50"], "Models (prophet_tf/bench/models.py) whose emulated "
                      "step is replayed.")
    flags.DEFINE_string("profile", None, "Replay this recorded profile instead of --model's "
                        "emulated step (prophet_tf.predict.load_profile).")
    flags.DEFINE_list("schedule", ["prophet"], "Schedules: prophet, priority, fifo (and their "
                      "_nocross forms).")
    flags.DEFINE_list("bandwidth", ["10G"], "The modelled cluster's link rate per host; the "
                      "emulated rate is this x byte_scale / time_scale.")
    flags.DEFINE_float("time_scale", 50.0, "The profile's times are played this many times slower.")
    flags.DEFINE_float("byte_scale", 0.01, "Share of every gradient's bytes the replay moves.")
    flags.DEFINE_float("accelerator_tflops", 100.0, "The modelled accelerator (--model's profile).")
    flags.DEFINE_enum("hierarchical", "auto", ["off", "on", "auto"], "The two-level path (the "
                      "runtime's default, auto: where the job spans several hosts of several "
                      "workers).")
    flags.DEFINE_integer("steps", 10, "Measured steps.")
    flags.DEFINE_integer("warmup", 3, "Steps before those (Prophet plans after two).")
    flags.DEFINE_bool("loopback", False, "Run on 127.0.0.x without namespaces or shaping "
                      "(no root needed; the prediction then assumes the --bandwidth link).")
    flags.DEFINE_enum("fusion", "scaled", ["scaled", "auto", "off"], "Buckets: scaled (the "
                      "modelled cluster's for --bandwidth, times --byte_scale), auto (the "
                      "strategy's, from the workers' probe of the emulated link) or off.")
    flags.DEFINE_bool("probe", False, "Run the strategy's start-up probe (push_pulls of 4 MiB or "
                      "64 KiB a worker, times --byte_scale unless --fusion auto needs its rate; "
                      "timed as start-up) even where fusion does not need it.")
    flags.DEFINE_integer("io_threads", 1, "Lanes per worker (the runtime's io_threads), in the "
                         "engines and in the prediction beside them.")
    flags.DEFINE_integer("shared_cores", 0, "Predict with every worker's I/O thread on one pool of "
                         "this many cores (this machine's, as the replay runs them); 0: a core "
                         "each.")
    flags.DEFINE_float("tbf_latency_ms", 0.0, "tbf's queue on each host, as time at its rate. "
                       "0: four full frames (or two packets of --gso_max_segs) for each "
                       "connection that crosses the host's link, and at least 1000 ms.")
    flags.DEFINE_integer("gso_max_segs", 4, "TCP segments per packet the hosts' interfaces hand "
                         "their qdisc. 4: 0.43 CPU-s per step for 16 workers where 1 took "
                         "0.55 (each packet crosses two veths, the bridge and tbf).")
    flags.DEFINE_integer("mtu", 1500, "MTU of the emulated hosts' links (9000: jumbo frames, a "
                         "sixth of the packets, each of which costs CPU on its way).")
    flags.DEFINE_list("sysctl", ["net.ipv4.tcp_congestion_control=reno"], "KEY=VALUE kernel "
                      "settings of every emulated host. Reno by default: with bbr (this machine's "
                      "default) the slow hosts' queues dropped packets of their 15-63 connections "
                      "(722 drops in 7 steps at N = 16, against none with reno) and the "
                      "retransmission timeouts stalled steps.")
    flags.DEFINE_float("heartbeat_s", 10.0, "The engine's heartbeat_s.")
    flags.DEFINE_float("timeout_s", 120.0, "The engine's operation and connect timeout.")
    flags.DEFINE_string("costs", None, "JSON of the predictor's CPU costs (python -m "
                        "prophet_tf.predict calibrate --out FILE) charged in the predictions.")
    flags.DEFINE_bool("check_all", False, "Check every element of every sum (else a sample).")
    flags.DEFINE_string("json", None, "Write every run's results here.")
    flags.DEFINE_list("merge", [], "Instead of running, print one table of the runs of these "
                      "--json files (and their error over the runs with 16 or more workers).")
    flags.DEFINE_string("out", "bench_out", "Output directory (OUT/replay: worker logs, specs).")


def _profile_for(model: str, flags_: Any) -> Any:
    from prophet_tf.predict import load_profile
    if flags_.profile:
        return load_profile(flags_.profile)
    from prophet_tf.bench.schedule_map import emulated_profiles
    return emulated_profiles([model], flags_.out, flags_.accelerator_tflops, None)[model]


def load_runs(path: str) -> list[ReplayRun]:
    """The runs a ``--json`` file holds."""
    with open(path) as f:
        data = json.load(f)
    # Runs written before a field existed get None for it.
    return [ReplayRun(**{f.name: r.get(f.name) for f in dataclasses.fields(ReplayRun)})
            for r in data["runs"]]


def error_line(runs: Sequence[ReplayRun], label: str) -> str:
    """``LABEL: median X%, max Y% over K runs`` (absolute relative error)."""
    errors = [abs(r.error) for r in runs if r.error is not None]
    if not errors:
        return f"{label}: no run with a prediction"
    return (f"{label}: median {100 * statistics.median(errors):.1f}%, max "
            f"{100 * max(errors):.1f}% over {len(errors)} runs")


def _merge(paths: Sequence[str]) -> int:
    runs = []
    for path in paths:
        try:
            runs += load_runs(path)
        except (OSError, KeyError, TypeError, ValueError) as e:
            print(f"error: cannot read {path}: {e}", file=sys.stderr)
            return 2
    print(TABLE_HEADER)
    for r in runs:
        print(format_row(r))
    print()
    print(error_line(runs, "prediction error"))
    print(error_line([r for r in runs if r.workers >= 16], "prediction error at N >= 16"))
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point (after absl parsed the flags)."""
    from absl import flags

    from prophet_tf.predict.cli import parse_rate
    FLAGS = flags.FLAGS
    if len(argv) > 1:
        print(f"unexpected arguments: {' '.join(argv[1:])}", file=sys.stderr)
        return 2
    if FLAGS.merge:
        return _merge(FLAGS.merge)
    try:
        workers = [int(w) for w in FLAGS.workers]
        bandwidths = [parse_rate(b) for b in FLAGS.bandwidth]
        costs = None
        if FLAGS.costs:
            from prophet_tf.predict.costs import load_costs
            costs = load_costs(FLAGS.costs)
        replay_binary()
        if not FLAGS.loopback:
            from prophet_tf.bench.netem import EmulatedCluster
            EmulatedCluster.check_available()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs: list[ReplayRun] = []
    command = " ".join(["python -m prophet_tf.bench.replay", *sys.argv[1:]])
    print(f"# {command}\n(load {' '.join(f'{v:.1f}' for v in os.getloadavg())})\n", flush=True)
    print(TABLE_HEADER, flush=True)
    status = 0
    for model in ([FLAGS.profile] if FLAGS.profile else FLAGS.model):
        profile = _profile_for(model, FLAGS)
        for bw in bandwidths:
            for n in workers:
                for schedule in FLAGS.schedule:
                    base = os.path.join(FLAGS.out, "replay")
                    os.makedirs(base, exist_ok=True)
                    workdir = tempfile.mkdtemp(prefix=f"{os.path.basename(model)}-{schedule}-{n}-",
                                               dir=base)
                    try:
                        run = run_replay(profile, workers=n, workers_per_host=FLAGS.workers_per_host,
                                         schedule=schedule, hierarchical=FLAGS.hierarchical,
                                         bandwidth_bps=bw, time_scale=FLAGS.time_scale,
                                         byte_scale=FLAGS.byte_scale, warmup=FLAGS.warmup,
                                         steps=FLAGS.steps, loopback=FLAGS.loopback,
                                         heartbeat_s=FLAGS.heartbeat_s, timeout_s=FLAGS.timeout_s,
                                         costs=costs, model=os.path.basename(model),
                                         workdir=workdir, probe=FLAGS.probe,
                                         check_all=FLAGS.check_all, fusion=FLAGS.fusion,
                                         shared_cores=FLAGS.shared_cores,
                                         tbf_latency_ms=FLAGS.tbf_latency_ms,
                                         sysctls=dict(kv.split("=", 1) for kv in FLAGS.sysctl),
                                         gso_max_segs=FLAGS.gso_max_segs, mtu=FLAGS.mtu,
                                         io_threads=FLAGS.io_threads)
                    except (RuntimeError, ValueError) as e:
                        print(f"| {model} | {schedule} | N={n} | failed: {e} |", flush=True)
                        status = 1
                        continue
                    runs.append(run)
                    print(format_row(run), flush=True)
                    if FLAGS.json:
                        with open(FLAGS.json, "w") as f:
                            json.dump({"command": command, "costs": costs,
                                       "shared_cores": FLAGS.shared_cores,
                                       "runs": [r.to_json() for r in runs]}, f, indent=1)
    if runs:
        print("\n" + error_line(runs, "prediction error"))
    return status


if __name__ == "__main__":
    from absl import app
    _define_flags()
    app.run(main)
