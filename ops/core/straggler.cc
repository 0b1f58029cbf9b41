#include "ops/core/straggler.h"

namespace prophet {

void StragglerProbe::Begin(const std::string& key, const std::vector<int>& peers, int64_t due_ns) {
  Ask& a = asks_[key];
  a.peers = peers;
  a.answer.assign(peers.size(), -1);
  a.due_ns = due_ns;
  a.pending = static_cast<int>(peers.size());
}

void StragglerProbe::OnReply(const std::string& key, int peer, bool submitted) {
  auto it = asks_.find(key);
  if (it == asks_.end()) return;
  Ask& a = it->second;
  for (size_t i = 0; i < a.peers.size(); ++i) {
    if (a.peers[i] != peer || a.answer[i] != -1) continue;
    a.answer[i] = submitted ? 1 : 0;
    a.pending--;
  }
}

std::vector<std::string> StragglerProbe::Due(int64_t now) const {
  std::vector<std::string> due;
  for (const auto& kv : asks_)
    if (kv.second.pending == 0 || now >= kv.second.due_ns) due.push_back(kv.first);
  return due;
}

StragglerProbe::Verdict StragglerProbe::Take(const std::string& key) {
  Verdict v;
  auto it = asks_.find(key);
  if (it == asks_.end()) return v;
  const Ask& a = it->second;
  for (size_t i = 0; i < a.peers.size(); ++i) {
    if (a.answer[i] == 0) v.behind.push_back(a.peers[i]);
    if (a.answer[i] == -1) v.silent.push_back(a.peers[i]);
  }
  asks_.erase(it);
  return v;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

}  // namespace prophet
