// Engine options: parsing the C API's lines, and the option table the Python package reads.
#include "ops/core/engine_options.h"
#include "ops/core/wire.h"

#include <string>

#include "ops/core/partition.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

TEST(ParsesEveryKeyAndKeepsDefaultsForTheRest) {
  EngineOptions o;
  const Status s = ParseEngineOptions("rank=1\nworld_size=2\naddresses=h:1,h:2\ntoken=t\nschedule=fifo\ncredit_bytes=1000\n", &o);
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(o.rank, 1);
  EXPECT_TRUE(o.addresses.size() == 2 && o.addresses[1] == "h:2");
  EXPECT_EQ(o.schedule, std::string("fifo"));
  EXPECT_EQ(o.credit_bytes, 1000u);
  EXPECT_EQ(o.partition_bytes, EngineOptions().partition_bytes);
  EXPECT_EQ(EngineOptions().schedule, std::string(kDefaultSchedule));
  EXPECT_EQ(EngineOptions().replan_threshold, kDefaultReplanThreshold);
}

// Each error names the option, what it accepts (from its row of engine_options.def) and what came.
TEST(RejectsBadInputNamingIt) {
  EngineOptions o;
  Status s = ParseEngineOptions("colour=blue", &o);
  EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "'colour'"));
  o = EngineOptions();
  s = ParseEngineOptions("timeout_s=soon", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "runtime option timeout_s must be a number above 0, got 'soon'"));
  o = EngineOptions();
  s = ParseEngineOptions("timeout_s=0", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "timeout_s must be a number above 0, got '0'"));
  o = EngineOptions();
  s = ParseEngineOptions("rank=2\nworld_size=2", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "rank 2 outside [0, 2)"));
  o = EngineOptions();
  s = ParseEngineOptions("partition_bytes=4096\nmax_early_bytes=1024", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "max_early_bytes (1024) must be at least partition_bytes (4096)"));
  o = EngineOptions();
  s = ParseEngineOptions("socket_unsent_bytes=-1", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "socket_unsent_bytes must be 0 (no limit) or an integer of at least 1, "
                                                "got '-1'"));
  o = EngineOptions();
  s = ParseEngineOptions("socket_buffer_bytes=4096", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "runtime option socket_buffer_bytes must be -1 (sized for the workers), "
                                                "0 (the kernel's autotuning) or an integer of at least 131072, got "
                                                "'4096'"));
  o = EngineOptions();
  s = ParseEngineOptions("socket_buffer_bytes=-2", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "got '-2'"));
  o = EngineOptions();
  s = ParseEngineOptions("heartbeat_s=0.1", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "heartbeat_s must be 0 (off) or a number of at least 0.2, got '0.1'"));
  o = EngineOptions();
  s = ParseEngineOptions("schedule=lifo", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "schedule must be one of prophet, priority, fifo, bytescheduler or p3, got 'lifo'"));
  // Unsigned sizes refuse a sign instead of wrapping around; a number is the whole value.
  o = EngineOptions();
  s = ParseEngineOptions("credit_bytes=-5", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "credit_bytes must be 0 (max(16 MiB, (N - 1) x partition_bytes); bytescheduler 16 MB on sums) or a "
                                                "whole number of at least 1, got '-5'"));
  o = EngineOptions();
  EXPECT_TRUE(!ParseEngineOptions("partition_bytes=4096x", &o).ok());
  o = EngineOptions();
  s = ParseEngineOptions("world_size=2\naddresses=h:1,h:2\nallow_no_token=1\nhosts=a", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "hosts names 1 host(s) for 2 workers"));
  o = EngineOptions();
  EXPECT_TRUE(ParseEngineOptions("socket_buffer_bytes=131072\nsocket_unsent_bytes=1", &o).ok());
  EXPECT_TRUE(ParseEngineOptions("socket_buffer_bytes=-1", &o).ok() && o.socket_buffer_bytes == kSocketBufferAuto);
  // A value refused leaves the option as it was.
  EXPECT_TRUE(!ParseEngineOption("socket_buffer_bytes", "5", &o).ok() && o.socket_buffer_bytes == kSocketBufferAuto);
}

TEST(BooleansAndListsReadAsPythonWritesThem) {
  EngineOptions o;
  for (const char* yes : {"1", "true", "True", "yes"}) {
    o = EngineOptions();
    EXPECT_TRUE(ParseEngineOption("allow_no_token", yes, &o).ok() && o.allow_no_token);
  }
  EXPECT_TRUE(ParseEngineOption("allow_no_token", "0", &o).ok() && !o.allow_no_token);
  const Status s = ParseEngineOption("allow_no_token", "maybe", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "allow_no_token must be true or false (1 or 0), got 'maybe'"));
  EXPECT_TRUE(ParseEngineOption("hosts", "a,b,a", &o).ok() && o.hosts.size() == 3 && o.hosts[2] == "a");
  EXPECT_TRUE(ParseEngineOption("hierarchical", "ON", &o).ok() && o.hierarchical == Hierarchy::kOn);
}

TEST(AMultiWorkerJobNeedsATokenUnlessAllowed) {
  EngineOptions o;
  Status s = ParseEngineOptions("rank=0\nworld_size=2\naddresses=h:1,h:2\ntoken=", &o);
  EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "needs a job token") &&
              Contains(s.message(), "PROPHET_JOB_TOKEN") && Contains(s.message(), "allow_no_token=True"));
  o = EngineOptions();
  s = ParseEngineOptions("rank=0\nworld_size=2\naddresses=h:1,h:2\ntoken=\nallow_no_token=1\nbind_host=0.0.0.0", &o);
  EXPECT_TRUE(s.ok() && o.allow_no_token && o.bind_host == "0.0.0.0");
  o = EngineOptions();
  EXPECT_TRUE(ParseEngineOptions("rank=0\nworld_size=1", &o).ok());  // one worker: no network, no token
}

// The default credit grows with N: one partition per peer, at least 16 MiB; a setting stays.
TEST(CreditFollowsTheWorkers) {
  EXPECT_EQ(EngineOptions().credit_bytes, kCreditAuto);
  EXPECT_EQ(ResolveCreditBytes(kCreditAuto, 2, 4u << 20), uint64_t{16} << 20);
  EXPECT_EQ(ResolveCreditBytes(kCreditAuto, 5, 4u << 20), uint64_t{16} << 20);
  EXPECT_EQ(ResolveCreditBytes(kCreditAuto, 16, 4u << 20), uint64_t{60} << 20);
  EXPECT_EQ(ResolveCreditBytes(kCreditAuto, 256, 1u << 20), uint64_t{255} << 20);
  EXPECT_EQ(ResolveCreditBytes(1000, 256, 4u << 20), 1000u);
  EngineOptions o;
  EXPECT_TRUE(ParseEngineOptions("rank=0\nworld_size=1\ncredit_bytes=0", &o).ok());
  EXPECT_EQ(o.credit_bytes, kCreditAuto);
}

TEST(SendBuffersShareTheBudgetFromThreeWorkersOn) {
  const int64_t wmem_max = 4 << 20;
  EXPECT_EQ(EngineOptions().socket_buffer_bytes, kSocketBufferAuto);
  // Two workers: the autotuning (its 4 MiB limit is the budget already).
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 2, wmem_max), 0);
  // N >= 3: 4 MiB over the N - 1 connections, at least 512 KiB each; Linux doubles the request.
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 3, wmem_max), 1 << 20);
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 5, wmem_max), 512 << 10);
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 16, wmem_max), 256 << 10);
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 256, wmem_max), 256 << 10);
  // A kernel that would cap the request (the stock net.core.wmem_max, 208 KiB), or an unknown cap:
  // the autotuning rather than a smaller fixed buffer than intended.
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 16, 212992), 0);
  EXPECT_EQ(SendBufferRequest(kSocketBufferAuto, 16, 0), 0);
  // Explicit settings are themselves (the kernel caps them), 0 the autotuning.
  EXPECT_EQ(SendBufferRequest(1 << 20, 16, 212992), 1 << 20);
  EXPECT_EQ(SendBufferRequest(0, 16, wmem_max), 0);
}

TEST(PartitionsAndCreditLeftToTheScheduleResolveByIt) {
  EngineOptions o;
  EXPECT_TRUE(ParseEngineOptions("partition_bytes=0\nschedule=p3\nmax_early_bytes=200000", &o).ok());
  EXPECT_EQ(o.partition_bytes, kPartitionAuto);
  Status s = ParseEngineOptions("partition_bytes=32", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "0 (the schedule's") && Contains(s.message(), "at least 64"));
  // max_early_bytes is checked against the schedule's partitions: P3's 160,000 bytes fit in
  // 200,000, the runtime's 4 MiB do not.
  o = EngineOptions();
  s = ParseEngineOptions("schedule=prophet\nmax_early_bytes=200000", &o);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "must be at least partition_bytes (4194304)"));
  EXPECT_EQ(ResolvePartitionBytes(kPartitionAuto, "fifo"), kRuntimePartitionBytes);
  EXPECT_EQ(ResolveScheduleCreditBytes(kCreditAuto, "prophet", 8, kRuntimePartitionBytes),
            ResolveCreditBytes(kCreditAuto, 8, kRuntimePartitionBytes));
  EXPECT_EQ(ResolveScheduleCreditBytes(kCreditAuto, "p3", 8, 160'000), ResolveCreditBytes(kCreditAuto, 8, 160'000));
  EXPECT_EQ(PartitionMinSplitBytes("priority"), kDefaultMinSplitBytes);
  EXPECT_EQ(PartitionMinSplitBytes("bytescheduler"), kNoExtraSplit);
}

// A push_pull travels in slices only where each lane's slice is still spread over every owner:
// each lane cuts its slice on its own, under the tensor's name.
TEST(APushPullIsSlicedOverTheLanesOnlyWhereEverySliceReachesEveryOwner) {
  const uint64_t kernel = 4ull * 3 * 3 * 512 * 512;  // 9 MiB
  EXPECT_TRUE(TravelsInSlices(kernel, 4, 3, 8));       // 3 MiB slices, 384 KiB an owner
  EXPECT_TRUE(!TravelsInSlices(kernel, 4, 3, 64));     // 3 MiB slices: below 64 x 64 KiB
  EXPECT_EQ(LaneSliceFromBytes(3, 64), 3 * 64 * kDefaultMinSplitBytes);
  EXPECT_EQ(LaneSliceFromBytes(8, 2), 8 * kMinLaneSliceBytes);
  EXPECT_EQ(LaneSliceFromBytes(1, 64), 0u);
  EXPECT_TRUE(!TravelsInSlices(kernel, 4, 1, 8));      // one lane: whole
  EXPECT_TRUE(!TravelsInSlices(kernel + 2, 4, 3, 8));  // not whole elements
  // Where it is sliced, every slice is cut over all N owners.
  for (const int world : {2, 8, 64, 256})
    for (const int lanes : {2, 3, 8}) {
      const uint64_t from = LaneSliceFromBytes(lanes, world);
      EXPECT_TRUE(MakePartitions("t", from / lanes, 4, world, 4u << 20).size() >= static_cast<size_t>(world));
    }
}

TEST(ConstantsForPythonComeFromTheCore) {
  const std::string json = RuntimeConstantsJson();
  for (const char* name : kScheduleNames) EXPECT_TRUE(Contains(json, std::string("\"") + name + "\""));
  EXPECT_TRUE(Contains(json, "\"control_priority\": " + std::to_string(kControlPriority)));
  EXPECT_TRUE(Contains(json, "\"protocol_version\": " + std::to_string(kProtocolVersion) + ","));
  EXPECT_TRUE(Contains(json, "\"compressions\": [\"fp16\", \"bf16\"]"));
  // The option table: one row per option, with its default, what it accepts (as the errors say
  // it), its use and its environment variable.
  EXPECT_TRUE(Contains(json, "{\"name\": \"schedule\", \"type\": \"string\", \"default\": \"" +
                                 std::string(kDefaultSchedule) + "\", \"accepts\": \"one of prophet, priority, fifo, bytescheduler or p3\""));
  EXPECT_TRUE(Contains(json, "{\"name\": \"socket_buffer_bytes\", \"type\": \"int\", \"default\": -1, \"accepts\": "
                             "\"-1 (sized for the workers), 0 (the kernel's autotuning) or an integer of at least 131072\", "
                             "\"specials\": [[-1, \"sized for the workers\"], [0, \"the kernel's autotuning\"]], "
                             "\"choices\": [], \"use\": \"user\", \"predicted\": true, \"env\": null"));
  EXPECT_TRUE(Contains(json, "{\"name\": \"replan_threshold\", \"type\": \"float\", \"default\": 0.2,"));
  EXPECT_TRUE(Contains(json, "\"name\": \"max_early_bytes\", \"type\": \"uint\", \"default\": " +
                                 std::to_string(EngineOptions().max_early_bytes)));
  EXPECT_TRUE(Contains(json, "\"use\": \"job\", \"predicted\": false, \"env\": \"PROPHET_JOB_TOKEN\""));
  EXPECT_TRUE(Contains(json, "\"p3\": {\"partition_bytes\": 160000, \"exact_partitions\": true, "
                             "\"credit_bytes\": 0, \"automatic_fusion\": false}"));
  EXPECT_TRUE(Contains(json, "\"name\": \"timeline_path\", \"type\": \"string\", \"default\": \"\", \"accepts\": \"\""));
}

// What the Python side reads back after a check: every option's value, the defaults included.
TEST(OptionsAsJson) {
  EngineOptions o;
  EXPECT_TRUE(ParseEngineOptions("world_size=2\naddresses=h:1,h:2\ntoken=t\nhosts=a,b\nheartbeat_s=0.5", &o).ok());
  const std::string json = EngineOptionsJson(o);
  EXPECT_TRUE(Contains(json, "{\"rank\": 0, \"world_size\": 2, \"addresses\": [\"h:1\", \"h:2\"], \"token\": \"t\", "
                             "\"schedule\": \"prophet\", \"partition_bytes\": 0, \"credit_bytes\": 0,"));
  EXPECT_TRUE(Contains(json, "\"heartbeat_s\": 0.5, \"socket_buffer_bytes\": -1,"));
  EXPECT_TRUE(Contains(json, "\"allow_no_token\": false, \"bind_host\": \"\", \"hierarchical\": \"auto\", "
                             "\"hosts\": [\"a\", \"b\"]}"));
  EXPECT_EQ(EngineOptionUse("socket_buffer_bytes"), kUser | kPredicted);
  EXPECT_EQ(EngineOptionUse("rank"), kJob);
  EXPECT_EQ(EngineOptionUse("colour"), 0u);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
