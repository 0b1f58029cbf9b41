// One submitted operation on this worker (push_pull by owners or by exchange, broadcast or allgather), between the
// engine that routes frames to it by `name#round` and the connections that carry its frames.
//
// A collective decides how its tensor is cut and who owns what, what it sends, where the payload
// of each frame it receives goes, when it is complete, and what it still waits for. It checks
// every frame against its own request: a mismatch (shape, dtype, kind, partitioning) fails the
// operation on every worker with one message naming both sides. It never touches a socket or
// another operation; it reaches the engine only through CollectiveHost.
//
// Lifetime: the engine owns collectives and frees one in Finish(). Anything that can finish an
// operation (a send completion, a failure) may therefore free `this`: after such a call, check
// host()->Alive(id) before touching members again.
#ifndef PROPHET_OPS_CORE_COLLECTIVE_H_
#define PROPHET_OPS_CORE_COLLECTIVE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ops/core/connection.h"
#include "ops/core/engine.h"
#include "ops/core/hosts.h"
#include "ops/core/partition.h"
#include "ops/core/scheduler.h"
#include "ops/core/wire.h"

namespace prophet {

class Collective;

// The error notice that fails the operation name#round with `status` on the worker that receives
// it (the code travels too); ErrorFrameStatus reads it back.
OutFrame ErrorNotice(const std::string& name, uint64_t round, const Status& status);
// The collective a frame type belongs to ("push_pull" for PUSH and RESULT, ...).
const char* CollectiveOfFrame(FrameType type);

// What a collective needs from the engine, and nothing more.
class CollectiveHost {
 public:
  virtual ~CollectiveHost() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual const EngineOptions& options() const = 0;
  // The hosts when push_pulls take the two-level path (two_level.h), else null.
  virtual const HostLayout* two_level_hosts() const { return nullptr; }
  // Queues a frame to `peer` (dropped if that connection is closed).
  virtual void Send(int peer, OutFrame frame) = 0;
  // Whether the operation with this id is still running (not finished nor failed).
  virtual bool Alive(uint64_t op_id) const = 0;
  // Ends `op` (and frees it) with `status`.
  virtual void Finish(Collective* op, const Status& status) = 0;
  // A mismatch found here: fails `op` on every worker with `message` (and frees it).
  virtual void FailEverywhere(Collective* op, const std::string& message) = 0;
  // `peer` sent `op` a frame no worker sends (a size the operation cannot carry): FailEverywhere,
  // then drops the connection to `peer`.
  virtual void Refuse(Collective* op, int peer, const std::string& message) = 0;
  // Scheduling of push_pull partitions: a tensor is ready, then each of its PUSHes is handed to
  // the scheduler, which releases it later through Collective::SendScheduled.
  virtual void Announce(const TensorReady& ready) = 0;
  virtual void Schedule(SendTask task) = 0;
  // The policy also schedules the partitions this worker owns (SchedulerPolicy::
  // schedules_owned_partitions).
  virtual bool SchedulesOwnedPartitions() const { return false; }
  // A released push left this worker (its last byte is in the kernel) or never will (the operation
  // ended): returns its credit (SchedulerPolicy::OnPushLeft).
  virtual void PushLeft(const SendTask& task) = 0;
  // A pushed partition's result came back, or an exchange stage's partner answered (feeds
  // bandwidth and timeline).
  virtual void PushCompleted(const TransferDone& done) = 0;
  // Memory for encoded payloads (compressed frames), recycled warm; give it back when sent.
  virtual ByteBuffer TakeBuffer(size_t bytes) = 0;
  virtual void GiveBuffer(ByteBuffer buffer) = 0;
};

// A frame's payload as it travels: the tensor's own bytes, or a block the operation's codec
// encoded (with its scale exponent).
struct Payload {
  const char* data = nullptr;
  uint64_t bytes = 0;
  Encoding encoding = Encoding::kNone;
  int scale_exp = 0;
};

class Collective {
 public:
  virtual ~Collective() = default;

  uint64_t id() const { return id_; }
  uint64_t round() const { return round_; }
  const std::string& key() const { return key_; }
  const OpRequest& request() const { return req_; }
  int64_t submit_ns() const { return submit_ns_; }
  int64_t deadline_ns() const { return deadline_ns_; }
  // "push_pull 'grad/dense' (round 3)"
  std::string Describe() const;

  // Sends what can be sent at once and sets up what it waits for. May finish the operation.
  virtual void Start() = 0;
  // A frame of this operation arrived from `peer` (header, name and dims): where does its payload
  // go? A frame that does not fit this request fails the operation everywhere (then: discard).
  virtual PayloadSink OnFrame(int peer, const FrameMeta& meta) = 0;
  // A payload received through the sink OnFrame returned (kInto or kStream) is complete.
  virtual void OnPayloadDone(int peer, const FrameMeta& meta) = 0;
  // A whole frame held in memory: it arrived before this worker submitted the operation, or
  // OnFrame asked for it to be buffered. The collective may take `data`; what it leaves is
  // recycled.
  virtual void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) = 0;
  // The scheduler released this PUSH (push_pull only).
  virtual void SendScheduled(const SendTask& /*task*/) {}
  // By rank: whether this operation still waits for that worker (for the timeout message).
  virtual std::vector<bool> WaitingFor() const = 0;
  // Called once when the operation ends, before it is freed: release what it holds, then call
  // the request's done callback.
  virtual void Complete(const Status& status);

 protected:
  Collective(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round);

  CollectiveHost* host() const { return host_; }
  int rank() const { return host_->rank(); }
  int n() const { return host_->world_size(); }
  size_t element_bytes() const { return elem_; }
  const std::vector<Partition>& parts() const { return parts_; }
  void set_parts(std::vector<Partition> parts) { parts_ = std::move(parts); }
  // Events (frames sent or received) left before the operation is complete.
  void set_pending(int events) { pending_ = events; }
  // One event happened; the last one finishes the operation (and frees `this`).
  void EventDone();
  // Tells the scheduler this worker's tensor is ready (its bytes, priority, submission time):
  // the profile (timeline, schedule="auto"'s prediction) describes tensors.
  void AnnounceReady();

  // The one place where an operation's frames are made: `type` for partition `part` (its
  // offset), with `payload`. `on_sent` runs only while the operation is alive.
  OutFrame Frame(FrameType type, uint32_t part, const Payload& payload, std::function<void()> on_sent = nullptr) const;
  // A frame that carries its own copy of `payload`: it leaves even after the operation ended
  // (the engine drops only frames whose payload points into an operation's tensors).
  OutFrame OwnedFrame(FrameType type, uint32_t part, std::string payload) const;
  // The same with the partition's own bytes at `data` (uncompressed).
  OutFrame Frame(FrameType type, uint32_t part, const char* data, std::function<void()> on_sent = nullptr) const {
    return Frame(type, part, Payload{data, parts_[part].bytes}, std::move(on_sent));
  }
  // How this operation's payloads travel (compressed or not; see codec.h).
  const PayloadCodec& codec() const { return codec_; }
  // Where a RESULT's payload for `out` goes: straight into it, or, compressed, decoded piece by
  // piece as it lands, while the codes are in cache.
  PayloadSink ResultSink(char* out, const FrameMeta& meta);
  // "push_pull 'x' (round 3): rank 1 sends it compressed as fp16 but rank 0 as none; ...", or ""
  // when `meta` travels as this worker's frames do.
  std::string EncodingMismatch(int peer, const FrameMeta& meta) const;
  // "push_pull 'x' (round 3): rank 0 has shape [4] float32 but rank 1 has shape [5] float32; ...",
  // or "" when `meta` has this request's shape and dtype.
  std::string ShapeMismatch(int peer, const FrameMeta& meta) const;
  // The type of the frames peers send this collective's data in (kPush, kBroadcast, kGather).
  virtual FrameType frame_type() const = 0;
  // Why a frame of frame_type() from `peer` does not fit this request, or "" when it does.
  virtual std::string Mismatch(int peer, const FrameMeta& meta) const = 0;
  // Whether a frame from `peer` is one this operation takes. If not, the operation has failed on
  // every worker (a different kind of collective or a mismatch; a stray RESULT is only dropped),
  // and `this` may be gone.
  bool Admit(int peer, const FrameMeta& meta);

  OpRequest req_;

 private:
  FrameMeta FrameMetaOf(FrameType type, uint32_t part, const Payload& payload) const;
  CollectiveHost* const host_;
  const uint64_t id_;
  const uint64_t round_;
  const std::string key_;
  const size_t elem_;
  const int64_t submit_ns_;
  const int64_t deadline_ns_;
  const PayloadCodec codec_;
  std::vector<Partition> parts_;
  int pending_ = 0;
};

// "name#round": how frames find their operation.
std::string OperationKey(const std::string& name, uint64_t round);

// The status an error notice (kError frame, `message` its payload) fails its operation with.
Status ErrorFrameStatus(const FrameMeta& meta, std::string message);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_COLLECTIVE_H_
