#include "ops/core/bandwidth.h"

#include <algorithm>
#include <utility>

namespace prophet {

BandwidthMonitor::BandwidthMonitor(const BandwidthOptions& options) : options_(options) {
  if (!(options_.ewma_alpha > 0 && options_.ewma_alpha <= 1)) options_.ewma_alpha = 0.3;
  if (options_.min_sample_busy_ns < 1) options_.min_sample_busy_ns = 1;
  if (options_.max_transfer_ns < 1) options_.max_transfer_ns = 1;
  if (options_.max_pending_samples < 1) options_.max_pending_samples = 1;
}

void BandwidthMonitor::OnTransfer(uint64_t bytes, int64_t start_ns, int64_t end_ns) {
  if (end_ns < start_ns) std::swap(start_ns, end_ns);  // a clock glitch must not poison the estimate
  double counted_bytes = static_cast<double>(bytes);
  if (end_ns - start_ns > options_.max_transfer_ns) {
    // A round trip that waited for the peer: only its last part is a link measurement.
    counted_bytes *= static_cast<double>(options_.max_transfer_ns) / static_cast<double>(end_ns - start_ns);
    start_ns = end_ns - options_.max_transfer_ns;
  }
  if (end_ns <= measured_until_ns_) return;  // a straggler wholly inside a measured window
  Transfer transfer{start_ns, end_ns, counted_bytes, end_ns - start_ns};
  if (start_ns < measured_until_ns_) {
    // Only its part after the measured windows is new; its bytes count in proportion to time.
    transfer.bytes *= static_cast<double>(end_ns - measured_until_ns_) /
                      static_cast<double>(end_ns - start_ns);
    transfer.start_ns = measured_until_ns_;
  }
  pending_.push_back(transfer);
  latest_end_ns_ = std::max(latest_end_ns_, end_ns);
  MaybeTakeSample();
}

void BandwidthMonitor::MaybeTakeSample() {
  int64_t settle_ns = 0;
  for (const Transfer& t : pending_) settle_ns = std::max(settle_ns, t.duration_ns);
  // Transfers still in flight started after this horizon (if they last no longer than the longest
  // seen), so the time before it is complete.
  const int64_t horizon_ns = latest_end_ns_ - settle_ns;
  if (horizon_ns <= measured_until_ns_) return;

  // Busy time before the horizon: union of the pending transfers' intervals, clipped.
  std::vector<std::pair<int64_t, int64_t>> intervals;
  for (const Transfer& t : pending_) {
    const int64_t end = std::min(t.end_ns, horizon_ns);
    if (end > t.start_ns) intervals.emplace_back(t.start_ns, end);
  }
  std::sort(intervals.begin(), intervals.end());
  int64_t busy_ns = 0;
  int64_t last_busy_end_ns = 0;
  int64_t run_start = 0, run_end = 0;
  bool in_run = false;
  for (const auto& interval : intervals) {
    if (in_run && interval.first <= run_end) {
      run_end = std::max(run_end, interval.second);
      continue;
    }
    if (in_run) busy_ns += run_end - run_start;
    run_start = interval.first;
    run_end = interval.second;
    in_run = true;
  }
  if (in_run) {
    busy_ns += run_end - run_start;
    last_busy_end_ns = run_end;
  }
  if (busy_ns < options_.min_sample_busy_ns) return;  // keep accumulating (idle time is free)

  // Bytes before the horizon (each transfer's bytes spread over its duration); what lies after the
  // horizon stays pending for the next window.
  double window_bytes = 0;
  std::vector<Transfer> still_pending;
  for (Transfer& t : pending_) {
    if (t.end_ns <= horizon_ns) {
      window_bytes += t.bytes;
      continue;
    }
    if (t.start_ns < horizon_ns) {
      const double after = static_cast<double>(t.end_ns - horizon_ns) /
                           static_cast<double>(t.end_ns - t.start_ns);
      window_bytes += t.bytes * (1 - after);
      t.bytes *= after;
      t.start_ns = horizon_ns;
    }
    still_pending.push_back(t);
  }
  pending_.swap(still_pending);
  measured_until_ns_ = horizon_ns;

  BandwidthSample sample;
  sample.ts_ns = last_busy_end_ns;
  sample.busy_ns = busy_ns;
  sample.bytes = static_cast<uint64_t>(window_bytes + 0.5);
  sample.sample_Bps = window_bytes * 1e9 / static_cast<double>(busy_ns);
  estimate_Bps_ = samples_taken_ == 0 ? sample.sample_Bps
                                      : options_.ewma_alpha * sample.sample_Bps +
                                            (1 - options_.ewma_alpha) * estimate_Bps_;
  sample.estimate_Bps = estimate_Bps_;
  ++samples_taken_;
  pending_samples_.push_back(sample);
  while (pending_samples_.size() > options_.max_pending_samples) pending_samples_.pop_front();
}

std::vector<BandwidthSample> BandwidthMonitor::TakeSamples() {
  std::vector<BandwidthSample> out(pending_samples_.begin(), pending_samples_.end());
  pending_samples_.clear();
  return out;
}

}  // namespace prophet
