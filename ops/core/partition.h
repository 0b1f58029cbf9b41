// How a tensor is cut into partitions and which worker owns (sums) each one.
#ifndef PROPHET_OPS_CORE_PARTITION_H_
#define PROPHET_OPS_CORE_PARTITION_H_

#include <cstdint>
#include <string>
#include <vector>

namespace prophet {

// MakePartitions' min_split_bytes unless a schedule asks for its own partitions only
// (schedule_traits.h: kNoExtraSplit turns the extra cuts off).
constexpr uint64_t kDefaultMinSplitBytes = 64 * 1024;

struct Partition {
  uint64_t offset = 0;  // bytes
  uint64_t bytes = 0;
  int owner = 0;
};

// Cuts `total_bytes` (a multiple of `element_size`) into partitions of at most `partition_bytes`,
// on element boundaries, so that owners share the work of summing it:
// - a tensor of at least `world_size * min_split_bytes` bytes into at least `world_size`
//   partitions, so that every worker sums a share of it, and a larger one into up to 8
//   partitions per worker (none below 128 KiB), so that sums flow back while later partitions
//   are still arriving; in whole rounds of the N owners (fewer where `partition_bytes` allows,
//   else more, then possibly below 128 KiB), so that every owner sums the same share;
// - a smaller one into as many partitions of at least `min_split_bytes` as it holds, each on
//   its own owner.
// Owners go round-robin from a start rank derived from the tensor name: the same on every worker,
// and different tensors start on different ranks so small tensors spread too. Every tensor, even
// an empty one, has at least one partition: partition 0 is where shape mismatches are caught.
// With min_split_bytes = ~0 (kNoExtraSplit) only `partition_bytes` cuts.
std::vector<Partition> MakePartitions(const std::string& name, uint64_t total_bytes, size_t element_size,
                                      int world_size, uint64_t partition_bytes,
                                      uint64_t min_split_bytes = kDefaultMinSplitBytes);
// How many partitions MakePartitions cuts (without cutting them).
uint64_t PartitionCount(uint64_t total_bytes, size_t element_size, int world_size, uint64_t partition_bytes,
                        uint64_t min_split_bytes = kDefaultMinSplitBytes);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_PARTITION_H_
