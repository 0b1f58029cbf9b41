#include "ops/core/bytescheduler_policy.h"

#include <algorithm>
#include <cstdio>

namespace prophet {

ByteSchedulerPolicy::ByteSchedulerPolicy(uint64_t credit_bytes, const BandwidthOptions& bandwidth)
    : SchedulerPolicy(bandwidth), credit_(credit_bytes > 0 ? credit_bytes : kByteSchedulerCreditBytes) {}

void ByteSchedulerPolicy::Enqueue(const SendTask& task) {
  (task.priority >= kControlPriority ? control_ : queue_).Push(task);
}

void ByteSchedulerPolicy::Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) {
  CreditWindow window(credit_bytes);
  if (!window.Release(&control_, out)) return;
  // The engine's credit counts what this call released before (the control tasks, too).
  uint64_t released = 0;
  for (const SendTask& t : *out) released += t.bytes;
  const auto release_top = [&](PriorityTaskQueue* queue) {
    const uint64_t bytes = queue->top().bytes;
    if (credit_bytes == 0 || (released > 0 && released + bytes > credit_bytes)) return false;
    SendTask task = queue->Pop();
    released += bytes;
    in_flight_ += bytes;
    flying_[std::make_tuple(task.name, task.round, task.partition)] = Flying{bytes, task.request_id};
    out->push_back(std::move(task));
    last_progress_ns_ = now_ns;
    return true;
  };
  // What a stall break opened goes first, past this policy's credit, as fast as the engine's
  // credit lets it: over as many calls as that takes, so that a break releases all of them even
  // where the engine's credit is smaller than the window (one at a time, each break waiting
  // StallBreakNs() again, a large window would take longer than any timeout).
  while (!broken_.empty()) {
    if (!release_top(&broken_)) return;
  }
  while (!queue_.empty() && in_flight_ < credit_) {
    if (!release_top(&queue_)) return;
  }
  if (!Blocked()) return;
  if (last_progress_ns_ < 0) last_progress_ns_ = now_ns;  // the wait starts now
  if (now_ns - last_progress_ns_ < StallBreakNs()) return;
  // Taken for a deadlock: every queued partition goes, most urgent first, without the credit
  // (the engine's still applies); the credit holds again for what is enqueued later.
  ++stall_breaks_;
  for (auto& entry : flying_) entry.second.waited_through_break = true;
  queue_.MoveAllTo(&broken_);
  while (!broken_.empty() && release_top(&broken_)) {
  }
}

int64_t ByteSchedulerPolicy::StallBreakNs() const {
  // A sum needs its partition pushed and sent back over links that carry the whole window: until
  // the link's rate is known, no wait is long enough to tell.
  const double rate_Bps = bandwidth()->estimate_Bps();
  if (recent_waits_ns_.empty() || !bandwidth()->has_estimate() || !(rate_Bps > 0)) return kFirstStallBreakNs;
  const int64_t longest = *std::max_element(recent_waits_ns_.begin(), recent_waits_ns_.end());
  const auto on_link = static_cast<int64_t>(kStallBreakLinkFactor * static_cast<double>(in_flight_) / rate_Bps * 1e9);
  // At most kFirstStallBreakNs: a rate measured through a window this small (its pushes wait on
  // the sums) can be far below the link's, and a break it delays past the operations' timeout
  // fails the step instead of opening the window.
  return std::min(kFirstStallBreakNs, std::max({kMinStallBreakNs, kStallBreakFactor * longest, on_link}));
}

int64_t ByteSchedulerPolicy::NextWakeupNs() const {
  if (!broken_.empty() || !Blocked() || last_progress_ns_ < 0) return -1;
  return last_progress_ns_ + StallBreakNs();
}

void ByteSchedulerPolicy::OnTransferDone(const TransferDone& d) {
  SchedulerPolicy::OnTransferDone(d);
  if (d.exchange) return;  // exchanges never pass the queue
  auto it = flying_.find(std::make_tuple(d.task.name, d.task.round, d.task.partition));
  if (it == flying_.end()) return;  // released by a policy this one replaced
  in_flight_ -= it->second.bytes;
  const bool waited_through_break = it->second.waited_through_break;
  flying_.erase(it);
  last_progress_ns_ = std::max(last_progress_ns_, d.done_ns);
  if (waited_through_break) return;
  const int64_t wait = std::max<int64_t>(0, d.done_ns - d.sent_ns);
  if (recent_waits_ns_.size() < kStallBreakSamples) {
    recent_waits_ns_.push_back(wait);
  } else {
    recent_waits_ns_[next_wait_] = wait;
    next_wait_ = (next_wait_ + 1) % kStallBreakSamples;
  }
}

void ByteSchedulerPolicy::OnOperationEnded(uint64_t request_id) {
  for (auto it = flying_.begin(); it != flying_.end();) {
    if (it->second.request_id != request_id) {
      ++it;
      continue;
    }
    in_flight_ -= it->second.bytes;
    it = flying_.erase(it);
  }
}

std::string ByteSchedulerPolicy::Describe() const {
  char buffer[200];
  std::snprintf(buffer, sizeof(buffer),
                "bytescheduler: %zu partitions (%.2f MB) waiting for their sums, credit %.2f MB, %llu stall breaks",
                flying_.size(), static_cast<double>(in_flight_) / 1e6, static_cast<double>(credit_) / 1e6,
                static_cast<unsigned long long>(stall_breaks_));
  return buffer;
}

}  // namespace prophet
