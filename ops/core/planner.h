// Prophet's block planner: a pure function from (profile, bandwidth) to an ordered list of blocks.
//
// Rule (Zhang et al., ICPP 2021, section "block assembly"), for any model:
//  - The "first layer" is the highest-priority tensor of the profile; the stage in which it becomes
//    ready is the credit stage. From the moment it is ready, everything left is sent under the byte
//    credit in priority order, so no block is planned for the credit stage or later.
//  - For every earlier stage k, budget_k = bandwidth x interval_k (the bytes the link can carry
//    before the next burst arrives). Block k takes the not-yet-planned tensors ready by stage k
//    (stages 0..k) in priority order (highest first), as long as they fit in budget_k; it stops at
//    the first tensor that does not fit, so a block never carries a lower-priority tensor in front
//    of a higher-priority one. The most urgent candidates that are bigger than the whole budget
//    join no block: a block is never preempted, so such a tensor as a block of its own would
//    hold the link for longer than the stage while the more urgent gradients of the next stages
//    wait (VGG16's 411 MB fc1 kernel, ready early in the backward pass, in a stage with nothing
//    more urgent: a block of 206 MB per worker at 2 workers, and prophet measured 4-6% behind
//    priority order); block k then goes on with the candidates after them. A stage with nothing
//    that fits gets no block.
//  - Tensors of earlier stages that fit in no block (including those bigger than a budget) are
//    left for the credit phase; the policy sends them earlier only when nothing planned is ready
//    (the link never idles while gradients wait), and a block whose data becomes ready overtakes
//    them at the granularity of the byte credit.
// Bytes are whatever the caller puts in ProfiledTensor::bytes; the policy uses the bytes this worker
// actually pushes, in the same unit as the measured bandwidth.
#ifndef PROPHET_OPS_CORE_PLANNER_H_
#define PROPHET_OPS_CORE_PLANNER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "ops/core/profiler.h"

namespace prophet {

struct PlanBlock {
  int stage = 0;                 // the stage whose interval sized it
  int64_t start_offset_ns = 0;   // the stage's start, from the step's origin
  uint64_t budget_bytes = 0;     // bandwidth x stage interval
  uint64_t bytes = 0;            // sum of members' bytes (never above the budget)
  std::vector<std::string> members;  // priority order, highest first
};

struct Plan {
  std::vector<PlanBlock> blocks;  // in sending order
  // The first layer: once it is ready, the credit phase begins.
  std::string top_tensor;
  int64_t top_priority = 0;
  int top_stage = -1;
  int64_t top_ready_offset_ns = 0;
  // Inputs the plan was made with, to decide when to re-plan.
  double bandwidth_Bps = 0;
  std::vector<int64_t> stage_intervals_ns;
  std::map<std::string, int> stage_of;  // tensor name -> stage
  std::map<std::string, int> block_of;  // tensor name -> block index (absent: credit phase)
  uint64_t profile_version = 0;

  // Block index of a tensor, or -1 when it is sent in the credit phase (or unknown).
  int BlockOf(const std::string& name) const;
  // One line: "3 stages, 2 blocks [1.0MB,2.5MB], 100.0 MB/s".
  std::string Summary() const;
};

Plan MakePlan(const Profile& profile, double bandwidth_Bps);

// What a step that follows `plan` is expected to look like on the link when its gradients become
// ready at `profile`'s offsets and the link carries `bandwidth_Bps`: one link sending one tensor
// after another under the policy's rules (blocks in order, each taking its members as they become
// ready, a later block's ready data going out rather than the link idling, tensors in no block
// held until the first layer is ready unless nothing planned is ready (then the most urgent of
// them goes rather than the link idling), then everything in priority order). Offsets from the
// step's origin.
struct StepForecast {
  int64_t first_layer_sent_ns = 0;  // the first layer's gradient is out: the next step can start
  int64_t all_sent_ns = 0;          // the last gradient is out
};
StepForecast ForecastStep(const Plan& plan, const Profile& profile, double bandwidth_Bps);

// A plan whose ready times moved is replaced only when a new plan is forecast to save more than
// this fraction of the new plan's time to send everything (see ReplanReason).
constexpr double kMinForecastGain = 0.05;

// +1 / -1 when `bandwidth_Bps` is above / below the plan's bandwidth by more than `threshold`
// (relative), else 0.
int BandwidthMoved(const Plan& plan, double bandwidth_Bps, double threshold);

// Why `plan` should be replaced for `profile` and `bandwidth_Bps`, or "" when it should be kept.
//  - Tensors appeared or left: always (the plan does not know them).
//  - The bandwidth moved by more than `threshold` (relative, e.g. 0.2) from the plan's: always,
//    so a real change of the link is followed at the next step.
//  - The stage structure or a stage interval moved (more than `threshold`): only when the plan
//    is forecast (ForecastStep) to deliver the first layer or the last gradient later than a plan
//    made for the new profile, by more than kMinForecastGain of the new plan's time to send
//    everything. Ready times jitter from step to step when the CPU delays the backward ops, and
//    stage boundaries move with them (a gap just above or below twice the mean gap); a plan made
//    for one jittered profile sends the next one as well as a fresh plan would, and re-planning
//    at every step only moves block boundaries around.
std::string ReplanReason(const Plan& plan, const Profile& profile, double bandwidth_Bps,
                         double threshold);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_PLANNER_H_
