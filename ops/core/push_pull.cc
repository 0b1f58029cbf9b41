#include "ops/core/push_pull.h"

#include <cstring>

#include "ops/core/fusion.h"
#include "ops/core/reduce.h"
#include "ops/core/schedule_traits.h"

namespace prophet {

void PushPull::Start() {
  const OpRequest& r = req_;
  if (n() == 1) {
    if (r.output != r.input && r.bytes) std::memcpy(r.output, r.input, r.bytes);
    host()->Finish(this, Status::OK());
    return;
  }
  if (r.fusion_bucket_bytes > 0) {  // a fused bucket (fuser.h): cut as the plan says
    set_parts(BucketPartitions(r.name, r.bytes, static_cast<uint32_t>(element_bytes()), n(),
                               host()->options().partition_bytes, r.fusion_bucket_bytes));
  } else {
    set_parts(MakePartitions(r.name, r.bytes, element_bytes(), n(), host()->options().partition_bytes,
                             PartitionMinSplitBytes(host()->options().schedule)));
  }
  const size_t np = parts().size();
  set_pending(static_cast<int>(np));
  push_state_.assign(np, PushState::kQueued);
  push_released_ns_.assign(np, 0);
  added_.assign(np, 0);
  result_sends_left_.assign(np, 0);
  contributed_.assign(np, {});
  held_.clear();
  held_.resize(np);
  seeded_.assign(np, 0);
  encoded_.clear();
  encoded_.resize(np);
  local_state_.assign(np, PushState::kDone);
  const bool schedule_owned = host()->SchedulesOwnedPartitions();

  // The tensor's bytes (the profile describes tensors); what travels is counted from the tasks.
  AnnounceReady();
  for (uint32_t p = 0; p < np; ++p) {
    if (parts()[p].owner == rank()) {
      // In place (input forwarded to output): the local values are already there.
      if (r.output == r.input) seeded_[p] = parts()[p].bytes;
      contributed_[p].assign(n(), false);
      contributed_[p][rank()] = true;
      added_[p] = 1;
      held_[p].resize(n());
      if (!schedule_owned) continue;
      local_state_[p] = PushState::kQueued;
    }
    host()->Schedule(PushTask(p));
  }
}

SendTask PushPull::PushTask(uint32_t part) const {
  SendTask t;
  t.name = req_.name;
  t.round = round();
  t.request_id = id();
  t.partition = static_cast<int>(part);
  t.peer = parts()[part].owner;
  t.priority = req_.priority;
  t.bytes = WireBytes(part);  // what travels: the credit, the bandwidth and the planner count it
  t.ready_ns = submit_ns();
  return t;
}

void PushPull::PushSent(uint32_t part) {
  push_state_[part] = PushState::kSent;
  host()->PushLeft(PushTask(part));
}

void PushPull::SendScheduled(const SendTask& task) {
  const uint32_t p = static_cast<uint32_t>(task.partition);
  push_released_ns_[p] = NowNs();
  if (parts()[p].owner == rank()) {  // this worker's own partition: nothing travels
    local_state_[p] = PushState::kReleased;
    host()->PushLeft(PushTask(p));
    if (added_[p] == n()) FinishPartition(p);
    return;
  }
  push_state_[p] = PushState::kReleased;
  const char* values = static_cast<const char*>(req_.input) + parts()[p].offset;
  if (!codec().compresses()) {
    host()->Send(task.peer, Frame(FrameType::kPush, p, values, [this, p] { PushSent(p); }));
    return;
  }
  encoded_[p] = host()->TakeBuffer(WireBytes(p));
  const int scale_exp = codec().Encode(values, parts()[p].bytes, encoded_[p].data());
  host()->Send(task.peer, Frame(FrameType::kPush, p, Payload{encoded_[p].data(), WireBytes(p), codec().encoding(), scale_exp},
                                [this, p] {
                                  ReleaseEncoded(p);
                                  PushSent(p);
                                }));
}

std::string PushPull::Mismatch(int peer, const FrameMeta& meta) const {
  const OpRequest& r = req_;
  const std::string shape = ShapeMismatch(peer, meta);
  if (!shape.empty()) return shape;
  const std::string encoding = EncodingMismatch(peer, meta);
  if (!encoding.empty()) return encoding;
  if (meta.partition >= parts().size() || parts()[meta.partition].owner != rank() ||
      parts()[meta.partition].offset != meta.offset || WireBytes(meta.partition) != meta.payload_bytes)
    return "push_pull '" + r.name + "': rank " + std::to_string(peer) +
           " partitioned the tensor differently (different partition_bytes?)";
  if (contributed_[meta.partition][peer])
    return "push_pull '" + r.name + "': rank " + std::to_string(peer) + " sent partition " +
           std::to_string(meta.partition) + " twice";
  return "";
}

PayloadSink PushPull::OnFrame(int peer, const FrameMeta& meta) {
  if (meta.type == FrameType::kResult) {
    const uint32_t p = meta.partition;
    if (p >= parts().size() || parts()[p].owner != peer || parts()[p].offset != meta.offset ||
        WireBytes(p) != meta.payload_bytes || meta.encoding != codec().encoding() ||
        push_state_[p] != PushState::kSent)
      return PayloadSink::Discard();  // not what this worker pushed: drop the bytes
    return ResultSink(static_cast<char*>(req_.output) + meta.offset, meta);
  }
  if (!Admit(peer, meta)) return PayloadSink::Discard();
  const uint32_t part = meta.partition;
  const int scale_exp = meta.scale_exp;
  PayloadSink::Consumer add = [this, part, scale_exp](uint64_t at, const char* data, uint64_t len) {
    Accumulate(part, at, data, len, scale_exp);
  };
  // Before its turn: held whole, added when the contributions before it are (OnWholeFrame).
  if (!InTurn(part, peer)) return PayloadSink::Buffer();
  // The first peer in the order (the only one with two workers) can land in the output itself,
  // and the local values are added to each piece as it lands (out = received + in, one pass, no
  // staging copy). Not when the output is the input (it holds the local values), nor when it
  // travels encoded.
  if (SumPosition(peer) == 1 && req_.output != req_.input && seeded_[part] == 0 && !codec().compresses())
    return PayloadSink::Into(static_cast<char*>(req_.output) + meta.offset, id(), std::move(add));
  return PayloadSink::Stream(std::move(add), id());
}

void PushPull::OnPayloadDone(int peer, const FrameMeta& meta) {
  const uint32_t p = meta.partition;
  if (meta.type == FrameType::kPush) {
    ContributionDone(p, peer);
    return;
  }
  push_state_[p] = PushState::kDone;
  TransferDone d;
  d.task = PushTask(p);
  d.sent_ns = push_released_ns_[p];
  d.done_ns = NowNs();
  host()->PushCompleted(d);
  EventDone();
}

void PushPull::OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) {
  if (!Admit(peer, meta)) return;
  const uint32_t part = meta.partition;
  if (InTurn(part, peer)) {
    Accumulate(part, 0, data->data(), meta.payload_bytes, meta.scale_exp);
    ContributionDone(part, peer);
    return;
  }
  contributed_[part][peer] = true;
  held_[part][SumPosition(peer)] = Held{std::move(*data), meta.payload_bytes, meta.scale_exp, true};
}

void PushPull::Accumulate(uint32_t part, uint64_t wire_at, const char* data, uint64_t wire_len, int scale_exp) {
  const Partition& p = parts()[part];
  char* out = static_cast<char*>(req_.output) + p.offset;
  const char* in = static_cast<const char*>(req_.input) + p.offset;
  const PayloadCodec& c = codec();
  // Tensor bytes from here on: a 2-byte code adds to a 4-byte value.
  const uint64_t at = c.TensorBytes(wire_at), len = c.TensorBytes(wire_len);
  uint64_t& seeded = seeded_[part];
  const uint64_t below = at < seeded ? std::min(len, seeded - at) : 0;
  if (below) {
    if (c.compresses()) c.DecodeAdd(data, c.WireBytes(below), scale_exp, out + at);
    else SumInto(req_.dtype, out + at, data, below / element_bytes());
  }
  if (below < len) {
    const char* rest = data + c.WireBytes(below);
    if (c.compresses()) c.DecodeAddTo(rest, wire_len - c.WireBytes(below), scale_exp, in + at + below, out + at + below);
    else SumTo(req_.dtype, out + at + below, in + at + below, rest, (len - below) / element_bytes());
    seeded = at + len;
  }
}

void PushPull::ContributionDone(uint32_t part, int peer) {
  contributed_[part][peer] = true;
  int& added = ++added_[part];
  for (; added < n() && held_[part][added].held; ++added) {
    Held& h = held_[part][added];
    Accumulate(part, 0, h.data.data(), h.bytes, h.scale_exp);
    host()->GiveBuffer(std::move(h.data));
    h = Held{};
  }
  if (added == n() && local_state_[part] != PushState::kQueued) FinishPartition(part);
}

void PushPull::FinishPartition(uint32_t part) {
  const Partition& p = parts()[part];
  char* out = static_cast<char*>(req_.output) + p.offset;
  if (req_.average) DivideBy(req_.dtype, out, p.bytes / element_bytes(), n());
  Payload result{out, p.bytes};
  if (codec().compresses()) {
    // Encoded once for every peer; this worker decodes the same payload into its own output, so
    // that every worker holds the same bits.
    encoded_[part] = host()->TakeBuffer(WireBytes(part));
    result = Payload{encoded_[part].data(), WireBytes(part), codec().encoding(),
                     codec().Encode(out, p.bytes, encoded_[part].data())};
    codec().Decode(result.data, result.bytes, result.scale_exp, out);
  }
  if (local_state_[part] == PushState::kReleased) {
    TransferDone d;
    d.task = PushTask(part);
    d.sent_ns = push_released_ns_[part];
    d.done_ns = NowNs();
    d.local = true;
    host()->PushCompleted(d);
  }
  result_sends_left_[part] = n() - 1;
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank()) continue;
    host()->Send(peer, Frame(FrameType::kResult, part, result, [this, part] {
                   if (--result_sends_left_[part] > 0) return;
                   ReleaseEncoded(part);
                   EventDone();
                 }));
  }
}

std::vector<bool> PushPull::WaitingFor() const {
  std::vector<bool> missing(n(), false);
  for (size_t p = 0; p < parts().size(); ++p) {
    if (parts()[p].owner == rank()) {
      if (added_[p] < n())
        for (int r = 0; r < n(); ++r)
          if (!contributed_[p].empty() && !contributed_[p][r]) missing[r] = true;
    } else if (push_state_[p] != PushState::kDone) {
      missing[parts()[p].owner] = true;
    }
  }
  return missing;
}

void PushPull::Complete(const Status& status) {
  // Released pushes that will not leave now (the engine dropped their frames): their credit.
  for (size_t p = 0; p < push_state_.size(); ++p)
    if (push_state_[p] == PushState::kReleased) host()->PushLeft(PushTask(static_cast<uint32_t>(p)));
  // Encoded payloads of frames that never left (the engine dropped or copied them: Abandon).
  for (uint32_t p = 0; p < encoded_.size(); ++p) ReleaseEncoded(p);
  for (std::vector<Held>& held : held_)
    for (Held& h : held)
      if (h.held) host()->GiveBuffer(std::move(h.data));
  Collective::Complete(status);
}

}  // namespace prophet
