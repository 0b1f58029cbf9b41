// Latency of a small push_pull among N real engines on loopback, in one process: by exchange
// (recursive doubling, small_allreduce.h; EngineOptions::kSmallAllreduceAlways) and by owners (the
// push_pull owner path, kSmallAllreduceNever), measured alternately in blocks side by side, so
// that load on the machine falls on both alike. Also the CPU the whole process spends per frame
// (every engine's I/O thread, sending and receiving, plus this driver), which is where the
// simulator's per-message cost (NetworkModel::message_send_ns / message_receive_ns) comes from.
//
//   bazel run -c opt //ops/core/bench:small_allreduce_bench -- --workers=2,3,4,8 --bytes=4 --iters=300
//
// The "engine" column says which path the engine takes there (kSmallAllreduceAuto).
//
// All engines share this machine's cores: at N = 8 on 2 cores the frames' CPU is the latency,
// which is the point (an owner handles 2(N-1) frames per operation, an exchange stage 2 per
// worker); on a cluster each worker has its own cores and the link's latency adds per stage.
#include <time.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/engine_testing.h"
#include "ops/core/small_allreduce.h"

namespace prophet {
namespace {

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// One job of N engines; Run() makes every rank submit one push_pull and waits for all of them.
class Job {
 public:
  Job(int n, bool exchange, const std::string& token) : n_(n) {
    std::vector<EngineOptions> options = testing::ClusterOptions(n, 30.0, token);
    for (EngineOptions& o : options)
      o.small_allreduce = exchange ? EngineOptions::kSmallAllreduceAlways : EngineOptions::kSmallAllreduceNever;
    std::vector<Status> statuses;
    engines_ = testing::StartCluster(options, &statuses);
    for (const Status& s : statuses)
      if (!s.ok()) {
        std::fprintf(stderr, "cannot start %d engines: %s\n", n, s.message().c_str());
        std::exit(1);
      }
  }

  // Seconds from the first submission to the last completion.
  double Run(uint64_t bytes) {
    const size_t elements = std::max<uint64_t>(1, bytes / 4);
    in_.assign(static_cast<size_t>(n_), std::vector<float>(elements, 1.0f));
    out_.assign(static_cast<size_t>(n_), std::vector<float>(elements, 0.0f));
    done_.Expect(n_);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < n_; ++r) {
      OpRequest q;
      q.kind = OpKind::kPushPull;
      q.name = "small";
      q.dtype = DataType::kFloat32;
      q.shape = {static_cast<int64_t>(elements)};
      q.input = in_[r].data();
      q.output = out_[r].data();
      q.bytes = 4 * elements;
      q.priority = kControlPriority;
      q.done = done_.Callback();
      engines_[r]->Submit(std::move(q));
    }
    done_.Wait();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (int r = 0; r < n_; ++r)
      if (out_[r][0] != static_cast<float>(n_)) {
        std::fprintf(stderr, "wrong sum %g on rank %d\n", out_[r][0], r);
        std::exit(1);
      }
    return seconds;
  }

 private:
  const int n_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<std::vector<float>> in_, out_;
  testing::DoneCounter done_;
};

// Frames every worker together sends per operation.
int FramesPerOperation(int n, bool exchange) {
  if (!exchange) return 2 * (n - 1);  // one owner: N-1 pushes, N-1 sums
  int frames = 0;
  for (int r = 0; r < n; ++r)
    for (const ExchangeStep& s : ExchangePlan(r, n)) frames += s.send_to >= 0;
  return frames;
}

struct Sample {
  std::vector<double> latency_s;
  double cpu_s = 0;
  int ops = 0;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main(int argc, char** argv) {
  std::string workers = "2,3,4,8", sizes = "4";
  int iters = 300, block = 25;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--workers=", 0) == 0) workers = a.substr(10);
    else if (a.rfind("--bytes=", 0) == 0) sizes = a.substr(8);
    else if (a.rfind("--iters=", 0) == 0) iters = std::atoi(a.c_str() + 8);
    else {
      std::fprintf(stderr, "flags: --workers=2,4,8 --bytes=4 --iters=300\n");
      return 2;
    }
  }
  std::printf("| N | bytes | owners median us | exchange median us | owners / exchange | engine | frames per op (owners, "
              "exchange) | CPU us per frame (owners, exchange) |\n|---|---|---|---|---|---|---|---|\n");
  for (int n : testing::ParseIntList(workers)) {
    for (int bytes : testing::ParseIntList(sizes)) {
      Job owners(n, false, "bench-owners"), exchange(n, true, "bench-exchange");
      Sample s[2];
      Job* jobs[2] = {&owners, &exchange};
      for (int k = 0; k < 2; ++k)
        for (int w = 0; w < 5; ++w) jobs[k]->Run(static_cast<uint64_t>(bytes));  // warm-up
      for (int done = 0; done < iters; done += block)
        for (int k = 0; k < 2; ++k) {
          const double cpu0 = ProcessCpuSeconds();
          for (int i = 0; i < block; ++i) s[k].latency_s.push_back(jobs[k]->Run(static_cast<uint64_t>(bytes)));
          s[k].cpu_s += ProcessCpuSeconds() - cpu0;
          s[k].ops += block;
        }
      const double own = Median(s[0].latency_s), exc = Median(s[1].latency_s);
      const int f0 = FramesPerOperation(n, false), f1 = FramesPerOperation(n, true);
      OpRequest probe;
      probe.bytes = static_cast<uint64_t>(std::max(4, bytes / 4 * 4));
      probe.priority = kControlPriority;  // the engine exchanges control collectives only
      EngineOptions rule;  // the engine's choice (its default)
      rule.small_allreduce = EngineOptions::kSmallAllreduceAuto;
      const bool engine_exchanges = ExchangesThis(probe, n, rule);
      std::printf("| %d | %d | %.1f | %.1f | %.2f | %s | %d, %d | %.1f, %.1f |\n", n, bytes, own * 1e6, exc * 1e6,
                  own / exc, engine_exchanges ? "exchange" : "owners", f0, f1, s[0].cpu_s / s[0].ops / f0 * 1e6,
                  s[1].cpu_s / s[1].ops / f1 * 1e6);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace prophet

int main(int argc, char** argv) { return prophet::Main(argc, argv); }
