// EarlyFrames: frames held per operation in arrival order, and the limits that refuse one before
// anything is allocated (partition_bytes, max_early_bytes), with messages that name the limit.
#include "ops/core/early_frames.h"

#include <string>

#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

FrameMeta Meta(FrameType type, const std::string& name, uint64_t round, uint64_t bytes) {
  FrameMeta meta;
  meta.type = type;
  meta.name = name;
  meta.round = round;
  meta.payload_bytes = bytes;
  return meta;
}

EngineOptions Options(uint64_t partition_bytes, uint64_t max_early_bytes) {
  EngineOptions o;
  o.world_size = 3;
  o.partition_bytes = partition_bytes;
  o.max_early_bytes = max_early_bytes;
  return o;
}

TEST(FramesAreHeldByOperationInArrivalOrder) {
  EarlyFrames early(Options(1 << 20, 1 << 30));
  for (int peer : {2, 1}) {
    const FrameMeta meta = Meta(FrameType::kPush, "g", 4, 16);
    EXPECT_EQ(early.Admit(peer, meta), std::string());
    early.Received(peer);
    early.Keep(peer, meta, ByteBuffer(16));
  }
  early.Keep(1, Meta(FrameType::kPush, "g", 5, 0), ByteBuffer());
  std::vector<EarlyFrame> frames = early.Take("g#4");
  EXPECT_EQ(frames.size(), size_t{2});
  if (frames.size() == 2) EXPECT_TRUE(frames[0].peer == 2 && frames[1].peer == 1 && frames[0].data.size() == 16);
  EXPECT_TRUE(early.Take("g#4").empty());
  EXPECT_EQ(early.Take("g#5").size(), size_t{1});
}

TEST(AFrameLargerThanAnyPartitionIsRefused) {
  EarlyFrames early(Options(1000, 1 << 30));
  const std::string problem = early.Admit(1, Meta(FrameType::kPush, "w", 0, 1001));
  EXPECT_TRUE(Contains(problem, "push_pull 'w' (round 0): rank 1 sent 1001 bytes for it before this worker started it"));
  EXPECT_TRUE(Contains(problem, "partition_bytes = 1000"));
  // An allgather frame carries a whole tensor: only max_early_bytes bounds it.
  EXPECT_EQ(early.Admit(1, Meta(FrameType::kGather, "w", 0, 1001)), std::string());
}

TEST(HeldAndArrivingFramesCountAgainstMaxEarlyBytes) {
  EarlyFrames early(Options(1 << 20, 1500));
  const FrameMeta a = Meta(FrameType::kBroadcast, "a", 0, 1000);
  EXPECT_EQ(early.Admit(1, a), std::string());
  // While `a` is still arriving, its footprint is reserved.
  const std::string problem = early.Admit(2, Meta(FrameType::kBroadcast, "b", 0, 1000));
  EXPECT_TRUE(Contains(problem, "that passes max_early_bytes = 1500"));
  EXPECT_TRUE(Contains(problem, "held already for 0 operation(s)"));
  early.Received(1);
  early.Keep(1, a, ByteBuffer(1000));
  EXPECT_TRUE(Contains(early.Admit(2, Meta(FrameType::kBroadcast, "b", 0, 1000)), "held already for 1 operation(s)"));
  // Taken (its operation started): the room is back.
  early.Take("a#0");
  EXPECT_EQ(early.Admit(2, Meta(FrameType::kBroadcast, "b", 0, 1000)), std::string());
  // A closed connection ends its reservation too.
  early.Received(2);
  EXPECT_EQ(early.Admit(1, Meta(FrameType::kBroadcast, "c", 0, 1000)), std::string());
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
