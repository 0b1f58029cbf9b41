#include "ops/core/gate.h"

namespace prophet {

void UpdateGates::Arm(const std::string& key, int64_t priority) {
  std::lock_guard<std::mutex> lock(mu_);
  Gate& g = gates_[key];
  g.pending++;
  g.priority = priority;
  total_pending_++;
}

void UpdateGates::Release(const std::string& key, const Status& status) {
  std::vector<Callback> ready, all_ready;
  Status result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = gates_.find(key);
    if (it == gates_.end() || it->second.pending == 0) return;
    Gate& g = it->second;
    if (!status.ok() && g.error.ok()) g.error = status;
    total_pending_--;
    if (--g.pending == 0) {
      ready.swap(g.waiters);
      result = g.error;
    }
    if (total_pending_ == 0) all_ready.swap(all_waiters_);
  }
  // Callbacks run outside the lock: they may arm or wait again.
  for (auto& cb : ready) cb(result);
  for (auto& cb : all_ready) cb(Status::OK());
}

void UpdateGates::Wait(const std::string& key, Callback done) {
  Wait(key, [done = std::move(done)](const Status& s, const Waited&) { done(s); });
}

void UpdateGates::Wait(const std::string& key, WaitCallback done) {
  Status now;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = gates_.find(key);
    if (it != gates_.end()) {
      if (it->second.pending > 0) {
        const Waited waited{true, it->second.priority};
        it->second.waiters.push_back([done = std::move(done), waited](const Status& s) { done(s, waited); });
        return;
      }
      now = it->second.error;
    }
  }
  done(now, Waited{});
}

void UpdateGates::WaitAll(Callback done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (total_pending_ > 0) {
      all_waiters_.push_back(std::move(done));
      return;
    }
  }
  done(Status::OK());
}

size_t UpdateGates::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_pending_;
}

void UpdateGates::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  gates_.clear();
  all_waiters_.clear();
  total_pending_ = 0;
}

UpdateGates& GlobalGates() {
  static UpdateGates* gates = new UpdateGates();  // outlives every kernel at exit
  return *gates;
}

}  // namespace prophet
