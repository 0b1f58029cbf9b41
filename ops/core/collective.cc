#include "ops/core/collective.h"

namespace prophet {

const char* CollectiveOfFrame(FrameType type) {
  switch (type) {
    case FrameType::kPush:
    case FrameType::kResult:
    case FrameType::kExchange: return OpKindName(OpKind::kPushPull);
    case FrameType::kBroadcast: return OpKindName(OpKind::kBroadcast);
    case FrameType::kGather: return OpKindName(OpKind::kAllgather);
    case FrameType::kError:
    case FrameType::kProbe:
    case FrameType::kProbeReply:
    case FrameType::kHeartbeat:
    case FrameType::kPeerLost:
    case FrameType::kLeaving:
    case FrameType::kFusionCheck: break;  // control frames belong to no collective
  }
  return "?";
}

OutFrame ErrorNotice(const std::string& name, uint64_t round, const Status& status) {
  const std::string message = status.message().substr(0, kMaxErrorMessageBytes);
  FrameMeta meta;
  meta.type = FrameType::kError;
  meta.name = name;
  meta.round = round;
  meta.partition = static_cast<uint32_t>(status.code());
  meta.payload_bytes = message.size();
  return MakeOwnedFrame(meta, message, kUrgentPriority);
}

std::string OperationKey(const std::string& name, uint64_t round) { return name + "#" + std::to_string(round); }

Collective::Collective(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round)
    : req_(std::move(request)),
      host_(host),
      id_(id),
      round_(round),
      key_(OperationKey(req_.name, round)),
      elem_(DataTypeSize(req_.dtype)),
      submit_ns_(NowNs()),
      deadline_ns_(submit_ns_ + static_cast<int64_t>(host->options().timeout_s * 1e9)),
      codec_(req_.kind == OpKind::kBroadcast ? Encoding::kNone : req_.compression, req_.dtype) {}

std::string Collective::Describe() const {
  return std::string(OpKindName(req_.kind)) + " '" + req_.name + "' (round " + std::to_string(round_) + ")";
}

void Collective::EventDone() {
  if (--pending_ == 0) host_->Finish(this, Status::OK());
}

void Collective::AnnounceReady() {
  TensorReady ready;
  ready.name = &req_.name;
  ready.round = round_;
  ready.priority = req_.priority;
  ready.bytes = req_.bytes;
  ready.ready_ns = submit_ns_;
  host_->Announce(ready);
}

FrameMeta Collective::FrameMetaOf(FrameType type, uint32_t part, const Payload& payload) const {
  FrameMeta meta;
  meta.type = type;
  meta.dtype = req_.dtype;
  meta.name = req_.name;
  meta.round = round_;
  meta.shape = req_.shape;
  meta.partition = part;
  meta.num_partitions = static_cast<uint32_t>(parts_.size());
  meta.offset = parts_[part].offset;
  meta.payload_bytes = payload.bytes;
  meta.encoding = payload.encoding;
  meta.scale_exp = payload.scale_exp;
  return meta;
}

OutFrame Collective::OwnedFrame(FrameType type, uint32_t part, std::string payload) const {
  const FrameMeta meta = FrameMetaOf(type, part, Payload{nullptr, payload.size()});
  return MakeOwnedFrame(meta, std::move(payload), req_.priority);
}

OutFrame Collective::Frame(FrameType type, uint32_t part, const Payload& payload, std::function<void()> on_sent) const {
  const FrameMeta meta = FrameMetaOf(type, part, payload);
  std::function<void()> when_alive;
  if (on_sent) {
    CollectiveHost* host = host_;
    const uint64_t id = id_;
    when_alive = [host, id, on_sent = std::move(on_sent)] {
      if (host->Alive(id)) on_sent();
    };
  }
  return MakeFrame(meta, payload.data, req_.priority, id_, std::move(when_alive));
}

namespace {
std::string HowItTravels(Encoding encoding) {
  return encoding == Encoding::kNone ? "uncompressed" : std::string("compressed to ") + EncodingName(encoding);
}
}  // namespace

std::string Collective::ShapeMismatch(int peer, const FrameMeta& meta) const {
  if (meta.dtype == req_.dtype && meta.shape == req_.shape) return "";
  return Describe() + ": rank " + std::to_string(rank()) + " has shape " + ShapeString(req_.shape) + " " +
         DataTypeName(req_.dtype) + " but rank " + std::to_string(peer) + " has shape " + ShapeString(meta.shape) +
         " " + DataTypeName(meta.dtype) + "; every worker must pass the same shape and dtype for the same name";
}

std::string Collective::EncodingMismatch(int peer, const FrameMeta& meta) const {
  if (meta.encoding == codec_.encoding()) return "";
  return Describe() + ": rank " + std::to_string(peer) + " sends it " + HowItTravels(meta.encoding) + " but rank " +
         std::to_string(rank()) + " " + HowItTravels(codec_.encoding()) +
         "; every worker must ask for the same compression (ProphetStrategy(compression=...), "
         "push_pull(..., compression=...))";
}

Status ErrorFrameStatus(const FrameMeta& meta, std::string message) {
  // Only the codes an operation fails with travel; anything else is read as a mismatch.
  Code code = Code::kInvalidArgument;
  switch (static_cast<Code>(meta.partition)) {
    case Code::kDeadlineExceeded:
    case Code::kUnavailable:
    case Code::kInternal:
    case Code::kFailedPrecondition:
      code = static_cast<Code>(meta.partition);
      break;
    default:
      break;
  }
  return Status(code, std::move(message));
}

bool Collective::Admit(int peer, const FrameMeta& meta) {
  if (meta.type != frame_type()) {
    // The same collective by another path (a push_pull by exchange here, by owners there): the
    // workers' tensors or compression differ, which is what the message should say.
    if (CollectiveOfFrame(meta.type) == std::string(OpKindName(req_.kind)) && meta.type != FrameType::kResult) {
      std::string why = ShapeMismatch(peer, meta);
      if (why.empty()) why = EncodingMismatch(peer, meta);
      if (why.empty())
        why = Describe() + ": rank " + std::to_string(peer) + " sends it by another path than rank " +
              std::to_string(rank()) + " (a different prophet_tf or partition_bytes?)";
      host_->FailEverywhere(this, why);
      return false;
    }
    // A RESULT answers a PUSH of a push_pull that no longer exists here: drop the bytes.
    if (meta.type != FrameType::kResult)
      host_->FailEverywhere(this, "'" + req_.name + "' (round " + std::to_string(round_) + ") is a " +
                                      CollectiveOfFrame(meta.type) + " on rank " + std::to_string(peer) + " but a " +
                                      OpKindName(req_.kind) + " on rank " + std::to_string(rank()));
    return false;
  }
  const std::string mismatch = Mismatch(peer, meta);
  if (mismatch.empty()) return true;
  host_->FailEverywhere(this, mismatch);
  return false;
}

void Collective::Complete(const Status& status) { req_.done(status, nullptr); }

PayloadSink Collective::ResultSink(char* out, const FrameMeta& meta) {
  if (!codec().compresses()) return PayloadSink::Into(out, id());
  const int scale_exp = meta.scale_exp;
  return PayloadSink::Stream(
      [this, out, scale_exp](uint64_t at, const char* data, uint64_t len) {
        codec().Decode(data, len, scale_exp, out + codec().TensorBytes(at));
      },
      id());
}

}  // namespace prophet
