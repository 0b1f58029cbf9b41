#include "ops/core/p3_policy.h"

#include <cstdio>

namespace prophet {

void P3Policy::Enqueue(const SendTask& task) {
  (task.priority >= kControlPriority ? control_ : queue_).Push(task);
}

int P3Policy::unsent_to(int peer) const {
  auto it = unsent_by_peer_.find(peer);
  return it == unsent_by_peer_.end() ? 0 : it->second;
}

void P3Policy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  CreditWindow window(credit_bytes);
  if (!window.Release(&control_, out)) return;
  uint64_t released = 0;
  for (const SendTask& t : *out) released += t.bytes;
  while (true) {
    if (!holding_) {
      if (queue_.empty()) return;
      held_ = queue_.Pop();  // the sender thread pops the most urgent slice and sends it
      holding_ = true;
    }
    // Its send blocks while the slice before it to the same peer has not left.
    if (unsent_to(held_.peer) > 0) return;
    if (credit_bytes == 0 || (released > 0 && released + held_.bytes > credit_bytes)) return;
    released += held_.bytes;
    ++unsent_by_peer_[held_.peer];
    unsent_[std::make_tuple(held_.name, held_.round, held_.partition)] = held_.peer;
    holding_ = false;
    out->push_back(std::move(held_));
  }
}

void P3Policy::OnPushLeft(const SendTask& task) {
  auto it = unsent_.find(std::make_tuple(task.name, task.round, task.partition));
  if (it == unsent_.end()) return;  // a control task, or released by a policy this one replaced
  if (--unsent_by_peer_[it->second] == 0) unsent_by_peer_.erase(it->second);
  unsent_.erase(it);
}

std::string P3Policy::Describe() const {
  char buffer[160];
  std::snprintf(buffer, sizeof(buffer), "p3: %zu slices queued, %zu released waiting to leave%s", queue_.size(),
                unsent_.size(), holding_ ? ", the sender holds one for a busy peer" : "");
  return buffer;
}

}  // namespace prophet
