#include "ops/core/partition.h"

#include <algorithm>

#include "ops/core/wire.h"

namespace prophet {

namespace {
constexpr uint64_t kPipelinePartitionsPerWorker = 8;
constexpr uint64_t kPipelineMinPartitionBytes = 128 * 1024;
}  // namespace

uint64_t PartitionCount(uint64_t total_bytes, size_t element_size, int world_size, uint64_t partition_bytes,
                        uint64_t min_split_bytes) {
  const uint64_t elements = element_size ? total_bytes / element_size : 0;
  const uint64_t max_elems_per_part = std::max<uint64_t>(1, partition_bytes / std::max<size_t>(1, element_size));
  uint64_t parts = (elements + max_elems_per_part - 1) / max_elems_per_part;
  if (world_size > 1 && total_bytes / static_cast<uint64_t>(world_size) >= min_split_bytes) {
    const uint64_t n = static_cast<uint64_t>(world_size);
    const uint64_t fit = std::max<uint64_t>(parts, 1);  // the fewest that respect partition_bytes
    parts = std::max<uint64_t>(parts, n);
    // Pipelining: with several partitions per owner, the first sums travel back while later
    // partitions are still arriving, so both directions of every link stay busy.
    parts = std::max<uint64_t>(parts, std::min<uint64_t>(kPipelinePartitionsPerWorker * n, total_bytes / kPipelineMinPartitionBytes));
    // Whole rounds of owners, so that every owner sums the same share of the tensor: 72
    // partitions over 64 owners gave 8 of them twice the others' bytes to receive and send back,
    // and each tensor's all-reduce ends with its busiest owner. Fewer when partition_bytes
    // allows it, else more (then possibly below kPipelineMinPartitionBytes, with a
    // partition_bytes just above it).
    if (parts % n != 0) parts = parts / n * n >= fit ? parts / n * n : (parts / n + 1) * n;
  } else if (world_size > 1) {
    // Too small for every owner, but not for several: each of those owners receives N-1 pushes of
    // its partition and sends N-1 sums back, so one owner of a whole 1.5 MB tensor at N = 64
    // carried 94 MB each way while the others waited (BERT-base's position embedding, 1 Gbit/s:
    // 8.16 s a step against the ring's 7.35).
    parts = std::max<uint64_t>(parts, total_bytes / min_split_bytes);
  }
  parts = std::max<uint64_t>(parts, 1);
  parts = std::min<uint64_t>(parts, std::max<uint64_t>(elements, 1));
  return parts;
}

std::vector<Partition> MakePartitions(const std::string& name, uint64_t total_bytes, size_t element_size,
                                      int world_size, uint64_t partition_bytes, uint64_t min_split_bytes) {
  const uint64_t elements = element_size ? total_bytes / element_size : 0;
  const uint64_t parts = PartitionCount(total_bytes, element_size, world_size, partition_bytes, min_split_bytes);

  const int start = world_size > 0 ? static_cast<int>(HashString(name) % static_cast<uint64_t>(world_size)) : 0;
  std::vector<Partition> out(parts);
  // Equal element counts (the first `extra` partitions get one more) keep owners balanced.
  const uint64_t base = elements / parts, extra = elements % parts;
  uint64_t offset_elems = 0;
  for (uint64_t i = 0; i < parts; ++i) {
    const uint64_t n = base + (i < extra ? 1 : 0);
    out[i].offset = offset_elems * element_size;
    out[i].bytes = n * element_size;
    out[i].owner = world_size > 0 ? static_cast<int>((start + i) % static_cast<uint64_t>(world_size)) : 0;
    offset_elems += n;
  }
  return out;
}

}  // namespace prophet
