#include "ops/core/bandwidth.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace prophet {

BandwidthMonitor::BandwidthMonitor(const BandwidthOptions& options) : options_(options) {
  if (!(options_.ewma_alpha > 0 && options_.ewma_alpha <= 1)) options_.ewma_alpha = 0.3;
  if (options_.min_sample_busy_ns < 1) options_.min_sample_busy_ns = 1;
  if (options_.min_drain_busy_ns < 1) options_.min_drain_busy_ns = 1;
  if (options_.drain_time_constant_ns < 1) options_.drain_time_constant_ns = 1;
  if (options_.max_transfer_ns < 1) options_.max_transfer_ns = 1;
  if (options_.max_pending_samples < 1) options_.max_pending_samples = 1;
}

void BandwidthMonitor::OnDrained(uint64_t bytes, int64_t from_ns, int64_t to_ns) {
  if (to_ns < from_ns) std::swap(from_ns, to_ns);  // a clock glitch must not poison the estimate
  double counted = static_cast<double>(bytes);
  if (to_ns <= drain_measured_until_ns_) return;  // wholly inside a measured window
  if (from_ns < drain_measured_until_ns_) {
    // Only its part after the measured windows is new; its bytes count in proportion to time.
    counted *= static_cast<double>(to_ns - drain_measured_until_ns_) / static_cast<double>(to_ns - from_ns);
    from_ns = drain_measured_until_ns_;
  }
  if (from_ns == to_ns) {
    // Taken at one instant: part of the busy time around it, if there is any (else nothing says
    // how long the link took for them).
    if (!drain_runs_.empty() && drain_runs_.back().second >= from_ns && drain_runs_.back().first <= from_ns) {
      drain_bytes_ += counted;
    }
    return;
  }
  // Merge into the runs. Calls come in to_ns order, so only the last runs can overlap it.
  while (!drain_runs_.empty() && drain_runs_.back().second >= from_ns) {
    from_ns = std::min(from_ns, drain_runs_.back().first);
    to_ns = std::max(to_ns, drain_runs_.back().second);
    drain_busy_ns_ -= drain_runs_.back().second - drain_runs_.back().first;
    drain_runs_.pop_back();
  }
  drain_runs_.emplace_back(from_ns, to_ns);
  drain_busy_ns_ += to_ns - from_ns;
  drain_bytes_ += counted;
  if (drain_busy_ns_ < options_.min_drain_busy_ns) return;

  BandwidthSample sample;
  sample.drained = true;
  sample.ts_ns = to_ns;
  sample.busy_ns = drain_busy_ns_;
  sample.bytes = static_cast<uint64_t>(drain_bytes_ + 0.5);
  sample.sample_Bps = drain_bytes_ * 1e9 / static_cast<double>(drain_busy_ns_);
  if (drain_samples_ == 0) {
    drain_estimate_Bps_ = sample.sample_Bps;
  } else {
    const double weight = 1 - std::exp(-static_cast<double>(drain_busy_ns_) /
                                       static_cast<double>(options_.drain_time_constant_ns));
    drain_estimate_Bps_ += weight * (sample.sample_Bps - drain_estimate_Bps_);
  }
  sample.estimate_Bps = drain_estimate_Bps_;
  ++drain_samples_;
  drain_measured_until_ns_ = to_ns;
  drain_runs_.clear();
  drain_busy_ns_ = 0;
  drain_bytes_ = 0;
  Keep(sample);
  // Round trips no longer speak: drop what they held.
  pending_.clear();
}

void BandwidthMonitor::OnSocketWrite(uint64_t bytes, bool was_full, bool full, int64_t now_ns) {
  const bool saturated_before = full_sockets_ > 0;
  full_sockets_ = std::max(0, full_sockets_ + (full ? 1 : 0) - (was_full ? 1 : 0));
  if (saturated_before) {
    if (bytes > 0) {
      OnDrained(bytes, saturated_mark_ns_, now_ns);
      saturated_mark_ns_ = std::max(saturated_mark_ns_, now_ns);
    }
  } else if (full_sockets_ > 0) {
    saturated_mark_ns_ = now_ns;  // what this write took entered a socket with room: not a drain
  }
}

void BandwidthMonitor::OnTransfer(uint64_t bytes, int64_t start_ns, int64_t end_ns) {
  if (drain_samples_ > 0) return;  // the link's own rate is known
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
  intervals_.clear();
  for (const Transfer& t : pending_) {
    const int64_t end = std::min(t.end_ns, horizon_ns);
    if (end > t.start_ns) intervals_.emplace_back(t.start_ns, end);
  }
  std::sort(intervals_.begin(), intervals_.end());
  int64_t busy_ns = 0;
  int64_t last_busy_end_ns = 0;
  int64_t run_start = 0, run_end = 0;
  bool in_run = false;
  for (const auto& interval : intervals_) {
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
  still_pending_.clear();
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
    still_pending_.push_back(t);
  }
  pending_.swap(still_pending_);
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
  Keep(sample);
}

void BandwidthMonitor::Keep(const BandwidthSample& sample) {
  pending_samples_.push_back(sample);
  while (pending_samples_.size() > options_.max_pending_samples) pending_samples_.pop_front();
}

std::vector<BandwidthSample> BandwidthMonitor::TakeSamples() {
  std::vector<BandwidthSample> out(pending_samples_.begin(), pending_samples_.end());
  pending_samples_.clear();
  return out;
}

}  // namespace prophet
