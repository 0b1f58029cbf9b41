// Update gates: waiters run once the last pending update of their key is released, failures stick,
// WaitAll sees every key, and concurrent arming, releasing and waiting loses no waiter (this test
// is also what `bazel test --config=tsan //ops/...` checks the gates' locking with).
#include "ops/core/gate.h"

#include <atomic>
#include <thread>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

TEST(WaitOnAnOpenGateRunsAtOnce) {
  UpdateGates gates;
  int calls = 0;
  gates.Wait("never/armed", [&](const Status& s) {
    EXPECT_TRUE(s.ok());
    ++calls;
  });
  EXPECT_EQ(calls, 1);
}

TEST(WaitersRunWhenTheLastPendingUpdateIsReleased) {
  UpdateGates gates;
  gates.Arm("v");
  gates.Arm("v");  // two updates of one variable in flight (two steps)
  int calls = 0;
  gates.Wait("v", [&](const Status&) { ++calls; });
  EXPECT_EQ(gates.pending(), 2u);
  gates.Release("v", Status::OK());
  EXPECT_EQ(calls, 0);
  gates.Release("v", Status::OK());
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(gates.pending(), 0u);
}

TEST(OtherKeysDoNotWait) {
  UpdateGates gates;
  gates.Arm("a");
  int calls = 0;
  gates.Wait("b", [&](const Status&) { ++calls; });
  EXPECT_EQ(calls, 1);
  gates.Release("a", Status::OK());
}

TEST(AFailedUpdateFailsLaterWaitsToo) {
  UpdateGates gates;
  gates.Arm("v");
  Status seen;
  gates.Wait("v", [&](const Status& s) { seen = s; });
  gates.Release("v", Status(Code::kUnavailable, "peer lost"));
  EXPECT_EQ(seen.message(), std::string("peer lost"));
  Status later;
  gates.Wait("v", [&](const Status& s) { later = s; });
  EXPECT_TRUE(!later.ok());
  gates.Reset();
  Status after_reset(Code::kInternal, "not called");
  gates.Wait("v", [&](const Status& s) { after_reset = s; });
  EXPECT_TRUE(after_reset.ok());
}

TEST(AWaiterLearnsWhetherItWaitedAndForWhichUpdate) {
  UpdateGates gates;
  UpdateGates::Waited open{true, -1};
  gates.Wait("v", [&](const Status&, const UpdateGates::Waited& w) { open = w; });
  EXPECT_TRUE(!open.waited);
  gates.Arm("v", 7);
  UpdateGates::Waited held;
  gates.Wait("v", [&](const Status&, const UpdateGates::Waited& w) { held = w; });
  EXPECT_TRUE(!held.waited);  // not released yet
  gates.Release("v", Status::OK());
  EXPECT_TRUE(held.waited);
  EXPECT_EQ(held.priority, 7);
}

TEST(WaitAllWaitsForEveryKey) {
  UpdateGates gates;
  gates.Arm("a");
  gates.Arm("b");
  int calls = 0;
  gates.WaitAll([&](const Status&) { ++calls; });
  gates.Release("a", Status::OK());
  EXPECT_EQ(calls, 0);
  gates.Release("b", Status::OK());
  EXPECT_EQ(calls, 1);
}

TEST(AWaiterMayArmAgain) {
  // Release runs waiters outside its lock: a waiter that starts the next update must not deadlock.
  UpdateGates gates;
  gates.Arm("v");
  gates.Wait("v", [&](const Status&) { gates.Arm("v"); });
  gates.Release("v", Status::OK());
  EXPECT_EQ(gates.pending(), 1u);
  gates.Release("v", Status::OK());
  EXPECT_EQ(gates.pending(), 0u);
}

TEST(ConcurrentUpdatesAndWaitsLoseNoWaiter) {
  // Several "steps" per variable, each armed on one thread and released on another, with readers
  // waiting in between: every waiter must run exactly once.
  UpdateGates gates;
  constexpr int kKeys = 8, kRounds = 300;
  std::atomic<int> ran{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < kKeys; ++k) {
    threads.emplace_back([&, k] {
      const std::string key = "var/" + std::to_string(k);
      for (int r = 0; r < kRounds; ++r) {
        gates.Arm(key);
        std::thread releaser([&gates, key] { gates.Release(key, Status::OK()); });
        gates.Wait(key, [&](const Status& s) {
          EXPECT_TRUE(s.ok());
          ran.fetch_add(1);
        });
        releaser.join();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ran.load(), kKeys * kRounds);
  EXPECT_EQ(gates.pending(), 0u);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
