// The sum of a small tensor by recursive doubling: log2(N) messages per worker instead of N-1
// pushes to one owner and N-1 sums back (docs/design.md, "Small tensors").
//
// A control collective too small to spread over N owners (metric state, loss-scale flags, the
// step report's sum, a scalar of the crossing's barrier) gets one or a few owners under
// push_pull: each such owner handles N-1 pushes and N-1 sums while the others wait, so its
// latency grows linearly with N. Here every worker exchanges its partial sum with one
// partner per stage, and the partners double: P = the largest power of two <= N workers take
// part, log2(P) stages. With N = P + r (0 < r < P), the first 2r ranks fold in pairs first (an even
// rank sends its values to the odd rank above it, which takes part in its place) and the odd rank
// sends the even one the final sum at the end: log2(P) + 2 stages.
//
// Bits: every sum is of exactly two operands, in one fixed order (the lower virtual rank's first),
// so the two partners of a stage compute the very same operation and hold the same bits; by
// induction every worker ends with the same bits, whatever order frames arrive in, every run
// (a + b == b + a holds for IEEE addition; the fixed order also keeps NaN payloads alike). The
// summation tree differs from the owner's order (own, owner+1, ...): small tensors sum in another
// order than before from N = 3 on (the same bits everywhere, run to run).
//
// Which tensors: SmallAllreduceApplies, a pure function of what every worker knows alike (the
// tensor's bytes, its priority, N, partition_bytes, the compression), so that all
// workers take the same path. Compressed tensors stay on push_pull.
#ifndef PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_
#define PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/collective.h"
#include "ops/core/fusion.h"

namespace prophet {

// One stage of a worker's exchange: it sends its current values (its partial sum, or with
// `send_result` the final sum) to `send_to`, then waits for `receive_from`'s values and adds them
// (or, with `receive_result`, takes them as the final sum).
struct ExchangeStep {
  int stage = 0;          // the frame's `partition`; stages are numbered alike on every worker
  int send_to = -1;       // -1: sends nothing at this stage
  int receive_from = -1;  // -1: receives nothing at this stage
  bool send_result = false;     // the fold's last stage: the final sum (averaged if asked) to the folded rank
  bool receive_result = false;  // the folded rank gets the final sum
  bool mine_first = false;      // sum = mine + theirs (this worker has the lower virtual rank), else theirs + mine
};

// Stages of the exchange of N workers: log2(P), plus 2 when N is not a power of two.
int ExchangeStages(int world_size);
// The stages worker `rank` takes part in, in order.
std::vector<ExchangeStep> ExchangePlan(int rank, int world_size);

// Which tensors go by exchange: where its predicted latency is below the owner path's, in a
// model of one worker's critical path (each worker has its own CPU; its I/O thread handles its
// frames one at a time). A frame costs `message_ns` of CPU (its sender's and its receiver's
// together), `latency_ns` on the link (one way) and bytes / link_Bps on the wire:
//   exchange:   stages x (m + L + B/R)           each stage: send one frame, receive the partner's
//   k owners:   2 L + N m + 2 (N-1) B/(k R)        a push in, an owner's N-1 receives and N-1
//                                                  sends one after the other (its link carries
//                                                  N-1 pushes in and N-1 sums out), the sum back
// (k: the owners MakePartitions spreads it over, one per 64 KiB below N x 64 KiB.) For a tiny
// tensor the exchange wins where (stages - 2) L < (N - stages) m: at N = 2 (one hop against a
// push and its sum) and N = 4 at any latency, never at N = 3 (3 stages with the fold); at other
// N once the N - stages frames it saves the owner outweigh its stages - 2 extra hops (with the
// assumed 20 us per frame and 25 us latency: every N but 3, 5 and 6 up to 256). Larger tensors
// tilt it towards the exchange (stages x B against an owner's 2 (N-1) B / k) while one owner
// takes them whole (below 128 KiB); beyond, their owners share the bytes.
// The engine decides with what every worker assumes alike (the default ExchangeModel: fusion's
// per-message cost and link rate, kExchangeAssumedLatencyNs), so that all take the same path;
// the simulator predicts that choice with the same model and the time it takes with its own.
// With the two-level path on, the comparison is still with the flat owner path (not modelled:
// the two-level path's four hops, two across the network, and H - 1 + K - 1 frames at a leader).
constexpr int64_t kExchangeAssumedLatencyNs = 25000;  // one way, a data-centre TCP hop (an estimate)
struct ExchangeModel {
  double message_ns = static_cast<double>(kFusionMessageCostNs);
  double latency_ns = static_cast<double>(kExchangeAssumedLatencyNs);
  double link_Bps = kFusionAssumedLink_Bps;
  // The owner path's cut of a small tensor: MakePartitions' min_split_bytes under the schedule
  // (PartitionMinSplitBytes; kNoExtraSplit keeps it on one owner).
  uint64_t min_split_bytes = kDefaultMinSplitBytes;
};
double ExchangeTimeNs(int world_size, uint64_t bytes, const ExchangeModel& model = ExchangeModel());
double OwnerTimeNs(int world_size, uint64_t bytes, const ExchangeModel& model = ExchangeModel());
// Whether a push_pull of `bytes` can go by exchange: uncompressed (a compressed tensor's owner
// encodes the sum once for all), not empty, one frame (at most partition_bytes; an early one is
// held within that), below N x 64 KiB (beyond, MakePartitions spreads it over N owners).
bool SmallAllreduceFits(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression);
// Whether it goes by exchange: it fits, and ExchangeTimeNs < OwnerTimeNs.
bool SmallAllreduceApplies(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression,
                           const ExchangeModel& model = ExchangeModel());

// Whether the engine sends `request` (a push_pull) by exchange, as EngineOptions::small_allreduce
// says. Auto: a control collective (priority >= kControlPriority: metrics, flags, reductions,
// barriers) that SmallAllreduceApplies to, unless it is to be cut as a bucket (fusion_bucket_bytes). Gradients stay on push_pull: the scheduler orders
// their pushes and Prophet's profile comes from them; small gradients travel fused.
bool ExchangesThis(const OpRequest& request, int world_size, const EngineOptions& options);
// "never"/"auto"/"always" (and "0"/"false" = never, "1"/"true" = auto: the engine's path or the
// owners'), the simulator's RuntimeModel::small_allreduce; false for anything else.
bool ParseSmallAllreduce(const std::string& text, EngineOptions::SmallAllreduceMode* out);

// The exchange as an operation (a push_pull request the engine routes here when
// SmallAllreduceApplies). Frames: kExchange, partition = stage, num_partitions = stages, the
// whole tensor each. A frame is checked against the plan (its sender is this stage's partner, it
// carries exactly the tensor, once) before its payload gets memory; frames of later stages are
// held (pooled buffers) until their stage. The values sent travel in a copy the frame owns, so
// they are never changed under the socket and always reach the partner, even when this worker
// is done before its last frame left (its result does not depend on that frame).
// Bandwidth: a stage whose partner's frame arrived after this worker sent its own is a transfer
// of the tensor's bytes from that send to that arrival (as a push and its sum are), reported
// through CollectiveHost::PushCompleted: with the control collectives exchanged, a worker that
// owns every gradient partition (a small model at N = 2) still measures its link, and
// schedule="auto" still decides (tests/test_auto_schedule.py).
class SmallAllreduce : public Collective {
 public:
  SmallAllreduce(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round);

  void Start() override;
  PayloadSink OnFrame(int peer, const FrameMeta& meta) override;
  void OnPayloadDone(int peer, const FrameMeta& meta) override;
  void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) override;
  std::vector<bool> WaitingFor() const override;
  void Complete(const Status& status) override;

 private:
  FrameType frame_type() const override { return FrameType::kExchange; }
  std::string Mismatch(int peer, const FrameMeta& meta) const override;
  // Index into plan_ of the stage that receives from `peer` at `stage`, or -1.
  int StepReceiving(int peer, uint32_t stage) const;
  // Runs the plan from next_ as far as the frames here allow; the last step finishes (and may
  // free `this`).
  void Advance();
  void Send(const ExchangeStep& step);
  void Average();
  // The frame of plan_[step] arrived at `arrived_ns`: a transfer if that was after this worker's
  // last send (see above).
  void MaybeReportTransfer(size_t step, int64_t arrived_ns);

  std::vector<ExchangeStep> plan_;
  size_t next_ = 0;       // the step to run next
  bool sent_next_ = false;  // plan_[next_]'s frame is sent
  bool averaged_ = false;
  int64_t last_send_ns_ = -1;  // when this worker last sent a frame of it
  // By step: the frame received for it, held until its turn.
  struct Held {
    ByteBuffer data;
    bool here = false;
    int64_t arrived_ns = 0;
  };
  std::vector<Held> held_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_
