#include "ops/core/broadcast.h"

#include <cstring>

namespace prophet {

void Broadcast::Start() {
  const OpRequest& r = req_;
  if (r.root_rank < 0 || r.root_rank >= n()) {
    host()->Finish(this, Status(Code::kInvalidArgument, "broadcast '" + r.name + "': root_rank " +
                                                            std::to_string(r.root_rank) + " outside [0, " +
                                                            std::to_string(n()) + ")"));
    return;
  }
  set_parts(MakePartitions(r.name, r.bytes, element_bytes(), 1, host()->options().partition_bytes));
  const int np = static_cast<int>(parts().size());
  if (rank() != r.root_rank) {
    received_.assign(parts().size(), false);
    set_pending(np);
    return;
  }
  if (r.output != r.input && r.bytes) std::memcpy(r.output, r.input, r.bytes);
  set_pending((n() - 1) * np);
  if (n() == 1) {
    host()->Finish(this, Status::OK());
    return;
  }
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank()) continue;
    for (uint32_t p = 0; p < parts().size(); ++p)
      host()->Send(peer, Frame(FrameType::kBroadcast, p, static_cast<const char*>(r.input) + parts()[p].offset,
                               [this] { EventDone(); }));
  }
}

std::string Broadcast::Mismatch(int peer, const FrameMeta& meta) const {
  const OpRequest& r = req_;
  const std::string what = "broadcast '" + r.name + "' (round " + std::to_string(round()) + "): rank " + std::to_string(peer);
  if (meta.dtype != r.dtype || meta.shape != r.shape || peer != r.root_rank)
    return what + " sent shape " + ShapeString(meta.shape) + " " + DataTypeName(meta.dtype) + " but rank " +
           std::to_string(rank()) + " expects " + ShapeString(r.shape) + " " + DataTypeName(r.dtype) + " from root " +
           std::to_string(r.root_rank);
  const uint32_t p = meta.partition;
  if (p >= parts().size() || meta.num_partitions != parts().size() || parts()[p].offset != meta.offset ||
      parts()[p].bytes != meta.payload_bytes)
    return what + " cut the tensor differently (partition " + std::to_string(p) + " of " +
           std::to_string(meta.num_partitions) + ", " + std::to_string(meta.payload_bytes) + " bytes at " +
           std::to_string(meta.offset) + "; here " + std::to_string(parts().size()) +
           " partitions): do all workers run with the same partition_bytes?";
  if (received_[p]) return what + " sent partition " + std::to_string(p) + " twice";
  return "";
}

PayloadSink Broadcast::OnFrame(int peer, const FrameMeta& meta) {
  if (!Admit(peer, meta)) return PayloadSink::Discard();
  received_[meta.partition] = true;
  // The same shape and dtype: DecodeFrameMeta checked that the payload lies inside the tensor.
  return PayloadSink::Into(static_cast<char*>(req_.output) + meta.offset, id());
}

void Broadcast::OnPayloadDone(int /*peer*/, const FrameMeta& /*meta*/) { EventDone(); }

void Broadcast::OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) {
  if (!Admit(peer, meta)) return;
  received_[meta.partition] = true;
  if (!data->empty()) std::memcpy(static_cast<char*>(req_.output) + meta.offset, data->data(), data->size());
  EventDone();
}

std::vector<bool> Broadcast::WaitingFor() const {
  std::vector<bool> missing(n(), false);
  if (req_.root_rank >= 0 && req_.root_rank < n()) missing[req_.root_rank] = rank() != req_.root_rank;
  return missing;
}

}  // namespace prophet
