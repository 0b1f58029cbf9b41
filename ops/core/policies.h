// The scheduling policies by name, and their state as JSON. Kept apart from the base class
// (scheduler.h) so that the base knows none of its subclasses; the engine and the simulator, which
// choose a policy by name, include this.
#ifndef PROPHET_OPS_CORE_POLICIES_H_
#define PROPHET_OPS_CORE_POLICIES_H_

#include <memory>
#include <string>

#include "ops/core/scheduler.h"

namespace prophet {

// Returns nullptr and sets *error for an unknown policy name.
std::unique_ptr<SchedulerPolicy> MakePolicy(const SchedulerOptions& options, std::string* error);

// The policy's state for the Python package (ProphetStrategy(schedule="auto") decides from it):
// {"schedule": ..., "bandwidth_Bps": ..., "bandwidth_samples": ..., "bandwidth_drained": true when
//  the estimate is the link's rate from full sockets (bandwidth.h), "planned_blocks": ..., "profile": null or
//  {"steps_observed": ..., "step_origin_ns": ..., "tensors": [{"name", "priority", "bytes",
//  "ready_offset_ns"}, ...]}}. step_origin_ns is the open step's first gradient (-1: none).
std::string PolicyStateJson(const SchedulerPolicy& policy);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_POLICIES_H_
