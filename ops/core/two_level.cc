#include "ops/core/two_level.h"

#include <cstring>

#include "ops/core/fusion.h"
#include "ops/core/reduce.h"
#include "ops/core/schedule_traits.h"

namespace prophet {

void TwoLevelPushPull::Start() {
  const OpRequest& r = req_;
  const int hosts = layout_.hosts();
  if (r.fusion_bucket_bytes > 0) {  // a fused bucket (fuser.h): each host's share, as the simulator cuts it
    set_parts(BucketPartitions(r.name, r.bytes, static_cast<uint32_t>(element_bytes()), hosts,
                               host()->options().partition_bytes,
                               r.fusion_bucket_bytes / static_cast<uint64_t>(n()) * static_cast<uint64_t>(hosts)));
  } else {
    set_parts(MakePartitions(r.name, r.bytes, element_bytes(), hosts, host()->options().partition_bytes,
                             PartitionMinSplitBytes(host()->options().schedule)));
  }
  const size_t np = parts().size();
  set_pending(static_cast<int>(np));
  name_hash_ = HashString(r.name);
  p_.clear();
  p_.resize(np);

  TensorReady ready;
  ready.name = &r.name;
  ready.round = round();
  ready.priority = r.priority;
  ready.bytes = r.bytes;  // the tensor's (see PushPull::Start)
  ready.ready_ns = submit_ns();
  host()->Announce(ready);
  const int my_host = host_of_rank();
  const int local = static_cast<int>(my_host_ranks().size());
  for (uint32_t p = 0; p < np; ++p) {
    Part& q = p_[p];
    q.leader = PartitionLeader(layout_, my_host, name_hash_, p);
    q.owner = PartitionLeader(layout_, parts()[p].owner, name_hash_, p);
    if (q.leader != rank()) {
      q.role = Role::kMember;
      SendMemberPush(p);
      continue;
    }
    q.role = parts()[p].owner == my_host ? Role::kOwner : Role::kLeader;
    q.needed = local + (q.role == Role::kOwner ? hosts - 1 : 0);
    q.contributed.assign(static_cast<size_t>(q.needed), false);
    q.contributed[0] = true;
    q.held.resize(static_cast<size_t>(q.needed));
    q.added = 1;
    // The host's sum grows in the output from this worker's own values.
    if (r.output != r.input && parts()[p].bytes) std::memcpy(Out(p), In(p), parts()[p].bytes);
  }
  // A leader alone on its host has its host's sum at once (sending never completes a partition
  // here: a partition ends when its frames are written, later).
  for (uint32_t p = 0; p < np; ++p)
    if (p_[p].role != Role::kMember && p_[p].added == p_[p].needed) SumComplete(p);
}

void TwoLevelPushPull::SendMemberPush(uint32_t part) {
  Part& q = p_[part];
  if (!codec().compresses()) {
    host()->Send(q.leader, Frame(FrameType::kPush, part, In(part)));
    return;
  }
  q.push_encoded = host()->TakeBuffer(WireBytes(part));
  const int scale_exp = codec().Encode(In(part), parts()[part].bytes, q.push_encoded.data());
  host()->Send(q.leader, Frame(FrameType::kPush, part,
                               Payload{q.push_encoded.data(), WireBytes(part), codec().encoding(), scale_exp},
                               [this, part] { host()->GiveBuffer(std::move(p_[part].push_encoded)); }));
}

SendTask TwoLevelPushPull::PushTask(uint32_t part) const {
  SendTask t;
  t.name = req_.name;
  t.round = round();
  t.request_id = id();
  t.partition = static_cast<int>(part);
  t.peer = p_[part].owner;
  t.priority = req_.priority;
  t.bytes = WireBytes(part);
  t.ready_ns = submit_ns();
  return t;
}

void TwoLevelPushPull::SendScheduled(const SendTask& task) {
  const uint32_t part = static_cast<uint32_t>(task.partition);
  Part& q = p_[part];
  q.push = PushState::kReleased;
  q.released_ns = NowNs();
  if (!codec().compresses()) {
    host()->Send(q.owner, Frame(FrameType::kPush, part, Out(part), [this, part] { PushSent(part); }));
    return;
  }
  q.push_encoded = host()->TakeBuffer(WireBytes(part));
  const int scale_exp = codec().Encode(Out(part), parts()[part].bytes, q.push_encoded.data());
  host()->Send(q.owner, Frame(FrameType::kPush, part,
                              Payload{q.push_encoded.data(), WireBytes(part), codec().encoding(), scale_exp},
                              [this, part] {
                                host()->GiveBuffer(std::move(p_[part].push_encoded));
                                PushSent(part);
                              }));
}

void TwoLevelPushPull::PushSent(uint32_t part) {
  p_[part].push = PushState::kSent;
  host()->PushLeft(PushTask(part));
}

int TwoLevelPushPull::Position(uint32_t part, int peer) const {
  const Part& q = p_[part];
  if (q.role == Role::kMember || peer == rank() || peer < 0 || peer >= n()) return -1;
  const int my_host = host_of_rank(), peer_host = layout_.host_of[static_cast<size_t>(peer)];
  const int local = static_cast<int>(my_host_ranks().size());
  if (peer_host == my_host) {
    const int mine = layout_.local_index[static_cast<size_t>(rank())];
    return (layout_.local_index[static_cast<size_t>(peer)] - mine + local) % local;
  }
  // Another host's sum: only the owner adds it, and only from that host's leader.
  if (q.role != Role::kOwner || peer != PartitionLeader(layout_, peer_host, name_hash_, part)) return -1;
  const int hosts = layout_.hosts();
  return local - 1 + (peer_host - my_host + hosts) % hosts;
}

int TwoLevelPushPull::RankAt(uint32_t part, int position) const {
  const std::vector<int>& mine = my_host_ranks();
  const int local = static_cast<int>(mine.size());
  if (position < local) {
    const int me = layout_.local_index[static_cast<size_t>(rank())];
    return mine[static_cast<size_t>((me + position) % local)];
  }
  const int hosts = layout_.hosts();
  return PartitionLeader(layout_, (host_of_rank() + position - local + 1) % hosts, name_hash_, part);
}

std::string TwoLevelPushPull::Mismatch(int peer, const FrameMeta& meta) const {
  const OpRequest& r = req_;
  if (meta.dtype != r.dtype || meta.shape != r.shape)
    return Describe() + ": rank " + std::to_string(rank()) + " has shape " + ShapeString(r.shape) + " " +
           DataTypeName(r.dtype) + " but rank " + std::to_string(peer) + " has shape " + ShapeString(meta.shape) +
           " " + DataTypeName(meta.dtype) + "; every worker must pass the same shape and dtype for the same name";
  const std::string encoding = EncodingMismatch(peer, meta);
  if (!encoding.empty()) return encoding;
  const uint32_t part = meta.partition;
  if (part >= parts().size() || parts()[part].offset != meta.offset || WireBytes(part) != meta.payload_bytes)
    return Describe() + ": rank " + std::to_string(peer) +
           " partitioned the tensor differently (different partition_bytes, hierarchical setting or hosts?)";
  const int position = Position(part, peer);
  if (position < 0)
    return Describe() + ": rank " + std::to_string(peer) + " sent partition " + std::to_string(part) + " to rank " +
           std::to_string(rank()) + ", which does not sum that contribution on the two-level path (the workers "
           "disagree on the hosts: " + layout_.Describe() + " here)";
  if (p_[part].contributed[static_cast<size_t>(position)])
    return Describe() + ": rank " + std::to_string(peer) + " sent partition " + std::to_string(part) + " twice";
  return "";
}

bool TwoLevelPushPull::ExpectedResult(int peer, const FrameMeta& meta) const {
  const uint32_t part = meta.partition;
  if (part >= parts().size() || parts()[part].offset != meta.offset || WireBytes(part) != meta.payload_bytes ||
      meta.encoding != codec().encoding())
    return false;
  const Part& q = p_[part];
  if (q.result) return false;
  if (q.role == Role::kMember) return peer == q.leader;
  return q.role == Role::kLeader && peer == q.owner && q.push == PushState::kSent;
}

PayloadSink TwoLevelPushPull::OnFrame(int peer, const FrameMeta& meta) {
  if (meta.type == FrameType::kResult) {
    if (!ExpectedResult(peer, meta)) return PayloadSink::Discard();  // not what this worker waits for
    const uint32_t part = meta.partition;
    // Compressed, a leader keeps the payload as it came, to pass the same bytes on (OnWholeFrame).
    if (codec().compresses() && p_[part].role == Role::kLeader) return PayloadSink::Buffer();
    return ResultSink(Out(part), meta);
  }
  if (!Admit(peer, meta)) return PayloadSink::Discard();
  const uint32_t part = meta.partition;
  // Before its turn: held whole, added when the contributions before it are (OnWholeFrame).
  if (Position(part, peer) != p_[part].added) return PayloadSink::Buffer();
  const int scale_exp = meta.scale_exp;
  return PayloadSink::Stream(
      [this, part, scale_exp](uint64_t at, const char* data, uint64_t len) { Accumulate(part, at, data, len, scale_exp); },
      id());
}

void TwoLevelPushPull::OnPayloadDone(int peer, const FrameMeta& meta) {
  const uint32_t part = meta.partition;
  if (meta.type == FrameType::kPush) {
    p_[part].contributed[static_cast<size_t>(Position(part, peer))] = true;
    ContributionDone(part);
    return;
  }
  ResultArrived(part);
}

void TwoLevelPushPull::OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) {
  const uint32_t part = meta.partition;
  if (meta.type == FrameType::kResult) {  // a leader's compressed result (OnFrame buffered it)
    if (!ExpectedResult(peer, meta) || p_[part].role != Role::kLeader) return;
    Part& q = p_[part];
    codec().Decode(data->data(), meta.payload_bytes, meta.scale_exp, Out(part));
    q.result_encoded = std::move(*data);
    q.result_scale_exp = meta.scale_exp;
    ResultArrived(part);
    return;
  }
  if (!Admit(peer, meta)) return;
  Part& q = p_[part];
  const int position = Position(part, peer);
  q.contributed[static_cast<size_t>(position)] = true;
  if (position == q.added) {
    Accumulate(part, 0, data->data(), meta.payload_bytes, meta.scale_exp);
    ContributionDone(part);
    return;
  }
  q.held[static_cast<size_t>(position)] = Held{std::move(*data), meta.payload_bytes, meta.scale_exp, true};
}

void TwoLevelPushPull::Accumulate(uint32_t part, uint64_t wire_at, const char* data, uint64_t wire_len, int scale_exp) {
  const PayloadCodec& c = codec();
  char* out = Out(part) + c.TensorBytes(wire_at);
  if (c.compresses()) c.DecodeAdd(data, wire_len, scale_exp, out);
  else SumInto(req_.dtype, out, data, c.TensorBytes(wire_len) / element_bytes());
}

void TwoLevelPushPull::ContributionDone(uint32_t part) {
  Part& q = p_[part];
  for (++q.added; q.added < q.needed && q.held[static_cast<size_t>(q.added)].held; ++q.added) {
    Held& h = q.held[static_cast<size_t>(q.added)];
    Accumulate(part, 0, h.data.data(), h.bytes, h.scale_exp);
    host()->GiveBuffer(std::move(h.data));
    h = Held{};
  }
  if (q.added == q.needed) SumComplete(part);
}

void TwoLevelPushPull::SumComplete(uint32_t part) {
  Part& q = p_[part];
  if (q.role == Role::kLeader) {
    q.push = PushState::kQueued;
    host()->Schedule(PushTask(part));
    return;
  }
  // The owner: the total, to the other hosts' leaders and to this host's ranks.
  const Partition& p = parts()[part];
  char* out = Out(part);
  if (req_.average) DivideBy(req_.dtype, out, p.bytes / element_bytes(), n());
  Payload result{out, p.bytes};
  if (codec().compresses()) {
    // Encoded once for every peer and decoded here too, so that every worker holds the same bits.
    q.result_encoded = host()->TakeBuffer(WireBytes(part));
    result = Payload{q.result_encoded.data(), WireBytes(part), codec().encoding(),
                     codec().Encode(out, p.bytes, q.result_encoded.data())};
    codec().Decode(result.data, result.bytes, result.scale_exp, out);
  }
  std::vector<int> peers;
  for (int h = 0; h < layout_.hosts(); ++h)
    if (h != host_of_rank()) peers.push_back(PartitionLeader(layout_, h, name_hash_, part));
  for (const int r : my_host_ranks())
    if (r != rank()) peers.push_back(r);
  SendResult(part, peers, result);
}

void TwoLevelPushPull::ResultArrived(uint32_t part) {
  Part& q = p_[part];
  q.result = true;
  if (q.role == Role::kMember) {
    EventDone();  // may free `this`
    return;
  }
  // A leader: its push is answered; the result goes on to its host's ranks, as it came.
  q.push = PushState::kDone;
  TransferDone d;
  d.task = PushTask(part);
  d.sent_ns = q.released_ns;
  d.done_ns = NowNs();
  host()->PushCompleted(d);
  Payload result{Out(part), parts()[part].bytes};
  if (codec().compresses())
    result = Payload{q.result_encoded.data(), WireBytes(part), codec().encoding(), q.result_scale_exp};
  std::vector<int> peers;
  for (const int r : my_host_ranks())
    if (r != rank()) peers.push_back(r);
  SendResult(part, peers, result);
}

void TwoLevelPushPull::SendResult(uint32_t part, const std::vector<int>& peers, const Payload& payload) {
  if (peers.empty()) {
    host()->GiveBuffer(std::move(p_[part].result_encoded));
    EventDone();  // may free `this`
    return;
  }
  p_[part].sends_left = static_cast<int>(peers.size());
  for (const int peer : peers) {
    host()->Send(peer, Frame(FrameType::kResult, part, payload, [this, part] {
                   if (--p_[part].sends_left > 0) return;
                   host()->GiveBuffer(std::move(p_[part].result_encoded));
                   EventDone();
                 }));
  }
}

std::vector<bool> TwoLevelPushPull::WaitingFor() const {
  std::vector<bool> missing(static_cast<size_t>(n()), false);
  for (uint32_t p = 0; p < p_.size(); ++p) {
    const Part& q = p_[p];
    if (q.role == Role::kMember) {
      if (!q.result) missing[static_cast<size_t>(q.leader)] = true;
      continue;
    }
    if (q.added < q.needed) {
      for (int position = 1; position < q.needed; ++position)
        if (!q.contributed[static_cast<size_t>(position)]) missing[static_cast<size_t>(RankAt(p, position))] = true;
    } else if (q.role == Role::kLeader && !q.result) {
      missing[static_cast<size_t>(q.owner)] = true;
    }
  }
  return missing;
}

void TwoLevelPushPull::Complete(const Status& status) {
  for (uint32_t p = 0; p < p_.size(); ++p) {
    Part& q = p_[p];
    // A released push that will not leave now (the engine dropped its frame): its credit.
    if (q.push == PushState::kReleased) host()->PushLeft(PushTask(p));
    host()->GiveBuffer(std::move(q.push_encoded));
    host()->GiveBuffer(std::move(q.result_encoded));
    for (Held& h : q.held)
      if (h.held) host()->GiveBuffer(std::move(h.data));
  }
  Collective::Complete(status);
}

}  // namespace prophet
