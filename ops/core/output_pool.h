// Memory for large operation outputs, recycled warm.
//
// Why: a push_pull's output is a new allocation on every call (TensorFlow's CPU allocator, i.e.
// malloc), and glibc serves anything above its mmap threshold, which it never raises past 32 MiB,
// with a fresh mmap that it unmaps again on free. Every 4 KiB page of such an output then faults
// when the engine's I/O thread first receives into it (the fault, the kernel zeroing the page,
// its memory-cgroup charge) and is unmapped when TensorFlow frees the tensor: on this machine's
// kernel, push_pull of 64 MiB cost 2.0-2.4x raw TCP's CPU per byte and 256 MiB 2.6-3.0x, against
// about 1.2x with recycled outputs (docs/benchmarks.md, "Transport"), and that CPU lands on the
// I/O thread, the one that limits the transport. Training asks for the same output sizes every
// step, so buffers handed back are kept and handed out again, already mapped.
//
// What is kept: freed buffers of at least kRecycleMinBytes, up to the most bytes that were taken
// and not yet given back at any one time (what the process used at its peak, so recycling never
// more than doubles that); a buffer not taken again within kRecycleIdleNs is freed. Thread-safe:
// TensorFlow frees outputs on any thread.
#ifndef PROPHET_OPS_CORE_OUTPUT_POOL_H_
#define PROPHET_OPS_CORE_OUTPUT_POOL_H_

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace prophet {

// Below this, malloc's heap serves outputs warm already.
constexpr size_t kRecycleMinBytes = size_t{1} << 20;
// A kept buffer that nothing took again for this long is freed.
constexpr int64_t kRecycleIdleNs = int64_t{10} * 1000 * 1000 * 1000;
// Alignment of every buffer (Eigen's, as TensorFlow's allocator gives).
constexpr size_t kOutputAlignment = 64;

class OutputPool {
 public:
  OutputPool() = default;
  ~OutputPool();
  OutputPool(const OutputPool&) = delete;
  OutputPool& operator=(const OutputPool&) = delete;

  // `bytes` of uninitialised memory aligned to kOutputAlignment: a kept buffer of at least
  // `bytes` and at most 1/8 more, else a new one; nullptr if memory is exhausted. `now_ns`:
  // the clock that ages kept buffers (NowNs()).
  void* Take(size_t bytes, int64_t now_ns);
  // Hands back a buffer from Take.
  void Give(void* data, int64_t now_ns);

  uint64_t kept_bytes() const;
  size_t kept_buffers() const;
  uint64_t peak_taken_bytes() const;
  // Buffers Take handed out that it had kept (for the tests).
  uint64_t reused() const;

 private:
  struct Kept {
    void* data;
    size_t capacity;
    int64_t since_ns;
  };
  // Frees kept buffers idle for too long, then the oldest while more than the peak is kept.
  void Trim(int64_t now_ns);

  mutable std::mutex mu_;
  std::unordered_map<void*, size_t> taken_;  // capacity of each buffer handed out
  std::vector<Kept> kept_;                   // oldest first
  uint64_t taken_bytes_ = 0, peak_taken_bytes_ = 0, kept_bytes_ = 0, reused_ = 0;
};

// The process-wide pool for the TensorFlow kernels' outputs (never destroyed: tensors may
// outlive every other static).
OutputPool& GlobalOutputPool();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_OUTPUT_POOL_H_
