#include "ops/core/scheduler.h"

#include <algorithm>
#include <cstdio>

#include "ops/core/bytescheduler_policy.h"
#include "ops/core/common.h"
#include "ops/core/p3_policy.h"
#include "ops/core/profiler.h"
#include "ops/core/prophet_policy.h"

namespace prophet {

void PriorityTaskQueue::Push(const SendTask& task) {
  heap_.push_back(task);
  std::push_heap(heap_.begin(), heap_.end(), LessUrgent);
}

SendTask PriorityTaskQueue::Pop() {
  std::pop_heap(heap_.begin(), heap_.end(), LessUrgent);
  SendTask task = std::move(heap_.back());
  heap_.pop_back();
  return task;
}

void PriorityTaskQueue::MoveAllTo(PriorityTaskQueue* other) {
  for (const SendTask& task : heap_) other->Push(task);
  heap_.clear();
}

SendTask FifoTaskQueue::Pop() {
  SendTask task = std::move(queue_.front());
  queue_.pop_front();
  return task;
}

void FifoPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  CreditWindow(credit_bytes).Release(&queue_, out);
}

void PriorityPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  CreditWindow(credit_bytes).Release(&queue_, out);
}

std::unique_ptr<SchedulerPolicy> MakePolicy(const SchedulerOptions& options, std::string* error) {
  if (options.policy == "fifo") return std::make_unique<FifoPolicy>();
  if (options.policy == "priority") return std::make_unique<PriorityPolicy>();
  if (options.policy == "prophet") return MakeProphetPolicy(options);
  if (options.policy == "bytescheduler") return std::make_unique<ByteSchedulerPolicy>(options.credit_bytes);
  if (options.policy == "p3") return std::make_unique<P3Policy>();
  std::string names;
  for (const char* name : kScheduleNames) names += std::string(names.empty() ? "" : ", ") + name;
  *error = "unknown schedule '" + options.policy + "': expected one of " + names;
  return nullptr;
}

std::string PolicyStateJson(const SchedulerPolicy& policy) {
  char number[64];
  std::string out = "{\"schedule\": ";
  AppendJsonString(policy.name(), &out);
  std::snprintf(number, sizeof(number), ", \"bandwidth_Bps\": %.17g", policy.bandwidth()->estimate_Bps());
  out += number;
  out += ", \"bandwidth_samples\": " + std::to_string(policy.bandwidth()->samples_taken()) +
         ", \"bandwidth_drained\": " + (policy.bandwidth()->drained() ? "true" : "false") +
         ", \"planned_blocks\": " + std::to_string(policy.planned_blocks()) + ", \"profile\": ";
  const ReadyTimeProfiler* profiler = policy.ready_time_profiler();
  if (profiler == nullptr || !profiler->has_profile()) return out + "null}";
  const Profile& profile = profiler->profile();
  out += "{\"steps_observed\": " + std::to_string(profile.steps_observed) +
         ", \"step_origin_ns\": " + std::to_string(profiler->step_origin_ns()) + ", \"tensors\": [";
  for (size_t i = 0; i < profile.tensors.size(); ++i) {
    const ProfiledTensor& t = profile.tensors[i];
    out += i ? ", {\"name\": " : "{\"name\": ";
    AppendJsonString(t.name, &out);
    out += ", \"priority\": " + std::to_string(t.priority) + ", \"bytes\": " + std::to_string(t.bytes) +
           ", \"ready_offset_ns\": " + std::to_string(t.ready_offset_ns) + "}";
  }
  return out + "]}}";
}

}  // namespace prophet
