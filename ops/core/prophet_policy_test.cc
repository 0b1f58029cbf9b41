// ProphetPolicy through the SchedulerPolicy interface, over synthetic training steps with injected
// time: priority fallback before a profile exists, blocks afterwards, no preemption of a block in
// flight, credit phase after the first layer, late and missing gradients, re-planning.
#include "ops/core/prophet_policy.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ops/core/policies.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr uint64_t kHalfMB = 500'000;
constexpr uint64_t kOneTask = 1;         // a credit of 1 byte releases exactly one task per call
constexpr uint64_t kLargeCredit = 1ull << 40;

// A 6-layer model; the backward pass makes g5 ready first and g0 (the first layer) last:
//   stage 0: g5 (1 MB in 2 partitions, priority 0) at 0,   g4 (0.5 MB, priority 1) at 0.1 ms
//   stage 1: g3 (0.5 MB, priority 2) at 10 ms,             g2 (0.5 MB, priority 3) at 10.1 ms
//   stage 2: g1 (0.5 MB, priority 4) at 20 ms,             g0 (0.5 MB, priority 5) at 20.1 ms
// With 120 MB/s, a stage interval of 10 ms carries 1.2 MB, so the plan is
//   block 0 = {g4} (g4 + g5 = 1.5 MB would not fit), block 1 = {g2, g3} (1 MB; + g5 would not),
//   credit phase: g1, g0 and the leftover g5.
struct Layer {
  const char* name;
  int64_t priority;
  int partitions;
  int64_t offset_ns;
};
const Layer kLayers[] = {{"g5", 0, 2, 0},       {"g4", 1, 1, kMs / 10},
                         {"g3", 2, 1, 10 * kMs}, {"g2", 3, 1, 10 * kMs + kMs / 10},
                         {"g1", 4, 1, 20 * kMs}, {"g0", 5, 1, 20 * kMs + kMs / 10}};
using Layers = std::vector<Layer>;
const Layers kModel(std::begin(kLayers), std::end(kLayers));

// Plays the engine: announces tensors, enqueues their partitions, asks for tasks and simulates a
// link of `link_Bps` that sends released tasks one after another, reporting them as done.
class Harness {
 public:
  explicit Harness(double link_Bps, const Layers& layers = kModel)
      : link_Bps_(link_Bps), layers_(layers) {
    ProphetOptions options;
    options.profiler.warmup_steps = 0;  // synthetic steps have no tracing step to skip
    options.profiler.min_steps = 1;
    policy_ = std::make_unique<ProphetPolicy>(options);
  }

  ProphetPolicy& policy() { return *policy_; }
  int64_t origin(uint64_t round) const { return 1'000 * kMs + static_cast<int64_t>(round) * 100 * kMs; }
  void set_link_Bps(double link_Bps) { link_Bps_ = link_Bps; }
  // Compressed gradients: the tensors announced are twice the bytes their tasks carry.
  void set_tensor_bytes_per_wire_byte(uint64_t ratio) { tensor_per_wire_ = ratio; }

  const Layer& LayerOf(const std::string& name) const {
    for (const Layer& layer : layers_) {
      if (name == layer.name) return layer;
    }
    return layers_.front();
  }

  void Ready(const std::string& name, uint64_t round, int64_t offset_ns) {
    const Layer& layer = LayerOf(name);
    names_.push_back(std::make_unique<std::string>(name));
    TensorReady ready;
    ready.name = names_.back().get();
    ready.round = round;
    ready.priority = layer.priority;
    ready.bytes = kHalfMB * layer.partitions * tensor_per_wire_;
    ready.ready_ns = origin(round) + offset_ns;
    policy_->OnTensorReady(ready);
    const uint64_t request = next_request_++;
    request_names_[request] = name;
    for (int p = 0; p < layer.partitions; ++p) {
      SendTask task;
      task.name = name;
      task.round = round;
      task.request_id = request;
      task.partition = p;
      task.peer = 1;
      task.priority = layer.priority;
      task.bytes = kHalfMB;
      task.ready_ns = ready.ready_ns;
      task.enqueue_seq = next_seq_++;
      policy_->Enqueue(task);
    }
  }
  // A control collective (metrics) at `offset_ns` of step `round`.
  void Control(uint64_t round, int64_t offset_ns) {
    names_.push_back(std::make_unique<std::string>("metrics"));
    TensorReady ready;
    ready.name = names_.back().get();
    ready.round = round;
    ready.priority = kControlPriority;
    ready.bytes = 8;
    ready.ready_ns = origin(round) + offset_ns;
    policy_->OnTensorReady(ready);
    const uint64_t request = next_request_++;
    request_names_[request] = "metrics";
    SendTask task;
    task.name = "metrics";
    task.round = round;
    task.request_id = request;
    task.peer = 1;
    task.priority = kControlPriority;
    task.bytes = 8;
    task.ready_ns = ready.ready_ns;
    task.enqueue_seq = next_seq_++;
    policy_->Enqueue(task);
  }
  void ReadyAtProfiledTime(const std::string& name, uint64_t round) {
    Ready(name, round, LayerOf(name).offset_ns);
  }

  // Names of the released tasks, in order ("g5" twice for its two partitions). They leave this
  // worker at once (the kernel takes them) and come back as the link carries them.
  std::string Dequeue(uint64_t credit, uint64_t round, int64_t offset_ns) {
    const int64_t now = origin(round) + offset_ns;
    std::vector<SendTask> out;
    policy_->Dequeue(credit, now, &out);
    std::string names;
    for (const SendTask& task : out) {
      names += (names.empty() ? "" : ",") + request_names_[task.request_id];
      policy_->OnPushLeft(task);
      TransferDone done;
      done.task = task;
      done.sent_ns = std::max(now, link_free_ns_);
      done.done_ns = done.sent_ns + static_cast<int64_t>(task.bytes * 1e9 / link_Bps_);
      link_free_ns_ = done.done_ns;
      policy_->OnTransferDone(done);
    }
    return names;
  }

  // As the engine does: released tasks stay unsent (in this worker's queues, holding `credit`)
  // until Leave reports them gone.
  std::string DequeueUnsent(uint64_t credit, uint64_t round, int64_t offset_ns) {
    const int64_t now = origin(round) + offset_ns;
    std::vector<SendTask> out;
    policy_->Dequeue(unsent_bytes_ < credit ? credit - unsent_bytes_ : 0, now, &out);
    std::string names;
    for (const SendTask& task : out) {
      names += (names.empty() ? "" : ",") + request_names_[task.request_id];
      unsent_bytes_ += task.bytes;
      unsent_.push_back(task);
    }
    return names;
  }
  // The oldest unsent task leaves this worker.
  void LeaveOne() {
    policy_->OnPushLeft(unsent_.front());
    unsent_bytes_ -= unsent_.front().bytes;
    unsent_.erase(unsent_.begin());
  }
  size_t unsent() const { return unsent_.size(); }

  // One step at the profiled times, releasing everything as soon as possible.
  // As the engine does, the policy is asked again when what it released has left.
  std::string RunProfiledStep(uint64_t round) {
    std::string order;
    for (const Layer& layer : layers_) {
      ReadyAtProfiledTime(layer.name, round);
      for (std::string released; !(released = Dequeue(kLargeCredit, round, layer.offset_ns)).empty();)
        order += (order.empty() ? "" : ",") + released;
    }
    return order;
  }

 private:
  double link_Bps_;
  Layers layers_;
  uint64_t tensor_per_wire_ = 1;
  std::unique_ptr<ProphetPolicy> policy_;
  std::vector<std::unique_ptr<std::string>> names_;
  std::map<uint64_t, std::string> request_names_;
  uint64_t next_request_ = 1;
  uint64_t next_seq_ = 0;
  int64_t link_free_ns_ = 0;
  std::vector<SendTask> unsent_;  // DequeueUnsent, oldest first
  uint64_t unsent_bytes_ = 0;
};

std::string Members(const PlanBlock& block) {
  std::string out;
  for (const std::string& name : block.members) out += (out.empty() ? "" : ",") + name;
  return out;
}

// Step 0 in priority order, leaving a profile and a bandwidth estimate behind.
void RunStepZero(Harness* h) {
  for (const char* name : {"g5", "g4", "g3", "g2"}) h->ReadyAtProfiledTime(name, 0);
  EXPECT_TRUE(!h->policy().blocks_active());
  // Everything of stages 0 and 1 is queued: priority order, one task per call.
  EXPECT_EQ(h->Dequeue(kOneTask, 0, 11 * kMs), std::string("g2"));
  EXPECT_EQ(h->Dequeue(kOneTask, 0, 11 * kMs), std::string("g3"));
  EXPECT_EQ(h->Dequeue(kOneTask, 0, 11 * kMs), std::string("g4"));
  EXPECT_EQ(h->Dequeue(kLargeCredit, 0, 11 * kMs), std::string("g5,g5"));
  h->ReadyAtProfiledTime("g1", 0);
  h->ReadyAtProfiledTime("g0", 0);
  EXPECT_EQ(h->Dequeue(kLargeCredit, 0, 21 * kMs), std::string("g0,g1"));
  EXPECT_EQ(h->policy().queued(), 0u);
}

TEST(PriorityFallbackThenBlocksWithoutPreemption) {
  Harness h(120e6);
  // Step 0: no profile yet -> the priority policy's order.
  RunStepZero(&h);
  EXPECT_TRUE(h.policy().bandwidth()->has_estimate());
  EXPECT_TRUE(h.policy().Describe().find("no profile") != std::string::npos);

  // Step 1: the first ready tensor opens the step and the plan is made.
  h.ReadyAtProfiledTime("g5", 1);
  EXPECT_TRUE(h.policy().blocks_active());
  const Plan& plan = h.policy().plan();
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() != 2) return;
  EXPECT_EQ(Members(plan.blocks[0]), std::string("g4"));
  EXPECT_EQ(Members(plan.blocks[1]), std::string("g2,g3"));
  EXPECT_EQ(plan.top_tensor, std::string("g0"));
  EXPECT_EQ(plan.blocks[0].bytes, kHalfMB);
  // g5 fits in no block, but block 0 (g4) has nothing ready: g5 takes the link rather than the
  // link idling.
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 0), std::string("g5,g5"));
  EXPECT_EQ(h.policy().open_block(), 0);
  h.ReadyAtProfiledTime("g4", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, kMs / 10), std::string("g4"));
  // Block 1 opens; its first member goes as soon as it is ready, without waiting for g2.
  h.ReadyAtProfiledTime("g3", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 10 * kMs), std::string("g3"));
  EXPECT_EQ(h.policy().open_block(), 1);
  h.ReadyAtProfiledTime("g2", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 10 * kMs + kMs / 10), std::string("g2"));
  // g1 is not a block member, and every block ended: it goes rather than the link idling.
  h.ReadyAtProfiledTime("g1", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 20 * kMs), std::string("g1"));
  EXPECT_TRUE(!h.policy().credit_phase());
  h.ReadyAtProfiledTime("g0", 1);
  EXPECT_TRUE(h.policy().credit_phase());
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 20 * kMs + kMs / 10), std::string("g0"));
  EXPECT_EQ(h.policy().queued(), 0u);
  EXPECT_EQ(h.policy().NextWakeupNs(), -1);

  // Step 2: a block in flight is not preempted by more urgent gradients.
  for (const char* name : {"g5", "g4"}) h.ReadyAtProfiledTime(name, 2);
  EXPECT_EQ(h.Dequeue(kOneTask, 2, kMs / 10), std::string("g4"));
  for (const char* name : {"g3", "g2"}) h.ReadyAtProfiledTime(name, 2);
  EXPECT_EQ(h.Dequeue(kOneTask, 2, 10 * kMs + kMs / 10), std::string("g2"));
  // Compute was fast this time: the first layers are ready while block 1 still has g3 queued.
  h.Ready("g1", 2, 10 * kMs + 2 * kMs / 10);
  h.Ready("g0", 2, 10 * kMs + 3 * kMs / 10);
  EXPECT_EQ(h.Dequeue(kOneTask, 2, 10 * kMs + 3 * kMs / 10), std::string("g3"));
  EXPECT_EQ(h.Dequeue(kOneTask, 2, 10 * kMs + 3 * kMs / 10), std::string("g0"));
  EXPECT_EQ(h.Dequeue(kLargeCredit, 2, 10 * kMs + 3 * kMs / 10), std::string("g1,g5,g5"));
  EXPECT_EQ(h.policy().replans(), 0u);
  EXPECT_TRUE(h.policy().Describe().find("2 blocks") != std::string::npos);
}

TEST(CompressedTensorsArePlannedWithTheBytesThatTravel) {
  // The tensors of PriorityFallbackThenBlocksWithoutPreemption compressed: each announced with
  // twice the bytes its pushes carry. The plan counts what the pushes carried (the bandwidth's
  // unit), so it is the same plan; with the tensors' bytes block 0 would hold 1 MB and block 1
  // only g2.
  Harness h(120e6);
  h.set_tensor_bytes_per_wire_byte(2);
  RunStepZero(&h);
  h.ReadyAtProfiledTime("g5", 1);
  const Plan& plan = h.policy().plan();
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() != 2) return;
  EXPECT_EQ(Members(plan.blocks[0]), std::string("g4"));
  EXPECT_EQ(Members(plan.blocks[1]), std::string("g2,g3"));
  EXPECT_EQ(plan.blocks[0].bytes, kHalfMB);
  EXPECT_EQ(plan.blocks[1].bytes, 2 * kHalfMB);
}

TEST(NoNewBlockUntilTheOpenOneHasLeft) {
  // Released pushes wait in this worker's queues until the kernel takes them (DequeueUnsent);
  // only then does the plan move on. The first layer does not wait.
  Harness h(120e6);
  RunStepZero(&h);
  h.ReadyAtProfiledTime("g5", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 0), std::string("g5,g5"));  // nothing planned is ready
  h.ReadyAtProfiledTime("g4", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, kMs / 10), std::string("g4"));  // block 0 goes at once
  h.ReadyAtProfiledTime("g3", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 10 * kMs), std::string());  // block 0 has not left
  h.LeaveOne();
  h.LeaveOne();
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 10 * kMs), std::string());  // g4 still has not
  EXPECT_EQ(h.policy().open_block(), 0);
  h.LeaveOne();
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 10 * kMs), std::string("g3"));
  EXPECT_EQ(h.policy().open_block(), 1);
  h.ReadyAtProfiledTime("g2", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 10 * kMs + kMs / 10), std::string("g2"));
  // Block 1 waits for nothing more, but has not left: g1 (in no block) is held rather than put
  // behind it. The first layer starts the credit phase, block 1 or not.
  h.ReadyAtProfiledTime("g1", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 20 * kMs), std::string());
  h.ReadyAtProfiledTime("g0", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 20 * kMs + kMs / 10), std::string("g0,g1"));
  EXPECT_EQ(h.unsent(), 4u);
  EXPECT_EQ(h.policy().pushes_unsent(), 4u);
  while (h.unsent() > 0) h.LeaveOne();
  EXPECT_EQ(h.policy().pushes_unsent(), 0u);
  EXPECT_EQ(h.policy().queued(), 0u);
}

// VGG16's shape: a big, low-priority gradient (fc, 4 MB in 8 partitions) is ready alone in stage 0;
// the more urgent c3, c2, c1 follow at 10 ms, cb and c0 (the first layer) at 20 ms:
//   stages {fc} | {c3, c2, c1} | {cb, c0}, 10 ms each; at 120 MB/s a stage carries 1.2 MB.
// fc is bigger than stage 0's budget: it joins no block (as a block of its own it would hold the
// link for 33 ms while c1 and c2 wait behind it). It fills the idle link one credit at a time, and
// block {c1, c2} overtakes what is left of it; then c3 and fc in priority order.
TEST(TensorBiggerThanItsBudgetDoesNotHoldBackMoreUrgentOnes) {
  const Layers model = {{"fc", 0, 8, 0},           {"c3", 1, 1, 10 * kMs},
                        {"c2", 2, 1, 10 * kMs + kMs / 10}, {"c1", 3, 1, 10 * kMs + 2 * kMs / 10},
                        {"cb", 4, 1, 20 * kMs},   {"c0", 5, 1, 20 * kMs + kMs / 10}};
  Harness h(120e6, model);
  h.RunProfiledStep(0);  // priority order, leaves a profile and a bandwidth estimate
  h.ReadyAtProfiledTime("fc", 1);
  EXPECT_TRUE(h.policy().blocks_active());
  const Plan& plan = h.policy().plan();
  EXPECT_EQ(plan.blocks.size(), 1u);
  if (plan.blocks.size() != 1) return;
  EXPECT_EQ(Members(plan.blocks[0]), std::string("c1,c2"));
  EXPECT_EQ(plan.BlockOf("fc"), -1);
  // One partition may wait in this worker at a time (the credit): fc fills the idle link.
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 0), std::string("fc"));
  h.LeaveOne();
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 5 * kMs), std::string("fc"));
  h.LeaveOne();
  for (const char* name : {"c3", "c2", "c1"}) h.ReadyAtProfiledTime(name, 1);
  // The block goes before the six partitions of fc still queued.
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 10 * kMs + 2 * kMs / 10), std::string("c1"));
  h.LeaveOne();
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 11 * kMs), std::string("c2"));
  h.LeaveOne();
  // Every block ended: what is held goes in priority order, c3 before fc.
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 12 * kMs), std::string("c3"));
  h.LeaveOne();
  EXPECT_EQ(h.DequeueUnsent(kHalfMB, 1, 13 * kMs), std::string("fc"));
  h.LeaveOne();
  h.ReadyAtProfiledTime("cb", 1);
  h.ReadyAtProfiledTime("c0", 1);
  EXPECT_EQ(h.DequeueUnsent(kLargeCredit, 1, 20 * kMs + kMs / 10),
            std::string("c0,cb,fc,fc,fc,fc,fc"));
  while (h.unsent() > 0) h.LeaveOne();
  EXPECT_EQ(h.policy().queued(), 0u);
}

TEST(ControlTrafficIsNeitherProfiledNorHeldBack) {
  Harness h(120e6);
  RunStepZero(&h);
  h.Control(0, 30 * kMs);  // metrics at the end of every step, most urgent of all
  EXPECT_EQ(h.Dequeue(kLargeCredit, 0, 30 * kMs), std::string("metrics"));
  h.ReadyAtProfiledTime("g5", 1);
  // The first layer is still g0: a step-end collective would otherwise hold every gradient
  // outside a block until the step is over.
  EXPECT_EQ(h.policy().plan().top_tensor, std::string("g0"));
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 0), std::string("g5,g5"));  // nothing planned is ready
  // In the middle of the block phase, control traffic goes at once.
  h.Control(1, kMs);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, kMs), std::string("metrics"));
  EXPECT_EQ(h.policy().open_block(), 0);
}

TEST(BlockLargerThanCreditIsReleasedOverSeveralCalls) {
  Harness h(120e6);
  RunStepZero(&h);
  for (const char* name : {"g5", "g4", "g3", "g2"}) h.ReadyAtProfiledTime(name, 1);
  EXPECT_EQ(h.Dequeue(kOneTask, 1, 10 * kMs + kMs / 10), std::string("g4"));
  // Credit for one partition at a time: block 1 goes in two calls, then g5 (in no block) as
  // every block ended.
  EXPECT_EQ(h.Dequeue(kHalfMB, 1, 10 * kMs + kMs / 10), std::string("g2"));
  EXPECT_EQ(h.Dequeue(kHalfMB, 1, 10 * kMs + kMs / 10), std::string("g3"));
  EXPECT_EQ(h.Dequeue(kHalfMB, 1, 10 * kMs + kMs / 10), std::string("g5"));
  // No credit left: nothing, whatever is queued.
  h.ReadyAtProfiledTime("g1", 1);
  h.ReadyAtProfiledTime("g0", 1);
  EXPECT_EQ(h.Dequeue(0, 1, 21 * kMs), std::string());
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 21 * kMs), std::string("g0,g1,g5"));
}

TEST(LateMemberJoinsTheOpenBlockAndLinkDoesNotIdle) {
  Harness h(120e6);
  RunStepZero(&h);
  // Step 1: g4 (block 0) is late. g3 (block 1) is ready: block 0 is closed rather than idling.
  h.ReadyAtProfiledTime("g5", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 0), std::string("g5,g5"));  // nothing planned is ready
  h.ReadyAtProfiledTime("g3", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 10 * kMs), std::string("g3"));
  EXPECT_EQ(h.policy().open_block(), 1);
  // g4 arrives late: it joins block 1 and goes at once.
  h.Ready("g4", 1, 10 * kMs + kMs / 20);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 10 * kMs + kMs / 20), std::string("g4"));
  h.ReadyAtProfiledTime("g2", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 10 * kMs + kMs / 10), std::string("g2"));
  h.ReadyAtProfiledTime("g1", 1);
  h.ReadyAtProfiledTime("g0", 1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, 21 * kMs), std::string("g0,g1"));
}

TEST(MissingFirstLayerStartsCreditPhaseAtDeadline) {
  Harness h(120e6);
  RunStepZero(&h);
  for (const char* name : {"g5", "g4", "g3", "g2", "g1"}) h.ReadyAtProfiledTime(name, 1);
  EXPECT_EQ(h.Dequeue(kOneTask, 1, 20 * kMs), std::string("g4"));
  // g0 never comes this step. Until the deadline (expected 20.1 ms x 1.2) blocks go first.
  const int64_t deadline = h.policy().NextWakeupNs();
  EXPECT_EQ(deadline, h.origin(1) + static_cast<int64_t>((20 * kMs + kMs / 10) * 1.2));
  EXPECT_EQ(h.Dequeue(kOneTask, 1, deadline - h.origin(1) - 1), std::string("g2"));
  EXPECT_TRUE(!h.policy().credit_phase());
  EXPECT_EQ(h.Dequeue(kOneTask, 1, deadline - h.origin(1)), std::string("g3"));
  EXPECT_TRUE(h.policy().credit_phase());
  EXPECT_EQ(h.policy().NextWakeupNs(), -1);
  EXPECT_EQ(h.Dequeue(kLargeCredit, 1, deadline - h.origin(1)), std::string("g1,g5,g5"));
}

TEST(LeftoversOfAStepGoFirstInTheNext) {
  Harness h(120e6);
  RunStepZero(&h);
  for (const char* name : {"g5", "g4", "g3", "g2", "g1"}) h.ReadyAtProfiledTime(name, 1);
  EXPECT_EQ(h.Dequeue(kOneTask, 1, 20 * kMs), std::string("g4"));
  // The next step opens before the credit released the rest of step 1.
  h.ReadyAtProfiledTime("g5", 2);
  EXPECT_EQ(h.policy().queued(), 7u);  // g3, g2, g1, g5 x2 of step 1, g5 x2 of step 2
  // Step 1's first, in priority order; then, once they have left, step 2's g5 (block 0, g4, has
  // nothing ready).
  EXPECT_EQ(h.Dequeue(kLargeCredit, 2, 0), std::string("g1,g2,g3,g5,g5"));
  EXPECT_EQ(h.Dequeue(kLargeCredit, 2, 0), std::string("g5,g5"));
}

TEST(ReplansWhenBandwidthDrops) {
  Harness h(120e6);
  RunStepZero(&h);
  EXPECT_EQ(h.RunProfiledStep(1), std::string("g5,g5,g4,g3,g2,g1,g0"));
  EXPECT_EQ(h.policy().replans(), 0u);
  // The link slows to 50 MB/s during steps 2 and 3.
  h.set_link_Bps(50e6);
  h.RunProfiledStep(2);
  h.RunProfiledStep(3);
  h.ReadyAtProfiledTime("g5", 4);
  EXPECT_TRUE(h.policy().replans() >= 1u);
  EXPECT_TRUE(h.policy().last_replan_reason().find("bandwidth") != std::string::npos);
  const Plan& plan = h.policy().plan();
  EXPECT_TRUE(plan.bandwidth_Bps < 0.8 * 120e6);
  // 10 ms now carries at most ~0.6 MB: one 0.5 MB gradient per block.
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() == 2) {
    EXPECT_EQ(Members(plan.blocks[0]), std::string("g4"));
    EXPECT_EQ(Members(plan.blocks[1]), std::string("g2"));
  }
  EXPECT_TRUE(h.policy().Describe().find("replans") != std::string::npos);
  // The timeline gets one mark per re-plan, at the origin of the step that follows the new plan.
  int marks = 0;
  for (const ProphetPolicy::PhaseSpan& span : h.policy().TakeSpans()) {
    if (!span.instant) continue;
    ++marks;
    EXPECT_TRUE(span.label.find("re-plan: bandwidth") == 0);
    EXPECT_EQ(span.tasks, 0u);
  }
  EXPECT_EQ(static_cast<uint64_t>(marks), h.policy().replans());
}

// The CPU delays the backward ops by a different amount at every step: g4 is ready anywhere from
// 0.1 to 5 ms, g3/g2 from 10 to 13 ms, g1/g0 from 20 to 23 ms. The profile's stage structure
// moves with it (2 or 3 stages), but the plan made for the first profile sends every such step
// as well as a new one would: no re-plan. Then the link slows down for real: re-plan.
TEST(JitterDoesNotReplanButABandwidthChangeDoes) {
  Harness h(120e6);
  RunStepZero(&h);
  uint64_t seed = 7;
  auto jitter = [&seed](int64_t range_ns) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int64_t>((seed >> 33) % static_cast<uint64_t>(range_ns));
  };
  auto run_jittered_step = [&](uint64_t round) {
    const int64_t g4 = kMs / 10 + jitter(5 * kMs);
    const int64_t middle = 10 * kMs + jitter(3 * kMs);
    const int64_t last = 20 * kMs + jitter(3 * kMs);
    const std::pair<const char*, int64_t> order[] = {
        {"g5", 0}, {"g4", g4}, {"g3", middle}, {"g2", middle + kMs / 10},
        {"g1", last}, {"g0", last + kMs / 10}};
    for (const auto& [name, offset] : order) {
      h.Ready(name, round, offset);
      h.Dequeue(kLargeCredit, round, offset);
    }
    h.Dequeue(kLargeCredit, round, 60 * kMs);  // the rest, before the next step
  };
  // The first plan comes from step 0's unjittered times; the first jittered steps may replace it
  // once (the profile's window fills with jittered times), and then it must stay.
  uint64_t round = 1;
  for (; round <= 5; ++round) run_jittered_step(round);
  const uint64_t settled_replans = h.policy().replans();
  EXPECT_TRUE(settled_replans <= 1u);
  int stage_count_changes = 0;
  size_t stages = h.policy().profiler().profile().stages.size();
  for (; round <= 40; ++round) {
    run_jittered_step(round);
    const size_t now = h.policy().profiler().profile().stages.size();
    if (now != stages) ++stage_count_changes;
    stages = now;
  }
  EXPECT_TRUE(h.policy().has_plan());
  EXPECT_TRUE(stage_count_changes >= 5);  // the jitter did move the stage structure
  EXPECT_EQ(h.policy().replans(), settled_replans);

  // The link slows to 40 MB/s: the next plan follows within a few steps (the estimate needs
  // samples of the slower link), whatever the jitter.
  h.set_link_Bps(40e6);
  const uint64_t changed_at = round;
  while (h.policy().replans() == settled_replans && round < changed_at + 20) run_jittered_step(round++);
  EXPECT_TRUE(h.policy().replans() > settled_replans);
  EXPECT_TRUE(h.policy().last_replan_reason().find("bandwidth") == 0);
  EXPECT_TRUE(h.policy().plan().bandwidth_Bps < 0.8 * 120e6);
}

// The bandwidth estimate swings from one step to the next (a link shared with the peer's traffic,
// a busy CPU): the link alternates between 60 and 200 MB/s. A plan follows a change only when two
// step starts in a row see it in the same direction, so the swings do not re-plan; a lasting
// change does, one step later.
TEST(ASwingingEstimateDoesNotReplan) {
  Harness h(120e6);
  RunStepZero(&h);
  h.RunProfiledStep(1);
  EXPECT_TRUE(h.policy().has_plan());
  int swings = 0;  // step starts whose estimate is beyond the threshold from the plan's
  for (uint64_t round = 2; round < 20; ++round) {
    h.set_link_Bps(round % 2 == 0 ? 60e6 : 200e6);
    h.RunProfiledStep(round);
    const double estimate = h.policy().bandwidth()->estimate_Bps();
    if (BandwidthMoved(h.policy().plan(), estimate, kDefaultReplanThreshold) != 0) ++swings;
  }
  EXPECT_TRUE(swings >= 5);
  EXPECT_EQ(h.policy().replans(), 0u);
  h.set_link_Bps(40e6);
  uint64_t round = 20;
  while (h.policy().replans() == 0 && round < 40) h.RunProfiledStep(round++);
  EXPECT_TRUE(h.policy().replans() == 1u);
  EXPECT_TRUE(h.policy().last_replan_reason().find("bandwidth") == 0);
}

TEST(PhaseSpansForTheTimeline) {
  Harness h(120e6);
  RunStepZero(&h);
  EXPECT_EQ(h.policy().TakeSpans().size(), 0u);  // priority fallback has no blocks
  EXPECT_EQ(h.policy().planned_blocks(), 0);
  h.RunProfiledStep(1);
  h.ReadyAtProfiledTime("g5", 2);  // closes step 1
  EXPECT_EQ(h.policy().planned_blocks(), 2);  // what the step report shows
  EXPECT_TRUE(PolicyStateJson(h.policy()).find("\"planned_blocks\": 2") != std::string::npos);
  const std::vector<ProphetPolicy::PhaseSpan> spans = h.policy().TakeSpans();
  // g5 fills the link at 0, block 1 (g4), block 2 (g3, g2), g1 fills the link, g0: credit phase.
  EXPECT_EQ(spans.size(), 5u);
  if (spans.size() != 5) return;
  EXPECT_EQ(spans[0].label, std::string("idle-link fill"));
  EXPECT_EQ(spans[0].tasks, 2u);
  EXPECT_EQ(spans[1].label, std::string("block 1/2 (1 tensors, 0.50MB planned)"));
  EXPECT_EQ(spans[1].start_ns, h.origin(1) + kMs / 10);
  EXPECT_EQ(spans[1].tasks, 1u);
  // Block 2 released g3 at 10 ms and g2 at 10.1 ms, and ended when g2 went.
  EXPECT_EQ(spans[2].start_ns, h.origin(1) + 10 * kMs);
  EXPECT_EQ(spans[2].end_ns, h.origin(1) + 10 * kMs + kMs / 10);
  EXPECT_EQ(spans[2].bytes, 2 * kHalfMB);
  EXPECT_EQ(spans[3].label, std::string("idle-link fill"));
  EXPECT_EQ(spans[3].start_ns, h.origin(1) + 20 * kMs);
  EXPECT_EQ(spans[4].label, std::string("credit phase"));
  EXPECT_EQ(spans[4].tasks, 1u);
  EXPECT_EQ(h.policy().TakeSpans().size(), 0u);  // drained
}

TEST(OneWorkerWithoutTasks) {
  // With world_size 1 nothing is pushed: the policy only sees ready events.
  ProphetOptions options;
  options.profiler.warmup_steps = 0;
  ProphetPolicy policy(options);
  std::vector<SendTask> out;
  for (uint64_t round = 0; round < 3; ++round) {
    for (const Layer& layer : kLayers) {
      const std::string name = layer.name;
      TensorReady ready;
      ready.name = &name;
      ready.round = round;
      ready.priority = layer.priority;
      ready.ready_ns = static_cast<int64_t>(round) * 100 * kMs + layer.offset_ns;
      policy.OnTensorReady(ready);
      policy.Dequeue(kLargeCredit, ready.ready_ns, &out);
    }
  }
  EXPECT_EQ(out.size(), 0u);
  EXPECT_EQ(policy.queued(), 0u);
  EXPECT_TRUE(policy.profiler().has_profile());
  EXPECT_TRUE(!policy.blocks_active());  // no transfer, no bandwidth, no plan
  EXPECT_EQ(policy.NextWakeupNs(), -1);
}

TEST(FactoryMakesProphet) {
  SchedulerOptions options;
  options.policy = "prophet";
  std::unique_ptr<SchedulerPolicy> policy = MakeProphetPolicy(options);
  EXPECT_TRUE(policy != nullptr);
  if (policy) {
    EXPECT_EQ(std::string(policy->name()), std::string("prophet"));
    EXPECT_EQ(policy->queued(), 0u);
  }
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
