// Test processes that feed the engine hostile sizes cap their own memory, so that a regression
// (the engine honouring a claim of gigabytes) fails the test instead of exhausting the machine.
#ifndef PROPHET_OPS_CORE_FUZZ_MEMORY_CAP_H_
#define PROPHET_OPS_CORE_FUZZ_MEMORY_CAP_H_

namespace prophet {
namespace fuzz {

// Allocations beyond a few GiB fail from now on: under ASan through its max_allocation_size_mb
// (set in this library's __asan_default_options), under TSan not at all, otherwise through RLIMIT_AS.
void CapMemory();

}  // namespace fuzz
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUZZ_MEMORY_CAP_H_
