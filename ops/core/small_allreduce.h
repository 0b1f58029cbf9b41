// The sum of a small tensor by recursive doubling: log2(N) messages per worker instead of N-1
// pushes to one owner and N-1 sums back (docs/design.md, "Small tensors").
//
// A control collective too small to spread over N owners (metric state, loss-scale flags, the
// step report's sum, a scalar of the crossing's barrier) gets one or a few owners under push_pull: each such owner handles N-1 pushes and N-1 sums while the others wait,
// so its latency grows linearly with N. Here every worker exchanges its partial sum with one
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
// tensor's bytes, N, partition_bytes, the compression, the fusion bucket size), so that all
// workers take the same path. Compressed tensors stay on push_pull.
#ifndef PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_
#define PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/collective.h"

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

// Which tensors go by exchange: where its predicted time is below the owner path's, in a model
// of a worker's time as bytes at the link rate R (so a message's cost c is R c bytes):
//   exchange:   stages x (2 R c + B)              a stage sends one frame and receives one
//   one owner:  2 (N-1) x (R c + B)                its N-1 pushes in and N-1 sums out
//   N owners:   4 (N-1) x R c + 2 (N-1)/N x B      each worker handles 2 (N-1) frames each way
// The exchange wins for small B at every N but 3 (3 stages of 2 frames against an owner's 4
// frames) and loses once its stages x B outweigh the messages it saves. R c: for a fusion bucket
// of `fusion_bucket_bytes`, bucket / N / kFusionAmortisation, the R c its size was derived from
// (fusion.h); otherwise kFusionAssumedLink_Bps x kFusionMessageCostNs (25 kB), what every worker
// assumes alike. Only what every worker knows alike goes in, so that all take the same path.
double SmallAllreduceMessageBytes(uint64_t fusion_bucket_bytes, int world_size);
double ExchangeCostBytes(int world_size, uint64_t bytes, double message_bytes);
double OwnerCostBytes(int world_size, uint64_t bytes, double message_bytes);
// Whether a push_pull of `bytes` can go by exchange: uncompressed (a compressed tensor's owner
// encodes the sum once for all), not empty, one frame (at most partition_bytes; an early one is
// held within that), below N x 64 KiB (beyond, MakePartitions spreads it over N owners).
bool SmallAllreduceFits(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression);
// Whether it goes by exchange: it fits, and ExchangeCostBytes < OwnerCostBytes.
bool SmallAllreduceApplies(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression,
                           double message_bytes);

// Whether the engine sends `request` (a push_pull) by exchange, as EngineOptions::small_allreduce
// says. Auto: a control collective (priority >= kControlPriority: metrics, flags, reductions,
// barriers) that SmallAllreduceApplies to. Gradients stay on push_pull: the scheduler orders
// their pushes, and its bandwidth estimate and Prophet's profile come from them (a model whose
// every gradient went by exchange would give schedule="auto" no bandwidth sample); small
// gradients travel fused.
bool ExchangesThis(const OpRequest& request, int world_size, const EngineOptions& options);

// The exchange as an operation (a push_pull request the engine routes here when
// SmallAllreduceApplies). Frames: kExchange, partition = stage, num_partitions = stages, the
// whole tensor each. A frame is checked against the plan (its sender is this stage's partner, it
// carries exactly the tensor, once) before its payload gets memory; frames of later stages are
// held (pooled buffers) until their stage. The values sent travel in a copy the frame owns, so
// they are never changed under the socket and always reach the partner, even when this worker
// is done before its last frame left (its result does not depend on that frame).
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

  std::vector<ExchangeStep> plan_;
  size_t next_ = 0;       // the step to run next
  bool sent_next_ = false;  // plan_[next_]'s frame is sent
  bool averaged_ = false;
  // By step: the frame received for it, held until its turn.
  struct Held {
    ByteBuffer data;
    bool here = false;
  };
  std::vector<Held> held_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_SMALL_ALLREDUCE_H_
