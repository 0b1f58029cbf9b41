#include "ops/core/small_allreduce.h"

#include <algorithm>
#include <cstring>

#include "ops/core/fusion.h"
#include "ops/core/partition.h"
#include "ops/core/reduce.h"
#include "ops/core/schedule_traits.h"

namespace prophet {

namespace {

// The largest power of two <= n (n >= 1), and its log2.
int FloorPowerOfTwo(int n, int* log2) {
  int p = 1, k = 0;
  while (2 * p <= n) {
    p *= 2;
    ++k;
  }
  if (log2) *log2 = k;
  return p;
}

}  // namespace

int ExchangeStages(int world_size) {
  if (world_size < 2) return 0;
  int log2 = 0;
  const int p = FloorPowerOfTwo(world_size, &log2);
  return log2 + (p == world_size ? 0 : 2);
}

std::vector<ExchangeStep> ExchangePlan(int rank, int world_size) {
  std::vector<ExchangeStep> plan;
  if (world_size < 2) return plan;
  int log2 = 0;
  const int p = FloorPowerOfTwo(world_size, &log2);
  const int r = world_size - p;  // ranks 0 .. 2r-1 fold in pairs
  const int stages = ExchangeStages(world_size);
  const int first = r > 0 ? 1 : 0;
  const bool folded = rank < 2 * r;
  if (folded && rank % 2 == 0) {  // hands its values to rank + 1, gets the sum back at the end
    ExchangeStep in, out;
    in.stage = 0;
    in.send_to = rank + 1;
    out.stage = stages - 1;
    out.receive_from = rank + 1;
    out.receive_result = true;
    return {in, out};
  }
  if (folded) {
    ExchangeStep in;
    in.stage = 0;
    in.receive_from = rank - 1;
    in.mine_first = false;  // the lower rank's values first
    plan.push_back(in);
  }
  const int v = folded ? rank / 2 : rank - r;  // virtual rank among the P
  auto real = [r](int virtual_rank) { return virtual_rank < r ? 2 * virtual_rank + 1 : virtual_rank + r; };
  for (int k = 0; k < log2; ++k) {
    const int partner = v ^ (1 << k);
    ExchangeStep s;
    s.stage = first + k;
    s.send_to = real(partner);
    s.receive_from = real(partner);
    s.mine_first = v < partner;
    plan.push_back(s);
  }
  if (folded) {
    ExchangeStep out;
    out.stage = stages - 1;
    out.send_to = rank - 1;
    out.send_result = true;
    plan.push_back(out);
  }
  return plan;
}

double ExchangeTimeNs(int world_size, uint64_t bytes, const ExchangeModel& model) {
  const double wire_ns = static_cast<double>(bytes) / model.link_Bps * 1e9;
  return ExchangeStages(world_size) * (model.message_ns + model.latency_ns + wire_ns);
}

double OwnerTimeNs(int world_size, uint64_t bytes, const ExchangeModel& model) {
  const double n = world_size, wire_ns = static_cast<double>(bytes) / model.link_Bps * 1e9;
  // The owners MakePartitions spreads it over (partition_bytes does not cut what fits).
  const double owners = static_cast<double>(std::min<uint64_t>(
      PartitionCount(bytes, 1, world_size, ~uint64_t{0}, model.min_split_bytes), std::max(world_size, 1)));
  return 2 * model.latency_ns + n * model.message_ns + 2 * (n - 1) * wire_ns / owners;
}

bool SmallAllreduceFits(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression) {
  return world_size >= 2 && compression == Encoding::kNone && bytes > 0 && bytes <= partition_bytes &&
         bytes < kDefaultMinSplitBytes * static_cast<uint64_t>(world_size);
}

bool SmallAllreduceApplies(uint64_t bytes, int world_size, uint64_t partition_bytes, Encoding compression,
                           const ExchangeModel& model) {
  return SmallAllreduceFits(bytes, world_size, partition_bytes, compression) &&
         ExchangeTimeNs(world_size, bytes, model) < OwnerTimeNs(world_size, bytes, model);
}

bool ExchangesThis(const OpRequest& request, int world_size, const EngineOptions& options) {
  switch (options.small_allreduce) {
    case EngineOptions::kSmallAllreduceNever: return false;
    case EngineOptions::kSmallAllreduceAlways:
      return SmallAllreduceFits(request.bytes, world_size, options.partition_bytes, request.compression);
    case EngineOptions::kSmallAllreduceAuto: break;
  }
  // Control collectives only: gradients stay under the scheduler (its order, credit, bandwidth
  // estimate and Prophet's profile come from their pushes); small ones are fused anyway.
  ExchangeModel model;
  model.min_split_bytes = PartitionMinSplitBytes(options.schedule);
  return request.priority >= kControlPriority && request.fusion_bucket_bytes == 0 &&  // a bucket: cut as planned
         SmallAllreduceApplies(request.bytes, world_size, options.partition_bytes, request.compression, model);
}

bool ParseSmallAllreduce(const std::string& text, EngineOptions::SmallAllreduceMode* out) {
  if (text == "never" || text == "0" || text == "false") {
    *out = EngineOptions::kSmallAllreduceNever;
  } else if (text == "auto" || text == "1" || text == "true") {
    *out = EngineOptions::kSmallAllreduceAuto;
  } else if (text == "always") {
    *out = EngineOptions::kSmallAllreduceAlways;
  } else {
    return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------------

SmallAllreduce::SmallAllreduce(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round)
    : Collective(host, id, std::move(request), round) {}

void SmallAllreduce::Start() {
  const OpRequest& r = req_;
  if (r.output != r.input && r.bytes) std::memcpy(r.output, r.input, r.bytes);
  if (n() == 1) {
    host()->Finish(this, Status::OK());
    return;
  }
  plan_ = ExchangePlan(rank(), n());
  held_.resize(plan_.size());
  // Each stage's frame carries the whole tensor: a "partition" per stage (its frames' offset 0).
  set_parts(std::vector<Partition>(static_cast<size_t>(ExchangeStages(n())), Partition{0, r.bytes, -1}));
  AnnounceReady();  // as push_pull does: the profile and the timeline see every tensor
  Advance();
}

int SmallAllreduce::StepReceiving(int peer, uint32_t stage) const {
  for (size_t i = 0; i < plan_.size(); ++i)
    if (plan_[i].stage == static_cast<int>(stage) && plan_[i].receive_from == peer) return static_cast<int>(i);
  return -1;
}

std::string SmallAllreduce::Mismatch(int peer, const FrameMeta& meta) const {
  const std::string shape = ShapeMismatch(peer, meta);
  if (!shape.empty()) return shape;
  const std::string encoding = EncodingMismatch(peer, meta);
  if (!encoding.empty()) return encoding;
  const int step = StepReceiving(peer, meta.partition);
  if (step < 0 || meta.num_partitions != parts().size() || meta.offset != 0 || meta.payload_bytes != req_.bytes)
    return Describe() + ": rank " + std::to_string(peer) + " sent stage " + std::to_string(meta.partition) + " of " +
           std::to_string(meta.num_partitions) + " (" + std::to_string(meta.payload_bytes) +
           " bytes), which rank " + std::to_string(rank()) + " does not expect from it in an exchange of " +
           std::to_string(parts().size()) + " stages among " + std::to_string(n()) + " workers";
  if (held_[step].here || static_cast<size_t>(step) < next_)
    return Describe() + ": rank " + std::to_string(peer) + " sent stage " + std::to_string(meta.partition) + " twice";
  return "";
}

PayloadSink SmallAllreduce::OnFrame(int peer, const FrameMeta& meta) {
  if (!Admit(peer, meta)) return PayloadSink::Discard();
  return PayloadSink::Buffer();  // whole, then OnWholeFrame: a frame of a later stage waits for it
}

void SmallAllreduce::OnPayloadDone(int /*peer*/, const FrameMeta& /*meta*/) {}  // every frame is buffered

void SmallAllreduce::OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) {
  if (!Admit(peer, meta)) return;
  Held& h = held_[StepReceiving(peer, meta.partition)];
  h.data = std::move(*data);
  h.here = true;
  h.arrived_ns = NowNs();
  Advance();
}

void SmallAllreduce::Send(const ExchangeStep& step) {
  if (step.send_result) Average();
  const char* out = static_cast<const char*>(req_.output);
  host()->Send(step.send_to, OwnedFrame(FrameType::kExchange, static_cast<uint32_t>(step.stage),
                                        std::string(out, req_.bytes)));
  last_send_ns_ = NowNs();
}

void SmallAllreduce::MaybeReportTransfer(size_t step, int64_t arrived_ns) {
  if (last_send_ns_ < 0 || arrived_ns <= last_send_ns_) return;  // it was here first: no round trip
  TransferDone d;
  d.task.name = req_.name;
  d.task.round = round();
  d.task.request_id = id();
  d.task.partition = plan_[step].stage;
  d.task.peer = plan_[step].receive_from;
  d.task.priority = req_.priority;
  d.task.bytes = req_.bytes;
  d.task.ready_ns = submit_ns();
  d.sent_ns = last_send_ns_;
  d.done_ns = arrived_ns;
  d.exchange = true;
  host()->PushCompleted(d);
}

void SmallAllreduce::Average() {
  if (averaged_) return;
  averaged_ = true;
  if (req_.average) DivideBy(req_.dtype, req_.output, req_.bytes / element_bytes(), n());
}

void SmallAllreduce::Advance() {
  char* out = static_cast<char*>(req_.output);
  const size_t count = req_.bytes / element_bytes();
  for (; next_ < plan_.size(); ++next_, sent_next_ = false) {
    const ExchangeStep& step = plan_[next_];
    if (!sent_next_ && step.send_to >= 0) Send(step);
    sent_next_ = true;
    if (step.receive_from < 0) continue;
    Held& h = held_[next_];
    if (!h.here) return;  // its frame is still to come
    MaybeReportTransfer(next_, h.arrived_ns);
    const char* theirs = h.data.data();
    if (step.receive_result) {
      std::memcpy(out, theirs, req_.bytes);
      averaged_ = true;  // the sender averaged it
    } else if (step.mine_first) {
      SumTo(req_.dtype, out, out, theirs, count);
    } else {
      SumTo(req_.dtype, out, theirs, out, count);
    }
    host()->GiveBuffer(std::move(h.data));
    h = Held{};
  }
  Average();
  host()->Finish(this, Status::OK());
}

std::vector<bool> SmallAllreduce::WaitingFor() const {
  std::vector<bool> missing(n(), false);
  for (size_t i = next_; i < plan_.size(); ++i)
    if (plan_[i].receive_from >= 0 && !held_[i].here) missing[plan_[i].receive_from] = true;
  return missing;
}

void SmallAllreduce::Complete(const Status& status) {
  for (Held& h : held_)
    if (h.here) host()->GiveBuffer(std::move(h.data));
  held_.clear();
  Collective::Complete(status);
}

}  // namespace prophet
