// How failures reach every worker, and how a peer's end is read: lost, unresponsive or departed.
//
// An operation that fails on one worker fails on all of them with the same message (an error
// notice, kError), and its key is remembered so that frames still on their way are dropped and a
// worker that submits it later fails at once with that message.
//
// A closed connection is a lost peer unless that peer said it was leaving (kLeaving: its program
// finished; only operations still waiting for its data fail, naming it). The first loss is told
// to every peer (kPeerLost) before this worker's own exit could close a connection, so every
// survivor names the lost worker rather than the survivor that left first; a peer's own report of
// a loss is the cause to give when that peer's connection closes in turn. With heartbeat_s > 0,
// a peer from which nothing arrived for a whole period is closed as unresponsive.
//
// Single-threaded: the engine's I/O thread owns it; it reaches the engine only through
// FailuresHost.
#ifndef PROPHET_OPS_CORE_FAILURES_H_
#define PROPHET_OPS_CORE_FAILURES_H_

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/core/buffer_pool.h"
#include "ops/core/common.h"
#include "ops/core/engine_options.h"
#include "ops/core/wire.h"

namespace prophet {

class Collective;
class Connection;

// What failure handling needs from the engine, and nothing more.
class FailuresHost {
 public:
  virtual ~FailuresHost() = default;
  virtual const EngineOptions& options() const = 0;
  // The connection to `peer` (nullptr for this rank); it may be closed.
  virtual Connection* connection(int peer) = 0;
  // The operation name#round running here, or nullptr.
  virtual Collective* Find(const std::string& key) = 0;
  // Whether this worker has submitted round `round` of `name` (it may have finished since).
  virtual bool Submitted(const std::string& name, uint64_t round) = 0;
  // Starts the operations submitted since the last look (so that a failure reaches them too).
  virtual void DrainSubmissions() = 0;
  // The operations running here.
  virtual std::vector<Collective*> Running() = 0;
  // Ends `op` (and frees it) with `status`.
  virtual void Finish(Collective* op, const Status& status) = 0;
};

class Failures {
 public:
  Failures(FailuresHost* host, int world_size);

  // --- operations --------------------------------------------------------------------------------
  // Fails `op` here and on every worker with `status` (its message says the whole story).
  void FailEverywhere(Collective* op, const Status& status);
  // Fails name#round, not started here, on every worker with `status`.
  void FailElsewhere(const std::string& name, uint64_t round, const Status& status);
  // The error a failed operation ended with, or nullptr (remembered for the last few thousand).
  const Status* FailedWith(const std::string& key) const;
  // An error notice from `peer` (`data` its message) fails its operation here.
  void OnErrorNotice(int peer, const FrameMeta& meta, const ByteBuffer& data);
  // `op` has just started here and is still running: after a lost peer it fails at once (the
  // frames already here did not complete it); it fails too if it waits for a departed worker.
  void OnStarted(Collective* op);

  // --- peers -------------------------------------------------------------------------------------
  // `peer` reported a lost worker (kPeerLost, `data` its words).
  void OnLossReport(int peer, const FrameMeta& meta, const ByteBuffer& data);
  // `peer` finished its program (kLeaving): operations still waiting for its data fail, the
  // others go on.
  void OnLeaving(int peer);
  // The connection `c` closed on an error: a departure, or a lost peer that fails everything.
  void OnClosed(Connection& c, const std::string& why);
  // Sends heartbeats and closes connections that have been silent for heartbeat_s.
  void Heartbeat(int64_t now);

  bool departed(int peer) const { return departed_[peer]; }
  // Whether this worker knows of a lost peer (then it leaves without the departure notice, so that
  // the survivors go on naming that loss rather than this exit).
  bool peer_lost() const { return !first_loss_.empty(); }

 private:
  void Remember(const std::string& key, const Status& status);
  // The job lost a peer: `message` (as `observer` saw it) fails everything pending, unless an
  // earlier loss already did; every peer hears of the first loss before this worker can leave.
  void LosePeer(int observer, const std::string& message);
  void FailAll(const std::string& message);
  // Fails `op` if it waits for data from a worker that has left.
  void FailIfWaitingForDeparted(Collective* op);
  const EngineOptions& options() const { return host_->options(); }

  FailuresHost* const host_;
  // Keys of failed operations with their error (bounded memory).
  std::unordered_map<std::string, Status> failed_keys_;
  std::deque<std::string> failed_order_;
  // By peer: the last error it reported for an operation that had already completed here (a
  // broadcast root finishes when its data is sent). Told again if that peer is lost, so that this
  // worker's error names the conflict, not only the lost connection.
  std::vector<std::string> peer_reports_;
  // By peer: the lost worker it reported (kPeerLost) and who saw that loss first. A worker leaves
  // soon after it loses a peer (its program fails), so when its own connection closes, the loss
  // it reported is the cause to name, not its leaving.
  struct LossReport {
    int observer = -1;
    std::string message;
  };
  std::vector<LossReport> loss_reports_;
  // The first loss of a peer this worker knew of, in the words every worker uses for it; once set,
  // every later closed connection is a consequence of it.
  std::string first_loss_;
  // By peer: it said kLeaving (its program finished). Its EOF is then a departure, not a loss.
  std::vector<bool> departed_;
  std::string unresponsive_reason_;  // set while the heartbeat closes a connection
  int64_t next_heartbeat_ = 0;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FAILURES_H_
