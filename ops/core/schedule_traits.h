// What a schedule asks of the rest of the runtime when the job leaves the options to it: how
// tensors are cut, the byte credit, and whether small gradients travel fused. The published
// schedulers (bytescheduler, p3) define their own partitions and flow control; the runtime's
// (prophet, priority, fifo) share the runtime's defaults. The engine (Engine::Start) and the
// simulator (Simulate) resolve their options here, and the Python package reads the table
// through RuntimeConstantsJson.
#ifndef PROPHET_OPS_CORE_SCHEDULE_TRAITS_H_
#define PROPHET_OPS_CORE_SCHEDULE_TRAITS_H_

#include <cstdint>
#include <string>

namespace prophet {

// partition_bytes = kPartitionAuto: the schedule's ScheduleTraits::partition_bytes.
constexpr uint64_t kPartitionAuto = 0;
// The runtime's partition size (prophet, priority, fifo).
constexpr uint64_t kRuntimePartitionBytes = 4u << 20;
// MakePartitions' min_split_bytes that turns its extra cuts off: only the partition size cuts.
constexpr uint64_t kNoExtraSplit = ~uint64_t{0};

struct ScheduleTraits {
  const char* name = "";
  uint64_t partition_bytes = kRuntimePartitionBytes;
  // Only the partition size cuts a tensor (ceil(bytes / partition_bytes) near-equal parts),
  // without the runtime's extra cuts that spread a tensor over every owner (partition.h).
  bool exact_partitions = false;
  // What credit_bytes = kCreditAuto gives; 0: the runtime's rule (ResolveCreditBytes).
  uint64_t credit_bytes = 0;
  // ProphetStrategy(fusion="auto") fuses small gradients into buckets (fusion.h); false: the
  // schedule's own partitions are what travels.
  bool automatic_fusion = true;
};

// The traits of `schedule` (one of kScheduleNames), or nullptr.
const ScheduleTraits* FindScheduleTraits(const std::string& schedule);

// A partition_bytes setting under `schedule`: the setting, or for kPartitionAuto the schedule's
// partition size (the runtime's for a name without traits).
uint64_t ResolvePartitionBytes(uint64_t setting, const std::string& schedule);

// A credit_bytes setting under `schedule` on `world_size` workers with partitions of
// `partition_bytes` (resolved): the setting, the schedule's credit, or ResolveCreditBytes.
uint64_t ResolveScheduleCreditBytes(uint64_t setting, const std::string& schedule, int world_size,
                                    uint64_t partition_bytes);

// MakePartitions' min_split_bytes under `schedule`: kNoExtraSplit where only the partition size
// cuts, else MakePartitions' default.
uint64_t PartitionMinSplitBytes(const std::string& schedule);

// {"prophet": {"partition_bytes": ..., "exact_partitions": ..., "credit_bytes": ...,
// "automatic_fusion": ...}, ...} for every schedule.
std::string ScheduleTraitsJson();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_SCHEDULE_TRAITS_H_
