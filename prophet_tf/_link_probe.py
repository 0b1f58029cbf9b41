"""The link rate automatic fusion sizes its buckets for, and the I/O threads the link needs,
measured once at start-up and agreed.

``ProphetStrategy(fusion="auto")`` sizes buckets from the number of workers and the link rate
(docs/design.md, "Fusion", "The size"). Every worker must make the same buckets, so the rate must
be the same number everywhere. With ``$PROPHET_LINK_GBPS`` set, that is the rate (one environment
for every worker). Otherwise the strategy measures the link at its first fusion declaration
(:func:`probe`):

1. ``PROBE_ROUNDS`` push_pulls of a float32 tensor of :func:`probe_bytes` bytes through the
   runtime's normal path: control priority (never profiled as a gradient by Prophet's policy,
   never counted by the step meter) but at least N x 64 KiB, so it is cut into at least N
   partitions, one per owner, and never takes the small-tensor exchange;
2. each worker's rate = 2 (N-1)/N x P / (its fastest round's time): the bytes each worker's link
   carries per direction in an all-reduce (its pushes to the other owners, then its sums to
   the other workers); the fastest round, since the first also waits for the workers that
   reached the probe later;
3. every worker's fastest round is gathered (float64) and the slowest worker's rate taken: the
   same gathered values give every worker the same bits;
4. that minimum is rounded to the 1-2-5 series (:func:`quantize_gbps`), so that runs on the
   same cluster nearly always size the same buckets.

The same probe sizes the runtime's lanes (``io_threads`` auto, ops/core/engine.h): where more
than one lane is connected (a job over several hosts), the probe runs on all of them, so that it
sees the link rather than what one thread moves, and each worker also measures what its I/O
threads spent per byte sent (their CPU time over the bytes they sent, receiving and summing
included); both are gathered, and every worker then uses :func:`lanes_for` the agreed rate and
the costliest worker's CPU per byte, as many lanes as keep pace with the link.

The same probe chooses the push_pulls' path where ``hierarchical`` is auto and the hosts allow
the two-level path (``runtime.stats()["path_choosable"]``): after its rounds on the two-level
path it times FLAT_PROBE_ROUNDS on the flat one, and every worker takes the two-level path unless
the flat one's round in lockstep (the period of its last PATH_TIMED_ROUNDS rounds, the slowest
worker's) was shorter than the two-level one's by more than :func:`two_level_margin` (the same
gathered times give every worker the same answer). The two-level path wins wherever a host's link
limits the flat one (each host's share crosses it once instead of once per worker); the flat one
wins where each worker's I/O threads are the limit (fast links, few workers per host:
docs/benchmarks.md, "The two-level path by default"). The rate fusion sizes for is then the chosen
path's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional

#: Timed push_pulls; the fastest counts. The first also absorbs the workers' arrival skew, and
#: the first few through a fresh job's connections are slow on fast links (buffers and windows
#: grow): with 3 rounds the start-up probe read 3.9-4.1 Gbit/s on an emulated 10 Gbit/s link
#: (sized for 5) and 3.3 on loopback (sized for 2), with 6 rounds 6.5-7.9 and 10.0 (sized for
#: 5-10 and 10), at 0.1 s more start-up at 1 Gbit/s (docs/design.md, "The size").
PROBE_ROUNDS = 6
#: Timed push_pulls on the flat path where the probe chooses the path: they follow the two-level
#: rounds (warm connections), and where the flat path is the slow one (slow links, many workers
#: per host) each of its rounds carries every worker's share over its host's link.
FLAT_PROBE_ROUNDS = 3
#: The path's rounds the choice is timed on: its last ones, from the end of the round before them.
PATH_TIMED_ROUNDS = 2
#: The probe's tensor: 4 MiB moves in about 3.4 ms per round at 10 Gbit/s with 2 workers (34 ms
#: at 1 Gbit/s), against a round trip of tens of microseconds and about 20 us of CPU per
#: message: long enough to measure up to about 10 Gbit/s within the series' steps (beyond,
#: where fusion's sizes grow only with the square root of the rate, it reads low: smaller
#: buckets); small enough that the probe costs a fraction of a second at 1 Gbit/s.
PROBE_BYTES = 4 << 20
#: The runtime spreads a tensor of at least N x this many bytes over every worker
#: (ops/core/partition.h, MakePartitions): below it the probe's bytes would meet fewer owners.
SPREAD_BYTES_PER_WORKER = 64 << 10
#: A measured rate counts as a series value v from this fraction of v on: TCP moves at most
#: about 95% of a link's line rate as payload (1500-byte frames) and an all-reduce adds the
#: owners' sums and round trips, so a strict rounding down would size most links for half
#: their rate (a 1 Gbit/s link measures 0.9, not 1.0).
PAYLOAD_ALLOWANCE = 0.7
#: The lowest rate buckets are sized for, Gbit/s: below it the bucket size is at its floor of
#: 4 KiB per owner anyway (ops/core/fusion.h, FusionOwnerBytes).
MIN_GBPS = 0.1
PROBE_NAME = "fusion_probe"


@dataclasses.dataclass(frozen=True)
class FusionLinkRate:
    """The link rate automatic fusion sized its buckets for, and where it came from.

    Attributes:
      source: ``"probe"`` (measured at start-up and agreed), ``"env"`` (``$PROPHET_LINK_GBPS``)
        or ``"assumed"`` (no eager context to probe from: the runtime's assumed 10 Gbit/s).
      gbps: the rate buckets are sized for, Gbit/s per direction (the same on every worker);
        None for ``"assumed"`` (the runtime's constant).
      measured_gbps: this worker's probe rate (its fastest round); None unless probed.
      agreed_gbps: the minimum of every worker's ``measured_gbps`` (before rounding to the
        series); None unless probed.
      probe_seconds: how long this worker's probe took, its gathering of the rates included;
        0.0 unless probed.
      io_threads: the lanes the runtime moves bytes on after the probe (the same on every
        worker); None unless the probe sized them (io_threads auto over several hosts).
      cpu_ns_per_byte: the largest of the workers' I/O CPU per byte sent during the probe; None
        unless the probe sized the lanes.
      two_level: the path push_pulls take after the probe (True: two-level) where it chose one;
        None where the path is fixed.
      two_level_round_s, flat_round_s: the slowest worker's round on each path in lockstep (its
        last PATH_TIMED_ROUNDS rounds' period); None unless the probe chose the path.
    """

    source: str
    gbps: Optional[float]
    measured_gbps: Optional[float] = None
    agreed_gbps: Optional[float] = None
    probe_seconds: float = 0.0
    io_threads: Optional[int] = None
    cpu_ns_per_byte: Optional[float] = None
    two_level: Optional[bool] = None
    two_level_round_s: Optional[float] = None
    flat_round_s: Optional[float] = None

    @property
    def bytes_per_s(self) -> Optional[float]:
        """``gbps`` in bytes per second, as runtime.declare_fusion takes it."""
        return None if self.gbps is None else self.gbps * 1e9 / 8


def probe_bytes(world_size: int, lanes: int = 1) -> int:
    """Bytes of the probe's tensor for ``world_size`` workers on ``lanes`` lanes: PROBE_BYTES, or
    N x 64 KiB where that is more, so that every worker owns a share of it, and with several
    lanes at least what the runtime cuts into a slice per lane (ops/core/engine_options.h,
    LaneSliceFromBytes: each slice spread over every worker), so that it travels on every lane."""
    from prophet_tf._library import predict_api

    sliced = int(predict_api().prophet_runtime_lane_slice_from_bytes(lanes, world_size))
    return max(PROBE_BYTES, world_size * SPREAD_BYTES_PER_WORKER, sliced)


def allreduce_rate(world_size: int, nbytes: int, seconds: float) -> float:
    """Bytes/s per direction of a worker's link that all-reduced ``nbytes`` in ``seconds``:
    2 (N-1)/N x nbytes leave (and arrive) at each worker (its pushes, then its sums)."""
    return 2.0 * (world_size - 1) / world_size * nbytes / seconds


def quantize_gbps(gbps: float) -> float:
    """The rate buckets are sized for, from a measured ``gbps``: the largest of the 1-2-5 series
    (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, ... Gbit/s) that ``gbps`` reaches within
    PAYLOAD_ALLOWANCE (a value v from 0.7 v on), at least MIN_GBPS. The same input gives the same
    output on every worker; measured rates that differ by less than a series step mostly give
    the same output."""
    if not gbps > 0 or math.isinf(gbps):
        raise ValueError(f"a link rate must be positive and finite, got {gbps!r} Gbit/s")
    exponent = math.floor(math.log10(gbps / PAYLOAD_ALLOWANCE))
    best = MIN_GBPS
    for e in (exponent - 1, exponent, exponent + 1):  # log10's rounding at a decade's edge
        for mantissa in (1, 2, 5):
            # Exact decimals (0.2, not 2 x 0.1): the series values print as written.
            value = mantissa * 10 ** e if e >= 0 else mantissa / 10 ** -e
            if value * PAYLOAD_ALLOWANCE <= gbps:  # (not gbps / allowance: 0.2 x 0.7 / 0.7 < 0.2)
                best = max(best, float(value))
    return best


#: The share of its time a lane may spend busy, on average, at the link's rate. Lanes kept busy
#: all the time on average fall behind wherever the bytes come unevenly (the end of the backward
#: pass, lanes dealt unequal shares): predicted with this machine's costs, ResNet50 at 100 Gbit/s
#: and N = 8 ran at 66% of linear on 7 lanes (each 68% busy over the step) and at 79% on 8.
LANE_BUSY_SHARE = 0.75


def lanes_for(link_Bps: float, cpu_s_per_byte: float, connected: Optional[int] = None) -> int:
    """The fewest I/O threads (lanes) that keep pace with a link of ``link_Bps`` per direction,
    each busy at most LANE_BUSY_SHARE of the time on average, when each byte a worker sends costs
    its I/O threads ``cpu_s_per_byte`` of CPU (sending it, receiving as much, and summing what it
    owns): ceil(rate x cost / LANE_BUSY_SHARE), at least 1 and at most ``connected``."""
    lanes = max(1, math.ceil(link_Bps * cpu_s_per_byte / LANE_BUSY_SHARE - 1e-9))
    return lanes if connected is None else min(lanes, connected)


def two_level_margin() -> float:
    """How much faster the flat path's probe rounds must be for the probe to choose it over the
    two-level one (the core's kTwoLevelMargin, ops/core/hosts.h)."""
    from prophet_tf._library import runtime_constants

    return float(runtime_constants()["two_level_margin"])


def path_to_choose(stats: dict) -> bool:
    """Whether the runtime's ``stats`` leave the push_pulls' path to the probe: hierarchical auto
    over hosts that allow the two-level path, not chosen yet (a second strategy in the process
    keeps the first one's choice)."""
    return bool(stats.get("path_choosable", False)) and not stats.get("path_chosen", False)


def choose_two_level(two_level_round_s: float, flat_round_s: float) -> bool:
    """Whether push_pulls take the two-level path, from the slowest worker's round on each path
    in lockstep: yes unless the flat one was shorter by more than :func:`two_level_margin`
    (ops/core/hosts.h, ChooseTwoLevel; the predictor applies it to whole steps)."""
    return not flat_round_s < two_level_round_s * (1 - two_level_margin())


def probe(world_size: int, priority: int, size_lanes: bool = False,
          link_Bps: Optional[float] = None) -> FusionLinkRate:
    """Measures the link with the runtime's push_pull and agrees on the rate with every worker
    (the module's docstring); with ``size_lanes`` (io_threads auto connected several lanes) it
    runs on all of them and then uses as many as the link needs (for ``link_Bps`` when given,
    $PROPHET_LINK_GBPS, else the agreed rate). Must run eagerly, on every worker at the same point
    of the program.

    Raises:
      prophet_tf.errors.ProphetError: a push_pull or the gathering failed (a peer left, the
        operation timeout passed); the runtime's error, naming the probe's tensor.
    """
    import numpy as np
    import tensorflow as tf

    from prophet_tf import ops, runtime
    from prophet_tf._devices import HOST_DEVICE

    start = time.perf_counter()
    connected = int(runtime.stats().get("lanes", 1))
    if size_lanes:
        runtime.set_io_threads(connected)  # every worker is here: the probe sees the link
    before = runtime.stats()
    choose_path = path_to_choose(before)
    nbytes = probe_bytes(world_size, int(before.get("io_threads", 1)))
    with tf.device(HOST_DEVICE):  # where push_pull runs: no copy from a GPU in the timing
        payload = tf.zeros([nbytes // 4], tf.float32)
    # The path in use first (as when there is no choice: fusion's rate from undisturbed rounds),
    # then the flat one, whose rounds meet connections the first ones warmed. Not alternating: a
    # round can end on one worker while its bytes still queue on the others' links, and slows the
    # other path's next round (12 x on emulated 8 x 8 hosts).
    paths = (True, False) if choose_path else (None,)
    best = {path: math.inf for path in paths}
    ends: dict = {path: [] for path in paths}
    for path in paths:
        if path is not None:
            runtime.set_two_level(path)
        for k in range(FLAT_PROBE_ROUNDS if path is False else PROBE_ROUNDS):
            name = f"{PROBE_NAME}/flat/{k}" if path is False else f"{PROBE_NAME}/{k}"
            t0 = time.perf_counter()
            ops.push_pull(payload, name=name, priority=priority).numpy()
            ends[path].append(time.perf_counter())
            best[path] = min(best[path], ends[path][-1] - t0)
    after = runtime.stats()
    sent = after["bytes_sent"] - before["bytes_sent"]
    cpu_per_byte = (after.get("io_cpu_s", 0.0) - before.get("io_cpu_s", 0.0)) / max(sent, 1)
    # Each path's round in lockstep: the time between the ends of its last PATH_TIMED_ROUNDS
    # rounds. A worker that starts a round late finds its peers' bytes already there and times a
    # round shorter than the link allows (a fastest round fit for fusion's rate, not for comparing
    # paths); the ends of consecutive rounds are one period apart on every worker, however late
    # each started.
    periods = [(ends[path][-1] - ends[path][-1 - PATH_TIMED_ROUNDS]) / PATH_TIMED_ROUNDS
               for path in paths] if choose_path else [math.nan, math.nan]
    rounds = [best[path] for path in paths] + [math.nan] * (2 - len(paths))
    gathered = ops.allgather(tf.constant([[cpu_per_byte] + rounds + periods], tf.float64),
                             name=f"{PROBE_NAME}/rates", priority=priority).numpy()
    slowest = np.max(gathered[:, 1:3], axis=0)
    slowest_period = np.max(gathered[:, 3:5], axis=0)
    two_level = None
    chosen = 0  # the column of the path taken: the only one, or the two-level one
    if choose_path:
        two_level = choose_two_level(float(slowest_period[0]), float(slowest_period[1]))
        chosen = 0 if two_level else 1
        runtime.set_two_level(two_level)
    measured = allreduce_rate(world_size, nbytes, rounds[chosen])
    agreed = allreduce_rate(world_size, nbytes, float(slowest[chosen]))
    lanes = costliest = None
    if size_lanes:
        costliest = float(np.max(gathered[:, 0]))
        lanes = lanes_for(link_Bps or agreed, costliest, connected)
        runtime.set_io_threads(lanes)
    return FusionLinkRate(source="probe", gbps=quantize_gbps(agreed * 8 / 1e9),
                          measured_gbps=measured * 8 / 1e9, agreed_gbps=agreed * 8 / 1e9,
                          probe_seconds=time.perf_counter() - start, io_threads=lanes,
                          cpu_ns_per_byte=None if costliest is None else costliest * 1e9,
                          two_level=two_level,
                          two_level_round_s=float(slowest_period[0]) if choose_path else None,
                          flat_round_s=float(slowest_period[1]) if choose_path else None)
