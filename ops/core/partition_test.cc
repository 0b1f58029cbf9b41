// Partitioning: exact cover on element boundaries, size limits, deterministic and balanced owners.
#include "ops/core/partition.h"

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "ops/core/testing.h"
#include "ops/core/wire.h"

namespace prophet {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * 1024;

// Checks the invariants of one partitioning; returns false (and logs) on the first violation.
bool CheckCover(const std::vector<Partition>& parts, uint64_t total, size_t elem, int world, uint64_t partition_bytes,
                uint64_t min_split = 64 * kKiB) {
  auto fail = [&](const char* what) {
    std::fprintf(stderr, "total %llu elem %zu world %d partition_bytes %llu: %s\n",
                 static_cast<unsigned long long>(total), elem, world,
                 static_cast<unsigned long long>(partition_bytes), what);
    return false;
  };
  if (parts.empty()) return fail("no partition");
  uint64_t next = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Partition& p = parts[i];
    if (p.offset != next) return fail("gap or overlap");
    if (p.offset % elem || p.bytes % elem) return fail("not on an element boundary");
    if (p.bytes > std::max<uint64_t>(partition_bytes, elem)) return fail("partition above partition_bytes");
    if (total > 0 && p.bytes == 0) return fail("empty partition of a non-empty tensor");
    if (p.owner < 0 || p.owner >= std::max(world, 1)) return fail("owner outside the world");
    if (i > 0 && p.owner != (parts[i - 1].owner + 1) % std::max(world, 1)) return fail("owners not round-robin");
    next += p.bytes;
  }
  if (next != total) return fail("does not cover the tensor");
  if (world > 1 && total >= static_cast<uint64_t>(world) * min_split &&
      parts.size() < std::min<uint64_t>(static_cast<uint64_t>(world), total / elem))
    return fail("large tensor with fewer partitions than workers");
  // Equal split: sizes differ by at most one element.
  uint64_t lo = ~0ull, hi = 0;
  for (const Partition& p : parts) lo = std::min(lo, p.bytes), hi = std::max(hi, p.bytes);
  if (total > 0 && hi - lo > elem) return fail("unequal partitions");
  return true;
}

TEST(PartitionsCoverExactlyOnElementBoundaries) {
  const size_t elems[] = {1, 2, 4, 8};
  const int worlds[] = {1, 2, 3, 4, 7, 16};
  const uint64_t part_sizes[] = {64, 1000, 64 * kKiB, kMiB, 4 * kMiB};
  const uint64_t counts[] = {0,      1,      2,      3,       7,        63,        64,         65,
                             1000,   16383,  16384,  16385,   100003,   262144,    1000000,    2359296,
                             2359297, 3000000};
  int checked = 0;
  for (size_t elem : elems)
    for (int world : worlds)
      for (uint64_t pb : part_sizes)
        for (uint64_t count : counts) {
          const uint64_t total = count * elem;
          const std::string name = "t/" + std::to_string(count) + "/" + std::to_string(elem);
          const std::vector<Partition> parts = MakePartitions(name, total, elem, world, pb);
          if (!CheckCover(parts, total, elem, world, pb)) {
            ++::prophet::testing::Failures();
            return;
          }
          ++checked;
        }
  EXPECT_TRUE(checked > 1000);
}

TEST(FewestPartitionsThatFit) {
  // 9 MiB of float32 with 1 MiB partitions: exactly 9 partitions of 1 MiB (one worker: no
  // pipelining, see MidSizeTensorsArePipelined).
  std::vector<Partition> parts = MakePartitions("w", 9 * kMiB, 4, 1, kMiB);
  EXPECT_EQ(parts.size(), 9u);
  for (const Partition& p : parts) EXPECT_EQ(p.bytes, kMiB);
  // One byte-element more than 4 partitions' worth needs a fifth (one worker: no pipelining).
  parts = MakePartitions("w", 4 * kMiB + 4, 4, 1, kMiB);
  EXPECT_EQ(parts.size(), 5u);
  // Small tensors stay whole.
  parts = MakePartitions("bias", 4000, 4, 4, kMiB);
  EXPECT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].bytes, 4000u);
}

TEST(MidSizeTensorsArePipelined) {
  // Up to 8 partitions per worker, none below 128 KiB, even when one partition would fit.
  std::vector<Partition> parts = MakePartitions("w", 4 * kMiB, 4, 2, 4 * kMiB);
  EXPECT_EQ(parts.size(), 16u);
  for (const Partition& p : parts) EXPECT_EQ(p.bytes, 256 * kKiB);
  parts = MakePartitions("w", kMiB, 4, 2, 4 * kMiB);
  EXPECT_EQ(parts.size(), 8u);
  parts = MakePartitions("w", 200 * kKiB, 4, 2, 4 * kMiB);  // only the one-share-per-worker rule
  EXPECT_EQ(parts.size(), 2u);
  // Large: partition_bytes decides (64 would fit), rounded up to whole rounds of the 3 owners.
  parts = MakePartitions("w", 256 * kMiB, 4, 3, 4 * kMiB);
  EXPECT_EQ(parts.size(), 66u);
  EXPECT_TRUE(CheckCover(parts, 256 * kMiB, 4, 3, 4 * kMiB));
}

// A tensor cut across every worker gives each owner the same share (to an element per partition),
// whatever N: its all-reduce ends when its busiest owner has received every contribution and sent
// every sum back. 72 partitions of ResNet50's 9 MiB kernels over 64 owners gave 8 owners twice
// the bytes of the others (predicted at 1 Gbit/s: 7% slower steps than TensorFlow's ring).
TEST(EveryOwnerSumsTheSameShareOfATensorCutAcrossAllWorkers) {
  const uint64_t sizes[] = {4ull * 3 * 3 * 512 * 512, 4ull * 3 * 3 * 256 * 256, 4ull * 2048 * 1000, kMiB,
                            37 * kMiB + 12, 400 * kMiB};
  int checked = 0;
  for (const int world : {2, 3, 5, 8, 16, 64, 100, 256}) {
    for (const uint64_t bytes : sizes) {
      for (const uint64_t partition_bytes : {4 * kMiB, kMiB}) {
        const std::vector<Partition> parts = MakePartitions("t", bytes, 4, world, partition_bytes);
        EXPECT_TRUE(CheckCover(parts, bytes, 4, world, partition_bytes));
        if (bytes < static_cast<uint64_t>(world) * 64 * kKiB) continue;  // not cut across all
        EXPECT_EQ(parts.size() % static_cast<size_t>(world), 0u);
        std::vector<uint64_t> load(world, 0);
        for (const Partition& p : parts) load[p.owner] += p.bytes;
        const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
        EXPECT_TRUE(*hi - *lo <= 4);  // one element: partitions differ by one, owners take whole rounds
        ++checked;
      }
    }
  }
  EXPECT_TRUE(checked > 40);
}

TEST(LargeTensorsAreSplitAcrossAllWorkers) {
  for (int world = 2; world <= 8; ++world) {
    // Exactly world * 64 KiB: at least world partitions even though it fits in one.
    const uint64_t total = static_cast<uint64_t>(world) * 64 * kKiB;
    std::vector<Partition> parts = MakePartitions("fc/kernel", total, 4, world, 4 * kMiB);
    EXPECT_TRUE(parts.size() >= static_cast<size_t>(world));
    std::vector<int> owned(world, 0);
    for (const Partition& p : parts) owned[p.owner]++;
    for (int r = 0; r < world; ++r) EXPECT_TRUE(owned[r] >= 1);  // every worker sums a share
    // Just below the threshold: one owner fewer, each partition at least 64 KiB.
    parts = MakePartitions("fc/kernel", total - 4, 4, world, 4 * kMiB);
    EXPECT_EQ(parts.size(), static_cast<size_t>(world - 1));
    // float64, float16 too.
    parts = MakePartitions("fc/kernel", total, 8, world, 4 * kMiB);
    EXPECT_TRUE(parts.size() >= static_cast<size_t>(world));
    parts = MakePartitions("fc/kernel", total, 2, world, 4 * kMiB);
    EXPECT_TRUE(parts.size() >= static_cast<size_t>(world));
  }
  // A single worker never splits for balance.
  EXPECT_EQ(MakePartitions("x", 10 * kMiB, 4, 1, 64 * kMiB).size(), 1u);
}

TEST(TensorsTooSmallForEveryOwnerSpreadOverSeveral) {
  // A whole 1.5 MB tensor on one owner at N = 64 made that owner receive and send back 63 x
  // 1.5 MB while the others waited; cut into partitions of at least 64 KiB, each on its own owner.
  const int world = 64;
  for (const uint64_t total : {uint64_t{64 * kKiB}, uint64_t{128 * kKiB} - 4, uint64_t{128 * kKiB},
                               uint64_t{1572864}, uint64_t{world * 64 * kKiB} - 4}) {
    const std::vector<Partition> parts = MakePartitions("position_embedding", total, 4, world, 64 * kMiB);
    EXPECT_EQ(parts.size(), static_cast<size_t>(std::max<uint64_t>(1, total / (64 * kKiB))));
    std::vector<int> owned(world, 0);
    uint64_t covered = 0;
    for (const Partition& p : parts) {
      EXPECT_EQ(p.offset, covered);
      covered += p.bytes;
      EXPECT_TRUE(p.bytes >= 64 * kKiB || parts.size() == 1);
      EXPECT_EQ(++owned[p.owner], 1);  // every partition on its own owner
    }
    EXPECT_EQ(covered, total);
  }
  // A schedule that asks for its own partitions only (kNoExtraSplit) keeps the tensor whole.
  EXPECT_EQ(MakePartitions("position_embedding", 1572864, 4, world, 64 * kMiB, ~uint64_t{0}).size(), 1u);
}

TEST(EmptyAndTinyTensors) {
  std::vector<Partition> parts = MakePartitions("empty", 0, 4, 3, kMiB);
  EXPECT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].offset, 0u);
  EXPECT_EQ(parts[0].bytes, 0u);
  EXPECT_TRUE(parts[0].owner >= 0 && parts[0].owner < 3);
  parts = MakePartitions("empty", 0, 4, 1, kMiB);
  EXPECT_EQ(parts.size(), 1u);
  // One element can not be split even with many workers.
  parts = MakePartitions("scalar", 8, 8, 16, 64);
  EXPECT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].bytes, 8u);
  // Fewer elements than workers on a tensor above the split threshold: one element each.
  parts = MakePartitions("few", 3 * 8, 8, 4, kMiB, /*min_split_bytes=*/1);
  EXPECT_EQ(parts.size(), 3u);
  EXPECT_TRUE(CheckCover(parts, 24, 8, 4, kMiB, 1));
}

TEST(OwnersAreDeterministicAndSpread) {
  // Same inputs, same answer (what every worker relies on).
  for (int world = 1; world <= 5; ++world) {
    const std::vector<Partition> a = MakePartitions("layer3/conv2/kernel:0", 9 * kMiB, 4, world, kMiB);
    const std::vector<Partition> b = MakePartitions("layer3/conv2/kernel:0", 9 * kMiB, 4, world, kMiB);
    EXPECT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
      EXPECT_EQ(a[i].owner, b[i].owner);
      EXPECT_EQ(a[i].offset, b[i].offset);
      EXPECT_EQ(a[i].bytes, b[i].bytes);
    }
    // The start rank is FNV-1a(name) mod N: stable across processes and builds.
    EXPECT_EQ(a[0].owner, static_cast<int>(HashString("layer3/conv2/kernel:0") % static_cast<uint64_t>(world)));
  }
  // Pinned values so that a change of hash or rule (which would break mixed-version jobs) shows.
  const int owner_of_a = MakePartitions("a", 4, 4, 3, kMiB)[0].owner;
  EXPECT_EQ(owner_of_a, static_cast<int>(0x44bd8ad473cd9906ull % 3));
  // Different tensors start on different ranks: every rank is a start rank for some of 100 names.
  for (int world = 2; world <= 8; ++world) {
    std::vector<int> starts(world, 0);
    for (int i = 0; i < 100; ++i) starts[MakePartitions("bias_" + std::to_string(i), 4, 4, world, kMiB)[0].owner]++;
    for (int r = 0; r < world; ++r) EXPECT_TRUE(starts[r] > 0);
  }
}

struct Tensor {
  std::string name;
  uint64_t bytes;
};

// The 161 trainable float32 tensors of ResNet-50 (torchvision layout: convolutions without bias,
// batch-norm gamma and beta, fully-connected kernel and bias): 256 B to 9 MiB, 25.5 M parameters.
std::vector<Tensor> ResNet50() {
  std::vector<Tensor> t;
  auto conv = [&](const std::string& name, int k, int in, int out) {
    t.push_back({name + "/kernel", 4ull * k * k * in * out});
    t.push_back({name + "/bn/gamma", 4ull * out});
    t.push_back({name + "/bn/beta", 4ull * out});
  };
  conv("conv1", 7, 3, 64);
  const int blocks[] = {3, 4, 6, 3};
  const int widths[] = {64, 128, 256, 512};
  int in = 64;
  for (int s = 0; s < 4; ++s) {
    const int w = widths[s];
    for (int b = 0; b < blocks[s]; ++b) {
      const std::string prefix = "layer" + std::to_string(s + 1) + "/block" + std::to_string(b);
      conv(prefix + "/conv1", 1, in, w);
      conv(prefix + "/conv2", 3, w, w);
      conv(prefix + "/conv3", 1, w, 4 * w);
      if (b == 0) conv(prefix + "/downsample", 1, in, 4 * w);
      in = 4 * w;
    }
  }
  t.push_back({"fc/kernel", 4ull * 2048 * 1000});
  t.push_back({"fc/bias", 4ull * 1000});
  return t;
}

// max owner load / mean owner load, in bytes summed.
double OwnerImbalance(const std::vector<Tensor>& model, int world, uint64_t partition_bytes) {
  std::vector<uint64_t> load(world, 0);
  uint64_t total = 0;
  for (const Tensor& t : model) {
    for (const Partition& p : MakePartitions(t.name, t.bytes, 4, world, partition_bytes)) {
      load[p.owner] += p.bytes;
      total += p.bytes;
    }
  }
  const double mean = static_cast<double>(total) / world;
  return static_cast<double>(*std::max_element(load.begin(), load.end())) / mean;
}

TEST(ResNet50ModelShape) {
  const std::vector<Tensor> model = ResNet50();
  EXPECT_EQ(model.size(), 161u);
  uint64_t total = 0, lo = ~0ull, hi = 0;
  for (const Tensor& t : model) total += t.bytes, lo = std::min(lo, t.bytes), hi = std::max(hi, t.bytes);
  EXPECT_EQ(total / 4, 25557032u);  // ResNet-50's parameter count
  EXPECT_EQ(lo, 256u);
  EXPECT_EQ(hi, 4ull * 3 * 3 * 512 * 512);  // 9 MiB
}

TEST(OwnerBalanceOverResNet50) {
  const std::vector<Tensor> model = ResNet50();
  const uint64_t sizes[] = {kMiB, 4 * kMiB};  // 4 MiB is the runtime default
  for (uint64_t pb : sizes) {
    for (int world = 2; world <= 4; ++world) {
      const double ratio = OwnerImbalance(model, world, pb);
      std::printf("ResNet-50, partition_bytes %llu MiB, N=%d: max/mean owner load = %.4f\n",
                  static_cast<unsigned long long>(pb / kMiB), world, ratio);
      EXPECT_TRUE(ratio <= 1.10);
    }
  }
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
