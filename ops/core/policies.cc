#include "ops/core/policies.h"

#include <cstdio>

#include "ops/core/bytescheduler_policy.h"
#include "ops/core/common.h"
#include "ops/core/p3_policy.h"
#include "ops/core/profiler.h"
#include "ops/core/prophet_policy.h"

namespace prophet {

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
         ", \"planned_blocks\": " + std::to_string(policy.planned_blocks()) +
         ", \"stall_breaks\": " + std::to_string(policy.stall_breaks()) + ", \"profile\": ";
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
