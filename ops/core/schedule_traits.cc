#include "ops/core/schedule_traits.h"

#include <sstream>

#include "ops/core/bytescheduler_policy.h"
#include "ops/core/engine_options.h"
#include "ops/core/p3_policy.h"
#include "ops/core/partition.h"

namespace prophet {

namespace {

ScheduleTraits Traits(const char* name, uint64_t partition_bytes, bool exact, uint64_t credit_bytes, bool fusion) {
  ScheduleTraits t;
  t.name = name;
  t.partition_bytes = partition_bytes;
  t.exact_partitions = exact;
  t.credit_bytes = credit_bytes;
  t.automatic_fusion = fusion;
  return t;
}

// ByteScheduler's code partitions and merges nothing; P3 sends every array as its own slices.
const ScheduleTraits kTraits[] = {
    Traits("prophet", kRuntimePartitionBytes, false, 0, true),
    Traits("priority", kRuntimePartitionBytes, false, 0, true),
    Traits("fifo", kRuntimePartitionBytes, false, 0, true),
    Traits("bytescheduler", kByteSchedulerPartitionBytes, true, kByteSchedulerCreditBytes, false),
    Traits("p3", kP3SliceBytes, true, 0, false),
};

}  // namespace

const ScheduleTraits* FindScheduleTraits(const std::string& schedule) {
  for (const ScheduleTraits& t : kTraits)
    if (schedule == t.name) return &t;
  return nullptr;
}

uint64_t ResolvePartitionBytes(uint64_t setting, const std::string& schedule) {
  if (setting != kPartitionAuto) return setting;
  const ScheduleTraits* traits = FindScheduleTraits(schedule);
  return traits != nullptr ? traits->partition_bytes : kRuntimePartitionBytes;
}

uint64_t ResolveScheduleCreditBytes(uint64_t setting, const std::string& schedule, int world_size,
                                    uint64_t partition_bytes) {
  const ScheduleTraits* traits = FindScheduleTraits(schedule);
  if (setting == kCreditAuto && traits != nullptr && traits->credit_bytes > 0) return traits->credit_bytes;
  return ResolveCreditBytes(setting, world_size, partition_bytes);
}

uint64_t PartitionMinSplitBytes(const std::string& schedule) {
  const ScheduleTraits* traits = FindScheduleTraits(schedule);
  return traits != nullptr && traits->exact_partitions ? kNoExtraSplit : kDefaultMinSplitBytes;
}

std::string ScheduleTraitsJson() {
  std::ostringstream os;
  os << "{";
  bool first = true;
  for (const ScheduleTraits& t : kTraits) {
    os << (first ? "" : ", ") << '"' << t.name << "\": {\"partition_bytes\": " << t.partition_bytes
       << ", \"exact_partitions\": " << (t.exact_partitions ? "true" : "false")
       << ", \"credit_bytes\": " << t.credit_bytes
       << ", \"automatic_fusion\": " << (t.automatic_fusion ? "true" : "false") << "}";
    first = false;
  }
  os << "}";
  return os.str();
}

}  // namespace prophet
