// Every schedule finishes every step on 4 and 8 real engines (loopback TCP, one process) training
// an emulated model: many small gradients and one large first-layer gradient, produced in
// backward order by an emulated accelerator (fixed times, no CPU), with the next step's layer k
// waiting for layer k's sum (crossing the barrier, as ProphetStrategy does) and a control
// collective at the end of each step. The byte credit, the partition size and the socket buffers
// are at their extremes. Sums are checked exactly. Waits are bounded by conditions, not by how
// fast this machine is: a stall is named (rank, step, layer) within kStallSeconds.
// ops/sim/stall_matrix_test.cc runs the same matrix on 16-128 simulated workers. Fused (fuser.h):
// every schedule, both credit extremes, on 4 and 8 engines. Lanes (io_threads 2 and 3): every
// schedule, fused and not, on 4 engines.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/engine_testing.h"
#include "ops/core/fusion.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr int kLayers = 12;
constexpr int kSteps = 5;  // prophet plans from the third step on (a profile and a link sample first)
// A step of this model moves a few MiB over loopback: far longer than this means it stopped.
constexpr double kStallSeconds = 60.0;

constexpr uint64_t kFirstLayerElements = 256 * kKiB;  // 1 MiB

uint64_t LayerElements(int layer, uint64_t first = kFirstLayerElements) {
  return layer == 0 ? first : (1 + (layer * 7) % 60) * kKiB / 4;  // then 1-60 KiB
}
int64_t ForwardUs(int layer) { return 50 + 25 * (layer % 3); }
int64_t BackwardUs(int layer) { return layer % 3 == 2 ? 1500 : 50; }  // bursts of three

// One worker's training loop and what it waits for.
class Worker {
 public:
  Worker(Engine* engine, int world, uint64_t first_layer) : engine_(engine), world_(world), first_layer_(first_layer) {
    for (int k = 0; k < kLayers; ++k) {
      input_.emplace_back(Elements(k), static_cast<float>(engine->rank() + 1 + k));
      output_.emplace_back(Elements(k), -1.0f);
    }
    summed_.assign(kLayers, 0);
  }

  // Runs kSteps steps; "" or what stalled or went wrong.
  std::string Train() {
    for (int step = 0; step < kSteps; ++step) {
      for (int k = 0; k < kLayers; ++k) {
        // Layer k's forward pass reads its variables: it waits for the previous step's update.
        if (!AwaitSummed(k, step)) return Where("forward pass waits for the previous step's sum", step, k);
        std::this_thread::sleep_for(std::chrono::microseconds(ForwardUs(k)));
      }
      for (int k = kLayers - 1; k >= 0; --k) {
        std::this_thread::sleep_for(std::chrono::microseconds(BackwardUs(k)));
        Submit(k, step);
      }
      // The step's loss, most urgent of all; the train function returns after it.
      if (!SubmitLoss(step)) return Where("the loss did not come back", step, -1);
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.empty()) return error_;
    }
    for (int k = 0; k < kLayers; ++k)
      if (!AwaitSummed(k, kSteps)) return Where("the last step's sum did not come back", kSteps - 1, k);
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  uint64_t Elements(int k) const { return LayerElements(k, first_layer_); }

  void Submit(int k, int step) {
    OpRequest r;
    r.kind = OpKind::kPushPull;
    r.name = "grad/L" + std::to_string(k);
    r.shape = {static_cast<int64_t>(Elements(k))};
    r.input = input_[k].data();
    r.output = output_[k].data();
    r.bytes = Elements(k) * sizeof(float);
    r.priority = kLayers - k;
    r.done = [this, k, step](const Status& s, const GatherResult*) {
      // Every rank's input is rank + 1 + k: the sum is exact in float32.
      const float expected = static_cast<float>(world_ * (world_ + 1) / 2 + world_ * k);
      std::string problem;
      if (!s.ok()) {
        problem = s.message();
      } else {
        for (float v : output_[k])
          if (v != expected) {
            problem = "sum " + std::to_string(v) + ", expected " + std::to_string(expected);
            break;
          }
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!problem.empty() && error_.empty()) error_ = Where(problem, step, k);
      summed_[k] = step + 1;
      cv_.notify_all();
    };
    engine_->Submit(std::move(r));
  }

  // Submits the step's loss and waits for it; false when it did not come back in time.
  bool SubmitLoss(int step) {
    OpRequest r;
    r.kind = OpKind::kPushPull;
    r.name = "loss";
    r.shape = {1};
    r.input = &loss_;
    r.output = &loss_sum_;
    r.bytes = sizeof(float);
    r.priority = int64_t{1} << 40;  // kControlPriority
    r.done = [this, step](const Status& s, const GatherResult*) {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty() && !s.ok()) error_ = Where("the loss failed: " + s.message(), step, -1);
      if (error_.empty() && loss_sum_ != static_cast<float>(world_)) error_ = Where("the loss sum is wrong", step, -1);
      losses_ = step + 1;
      cv_.notify_all();
    };
    engine_->Submit(std::move(r));
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(kStallSeconds), [&] { return losses_ > step; });
  }

  bool AwaitSummed(int k, int steps) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::duration<double>(kStallSeconds), [&] { return summed_[k] >= steps; });
  }

  std::string Where(const std::string& what, int step, int layer) const {
    return "rank " + std::to_string(engine_->rank()) + ", step " + std::to_string(step) +
           (layer >= 0 ? ", layer " + std::to_string(layer) : std::string()) + ": " + what;
  }

  Engine* const engine_;
  const int world_;
  const uint64_t first_layer_;
  std::vector<std::vector<float>> input_, output_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> summed_;  // per layer: steps whose sum arrived
  float loss_ = 1.0f, loss_sum_ = 0.0f;
  int losses_ = 0;  // steps whose loss sum arrived
  std::string error_;
};

std::string RunCluster(int n, const char* schedule, uint64_t partition, uint64_t credit, int socket_buffer,
                       int socket_unsent, bool fused = false, int io_threads = 1,
                       uint64_t first_layer = kFirstLayerElements) {
  std::vector<EngineOptions> options = testing::ClusterOptions(n, kStallSeconds, "engine-stress");
  for (EngineOptions& o : options) {
    o.io_threads = io_threads;
    o.schedule = schedule;
    o.partition_bytes = partition;
    o.credit_bytes = credit;
    o.socket_buffer_bytes = socket_buffer;
    o.socket_unsent_bytes = socket_unsent;
  }
  std::vector<Status> started;
  std::vector<std::unique_ptr<Engine>> engines = testing::StartCluster(options, &started);
  for (int r = 0; r < n; ++r)
    if (!started[r].ok()) return "rank " + std::to_string(r) + " did not start: " + started[r].message();
  if (fused) {  // the gradients travel in buckets (fuser.h), sized for a 10 Gbit/s link
    std::vector<FusionDeclaration> gradients;
    for (int k = 0; k < kLayers; ++k) {
      FusionDeclaration d;
      d.name = "grad/L" + std::to_string(k);
      d.bytes = LayerElements(k, first_layer) * sizeof(float);
      d.shape = {static_cast<int64_t>(LayerElements(k, first_layer))};
      d.priority = kLayers - k;
      gradients.push_back(d);
    }
    for (auto& e : engines) e->DeclareFusion("stress", gradients, FusionBucketBytes(n, 1.25e9));
  }
  // The workers outlive the engines: a stalled worker returns while its operations are pending,
  // and the engines fail them (calling back into their worker) when they stop.
  std::vector<std::unique_ptr<Worker>> workers;
  for (int r = 0; r < n; ++r) workers.push_back(std::make_unique<Worker>(engines[r].get(), n, first_layer));
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { errors[r] = workers[r]->Train(); });
  for (std::thread& t : threads) t.join();
  const std::string stats = engines[0]->StatsJson();
  engines.clear();
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  if (fused && stats.find("\"fused_submitted\": 0,") != std::string::npos) return "nothing travelled fused: " + stats;
  return "";
}

TEST(EveryScheduleFinishesEveryStepOnFourAndEightEngines) {
  int runs = 0, failed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const int n : {4, 8}) {
    for (const char* schedule : {"fifo", "priority", "prophet"}) {
      for (const uint64_t partition : {64 * kKiB, uint64_t{64} << 20}) {
        for (const uint64_t credit : {partition, uint64_t{1} << 30}) {
          // The smallest socket buffers accepted, holding at most 1 KiB unsent, and the defaults.
          for (const auto& [buffer, unsent] : {std::pair<int, int>{kMinSocketBufferBytes, 1024},
                                               std::pair<int, int>{0, EngineOptions().socket_unsent_bytes}}) {
            ++runs;
            // After a failure, one more would only take as long again.
            if (failed > 0) continue;
            const std::string error = RunCluster(n, schedule, partition, credit, buffer, unsent);
            if (error.empty()) continue;
            ++failed;
            std::fprintf(stderr, "%d workers, %s, partitions %llu, credit %llu, socket buffer %d, unsent %d: %s\n", n,
                         schedule, static_cast<unsigned long long>(partition), static_cast<unsigned long long>(credit),
                         buffer, unsent, error.c_str());
          }
        }
      }
    }
  }
  std::printf("%d settings, %d failed, %.1f s\n", runs, failed, testing::SecondsSince(t0));
  EXPECT_EQ(failed, 0);
}

TEST(FusedEveryScheduleFinishesEveryStepOnFourAndEightEngines) {
  int runs = 0, failed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const int n : {4, 8}) {
    for (const char* schedule : {"fifo", "priority", "prophet"}) {
      for (const uint64_t credit : {64 * kKiB, uint64_t{1} << 30}) {
        ++runs;
        if (failed > 0) continue;
        const std::string error = RunCluster(n, schedule, 64 * kKiB, credit, 0, EngineOptions().socket_unsent_bytes,
                                             /*fused=*/true);
        if (error.empty()) continue;
        ++failed;
        std::fprintf(stderr, "fused, %d workers, %s, credit %llu: %s\n", n, schedule,
                     static_cast<unsigned long long>(credit), error.c_str());
      }
    }
  }
  std::printf("fused: %d settings, %d failed, %.1f s\n", runs, failed, testing::SecondsSince(t0));
  EXPECT_EQ(failed, 0);
}

// Lanes (io_threads): the first layer (3 MiB) travels in slices on every lane while the small
// gradients travel whole on their lanes, or fused in buckets dealt over the lanes; every schedule
// on 4 engines.
TEST(LanesFinishEveryStepFusedAndNot) {
  int runs = 0, failed = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const int lanes : {2, 3}) {
    for (const char* schedule : {"fifo", "priority", "prophet"}) {
      for (const bool fused : {false, true}) {
        ++runs;
        if (failed > 0) continue;
        const std::string error = RunCluster(4, schedule, 1024 * kKiB, uint64_t{1} << 30, 0,
                                             EngineOptions().socket_unsent_bytes, fused, lanes, 768 * kKiB);
        if (error.empty()) continue;
        ++failed;
        std::fprintf(stderr, "%d lanes, %s, %s: %s\n", lanes, schedule, fused ? "fused" : "not fused", error.c_str());
      }
    }
  }
  std::printf("lanes: %d settings, %d failed, %.1f s\n", runs, failed, testing::SecondsSince(t0));
  EXPECT_EQ(failed, 0);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
