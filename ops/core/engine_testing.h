// Real engines of one job over loopback, all in one process: for the tests that run them.
#ifndef PROPHET_OPS_CORE_ENGINE_TESTING_H_
#define PROPHET_OPS_CORE_ENGINE_TESTING_H_

#include <memory>
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

}  // namespace testing
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_TESTING_H_
