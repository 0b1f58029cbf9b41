#include "ops/core/timeouts.h"

#include <algorithm>

#include "ops/core/collective.h"

namespace prophet {

// Replies are urgent frames and come back at once; the grace only bounds peers that cannot answer.
void Timeouts::Check(int64_t now) {
  const EngineOptions& options = host_->options();
  std::vector<Collective*> expired;
  for (Collective* op : host_->Running())
    if (now > op->deadline_ns() && !stragglers_.Asking(op->key())) expired.push_back(op);
  const int64_t grace_ns = static_cast<int64_t>(std::min(10.0, std::max(1.0, options.timeout_s / 4)) * 1e9);
  for (Collective* op : expired) {
    std::vector<int> asked;
    for (int peer = 0; peer < options.world_size; ++peer) {
      if (!host_->Reachable(peer)) continue;
      FrameMeta probe;
      probe.type = FrameType::kProbe;
      probe.name = op->request().name;
      probe.round = op->round();
      host_->Send(peer, MakeOwnedFrame(probe, "", kUrgentPriority));
      asked.push_back(peer);
    }
    stragglers_.Begin(op->key(), asked, now + grace_ns);
  }
  for (const std::string& key : stragglers_.Due(now)) {
    Collective* op = host_->Find(key);
    const StragglerProbe::Verdict verdict = stragglers_.Take(key);
    if (op != nullptr) Decide(op, verdict);
  }
}

void Timeouts::Decide(Collective* op, const StragglerProbe::Verdict& v) {
  // The message depends only on the answers, not on who asked: every survivor says the same.
  std::string why;
  if (!v.behind.empty())
    why = "rank(s) " + RankList(v.behind) +
          " did not reach it (every other worker did): a different code path, a crash, or a stall there";
  if (!v.silent.empty())
    why += (why.empty() ? "" : "; ") + std::string("rank(s) ") + RankList(v.silent) +
           " did not answer whether they reached it: stopped, hung or unreachable";
  if (why.empty()) {
    std::vector<int> waiting;
    const std::vector<bool> missing = op->WaitingFor();
    for (int r = 0; r < host_->options().world_size; ++r)
      if (missing[r]) waiting.push_back(r);
    why = "every worker reached it, but its data has not arrived from rank(s) " +
          (waiting.empty() ? std::string("?") : RankList(waiting)) + " (a slow or congested network?)";
  }
  host_->FailEverywhere(op, Status(Code::kDeadlineExceeded, op->Describe() + " did not complete within " +
                                                                SecondsString(host_->options().timeout_s) + ": " + why +
                                                                ". Raise timeout_s if those workers are only slow"));
}

void Timeouts::OnProbe(int peer, const FrameMeta& meta) {
  FrameMeta reply;
  reply.type = FrameType::kProbeReply;
  reply.name = meta.name;
  reply.round = meta.round;
  reply.partition = host_->Submitted(meta.name, meta.round) ? 1 : 0;
  host_->Send(peer, MakeOwnedFrame(reply, "", kUrgentPriority));
}

void Timeouts::OnProbeReply(int peer, const FrameMeta& meta) {
  stragglers_.OnReply(OperationKey(meta.name, meta.round), peer, meta.partition == 1);
}

}  // namespace prophet
