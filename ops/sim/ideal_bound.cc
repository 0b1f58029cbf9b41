#include "ops/sim/ideal_bound.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "ops/core/scheduler.h"

namespace prophet {

namespace {

// One gradient (or control collective) on the pooled link: released `release_ns` after the
// backward pass's start, `work_ns` of link time, served in `key` order (smaller first).
struct Job {
  double release_ns;
  double work_ns;
  int key;
};

// Completion of every key's jobs on one fluid server that serves the smallest key with work
// left, preemptively (-1 for a key without jobs). Each key completes when its last job's work is
// done and no job of that key is still to be released.
std::vector<double> PriorityCompletion(std::vector<Job> jobs, int keys) {
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.release_ns < b.release_ns; });
  std::vector<int> unreleased(keys, 0);
  for (const Job& j : jobs) ++unreleased[j.key];
  std::vector<double> done(keys, -1);
  std::map<int, double> left;  // keys with work left, smallest first
  double now = 0;
  size_t next = 0;
  while (next < jobs.size() || !left.empty()) {
    if (left.empty()) now = std::max(now, jobs[next].release_ns);
    while (next < jobs.size() && jobs[next].release_ns <= now) {
      const Job& j = jobs[next++];
      --unreleased[j.key];
      if (j.work_ns > 0) {
        left[j.key] += j.work_ns;
      } else if (unreleased[j.key] == 0 && left.find(j.key) == left.end()) {
        done[j.key] = std::max(done[j.key], now);
      }
    }
    if (left.empty()) continue;
    auto first = left.begin();
    const double release = next < jobs.size() ? jobs[next].release_ns : std::numeric_limits<double>::infinity();
    if (now + first->second <= release) {
      now += first->second;
      if (unreleased[first->first] == 0) done[first->first] = now;
      left.erase(first);
    } else {
      first->second -= release - now;
      now = release;
    }
  }
  return done;
}

}  // namespace

Status ComputeIdealBound(const StepProfile& profile, const NetworkModel& network, IdealBound* bound) {
  // Several workers per host: the hosts' NICs are the links (traffic inside a host is free here).
  const int n = (network.workers + std::max(1, network.workers_per_host) - 1) / std::max(1, network.workers_per_host);
  if (n < 1) return Status(Code::kInvalidArgument, "workers must be at least 1, got " + std::to_string(n));
  const double rate_Bps = network.link_Bps * network.payload_efficiency;
  if (n > 1 && !(rate_Bps > 0 && std::isfinite(rate_Bps))) {
    return Status(Code::kInvalidArgument, "the link rate and payload efficiency must be positive for more than one worker");
  }
  if (network.payload_efficiency > 1) {
    return Status(Code::kInvalidArgument, "payload_efficiency must be at most 1, got " +
                                              std::to_string(network.payload_efficiency));
  }
  if (profile.layers.empty()) return Status(Code::kInvalidArgument, "the profile has no layer");
  const int layers = static_cast<int>(profile.layers.size());
  for (const ModelLayer& l : profile.layers) {
    if (l.forward_ns < 0) return Status(Code::kInvalidArgument, "layer '" + l.name + "' has a negative forward time");
  }
  if (profile.launch_ns < 0 || profile.backward_ns < 0 || profile.tail_ns < 0 || profile.gap_ns < 0 ||
      network.latency_ns < 0) {
    return Status(Code::kInvalidArgument, "launch, backward, tail, gap and latency must not be negative");
  }
  // Keys: 0 the control collectives (the step returns after them), 1 + k layer k's gradients,
  // layers + 1 gradients no layer reads (they only take their share of the link).
  const int ungated = layers + 1;
  const double share = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  const double ns_per_byte = n > 1 ? 1e9 / rate_Bps : 0.0;
  std::vector<Job> jobs;
  double total_work_ns = 0;
  uint64_t gradient_bytes = 0;
  for (const ModelTensor& t : profile.tensors) {
    if (t.layer >= layers || t.ready_ns < 0) {
      return Status(Code::kInvalidArgument, "tensor '" + t.name + "' names layer " + std::to_string(t.layer) +
                                                " of " + std::to_string(layers) + " or is ready before the backward pass");
    }
    const int key = t.priority >= kControlPriority ? 0 : t.layer >= 0 ? 1 + t.layer : ungated;
    const uint64_t wire_bytes = t.WireBytes(t.bytes);  // compressed gradients: half
    if (key != 0) gradient_bytes += wire_bytes;
    const double work = share * static_cast<double>(wire_bytes) * ns_per_byte;
    jobs.push_back({static_cast<double>(t.ready_ns), work, key});
    total_work_ns += work;
  }
  std::vector<double> done = PriorityCompletion(jobs, layers + 2);
  const double latency = n > 1 ? static_cast<double>(network.latency_ns) : 0.0;
  for (double& d : done) {
    if (d >= 0) d += latency;
  }

  IdealBound b;
  b.done_s.assign(layers, -1);
  for (int k = 0; k < layers; ++k) {
    if (done[1 + k] >= 0) b.done_s[k] = done[1 + k] / 1e9;
  }
  // The longest path from one backward pass's start to the next (see the header).
  double x = std::max(static_cast<double>(profile.backward_ns), done[0]) +
             static_cast<double>(profile.tail_ns + profile.gap_ns + profile.launch_ns);
  double forward_total = 0;
  for (int k = 0; k < layers; ++k) {
    if (k > 0) x += static_cast<double>(profile.layers[k - 1].forward_ns);
    if (done[1 + k] > x) {
      x = done[1 + k];
      b.binding_layer = k;
    }
    forward_total += static_cast<double>(profile.layers[k].forward_ns);
  }
  const double period = std::max(x + static_cast<double>(profile.layers.back().forward_ns), total_work_ns);
  const double compute = forward_total + static_cast<double>(profile.launch_ns + profile.backward_ns +
                                                             profile.tail_ns + profile.gap_ns);
  b.step_s = period / 1e9;
  b.compute_s = compute / 1e9;
  b.comm_s = total_work_ns / 1e9;
  b.wait_s = std::max(0.0, period - compute) / 1e9;
  b.gradient_bytes = gradient_bytes;
  *bound = std::move(b);
  return Status::OK();
}

}  // namespace prophet
