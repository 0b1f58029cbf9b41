// Shared by the policies' tests: one Dequeue call as the engine makes it.
#ifndef PROPHET_OPS_CORE_POLICY_TESTING_H_
#define PROPHET_OPS_CORE_POLICY_TESTING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/scheduler.h"

namespace prophet {
namespace testing {

constexpr uint64_t kNoEngineLimit = ~uint64_t{0};

// A push of partition `partition` of `name` (round 0, request 7) to `peer`.
inline SendTask MakeTask(const std::string& name, int partition, int peer, int64_t priority, uint64_t bytes,
                         uint64_t enqueue_seq) {
  SendTask t;
  t.name = name;
  t.request_id = 7;
  t.partition = partition;
  t.peer = peer;
  t.priority = priority;
  t.bytes = bytes;
  t.enqueue_seq = enqueue_seq;
  return t;
}

// What `policy` releases in one Dequeue with the engine's credit `engine_credit` at `now_ns`.
inline std::vector<SendTask> ReleaseOnce(SchedulerPolicy& policy, uint64_t engine_credit = kNoEngineLimit,
                                         int64_t now_ns = 0) {
  std::vector<SendTask> out;
  policy.Dequeue(engine_credit, now_ns, &out);
  return out;
}

}  // namespace testing
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_POLICY_TESTING_H_
