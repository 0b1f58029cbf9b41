// An emulated accelerator for the training benchmark: operations that take a fixed time and no
// CPU, executed one at a time in issue order like the kernels of a GPU's compute stream.
//
// The benchmark replaces every layer's forward and backward computation with such an operation
// (ops/tf_bench/emulated_compute_ops.cc) so that, on a machine without accelerators, the CPU is left to
// what it does on a real cluster: the framework, the optimizer and the communication.
//
// Start rule (StartNs): an operation issued while the device is busy starts when the previous one
// ends. One issued within `launch_slack_ns` after the device became idle also starts at that
// moment: a GPU hides the host's issue latency by queueing kernels ahead, and without this rule
// every layer would add TensorFlow's scheduling delay (tens of microseconds, more on a loaded
// machine) to the emulated compute time. One issued later (it waited for something else, e.g. a
// variable's pending update) starts when issued.
//
// One timer thread per process completes the operations; it sleeps until the earliest deadline
// and runs the completion callbacks outside the lock. Because the device is in-order, deadlines
// are non-decreasing and a FIFO is enough.
#ifndef PROPHET_OPS_TF_BENCH_EMULATED_DEVICE_H_
#define PROPHET_OPS_TF_BENCH_EMULATED_DEVICE_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace prophet {

class EmulatedDevice {
 public:
  // Called on the device's timer thread with the emulated [start, end) of the operation.
  using Done = std::function<void(int64_t start_ns, int64_t end_ns)>;

  static constexpr int64_t kDefaultLaunchSlackNs = 500'000;

  explicit EmulatedDevice(int64_t launch_slack_ns = kDefaultLaunchSlackNs);
  ~EmulatedDevice();  // completes nothing that is still pending; joins the timer thread
  EmulatedDevice(const EmulatedDevice&) = delete;
  EmulatedDevice& operator=(const EmulatedDevice&) = delete;

  // When an operation issued at `issue_ns` starts on a device that is free from `free_ns`.
  static int64_t StartNs(int64_t issue_ns, int64_t free_ns, int64_t launch_slack_ns);

  // Queues an operation of `duration_ns` (>= 0) issued now; `done` runs once it has passed.
  void Run(int64_t duration_ns, Done done);

  // Number of operations queued or running (tests).
  size_t pending() const;

 private:
  struct Pending {
    int64_t start_ns;
    int64_t end_ns;
    Done done;
  };
  void TimerLoop();

  const int64_t launch_slack_ns_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;  // end_ns non-decreasing
  int64_t free_ns_ = 0;        // when the last queued operation ends
  bool stop_ = false;
  std::thread timer_;
};

// The process-wide device the TensorFlow kernels share (created on first use, never destroyed:
// kernels may still complete while the process exits).
EmulatedDevice& GlobalEmulatedDevice();

}  // namespace prophet

#endif  // PROPHET_OPS_TF_BENCH_EMULATED_DEVICE_H_
