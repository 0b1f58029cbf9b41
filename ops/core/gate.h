// Update gates: "this variable has an update in flight" for crossing the global barrier.
//
// When the next step may start before the previous step's gradients are summed, a variable's
// update runs later, asynchronously. Its gate is armed when the update is handed off and released
// when the update has been applied; anything that reads or writes the variable first waits on the
// gate. Keys identify variables (the TF adapter uses the resource handle's container and name).
#ifndef PROPHET_OPS_CORE_GATE_H_
#define PROPHET_OPS_CORE_GATE_H_

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/core/common.h"

namespace prophet {

class UpdateGates {
 public:
  using Callback = std::function<void(const Status&)>;
  // What a waiter learns besides the status, for the step report (step_meter.h): whether it had
  // to wait at all, and the priority of the update it waited for (its gradient's: the largest is
  // the first layer's).
  struct Waited {
    bool waited = false;
    int64_t priority = 0;
  };
  using WaitCallback = std::function<void(const Status&, const Waited&)>;

  // One more update of `key` in flight; `priority` is its gradient's.
  void Arm(const std::string& key, int64_t priority = 0);
  // One update of `key` finished. A failure sticks to the key: later waits fail with it, so a
  // step never silently reads a variable whose update was lost.
  void Release(const std::string& key, const Status& status);
  // Calls `done` (inline when nothing is pending, otherwise when the last update is released).
  void Wait(const std::string& key, Callback done);
  void Wait(const std::string& key, WaitCallback done);
  // Calls `done` once no key has an update in flight.
  void WaitAll(Callback done);
  size_t pending() const;
  // Forgets failures and waiters (tests; a new runtime).
  void Reset();

 private:
  struct Gate {
    int pending = 0;
    int64_t priority = 0;  // of the last update armed
    Status error;
    std::vector<Callback> waiters;
  };
  mutable std::mutex mu_;
  std::unordered_map<std::string, Gate> gates_;
  size_t total_pending_ = 0;
  std::vector<Callback> all_waiters_;
};

UpdateGates& GlobalGates();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_GATE_H_
