// This worker's link rate, as the engine sees it: the one estimate the Prophet planner, the
// timeline's bandwidth counter and schedule="auto" read.
//
// Two measurements, the first preferred:
//
// 1. Drains (OnSocketWrite, OnDrained): while at least one of this worker's sockets is full (a
//    write was short and frames stay queued, Connection::Flush), the link is saturated: it sends
//    as fast as it can, and a full socket takes bytes exactly as fast as the link delivers them.
//    So the bytes the sockets take while saturated (every socket's: one with room takes bytes at
//    once, which then leave at the link's pace beside the full ones), over the time saturated, is
//    the link's payload rate, whatever the latency, the peers' waits or the size of each frame.
//    Idle time, compute and a late peer are never in it: no socket is full then. The simulator
//    reports what its NIC sent while saturated (LinkModel, LinkEvent::kDrained), the same rate.
//    Reports are merged into busy intervals, and time is measured in windows that close once they
//    hold min_drain_busy_ns of saturated time; each window's rate moves the estimate by a weight
//    that grows with the window's time (drain_time_constant_ns), so a short window moves it little.
//    This measures the link only when the engine offers it more than the sockets hold (a
//    saturated link: when scheduling matters); a link that never fills (kernel buffers bigger than
//    what a step sends to each peer: N = 8 at 10 Gbit/s in the simulator) keeps the last drained
//    rate, or has none (then 2. speaks).
//
// 2. Round trips (OnTransfer), until the first drain: a push from its release to its sum's arrival
//    (or an exchange stage, small_allreduce.h). It is a goodput, not the link's rate: it also lasts
//    while the owner waits for other workers (their compute, their queues), and each round trip
//    of a small message is mostly latency. It is kept because a worker whose link never fills
//    (a small model, a worker that owns every partition) still needs some estimate.
//    For it, transfers are merged into busy intervals (overlapping transfers count once: with
//    several partitions in flight each one lasts longer, but the link is busy once), idle gaps are
//    dropped. Bytes are spread evenly over each transfer's duration (fluid model), and time is
//    measured in windows that close once they hold min_sample_busy_ns of busy time. Transfers are
//    reported when they complete, so a window [a, h) is only measured when every transfer that may
//    still overlap it has been reported: h lags the latest completion by the longest transfer
//    duration seen. A window's rate is (bytes falling inside it) / (busy time inside it); windows
//    are smoothed with an EWMA so one slow partition does not swing the plan.
//    A round trip also lasts while the owner has not reached that tensor yet: in the first
//    training step (tracing: workers tens of seconds apart), or while a peer stalls or saves a
//    checkpoint. Taken whole it held the windows back by its duration and then filled them with
//    its idle time (measured: the estimate stayed at 1.5 MB/s on a 246 MB/s link for the first 14
//    steps of a ResNet50 run). So only the last max_transfer_ns of a transfer count, with its
//    bytes in proportion (for a link so slow that a partition legitimately takes longer, this is
//    the same rate).
//
// Why drains replaced round trips as the estimate: with fusion's small buckets and the exchanged
// control collectives, round trips were dominated by latency and by peers' waits (the simulated
// ResNet50 run at N = 2 estimated 3.6-7.6 MB/s on a link that carried 165 MB/s), and they count
// only the pushes' bytes while the link also carries this worker's sums (VGG16: 115-164 MB/s on
// 234 MB/s, swinging from step to step).
//
// Cost: it runs on the engine's I/O thread for every write while a socket is full and every
// completed push, so nothing allocates once the internal vectors have grown; a drain is O(1)
// amortised; a round trip is O(round trips not yet measured), and round trips are ignored once
// the link has been drained.
#ifndef PROPHET_OPS_CORE_BANDWIDTH_H_
#define PROPHET_OPS_CORE_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <utility>
#include <vector>

namespace prophet {

struct BandwidthOptions {
  // Drains: full time a window must cover before it is a sample, and the time over which samples
  // are averaged (a window of t moves the estimate by 1 - exp(-t / drain_time_constant_ns) of the
  // way to its rate).
  int64_t min_drain_busy_ns = 5'000'000;
  int64_t drain_time_constant_ns = 50'000'000;
  // Round trips: weight of a new sample in the smoothed estimate (1 = no smoothing).
  double ewma_alpha = 0.3;
  // Round trips: busy time a sample must cover (shorter windows are dominated by per-message
  // latency).
  int64_t min_sample_busy_ns = 2'000'000;
  // Round trips: only the last this-many nanoseconds of a transfer count (see above); it also
  // bounds how far the windows lag behind the latest completion.
  int64_t max_transfer_ns = 1'000'000'000;
  // Samples kept for TakeSamples() when nobody drains them (oldest dropped first).
  size_t max_pending_samples = 4096;
};

// One measurement window, for logs and the timeline's bandwidth counter.
struct BandwidthSample {
  int64_t ts_ns = 0;          // end of the window's last busy interval
  double sample_Bps = 0;      // bytes / busy seconds of this window
  double estimate_Bps = 0;    // the estimate after this sample
  int64_t busy_ns = 0;        // busy time the window covered (idle gaps excluded)
  uint64_t bytes = 0;         // bytes attributed to the window
  bool drained = false;       // a drain window (else round trips)
};

class BandwidthMonitor {
 public:
  explicit BandwidthMonitor(const BandwidthOptions& options = BandwidthOptions());

  // The link sent `bytes` between from_ns and to_ns, saturated all along. Calls come in the order
  // of to_ns (they are made at to_ns); from_ns == to_ns adds bytes taken at that instant to the
  // busy time around it.
  void OnDrained(uint64_t bytes, int64_t from_ns, int64_t to_ns);
  // The engine's sockets (all of this worker's connections): a write of `bytes` at now_ns to a
  // socket that was full before it (`was_full`) and is full after it (`full`). While at least one
  // socket is full the link is saturated, and every byte any socket takes then is a drain from the
  // last such write (or the saturation's start) to now_ns: bytes that entered a socket with room
  // leave at the link's pace behind the full ones. Only calls while saturated, or with was_full or
  // full, matter (saturated() says whether a call is needed).
  void OnSocketWrite(uint64_t bytes, bool was_full, bool full, int64_t now_ns);
  bool saturated() const { return full_sockets_ > 0; }
  // A round trip of `bytes` from start_ns to end_ns. Transfers may be reported out of start order
  // (they are reported at completion) and may overlap. Ignored once the link has been drained.
  void OnTransfer(uint64_t bytes, int64_t start_ns, int64_t end_ns);

  bool has_estimate() const { return drain_samples_ > 0 || samples_taken_ > 0; }
  // The link's payload rate in bytes per second (drains), else the round trips' goodput; 0 before
  // the first sample.
  double estimate_Bps() const { return drain_samples_ > 0 ? drain_estimate_Bps_ : estimate_Bps_; }
  // Whether the estimate comes from drains (the link's rate), not round trips.
  bool drained() const { return drain_samples_ > 0; }
  uint64_t samples_taken() const { return samples_taken_ + drain_samples_; }

  // Drains the samples taken since the last call (oldest first).
  std::vector<BandwidthSample> TakeSamples();

 private:
  struct Transfer {
    int64_t start_ns;
    int64_t end_ns;
    double bytes;         // bytes of the part [start_ns, end_ns) not yet measured
    int64_t duration_ns;  // of the whole transfer (sets how long windows wait for stragglers)
  };
  void MaybeTakeSample();
  void Keep(const BandwidthSample& sample);

  BandwidthOptions options_;

  // OnSocketWrite: sockets full now, and the time of the last drain reported from them.
  int full_sockets_ = 0;
  int64_t saturated_mark_ns_ = 0;
  // Drains: the current window's merged full intervals (sorted, disjoint), their total, its bytes.
  std::vector<std::pair<int64_t, int64_t>> drain_runs_;
  int64_t drain_busy_ns_ = 0;
  double drain_bytes_ = 0;
  int64_t drain_measured_until_ns_ = std::numeric_limits<int64_t>::min();  // end of the last window
  double drain_estimate_Bps_ = 0;
  uint64_t drain_samples_ = 0;

  // Round trips.
  std::vector<Transfer> pending_;  // transfers that end after measured_until_ns_
  std::vector<Transfer> still_pending_;                // scratch of MaybeTakeSample
  std::vector<std::pair<int64_t, int64_t>> intervals_; // scratch of MaybeTakeSample
  int64_t measured_until_ns_ = std::numeric_limits<int64_t>::min();  // end of the last window
  int64_t latest_end_ns_ = std::numeric_limits<int64_t>::min();
  double estimate_Bps_ = 0;
  uint64_t samples_taken_ = 0;

  std::deque<BandwidthSample> pending_samples_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_BANDWIDTH_H_
