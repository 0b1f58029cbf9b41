#include "ops/core/fuzz/memory_cap.h"

#include <sys/resource.h>

#include <cstdint>

// The sanitizer configs undefine __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__ (see .bazelrc) and
// define PROPHET_ASAN / PROPHET_TSAN. Sanitizers reserve terabytes of address space, so RLIMIT_AS
// cannot be used with them.
#if defined(PROPHET_ASAN)
extern "C" const char* __asan_default_options() { return "max_allocation_size_mb=4096"; }
#endif

namespace prophet {
namespace fuzz {

void CapMemory() {
#if !defined(PROPHET_ASAN) && !defined(PROPHET_TSAN)
  const rlimit cap{uint64_t{8} << 30, uint64_t{8} << 30};
  ::setrlimit(RLIMIT_AS, &cap);
#endif
}

}  // namespace fuzz
}  // namespace prophet
