// An authenticated peer that sends sizes no operation can carry: the engine refuses them before it
// allocates anything, fails the operation on every worker with a message naming the problem, and
// drops that connection. The engine under test is rank 1; the test plays rank 0 (FakePeer).
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/fuzz/fake_peer.h"
#include "ops/core/fuzz/frames.h"
#include "ops/core/fuzz/memory_cap.h"
#include "ops/core/socket_testing.h"
#include "ops/core/testing.h"

namespace prophet {
namespace fuzz {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The engine (rank 1) and the test's peer (rank 0), connected.
struct Job {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<FakePeer> peer;
  std::mutex mu;
  std::vector<std::pair<FrameMeta, std::string>> received;  // frames the engine sent to the peer

  explicit Job(EngineOptions options) {
    options.rank = 1;
    options.world_size = 2;
    options.addresses = testing::LoopbackAddresses(2);
    options.token = "hostile-peer-test";
    options.connect_timeout_s = 10;
    BootstrapOptions b;
    b.rank = 0;
    b.world_size = 2;
    b.addresses = options.addresses;
    b.token = options.token;
    b.connect_timeout_s = 10;
    Status s = FakePeer::Listen(b, &peer);
    EXPECT_TRUE(s.ok());
    if (!s.ok()) return;
    Status started;
    std::thread starter([&] { started = Engine::Start(options, &engine); });
    s = peer->Join([this](const FrameMeta& meta, const char* payload) {
      std::lock_guard<std::mutex> lock(mu);
      received.emplace_back(meta, std::string(payload, meta.payload_bytes));
    });
    starter.join();
    EXPECT_TRUE(s.ok() && started.ok());
  }

  // The peer's reader thread writes `received`: stop it before the members go.
  ~Job() {
    peer.reset();
    engine.reset();
  }

  // The error notices the engine sent for `name`.
  std::vector<std::string> Errors(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<std::string> out;
    for (const auto& [meta, payload] : received)
      if (meta.type == FrameType::kError && meta.name == name) out.push_back(payload);
    return out;
  }
};

bool WaitFor(const std::function<bool()>& condition, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return true;
}

// Submits `r` on the engine; the future holds its status.
std::future<Status> SubmitOp(Engine* engine, OpRequest r) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  r.done = [promise](const Status& s, const GatherResult*) { promise->set_value(s); };
  engine->Submit(std::move(r));
  return future;
}

// Submits a push_pull of `elements` float32 on the engine; returns its status (waits <= 10 s).
Status PushPullOnEngine(Engine* engine, const std::string& name, int64_t elements) {
  std::vector<float> in(static_cast<size_t>(elements), 1.0f), out(in.size());
  OpRequest r;
  r.kind = OpKind::kPushPull;
  r.name = name;
  r.dtype = DataType::kFloat32;
  r.shape = {elements};
  r.input = in.data();
  r.output = out.data();
  r.bytes = 4 * static_cast<uint64_t>(elements);
  std::future<Status> future = SubmitOp(engine, std::move(r));
  if (future.wait_for(std::chrono::seconds(10)) != std::future_status::ready)
    return Status(Code::kInternal, "test: no done callback within 10 s");
  return future.get();
}

// A header that claims a payload of `payload_bytes` for a float32 tensor of that size. Only the
// header, name and dims are sent: the claim alone must be refused.
std::string HugeClaim(FrameType type, const std::string& name, uint64_t payload_bytes, std::vector<int64_t> shape = {}) {
  FrameMeta m;
  m.type = type;
  m.dtype = DataType::kFloat32;
  m.name = name;
  m.shape = shape.empty() ? std::vector<int64_t>{static_cast<int64_t>(payload_bytes / 4)} : shape;
  m.num_partitions = 1;
  m.payload_bytes = payload_bytes;
  return EncodeFrame(m, "");
}

TEST(EarlyPushOfAHugePayloadIsRefusedBeforeAllocating) {
  EngineOptions o;
  o.partition_bytes = 1 << 20;
  Job job(o);
  if (!job.engine) return;
  // 256 GiB for an operation this worker has not started: a partition is at most 1 MiB here.
  EXPECT_TRUE(job.peer->Send(HugeClaim(FrameType::kPush, "grad/huge", uint64_t{1} << 38)));
  EXPECT_TRUE(WaitFor([&] { return job.peer->closed_by_engine(); }, 5.0));
  const std::vector<std::string> errors = job.Errors("grad/huge");
  EXPECT_EQ(errors.size(), 1u);
  if (!errors.empty()) {
    std::printf("error notice to rank 0: %s\n", errors[0].c_str());
    EXPECT_TRUE(Contains(errors[0], "'grad/huge'") && Contains(errors[0], "274877906944 bytes") &&
                Contains(errors[0], "partition_bytes"));
  }
  // The operation fails here too when it is submitted, with the same reason.
  const Status s = PushPullOnEngine(job.engine.get(), "grad/huge", 4);
  std::printf("rank 1: %s\n", s.message().c_str());
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "274877906944 bytes"));
}

TEST(EarlyFramesBeyondTheMemoryBoundAreRefused) {
  EngineOptions o;
  o.partition_bytes = 64 << 10;
  o.max_early_bytes = 1 << 20;
  Job job(o);
  if (!job.engine) return;
  // Well-formed partitions of 64 KiB for operations never submitted here: the 17th passes 1 MiB.
  int sent = 0;
  for (int i = 0; i < 64 && !job.peer->closed_by_engine(); ++i) {
    FrameMeta m;
    m.type = FrameType::kPush;
    m.dtype = DataType::kFloat32;
    m.name = "early/" + std::to_string(i);
    m.shape = {16 << 10};
    m.num_partitions = 1;
    m.payload_bytes = 64 << 10;
    if (!job.peer->Send(EncodeFrame(m, std::string(m.payload_bytes, '\1')))) break;
    ++sent;
  }
  EXPECT_TRUE(WaitFor([&] { return job.peer->closed_by_engine(); }, 5.0));
  EXPECT_TRUE(sent >= 16);
  const Status s = PushPullOnEngine(job.engine.get(), "anything", 4);
  std::printf("rank 1 after %d early frames: %s\n", sent, s.message().c_str());
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "max_early_bytes"));
}

TEST(AllgatherContributionAboveTheLimitIsRefused) {
  EngineOptions o;
  o.max_early_bytes = 1 << 20;
  Job job(o);
  if (!job.engine) return;
  std::vector<float> mine(12, 2.0f);
  OpRequest r;
  r.kind = OpKind::kAllgather;
  r.name = "gather/rows";
  r.dtype = DataType::kFloat32;
  r.shape = {4, 3};
  r.input = mine.data();
  r.bytes = 48;
  std::future<Status> future = SubmitOp(job.engine.get(), std::move(r));
  // Once the engine runs the operation (it sent its own tensor), rank 0 claims 2^33 rows of 3
  // floats (96 GiB), consistent with its declared shape.
  EXPECT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(job.mu);
    for (const auto& frame : job.received)
      if (frame.first.type == FrameType::kGather) return true;
    return false;
  }, 10.0));
  EXPECT_TRUE(job.peer->Send(HugeClaim(FrameType::kGather, "gather/rows", (uint64_t{1} << 33) * 12,
                                       {int64_t{1} << 33, 3})));
  const bool done = future.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  EXPECT_TRUE(done);
  if (!done) return;
  const Status s = future.get();
  std::printf("allgather: %s\n", s.message().c_str());
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "'gather/rows'") && Contains(s.message(), "[8589934592, 3]") &&
              Contains(s.message(), "max_early_bytes"));
  EXPECT_TRUE(WaitFor([&] { return job.peer->closed_by_engine(); }, 5.0));
  EXPECT_EQ(job.Errors("gather/rows").size(), 1u);
}

TEST(RepeatedBroadcastPartitionFailsInsteadOfCompleting) {
  // 4 partitions of 1 KiB; rank 0 (the root) sends partition 0 four times. Counting frames would
  // complete the broadcast with three quarters of the output never written.
  EngineOptions o;
  o.partition_bytes = 1024;
  Job job(o);
  if (!job.engine) return;
  std::vector<float> out(1024, -1.0f);
  OpRequest r;
  r.kind = OpKind::kBroadcast;
  r.name = "weights";
  r.dtype = DataType::kFloat32;
  r.shape = {1024};
  r.input = out.data();
  r.output = out.data();
  r.bytes = 4096;
  r.root_rank = 0;
  std::future<Status> future = SubmitOp(job.engine.get(), std::move(r));
  FrameMeta m;
  m.type = FrameType::kBroadcast;
  m.dtype = DataType::kFloat32;
  m.name = "weights";
  m.shape = {1024};
  m.num_partitions = 4;
  m.payload_bytes = 1024;
  for (int i = 0; i < 4; ++i) job.peer->Send(EncodeFrame(m, std::string(1024, '\0')));
  const bool done = future.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  EXPECT_TRUE(done);
  if (!done) return;
  const Status s = future.get();
  std::printf("broadcast: %s\n", s.message().c_str());
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "'weights'") && Contains(s.message(), "partition 0 twice"));
}

}  // namespace
}  // namespace fuzz
}  // namespace prophet

int main() {
  prophet::fuzz::CapMemory();
  return prophet::testing::RunAll();
}
