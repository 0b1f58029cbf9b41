// Operations past their deadline (timeout_s): who is behind, then one verdict on every worker.
//
// A worker's own view of a timed-out operation cannot name the culprit (straggler.h), so each
// expired operation starts a probe: every reachable peer is asked (kProbe, urgent) whether it has
// submitted the operation and answers from its own round counters (kProbeReply). When all have
// answered, or the grace period is over, the operation fails on every worker with a message that
// depends only on the answers: the ranks behind, the silent ones, or, when everyone reached it,
// the ranks whose data has not arrived.
//
// Single-threaded: the engine's I/O thread owns it; it reaches the engine only through
// TimeoutsHost.
#ifndef PROPHET_OPS_CORE_TIMEOUTS_H_
#define PROPHET_OPS_CORE_TIMEOUTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/connection.h"
#include "ops/core/engine_options.h"
#include "ops/core/straggler.h"
#include "ops/core/wire.h"

namespace prophet {

class Collective;

// What timeout handling needs from the engine, and nothing more.
class TimeoutsHost {
 public:
  virtual ~TimeoutsHost() = default;
  virtual const EngineOptions& options() const = 0;
  // The operations running here.
  virtual std::vector<Collective*> Running() = 0;
  // The operation name#round running here, or nullptr.
  virtual Collective* Find(const std::string& key) = 0;
  // Whether this worker has submitted round `round` of `name` (it may have finished since).
  virtual bool Submitted(const std::string& name, uint64_t round) = 0;
  // Whether `peer` can still answer: its connection is open and it has not left.
  virtual bool Reachable(int peer) = 0;
  // Queues a frame to `peer` (dropped if that connection is closed).
  virtual void Send(int peer, OutFrame frame) = 0;
  // Fails `op` here and on every worker with `status`.
  virtual void FailEverywhere(Collective* op, const Status& status) = 0;
};

class Timeouts {
 public:
  explicit Timeouts(TimeoutsHost* host) : host_(host) {}

  // Probes operations that have just passed their deadline, and fails those whose verdict is due.
  void Check(int64_t now);
  // A peer asks whether this worker has submitted meta.name#meta.round (kProbe).
  void OnProbe(int peer, const FrameMeta& meta);
  // A peer's answer (kProbeReply).
  void OnProbeReply(int peer, const FrameMeta& meta);
  // The operation `key` ended (completed late, or failed otherwise): no verdict is due for it.
  void Forget(const std::string& key) { stragglers_.Forget(key); }

 private:
  void Decide(Collective* op, const StragglerProbe::Verdict& verdict);

  TimeoutsHost* const host_;
  StragglerProbe stragglers_;  // timed-out operations whose peers are being asked who is behind
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_TIMEOUTS_H_
