#include "ops/core/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace prophet {

namespace {

std::string FormatBytes(double bytes) {
  char buffer[32];
  if (bytes >= 1e9) {
    std::snprintf(buffer, sizeof(buffer), "%.2fGB", bytes / 1e9);
  } else if (bytes >= 1e6) {
    std::snprintf(buffer, sizeof(buffer), "%.2fMB", bytes / 1e6);
  } else if (bytes >= 1e3) {
    std::snprintf(buffer, sizeof(buffer), "%.1fkB", bytes / 1e3);
  } else {
    std::snprintf(buffer, sizeof(buffer), "%.0fB", bytes);
  }
  return buffer;
}

// Relative change of `now` against `before`; a value that appears from 0 counts as a full change.
double RelativeChange(double before, double now) {
  if (before == 0) return now == 0 ? 0.0 : 1.0;
  return std::fabs(now - before) / std::fabs(before);
}

}  // namespace

int Plan::BlockOf(const std::string& name) const {
  auto it = block_of.find(name);
  return it == block_of.end() ? -1 : it->second;
}

std::string Plan::Summary() const {
  std::string out = std::to_string(stage_intervals_ns.size()) + " stages, " +
                    std::to_string(blocks.size()) + " blocks [";
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i > 0) out += ",";
    out += std::to_string(blocks[i].members.size()) + ":" +
           FormatBytes(static_cast<double>(blocks[i].bytes));
  }
  out += "], " + FormatBytes(bandwidth_Bps) + "/s";
  return out;
}

Plan MakePlan(const Profile& profile, double bandwidth_Bps) {
  Plan plan;
  plan.bandwidth_Bps = bandwidth_Bps;
  plan.profile_version = profile.version;
  for (const ProfileStage& stage : profile.stages) plan.stage_intervals_ns.push_back(stage.interval_ns);
  for (const ProfiledTensor& tensor : profile.tensors) plan.stage_of[tensor.name] = tensor.stage;
  if (profile.tensors.empty()) return plan;

  // The first layer: highest priority; among equals the one ready last (it ends the backward pass).
  int top = 0;
  for (size_t i = 1; i < profile.tensors.size(); ++i) {
    if (profile.tensors[i].priority >= profile.tensors[top].priority) top = static_cast<int>(i);
  }
  plan.top_tensor = profile.tensors[top].name;
  plan.top_priority = profile.tensors[top].priority;
  plan.top_stage = profile.tensors[top].stage;
  plan.top_ready_offset_ns = profile.tensors[top].ready_offset_ns;

  // Tensors ready by the current stage and not yet in a block, most urgent first. The profile is in
  // ready order, so stage k's members are appended as k advances.
  auto more_urgent = [&profile](int a, int b) {
    const ProfiledTensor& ta = profile.tensors[a];
    const ProfiledTensor& tb = profile.tensors[b];
    if (ta.priority != tb.priority) return ta.priority > tb.priority;
    if (ta.ready_offset_ns != tb.ready_offset_ns) return ta.ready_offset_ns < tb.ready_offset_ns;
    return ta.name < tb.name;
  };
  std::vector<int> candidates;
  for (int k = 0; k < plan.top_stage; ++k) {
    const ProfileStage& stage = profile.stages[k];
    candidates.insert(candidates.end(), stage.members.begin(), stage.members.end());
    std::sort(candidates.begin(), candidates.end(), more_urgent);
    if (candidates.empty()) continue;

    PlanBlock block;
    block.stage = k;
    block.start_offset_ns = stage.start_offset_ns;
    const double budget = std::max(0.0, bandwidth_Bps) * static_cast<double>(stage.interval_ns) / 1e9;
    block.budget_bytes = static_cast<uint64_t>(std::floor(budget));
    size_t taken = 0;
    while (taken < candidates.size()) {
      const ProfiledTensor& tensor = profile.tensors[candidates[taken]];
      if (taken > 0 && block.bytes + tensor.bytes > block.budget_bytes) break;
      block.bytes += tensor.bytes;
      block.members.push_back(tensor.name);
      plan.block_of[tensor.name] = static_cast<int>(plan.blocks.size());
      ++taken;
    }
    candidates.erase(candidates.begin(), candidates.begin() + taken);
    plan.blocks.push_back(std::move(block));
  }
  return plan;
}

std::string ReplanReason(const Plan& plan, const Profile& profile, double bandwidth_Bps,
                         double threshold) {
  char buffer[160];
  if (profile.stages.size() != plan.stage_intervals_ns.size()) {
    std::snprintf(buffer, sizeof(buffer), "stages %zu->%zu", plan.stage_intervals_ns.size(),
                  profile.stages.size());
    return buffer;
  }
  if (profile.tensors.size() != plan.stage_of.size()) return "tensors changed";
  for (const ProfiledTensor& tensor : profile.tensors) {
    auto it = plan.stage_of.find(tensor.name);
    if (it == plan.stage_of.end()) return "new tensor " + tensor.name;
    if (it->second != tensor.stage) return "tensor " + tensor.name + " changed stage";
  }
  const double bandwidth_change = RelativeChange(plan.bandwidth_Bps, bandwidth_Bps);
  if (bandwidth_change > threshold) {
    std::snprintf(buffer, sizeof(buffer), "bandwidth %s/s->%s/s (%+.0f%%)",
                  FormatBytes(plan.bandwidth_Bps).c_str(), FormatBytes(bandwidth_Bps).c_str(),
                  100.0 * bandwidth_change * (bandwidth_Bps < plan.bandwidth_Bps ? -1 : 1));
    return buffer;
  }
  for (size_t k = 0; k < profile.stages.size(); ++k) {
    const double before = static_cast<double>(plan.stage_intervals_ns[k]);
    const double now = static_cast<double>(profile.stages[k].interval_ns);
    if (RelativeChange(before, now) > threshold) {
      std::snprintf(buffer, sizeof(buffer), "stage %zu interval %.3fms->%.3fms", k, before / 1e6,
                    now / 1e6);
      return buffer;
    }
  }
  return "";
}

}  // namespace prophet
