// Emulated accelerator: start rule, in-order completion, callbacks never before their deadline.
// (Only lower bounds on time are asserted: a loaded machine may complete operations late.)
#include "ops/tf_bench/emulated_device.h"

#include <condition_variable>
#include <mutex>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;

TEST(StartRule) {
  const int64_t slack = kMs / 2;
  EXPECT_EQ(EmulatedDevice::StartNs(100 * kMs, 150 * kMs, slack), 150 * kMs);  // busy: queued
  EXPECT_EQ(EmulatedDevice::StartNs(150 * kMs, 150 * kMs, slack), 150 * kMs);
  // Issued shortly after the device became idle: the issue latency is hidden.
  EXPECT_EQ(EmulatedDevice::StartNs(150 * kMs + slack, 150 * kMs, slack), 150 * kMs);
  // Issued later (it waited for something else): starts when issued.
  EXPECT_EQ(EmulatedDevice::StartNs(150 * kMs + slack + 1, 150 * kMs, slack), 150 * kMs + slack + 1);
  EXPECT_EQ(EmulatedDevice::StartNs(300 * kMs, 150 * kMs, 0), 300 * kMs);
}

struct Completion {
  int index;
  int64_t start_ns, end_ns, called_ns;
};

class Recorder {
 public:
  EmulatedDevice::Done For(int index) {
    return [this, index](int64_t start, int64_t end) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.push_back({index, start, end, NowNs()});
      cv_.notify_all();
    };
  }
  std::vector<Completion> WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_.size() >= n; });
    return done_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Completion> done_;
};

TEST(OperationsRunInIssueOrderBackToBack) {
  // A slack far above any scheduling delay makes the chaining deterministic.
  EmulatedDevice device(/*launch_slack_ns=*/60'000 * kMs);
  Recorder recorder;
  const std::vector<int64_t> durations = {3 * kMs, 0, 1 * kMs, 5 * kMs, 2 * kMs};
  const int64_t issued = NowNs();
  for (size_t i = 0; i < durations.size(); ++i) device.Run(durations[i], recorder.For(static_cast<int>(i)));
  const std::vector<Completion> done = recorder.WaitFor(durations.size());
  EXPECT_EQ(done.size(), durations.size());
  for (size_t i = 0; i < done.size(); ++i) {
    EXPECT_EQ(done[i].index, static_cast<int>(i));
    EXPECT_EQ(done[i].end_ns - done[i].start_ns, durations[i]);
    EXPECT_TRUE(done[i].called_ns >= done[i].end_ns);  // never early
    if (i > 0) EXPECT_EQ(done[i].start_ns, done[i - 1].end_ns);
  }
  EXPECT_TRUE(done[0].start_ns >= issued);
  EXPECT_TRUE(done.back().end_ns - done[0].start_ns == 11 * kMs);
  EXPECT_EQ(device.pending(), 0u);
}

TEST(IdleDeviceStartsLateOperationsWhenIssued) {
  EmulatedDevice device(/*launch_slack_ns=*/0);
  Recorder recorder;
  device.Run(1 * kMs, recorder.For(0));
  recorder.WaitFor(1);
  const int64_t issued = NowNs();
  device.Run(2 * kMs, recorder.For(1));
  const std::vector<Completion> done = recorder.WaitFor(2);
  EXPECT_TRUE(done[1].start_ns >= issued);  // not at the end of the first operation
  EXPECT_TRUE(done[1].start_ns > done[0].end_ns);
  EXPECT_EQ(done[1].end_ns - done[1].start_ns, 2 * kMs);
}

TEST(CallbackMayIssueTheNextOperation) {
  // A layer's completion triggers the next layer (TensorFlow runs successors on this thread).
  EmulatedDevice device(/*launch_slack_ns=*/60'000 * kMs);
  Recorder recorder;
  EmulatedDevice::Done second = recorder.For(1);
  EmulatedDevice::Done first = [&](int64_t start, int64_t end) {
    device.Run(1 * kMs, second);
    recorder.For(0)(start, end);
  };
  device.Run(1 * kMs, first);
  const std::vector<Completion> done = recorder.WaitFor(2);
  EXPECT_EQ(done[0].index, 0);
  EXPECT_EQ(done[1].index, 1);
  EXPECT_EQ(done[1].start_ns, done[0].end_ns);
}

TEST(DestructorWithNothingPending) {
  EmulatedDevice device;
  EXPECT_EQ(device.pending(), 0u);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
