#include "ops/core/allgather.h"

#include <algorithm>
#include <cstring>

namespace prophet {

void Allgather::Start() {
  const OpRequest& r = req_;
  gathered_.clear();
  gathered_.resize(n());
  scale_exp_.assign(n(), 0);
  gathered_shapes_.assign(n(), {});
  got_.assign(n(), false);
  got_[rank()] = true;
  set_parts({Partition{0, r.bytes, rank()}});  // one frame: the whole tensor
  set_pending(2 * (n() - 1));                  // sent to and received from every other rank
  if (n() == 1) {
    host()->Finish(this, Status::OK());
    return;
  }
  Payload payload{static_cast<const char*>(r.input), r.bytes};
  if (codec().compresses()) {
    ByteBuffer& own = gathered_[rank()];
    own = host()->TakeBuffer(codec().WireBytes(r.bytes));
    scale_exp_[rank()] = codec().Encode(r.input, r.bytes, own.data());
    payload = Payload{own.data(), own.size(), codec().encoding(), scale_exp_[rank()]};
  }
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank()) continue;
    host()->Send(peer, Frame(FrameType::kGather, 0, payload, [this] { EventDone(); }));
  }
}

std::string Allgather::Mismatch(int peer, const FrameMeta& meta) const {
  const OpRequest& r = req_;
  const std::string what = "allgather '" + r.name + "' (round " + std::to_string(round()) + "): rank " + std::to_string(peer);
  const bool tail_match = meta.shape.size() == r.shape.size() && !meta.shape.empty() &&
                          std::equal(meta.shape.begin() + 1, meta.shape.end(), r.shape.begin() + 1);
  if (meta.dtype != r.dtype || !tail_match)
    return what + " has shape " + ShapeString(meta.shape) + " " + DataTypeName(meta.dtype) + " but rank " +
           std::to_string(rank()) + " has " + ShapeString(r.shape) + " " + DataTypeName(r.dtype) +
           "; only the first dimension may differ";
  const std::string encoding = EncodingMismatch(peer, meta);
  if (!encoding.empty()) return encoding;
  // One frame carries a worker's whole tensor: exactly the bytes its shape says.
  uint64_t elements = 1;
  for (int64_t d : meta.shape) elements *= static_cast<uint64_t>(d);  // DecodeFrameMeta bounded the product
  if (meta.partition != 0 || meta.num_partitions != 1 || meta.offset != 0 ||
      meta.payload_bytes != codec().WireBytes(elements * element_bytes()))
    return what + " sent " + std::to_string(meta.payload_bytes) + " bytes at offset " + std::to_string(meta.offset) +
           " of a tensor of shape " + ShapeString(meta.shape) + " (partition " + std::to_string(meta.partition) +
           " of " + std::to_string(meta.num_partitions) + "): an allgather frame is the whole tensor";
  if (got_[peer]) return what + " sent its tensor twice";
  return "";
}

PayloadSink Allgather::OnFrame(int peer, const FrameMeta& meta) {
  if (!Admit(peer, meta)) return PayloadSink::Discard();
  // The first dimension is the sender's own: bounded by configuration, not by this request.
  const uint64_t limit = host()->options().max_early_bytes;
  if (meta.payload_bytes > limit) {
    host()->Refuse(this, peer, "allgather '" + req_.name + "' (round " + std::to_string(round()) + "): rank " +
                                   std::to_string(peer) + " sent a tensor of shape " + ShapeString(meta.shape) + " (" +
                                   std::to_string(meta.payload_bytes) + " bytes), more than max_early_bytes = " +
                                   std::to_string(limit) + " (raise it for allgathers that large)");
    return PayloadSink::Discard();  // `this` is gone
  }
  return PayloadSink::Buffer();
}

void Allgather::OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) {
  if (!Admit(peer, meta)) return;
  gathered_[peer] = std::move(*data);
  scale_exp_[peer] = meta.scale_exp;
  gathered_shapes_[peer] = meta.shape;
  got_[peer] = true;
  EventDone();
}

std::vector<bool> Allgather::WaitingFor() const {
  std::vector<bool> missing(n(), false);
  for (int r = 0; r < n(); ++r) missing[r] = !got_[r];
  return missing;
}

void Allgather::Complete(const Status& status) {
  if (!status.ok()) {
    req_.done(status, nullptr);
    ReleaseOwnEncoded();
    return;
  }
  GatherResult g;
  g.shapes.resize(n());
  g.data.resize(n());
  g.bytes.resize(n());
  g.encoding = codec().encoding();
  g.scale_exp = scale_exp_;
  for (int r = 0; r < n(); ++r) {
    if (r == rank()) {
      g.shapes[r] = req_.shape;
      g.data[r] = codec().compresses() ? gathered_[r].data() : static_cast<const char*>(req_.input);
      g.bytes[r] = req_.bytes;
    } else {
      g.shapes[r] = gathered_shapes_[r];
      g.data[r] = gathered_[r].data();
      g.bytes[r] = codec().TensorBytes(gathered_[r].size());
    }
  }
  req_.done(status, &g);
  ReleaseOwnEncoded();
}

void Allgather::ReleaseOwnEncoded() {
  // Not there when the operation failed before it started (it failed elsewhere first).
  if (static_cast<size_t>(rank()) < gathered_.size()) host()->GiveBuffer(std::move(gathered_[rank()]));
}

void GatherResult::CopyOut(size_t r, char* dst) const {
  if (bytes[r] == 0) return;
  if (encoding == Encoding::kNone) {
    std::memcpy(dst, data[r], bytes[r]);
    return;
  }
  PayloadCodec(encoding, DataType::kFloat32).Decode(data[r], bytes[r] / 2, scale_exp[r], dst);
}

}  // namespace prophet
