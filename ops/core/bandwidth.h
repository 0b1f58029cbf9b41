// Goodput estimate of this worker's link, from the transfers the engine completed.
//
// The scheduler needs "how many bytes can I push per second while I am pushing", not "bytes per
// second of wall time": between steps (forward pass, data loading) the link idles, and dividing by
// wall time would make a fast link look slow exactly when the compute is slow. So only busy time
// counts: transfers are merged into busy intervals (overlapping transfers count once: with several
// partitions in flight each one lasts longer, but the link is busy once), idle gaps are dropped.
//
// Bytes are spread evenly over each transfer's duration (fluid model), and time is measured in
// windows that close once they hold min_sample_busy_ns of busy time. Transfers are reported when
// they complete, so a window [a, h) is only measured when every transfer that may still overlap it
// has been reported: h lags the latest completion by the longest transfer duration seen. A window's
// rate is (bytes falling inside it) / (busy time inside it); windows are smoothed with an EWMA so
// one slow partition does not swing the plan.
//
// A transfer is a push's round trip, so it also lasts while the owner has not reached that tensor
// yet: in the first training step (tracing: workers tens of seconds apart), or while a peer stalls
// or saves a checkpoint. Such a round trip says nothing about the link, and taken whole it held
// the windows back by its duration and then filled them with its idle time (measured: the
// estimate stayed at 1.5 MB/s on a 246 MB/s link for the first 14 steps of a ResNet50 run). So
// only the last max_transfer_ns of a transfer count, with its bytes in proportion (for a link so
// slow that a partition legitimately takes longer, this is the same rate).
#ifndef PROPHET_OPS_CORE_BANDWIDTH_H_
#define PROPHET_OPS_CORE_BANDWIDTH_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <vector>

namespace prophet {

struct BandwidthOptions {
  // Weight of a new sample in the smoothed estimate (1 = no smoothing).
  double ewma_alpha = 0.3;
  // Busy time a sample must cover: shorter windows are dominated by per-message latency.
  int64_t min_sample_busy_ns = 2'000'000;
  // Only the last this-many nanoseconds of a transfer count (see above); it also bounds how far
  // the windows lag behind the latest completion.
  int64_t max_transfer_ns = 1'000'000'000;
  // Samples kept for TakeSamples() when nobody drains them (oldest dropped first).
  size_t max_pending_samples = 4096;
};

// One measurement window, for logs and the timeline's bandwidth counter.
struct BandwidthSample {
  int64_t ts_ns = 0;          // end of the window's last busy interval
  double sample_Bps = 0;      // bytes / busy seconds of this window
  double estimate_Bps = 0;    // smoothed estimate after this sample
  int64_t busy_ns = 0;        // busy time the window covered (idle gaps excluded)
  uint64_t bytes = 0;         // bytes attributed to the window
};

class BandwidthMonitor {
 public:
  explicit BandwidthMonitor(const BandwidthOptions& options = BandwidthOptions());

  // A transfer of `bytes` that occupied the link from start_ns to end_ns. Transfers may be
  // reported out of start order (they are reported at completion) and may overlap.
  void OnTransfer(uint64_t bytes, int64_t start_ns, int64_t end_ns);

  bool has_estimate() const { return samples_taken_ > 0; }
  // Smoothed goodput in bytes per second; 0 before the first sample.
  double estimate_Bps() const { return estimate_Bps_; }
  uint64_t samples_taken() const { return samples_taken_; }

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

  BandwidthOptions options_;
  std::vector<Transfer> pending_;  // transfers that end after measured_until_ns_
  int64_t measured_until_ns_ = std::numeric_limits<int64_t>::min();  // end of the last window
  int64_t latest_end_ns_ = std::numeric_limits<int64_t>::min();
  double estimate_Bps_ = 0;
  uint64_t samples_taken_ = 0;
  std::deque<BandwidthSample> pending_samples_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_BANDWIDTH_H_
