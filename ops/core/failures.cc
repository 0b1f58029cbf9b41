#include "ops/core/failures.h"

#include <algorithm>
#include <cstdio>

#include "ops/core/collective.h"
#include "ops/core/connection.h"

namespace prophet {
namespace {

constexpr size_t kRememberedFailures = 4096;

}  // namespace

Failures::Failures(FailuresHost* host, int world_size)
    : host_(host),
      peer_reports_(static_cast<size_t>(std::max(world_size, 0))),
      loss_reports_(static_cast<size_t>(std::max(world_size, 0))),
      departed_(static_cast<size_t>(std::max(world_size, 0)), false) {}

// ------------------------------------------------------------------------------------------------
// Operations

void Failures::FailEverywhere(Collective* op, const Status& status) {
  FailElsewhere(op->request().name, op->round(), status);
  host_->Finish(op, status);
}

void Failures::FailElsewhere(const std::string& name, uint64_t round, const Status& status) {
  for (int peer = 0; peer < options().world_size; ++peer) {
    Connection* c = host_->connection(peer);
    if (c && c->open()) c->Queue(ErrorNotice(name, round, status));
  }
  Remember(OperationKey(name, round), status);
}

const Status* Failures::FailedWith(const std::string& key) const {
  auto it = failed_keys_.find(key);
  return it == failed_keys_.end() ? nullptr : &it->second;
}

void Failures::Remember(const std::string& key, const Status& status) {
  if (failed_keys_.emplace(key, status).second) failed_order_.push_back(key);
  if (failed_order_.size() > kRememberedFailures) {
    failed_keys_.erase(failed_order_.front());
    failed_order_.pop_front();
  }
}

void Failures::OnErrorNotice(int peer, const FrameMeta& meta, const ByteBuffer& data) {
  const std::string key = OperationKey(meta.name, meta.round);
  const Status status = ErrorFrameStatus(meta, std::string(data.data(), data.size()));
  Remember(key, status);
  if (Collective* op = host_->Find(key)) {
    host_->Finish(op, status);
  } else if (host_->Submitted(meta.name, meta.round)) {
    PROPHET_ERROR("rank %d failed an operation that completed here: %s", peer, status.message().c_str());
    peer_reports_[peer] = status.message();
  }
}

// After a lost peer, an operation completes only if the frames already here complete it (a
// broadcast whose root sent everything, then left); anything else fails at once, everywhere.
void Failures::OnStarted(Collective* op) {
  if (!first_loss_.empty())
    FailEverywhere(op, Status(Code::kUnavailable, op->Describe() + " failed: " + first_loss_));
  else
    FailIfWaitingForDeparted(op);
}

// ------------------------------------------------------------------------------------------------
// Peers

void Failures::OnLossReport(int peer, const FrameMeta& meta, const ByteBuffer& data) {
  // Kept until that peer's connection closes: what it saw then is the cause, its leaving the
  // consequence. Nothing fails yet: what the lost worker sent here may still complete operations.
  LossReport& report = loss_reports_[peer];
  if (!report.message.empty()) return;
  const bool other = meta.partition < static_cast<uint32_t>(options().world_size) &&
                     static_cast<int>(meta.partition) != options().rank;
  report.observer = other ? static_cast<int>(meta.partition) : peer;
  report.message.assign(data.data(), data.size());
  PROPHET_INFO("rank %d reports: %s", peer, report.message.c_str());
}

void Failures::OnLeaving(int peer) {
  if (departed_[peer]) return;
  departed_[peer] = true;
  PROPHET_INFO("rank %d finished its program and left", peer);
  for (Collective* op : host_->Running()) FailIfWaitingForDeparted(op);
}

// Told to every worker too: one that waits only for this worker's data (say a partition this
// worker owns) could not know otherwise.
void Failures::FailIfWaitingForDeparted(Collective* op) {
  const std::vector<bool> missing = op->WaitingFor();
  std::vector<int> gone;
  for (int r = 0; r < options().world_size; ++r)
    if (missing[r] && departed_[r]) gone.push_back(r);
  if (gone.empty()) return;
  std::string who, reports;
  for (int r : gone) {
    who += (who.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " (" + options().addresses[r] + ")";
    if (!peer_reports_[r].empty()) reports += ". Before that rank " + std::to_string(r) + " reported: " + peer_reports_[r];
  }
  const Status status(Code::kUnavailable,
                      op->Describe() + " failed: " + who + " shut down its prophet_tf runtime before taking part in it " +
                          "(its program ended, or raised an error: see its log). If it ended normally, the workers ran " +
                          "different collectives: a different number of steps or batches, or a branch on the rank " +
                          "such as `if rank == 0: model.save(...)`; every worker must run the same ones" + reports);
  FailEverywhere(op, status);
}

void Failures::OnClosed(Connection& c, const std::string& why) {
  if (departed_[c.peer()] && !c.refused()) {  // its EOF (or a reset after it) follows its notice
    PROPHET_INFO("rank %d closed its connection after leaving: %s", c.peer(), why.c_str());
    return;
  }
  const std::string who = "rank " + std::to_string(c.peer()) + " (" + options().addresses[c.peer()] + ")";
  std::string message =
      c.refused() ? "dropped the connection to " + who + ", which broke the protocol: " + why
      : !unresponsive_reason_.empty()
          ? who + " is unresponsive: " + unresponsive_reason_
          : "lost the connection to " + who + ": " + why + ". That worker exited, crashed or was killed; see its log";
  unresponsive_reason_.clear();
  if (!peer_reports_[c.peer()].empty()) message += ". Before that it reported: " + peer_reports_[c.peer()];
  if (!host_->Running().empty()) PROPHET_ERROR("%s", message.c_str());
  else PROPHET_INFO("%s", message.c_str());
  const LossReport& report = loss_reports_[c.peer()];
  if (!report.message.empty() && !c.refused()) return LosePeer(report.observer, report.message);
  LosePeer(options().rank, message);
}

// The first loss is told to every peer in a frame that leaves before this worker's own exit could
// close a connection, so a survivor that sees this worker leave before it sees the lost peer go
// names the lost peer, as this worker does.
void Failures::LosePeer(int observer, const std::string& message) {
  if (first_loss_.empty()) {
    first_loss_ =
        observer == options().rank ? message : message + " (rank " + std::to_string(observer) + " saw this first)";
    const std::string words = message.substr(0, kMaxErrorMessageBytes);
    FrameMeta lost;
    lost.type = FrameType::kPeerLost;
    lost.partition = static_cast<uint32_t>(observer);
    lost.payload_bytes = words.size();
    for (int peer = 0; peer < options().world_size; ++peer) {
      Connection* c = host_->connection(peer);
      if (c && c->open()) c->Queue(MakeOwnedFrame(lost, words, kUrgentPriority));
    }
  }
  FailAll(first_loss_);
}

// A peer is lost: every pending operation fails, here and (through error notices that arrive
// before this worker's own exit could) on every other worker, so that all of them give the cause
// rather than "lost the connection" to a survivor that failed first.
void Failures::FailAll(const std::string& message) {
  host_->DrainSubmissions();
  for (Collective* op : host_->Running())
    FailEverywhere(op, Status(Code::kUnavailable, op->Describe() + " failed: " + message));
}

// Liveness (heartbeat_s > 0): a frame to every peer several times per period, and a peer from
// which nothing at all arrived for a whole period is declared lost. A stalled program still
// answers (its engine thread runs); a stopped or frozen process does not.
void Failures::Heartbeat(int64_t now) {
  if (options().heartbeat_s <= 0 || now < next_heartbeat_) return;
  const int64_t period_ns = static_cast<int64_t>(options().heartbeat_s * 1e9);
  next_heartbeat_ = now + period_ns / 4;
  FrameMeta beat;
  beat.type = FrameType::kHeartbeat;
  for (int peer = 0; peer < options().world_size; ++peer) {
    Connection* c = host_->connection(peer);
    if (!c || !c->open() || departed_[peer]) continue;
    if (now - c->last_receive_ns() > period_ns) {
      char silent[32];
      std::snprintf(silent, sizeof(silent), "%.1f s", (now - c->last_receive_ns()) / 1e9);
      unresponsive_reason_ = std::string("nothing arrived from it for ") + silent + " (heartbeat_s " +
                             SecondsString(options().heartbeat_s) + "): that worker is stopped, frozen or unreachable";
      c->Close(unresponsive_reason_);
      continue;
    }
    c->Queue(MakeOwnedFrame(beat, "", kUrgentPriority));
  }
}

}  // namespace prophet
