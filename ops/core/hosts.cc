#include "ops/core/hosts.h"

#include <algorithm>
#include <map>

#include "ops/core/transport.h"

namespace prophet {

const char* HierarchyName(Hierarchy h) {
  switch (h) {
    case Hierarchy::kOff: return "off";
    case Hierarchy::kOn: return "on";
    case Hierarchy::kAuto: return "auto";
  }
  return "?";
}

bool ParseHierarchy(const std::string& text, Hierarchy* out) {
  if (text == "off" || text == "0" || text == "false") *out = Hierarchy::kOff;
  else if (text == "on" || text == "1" || text == "true") *out = Hierarchy::kOn;
  else if (text == "auto") *out = Hierarchy::kAuto;
  else return false;
  return true;
}

bool HostLayout::shared() const {
  for (const std::vector<int>& r : ranks)
    if (r.size() > 1) return true;
  return false;
}

std::string HostLayout::Describe() const {
  std::string sizes;
  for (size_t h = 0; h < ranks.size(); ++h) sizes += (h ? " + " : "") + std::to_string(ranks[h].size());
  return std::to_string(hosts()) + (hosts() == 1 ? " host (" : " hosts (") + sizes + " workers)";
}

HostLayout LayoutFromLabels(const std::vector<std::string>& labels) {
  HostLayout layout;
  std::map<std::string, int> index;
  for (size_t r = 0; r < labels.size(); ++r) {
    auto it = index.emplace(labels[r], layout.hosts()).first;
    if (it->second == layout.hosts()) layout.ranks.emplace_back();
    layout.host_of.push_back(it->second);
    layout.local_index.push_back(static_cast<int>(layout.ranks[it->second].size()));
    layout.ranks[it->second].push_back(static_cast<int>(r));
  }
  return layout;
}

HostLayout UniformLayout(int workers, int per_host) {
  std::vector<std::string> labels;
  for (int w = 0; w < workers; ++w) labels.push_back(std::to_string(w / std::max(per_host, 1)));
  return LayoutFromLabels(labels);
}

Status HostLabels(const std::vector<std::string>& hosts, const std::vector<std::string>& addresses, int world_size,
                  std::vector<std::string>* labels) {
  labels->clear();
  if (!hosts.empty()) {
    if (static_cast<int>(hosts.size()) != world_size)
      return Status(Code::kInvalidArgument, "hosts names " + std::to_string(hosts.size()) + " host(s) for " +
                                                std::to_string(world_size) +
                                                " workers: give one host label per rank, in rank order");
    *labels = hosts;
    return Status::OK();
  }
  for (const std::string& address : addresses) {
    std::string host;
    int port = 0;
    const Status s = ParseAddress(address, &host, &port);
    if (!s.ok()) return s;
    labels->push_back(host);
  }
  if (static_cast<int>(labels->size()) != world_size) labels->resize(static_cast<size_t>(world_size), "");
  return Status::OK();
}

bool UseTwoLevel(Hierarchy setting, const HostLayout& layout) {
  if (layout.world_size() < 2) return false;
  switch (setting) {
    case Hierarchy::kOff: return false;
    case Hierarchy::kOn: return true;
    case Hierarchy::kAuto: return layout.hosts() > 1 && layout.shared();
  }
  return false;
}

bool ChooseTwoLevel(double two_level_s, double flat_s) { return !(flat_s < two_level_s * (1 - kTwoLevelMargin)); }

uint16_t PathTag(bool two_level, const HostLayout& layout, bool chosen_at_start_up) {
  if (!two_level) return 0;
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the host of every rank
  for (const int host : layout.host_of) {
    h ^= static_cast<uint64_t>(host) + 1;
    h *= 1099511628211ull;
  }
  const uint16_t tag = static_cast<uint16_t>(h ^ (h >> 16) ^ (h >> 32) ^ (h >> 48)) & ~kPathChosenAtStartUp;
  return (tag == 0 ? 1 : tag) | (chosen_at_start_up ? kPathChosenAtStartUp : 0);
}

int PartitionLeader(const HostLayout& layout, int host, uint64_t name_hash, uint32_t partition) {
  const std::vector<int>& ranks = layout.ranks[static_cast<size_t>(host)];
  return ranks[(name_hash + partition) % ranks.size()];
}

}  // namespace prophet
