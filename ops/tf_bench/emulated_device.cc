#include "ops/tf_bench/emulated_device.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "ops/core/common.h"

namespace prophet {

EmulatedDevice::EmulatedDevice(int64_t launch_slack_ns)
    : launch_slack_ns_(std::max<int64_t>(0, launch_slack_ns)) {
  timer_ = std::thread([this] { TimerLoop(); });
}

EmulatedDevice::~EmulatedDevice() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  timer_.join();
}

int64_t EmulatedDevice::StartNs(int64_t issue_ns, int64_t free_ns, int64_t launch_slack_ns) {
  return issue_ns <= free_ns + launch_slack_ns ? free_ns : issue_ns;
}

void EmulatedDevice::Run(int64_t duration_ns, Done done) {
  const int64_t now = NowNs();
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t start = StartNs(now, free_ns_, launch_slack_ns_);
    free_ns_ = start + std::max<int64_t>(0, duration_ns);
    queue_.push_back({start, free_ns_, std::move(done)});
  }
  cv_.notify_one();
}

size_t EmulatedDevice::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size();
}

void EmulatedDevice::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (queue_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const int64_t deadline = queue_.front().end_ns;
    if (NowNs() < deadline) {
      // steady_clock is what NowNs reads; sleeping uses no CPU.
      cv_.wait_until(lock, std::chrono::steady_clock::time_point(std::chrono::nanoseconds(deadline)));
      continue;
    }
    Pending op = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    op.done(op.start_ns, op.end_ns);  // may issue the next operation (Run takes the lock)
    lock.lock();
  }
}

EmulatedDevice& GlobalEmulatedDevice() {
  static EmulatedDevice* device = new EmulatedDevice();
  return *device;
}

}  // namespace prophet
