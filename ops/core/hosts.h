// Which workers share a host, and whether push_pulls take the two-level path over them.
//
// The two-level path (two_level.h; the simulator's RuntimeModel::hierarchical predicts it) sums
// on each host first and sends each host's share over the network once. It needs every worker to
// see the same hosts: they come from the cluster addresses every worker is given (workers whose
// addresses have the same host part share a host), or from an explicit label per rank (the
// `hosts` option, for tests and for addresses that do not tell: a Kubernetes Service per pod).
// Hosts may have different numbers of workers.
#ifndef PROPHET_OPS_CORE_HOSTS_H_
#define PROPHET_OPS_CORE_HOSTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/common.h"

namespace prophet {

// The `hierarchical` setting, of the engine (EngineOptions) and of the predictor (RuntimeModel):
// off, the flat push_pull; on, the two-level one; auto, where the job spans several hosts and some
// host has several workers, the two-level one unless the start-up probe finds the flat one faster
// (Engine::SetTwoLevel, ChooseTwoLevel; on one host, or with one worker per host, the two-level
// path is the flat one: nothing to gain).
enum class Hierarchy : uint8_t { kOff = 0, kOn = 1, kAuto = 2 };
const char* HierarchyName(Hierarchy h);  // "off", "on", "auto"
inline constexpr const char* kHierarchyNames[] = {"off", "on", "auto"};
// "off"/"on"/"auto" (and "0"/"1"/"false"/"true"); false for anything else.
bool ParseHierarchy(const std::string& text, Hierarchy* out);

struct HostLayout {
  std::vector<int> host_of;             // by rank: its host's index
  std::vector<std::vector<int>> ranks;  // by host: its ranks, ascending
  std::vector<int> local_index;         // by rank: its place in its host's `ranks`
  int hosts() const { return static_cast<int>(ranks.size()); }
  int world_size() const { return static_cast<int>(host_of.size()); }
  // Whether some host has more than one worker.
  bool shared() const;
  // "2 hosts (2 + 2 workers)".
  std::string Describe() const;
};

// Hosts from one label per rank: ranks with equal labels share a host; hosts are numbered in the
// order their first rank appears (so contiguous blocks of ranks give host = rank / K, as the
// simulator places them).
HostLayout LayoutFromLabels(const std::vector<std::string>& labels);
// `workers` workers, `per_host` on each host, worker w on host w / per_host (the simulator's).
HostLayout UniformLayout(int workers, int per_host);
// The labels the engine groups by: `hosts` when given (one per rank), else the host part of each
// address ("10.0.0.2:2222" -> "10.0.0.2"). An error names what does not fit.
Status HostLabels(const std::vector<std::string>& hosts, const std::vector<std::string>& addresses, int world_size,
                  std::vector<std::string>* labels);

// Whether push_pulls take the two-level path with this setting over this layout (at start-up:
// under auto the strategy's probe may then choose the flat one, Engine::SetTwoLevel).
bool UseTwoLevel(Hierarchy setting, const HostLayout& layout);

// Under auto, the path the start-up probe keeps (prophet_tf/_link_probe.py), from the slowest
// worker's fastest round on each path: the two-level one unless the flat one was faster by more
// than kTwoLevelMargin. The two-level path is the default where the hosts allow it, and a probe
// round of one 4 MiB tensor weighs its extra stage more than a step of larger buckets does.
inline constexpr double kTwoLevelMargin = 0.05;
bool ChooseTwoLevel(double two_level_s, double flat_s);

// A 16-bit digest of the path push_pulls take: 0 for the flat one, else of the host of every rank,
// with kPathChosenAtStartUp where the strategy's probe may still change it (auto). Exchanged at
// start-up (the hello's flags): workers that would take different paths, see different hosts, or
// would not all choose (on beside auto), refuse to form a job instead of failing on every
// push_pull.
inline constexpr uint16_t kPathChosenAtStartUp = 0x8000;
uint16_t PathTag(bool two_level, const HostLayout& layout, bool chosen_at_start_up);

// The leader of partition `partition` on host `host`: the rank that sums the host's contributions
// to it. Leaders rotate over a host's ranks from the tensor name's hash, so a host's partitions
// spread over its workers (the simulator picks them the same way).
int PartitionLeader(const HostLayout& layout, int host, uint64_t name_hash, uint32_t partition);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_HOSTS_H_
