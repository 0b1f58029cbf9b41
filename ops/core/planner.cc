#include "ops/core/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <utility>

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

// The first layer: highest priority; among equals the one ready last (it ends the backward pass).
// -1 for an empty profile.
int FirstLayer(const Profile& profile) {
  if (profile.tensors.empty()) return -1;
  int top = 0;
  for (size_t i = 1; i < profile.tensors.size(); ++i) {
    if (profile.tensors[i].priority >= profile.tensors[top].priority) top = static_cast<int>(i);
  }
  return top;
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

  const int top = FirstLayer(profile);
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
    // The most urgent candidates bigger than the whole budget are held for the credit phase (see
    // planner.h): as a block of their own they would hold the link for longer than the stage,
    // and no more urgent gradient may overtake a block.
    size_t held = 0;
    while (held < candidates.size() && profile.tensors[candidates[held]].bytes > block.budget_bytes) {
      ++held;
    }
    size_t taken = held;
    while (taken < candidates.size()) {
      const ProfiledTensor& tensor = profile.tensors[candidates[taken]];
      if (block.bytes + tensor.bytes > block.budget_bytes) break;
      block.bytes += tensor.bytes;
      block.members.push_back(tensor.name);
      plan.block_of[tensor.name] = static_cast<int>(plan.blocks.size());
      ++taken;
    }
    candidates.erase(candidates.begin(), candidates.begin() + taken);
    if (!block.members.empty()) plan.blocks.push_back(std::move(block));
  }
  return plan;
}

StepForecast ForecastStep(const Plan& plan, const Profile& profile, double bandwidth_Bps) {
  StepForecast forecast;
  const std::vector<ProfiledTensor>& tensors = profile.tensors;
  const size_t n = tensors.size();
  if (n == 0) return forecast;
  const double ns_per_byte = bandwidth_Bps > 0 ? 1e9 / bandwidth_Bps : 0.0;
  const int first_layer = FirstLayer(profile);

  std::vector<int> block_of(n);
  for (size_t i = 0; i < n; ++i) block_of[i] = plan.BlockOf(tensors[i].name);
  // The credit phase starts when the plan's first layer, or anything more urgent, is ready
  // (without blocks the policy sends in priority order from the start).
  const bool blocks = !plan.blocks.empty();
  double credit_start = static_cast<double>(plan.top_ready_offset_ns);
  bool credit_trigger_seen = false;
  for (const ProfiledTensor& tensor : tensors) {
    if (tensor.name != plan.top_tensor && tensor.priority <= plan.top_priority) continue;
    const double offset = static_cast<double>(tensor.ready_offset_ns);
    credit_start = credit_trigger_seen ? std::min(credit_start, offset) : offset;
    credit_trigger_seen = true;
  }

  // Ready order (a profile is in ready order; sorted again for hand-made ones).
  std::vector<int> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&tensors](int a, int b) {
    return tensors[a].ready_offset_ns < tensors[b].ready_offset_ns;
  });
  // Ready tensors not sent yet, most urgent first (ties: profile order). O(n log n): the engine
  // thread runs this at a step start.
  using Urgency = std::pair<int64_t, int>;  // (-priority, index)
  auto urgency = [&tensors](int i) { return Urgency(-tensors[i].priority, i); };
  std::set<Urgency> sendable;  // credit phase: all; before: members of the open and earlier blocks
  std::map<int, std::set<Urgency>> later_blocks;  // before the credit phase, by block
  std::vector<int> held;  // before the credit phase: tensors in no block
  bool credit = !blocks;
  int open_block = 0;
  size_t next = 0;
  size_t left = n;
  double now = 0;
  while (left > 0) {
    if (!credit && now >= credit_start) {
      credit = true;
      for (const auto& entry : later_blocks) sendable.insert(entry.second.begin(), entry.second.end());
      later_blocks.clear();
      for (int i : held) sendable.insert(urgency(i));
      held.clear();
    }
    for (; next < n && static_cast<double>(tensors[order[next]].ready_offset_ns) <= now; ++next) {
      const int i = order[next];
      if (credit || (block_of[i] >= 0 && block_of[i] <= open_block)) {
        sendable.insert(urgency(i));  // a late member joins the open block
      } else if (block_of[i] < 0) {
        held.push_back(i);
      } else {
        later_blocks[block_of[i]].insert(urgency(i));
      }
    }
    if (sendable.empty() && !later_blocks.empty()) {
      // Nothing of the open block is ready: the link goes to the next block with ready data.
      auto first = later_blocks.begin();
      open_block = first->first;
      sendable.swap(first->second);
      later_blocks.erase(first);
    }
    if (sendable.empty() && !held.empty()) {
      // Nothing planned is ready: the link takes the most urgent held tensor rather than idle.
      auto most_urgent = std::min_element(held.begin(), held.end(),
                                          [&](int a, int b) { return urgency(a) < urgency(b); });
      sendable.insert(urgency(*most_urgent));
      held.erase(most_urgent);
    }
    if (sendable.empty()) {
      double next_event = next < n ? static_cast<double>(tensors[order[next]].ready_offset_ns) : -1;
      if (!credit && (next_event < 0 || credit_start < next_event)) next_event = credit_start;
      if (!(next_event > now)) break;  // cannot happen; never loop forever
      now = next_event;
      continue;
    }
    const int best = sendable.begin()->second;
    sendable.erase(sendable.begin());
    now += static_cast<double>(tensors[best].bytes) * ns_per_byte;
    --left;
    if (best == first_layer) forecast.first_layer_sent_ns = static_cast<int64_t>(now);
    forecast.all_sent_ns = static_cast<int64_t>(now);
  }
  return forecast;
}

int BandwidthMoved(const Plan& plan, double bandwidth_Bps, double threshold) {
  if (RelativeChange(plan.bandwidth_Bps, bandwidth_Bps) <= threshold) return 0;
  return bandwidth_Bps < plan.bandwidth_Bps ? -1 : 1;
}

std::string ReplanReason(const Plan& plan, const Profile& profile, double bandwidth_Bps,
                         double threshold) {
  char buffer[240];
  if (profile.tensors.size() != plan.stage_of.size()) return "tensors changed";
  for (const ProfiledTensor& tensor : profile.tensors) {
    if (plan.stage_of.count(tensor.name) == 0) return "new tensor " + tensor.name;
  }
  if (BandwidthMoved(plan, bandwidth_Bps, threshold) != 0) {
    const double bandwidth_change = RelativeChange(plan.bandwidth_Bps, bandwidth_Bps);
    std::snprintf(buffer, sizeof(buffer), "bandwidth %s/s->%s/s (%+.0f%%)",
                  FormatBytes(plan.bandwidth_Bps).c_str(), FormatBytes(bandwidth_Bps).c_str(),
                  100.0 * bandwidth_change * (bandwidth_Bps < plan.bandwidth_Bps ? -1 : 1));
    return buffer;
  }

  std::string moved;
  if (profile.stages.size() != plan.stage_intervals_ns.size()) {
    std::snprintf(buffer, sizeof(buffer), "stages %zu->%zu", plan.stage_intervals_ns.size(),
                  profile.stages.size());
    moved = buffer;
  }
  for (size_t i = 0; moved.empty() && i < profile.tensors.size(); ++i) {
    if (plan.stage_of.at(profile.tensors[i].name) != profile.tensors[i].stage) {
      moved = "tensor " + profile.tensors[i].name + " changed stage";
    }
  }
  for (size_t k = 0; moved.empty() && k < profile.stages.size(); ++k) {
    const double before = static_cast<double>(plan.stage_intervals_ns[k]);
    const double now = static_cast<double>(profile.stages[k].interval_ns);
    if (RelativeChange(before, now) > threshold) {
      std::snprintf(buffer, sizeof(buffer), "stage %zu interval %.3fms->%.3fms", k, before / 1e6,
                    now / 1e6);
      moved = buffer;
    }
  }
  if (moved.empty()) return "";

  // The ready times moved: keep the plan unless a new one is expected to send clearly faster.
  const StepForecast kept = ForecastStep(plan, profile, bandwidth_Bps);
  const StepForecast renewed = ForecastStep(MakePlan(profile, bandwidth_Bps), profile,
                                            bandwidth_Bps);
  const int64_t loss = std::max(kept.first_layer_sent_ns - renewed.first_layer_sent_ns,
                                kept.all_sent_ns - renewed.all_sent_ns);
  if (static_cast<double>(loss) <= kMinForecastGain * static_cast<double>(renewed.all_sent_ns)) {
    return "";
  }
  std::snprintf(buffer, sizeof(buffer),
                "%s: first layer out at %.1fms, all at %.1fms (new plan: %.1fms, %.1fms)",
                moved.c_str(), kept.first_layer_sent_ns / 1e6, kept.all_sent_ns / 1e6,
                renewed.first_layer_sent_ns / 1e6, renewed.all_sent_ns / 1e6);
  return buffer;
}

}  // namespace prophet
