// Real engines of one job over loopback, all in one process: for the tests that run them.
#ifndef PROPHET_OPS_CORE_ENGINE_TESTING_H_
#define PROPHET_OPS_CORE_ENGINE_TESTING_H_

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/socket_testing.h"

namespace prophet {
namespace testing {

// The options of every rank of an n-worker job on free loopback ports; the rest are defaults.
inline std::vector<EngineOptions> ClusterOptions(int n, double timeout_s, const std::string& token) {
  const std::vector<std::string> addresses = LoopbackAddresses(n);
  std::vector<EngineOptions> out(n);
  for (int r = 0; r < n; ++r) {
    out[r].rank = r;
    out[r].world_size = n;
    out[r].addresses = addresses;
    out[r].token = token;
    out[r].timeout_s = timeout_s;
    out[r].connect_timeout_s = 10.0;
  }
  return out;
}

// "2,3,8" -> {2, 3, 8}: the benchmarks' list flags.
inline std::vector<int> ParseIntList(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::atoi(item.c_str()));
  return out;
}

// Starts every engine on its own thread (Start returns once every peer is connected); `statuses`
// gets each rank's outcome.
inline std::vector<std::unique_ptr<Engine>> StartCluster(const std::vector<EngineOptions>& options,
                                                         std::vector<Status>* statuses) {
  const size_t n = options.size();
  std::vector<std::unique_ptr<Engine>> engines(n);
  statuses->assign(n, Status::OK());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] { (*statuses)[r] = Engine::Start(options[r], &engines[r]); });
  for (std::thread& t : threads) t.join();
  return engines;
}

// Waits for the done callbacks of operations a benchmark submitted: Expect(n), hand Callback() to
// each of the n requests, Wait(). A failed operation ends the program with its message.
class DoneCounter {
 public:
  void Expect(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    left_ = n;
  }
  std::function<void(const Status&, const GatherResult*)> Callback() {
    return [this](const Status& s, const GatherResult*) {
      if (!s.ok()) {
        std::fprintf(stderr, "operation failed: %s\n", s.message().c_str());
        std::exit(1);
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (--left_ == 0) cv_.notify_all();
    };
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return left_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_ = 0;
};

}  // namespace testing
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_TESTING_H_
