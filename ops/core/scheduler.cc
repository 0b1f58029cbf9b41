#include "ops/core/scheduler.h"

#include <algorithm>

#include "ops/core/prophet_policy.h"

namespace prophet {

void FifoPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  // Always release at least one task when any credit is left, so that a partition larger than the
  // whole credit still moves.
  uint64_t used = 0;
  while (!queue_.empty() && credit_bytes > 0 && (used == 0 || used + queue_.front().bytes <= credit_bytes)) {
    used += queue_.front().bytes;
    out->push_back(queue_.front());
    queue_.pop_front();
  }
}

void PriorityPolicy::Enqueue(const SendTask& task) {
  heap_.push_back(task);
  std::push_heap(heap_.begin(), heap_.end(), LessUrgent);
}

void PriorityPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  uint64_t used = 0;
  while (!heap_.empty() && credit_bytes > 0 && (used == 0 || used + heap_.front().bytes <= credit_bytes)) {
    std::pop_heap(heap_.begin(), heap_.end(), LessUrgent);
    used += heap_.back().bytes;
    out->push_back(heap_.back());
    heap_.pop_back();
  }
}

std::unique_ptr<SchedulerPolicy> MakePolicy(const SchedulerOptions& options, std::string* error) {
  if (options.policy == "fifo") return std::make_unique<FifoPolicy>();
  if (options.policy == "priority") return std::make_unique<PriorityPolicy>();
  if (options.policy == "prophet") return MakeProphetPolicy(options);
  *error = "unknown schedule '" + options.policy + "': expected one of fifo, priority, prophet";
  return nullptr;
}

}  // namespace prophet
