// push_pull between two real engines next to raw TCP, in one process, without TensorFlow: the
// engine's own cost per byte (sockets, framing, summation), measured alternately, size by size.
//
//   bazel run -c opt //ops/core/bench:transport_bench -- --sizes=4MiB,64MiB --iters=30
//   bazel run -c opt //ops/core/bench:transport_bench -- --engine_options='socket_unsent_bytes=0'
//   bazel run -c opt //ops/core/bench:transport_bench -- --io_threads=1,2   # lanes, side by side
//   valgrind --tool=callgrind bazel-bin/ops/core/bench/transport_bench --sizes=64MiB --iters=3 --only=push_pull
//
// raw TCP moves the same bytes in the same pattern as push_pull with 2 workers (each side sends
// and receives the whole tensor, both directions at once) over one loopback connection, with a
// sender and a receiver thread per side, straight from and into its buffers. CPU is the whole
// process's (both engines' I/O threads, or the four raw threads, and this driver) per tensor byte.
// Under callgrind (--only=push_pull) the instructions per byte are the engine's user-space cost
// alone, steady on a loaded machine; the kernel's copies are not in them. --fresh_output gives
// every push_pull a new output allocation, as TensorFlow's allocator would without the recycled
// pool (output_pool.h), to show what the pages' first touch costs. --io_threads=1,2 runs a job per
// setting (EngineOptions::io_threads: lanes), all measured alternately with raw TCP.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/engine_testing.h"

namespace prophet {
namespace {

double ProcessCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

uint64_t ParseSize(const std::string& text) {
  char* end = nullptr;
  const uint64_t n = std::strtoull(text.c_str(), &end, 10);
  const std::string unit = end;
  if (unit == "KiB") return n << 10;
  if (unit == "MiB") return n << 20;
  if (unit == "GiB") return n << 30;
  if (unit.empty() || unit == "B") return n;
  std::fprintf(stderr, "bad size %s (e.g. 4MiB)\n", text.c_str());
  std::exit(2);
}

// Two engines of one job on loopback, each summing a float32 tensor.
class Job {
 public:
  Job(const std::string& options_text, int io_threads) {
    std::vector<EngineOptions> options = testing::ClusterOptions(2, 120, "transport-bench");
    for (EngineOptions& o : options) {
      o.schedule = "priority";
      o.io_threads = io_threads;
      const Status s = ParseEngineOptions(options_text, &o);
      if (!s.ok()) {
        std::fprintf(stderr, "--engine_options: %s\n", s.message().c_str());
        std::exit(2);
      }
    }
    std::vector<Status> statuses;
    engines_ = testing::StartCluster(options, &statuses);
    for (const Status& s : statuses)
      if (!s.ok()) {
        std::fprintf(stderr, "cannot start the engines: %s\n", s.message().c_str());
        std::exit(1);
      }
  }

  void Prepare(uint64_t bytes) {
    for (int r = 0; r < 2; ++r) {
      in_[r].assign(bytes / 4, static_cast<float>(r + 1));
      out_[r].assign(bytes / 4, 0.0f);
    }
  }

  // Both ranks submit; returns when both are done. With `fresh_output` each output is a new
  // allocation, freed after the operation.
  void Run(const std::string& name, bool fresh_output) {
    void* fresh[2] = {nullptr, nullptr};
    done_.Expect(2);
    for (int r = 0; r < 2; ++r) {
      if (fresh_output && ::posix_memalign(&fresh[r], 64, 4 * in_[r].size()) != 0) std::exit(1);
      OpRequest q;
      q.name = name;
      q.shape = {static_cast<int64_t>(in_[r].size())};
      q.input = in_[r].data();
      q.output = fresh_output ? fresh[r] : out_[r].data();
      q.bytes = 4 * in_[r].size();
      q.done = done_.Callback();
      engines_[r]->Submit(std::move(q));
    }
    done_.Wait();
    for (int r = 0; r < 2; ++r) {
      if (!fresh[r]) continue;
      std::memcpy(out_[r].data(), fresh[r], 4);
      out_[r].back() = static_cast<float*>(fresh[r])[out_[r].size() - 1];
      std::free(fresh[r]);
    }
  }

  void Check() const {
    for (int r = 0; r < 2; ++r)
      if (out_[r].front() != 3.0f || out_[r].back() != 3.0f) {
        std::fprintf(stderr, "wrong sum on rank %d: %g ... %g\n", r, out_[r].front(), out_[r].back());
        std::exit(1);
      }
  }

 private:
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<float> in_[2], out_[2];
  testing::DoneCounter done_;
};

// One loopback TCP connection with the socket options of the Python benchmark's raw TCP.
class RawPair {
 public:
  RawPair() {
    const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr = testing::Loopback(0);
    socklen_t len = sizeof(addr);
    if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(listener, 1) != 0 ||
        ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      std::perror("listen");
      std::exit(1);
    }
    fd_[1] = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd_[1], reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      std::perror("connect");
      std::exit(1);
    }
    fd_[0] = ::accept(listener, nullptr, nullptr);
    ::close(listener);
    for (int fd : fd_) {
      const int one = 1, buffer = 4 << 20;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
      ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
    }
  }
  ~RawPair() {
    for (int fd : fd_) ::close(fd);
  }
  void Prepare(uint64_t bytes) {
    for (int r = 0; r < 2; ++r) {
      send_[r].assign(bytes, static_cast<char>(r + 1));
      recv_[r].assign(bytes, 0);
    }
  }
  // Each side sends its buffer while receiving the other's, on a thread per direction.
  void Run() {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([this, r] { Move(r, send_[r].data(), send_[r].size(), true); });
      threads.emplace_back([this, r] { Move(r, recv_[r].data(), recv_[r].size(), false); });
    }
    for (std::thread& t : threads) t.join();
  }

 private:
  void Move(int r, char* p, size_t left, bool sending) {
    while (left > 0) {
      const ssize_t n = sending ? ::send(fd_[r], p, left, 0) : ::recv(fd_[r], p, left, 0);
      if (n <= 0) {
        std::perror("raw TCP");
        std::exit(1);
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
  }

  int fd_[2] = {-1, -1};
  std::vector<char> send_[2], recv_[2];
};

// Median wall and CPU seconds of the runs of one system.
struct Sample {
  std::vector<double> seconds, cpu_s;
  void Time(const std::function<void()>& run) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = ProcessCpuSeconds();
    run();
    cpu_s.push_back(ProcessCpuSeconds() - c0);
    seconds.push_back(testing::SecondsSince(t0));
  }
};

int Main(int argc, char** argv) {
  std::string sizes = "4MiB,16MiB,64MiB,256MiB", only, engine_options, threads = "1";
  int iters = 30;
  bool fresh_output = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--sizes=", 0) == 0) sizes = a.substr(8);
    else if (a.rfind("--iters=", 0) == 0) iters = std::atoi(a.c_str() + 8);
    else if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    else if (a.rfind("--engine_options=", 0) == 0) engine_options = a.substr(17);
    else if (a.rfind("--io_threads=", 0) == 0) threads = a.substr(13);
    else if (a == "--fresh_output") fresh_output = true;
    else {
      std::fprintf(stderr,
                   "flags: --sizes=4MiB,64MiB --iters=30 [--only=push_pull|raw_tcp] [--fresh_output] "
                   "[--io_threads=1,2] [--engine_options='key=value;key=value' (the C API's configuration keys)]\n");
      return 2;
    }
  }
  std::replace(engine_options.begin(), engine_options.end(), ';', '\n');
  const bool push_pull = only != "raw_tcp", raw_tcp = only != "push_pull";
  const std::vector<int> io_threads = testing::ParseIntList(threads);
  std::vector<std::unique_ptr<Job>> jobs;
  if (push_pull)
    for (const int t : io_threads) jobs.push_back(std::make_unique<Job>(engine_options, t));
  RawPair raw;
  std::string head = "| size | raw TCP ms |", rule = "|---:|---:|";
  for (const int t : io_threads) {
    const std::string k = std::to_string(t);
    head += " push_pull ms (" + k + ") | push_pull/raw_tcp throughput (" + k + ") | push_pull CPU ns/B (" + k +
            ") | CPU ratio (" + k + ") |";
    rule += "---:|---:|---:|---:|";
  }
  std::printf("%s raw TCP CPU ns/B |\n%s---:|\n", head.c_str(), rule.c_str());
  std::stringstream list(sizes);
  std::string item;
  for (int size_index = 0; std::getline(list, item, ','); ++size_index) {
    const uint64_t bytes = ParseSize(item);
    const std::string name = "bench/" + std::to_string(size_index);
    std::vector<Sample> pp(jobs.size());
    Sample rt;
    for (auto& job : jobs) {
      job->Prepare(bytes);
      job->Run(name, fresh_output);  // warm-up: the buffers' pages, the pools
      job->Check();
    }
    if (raw_tcp) {
      raw.Prepare(bytes);
      raw.Run();
    }
    for (int it = 0; it < iters; ++it) {
      for (size_t j = 0; j < jobs.size(); ++j) pp[j].Time([&] { jobs[j]->Run(name, fresh_output); });
      if (raw_tcp) rt.Time([&] { raw.Run(); });
    }
    for (auto& job : jobs) job->Check();
    const double b = static_cast<double>(bytes);
    const double rs = Median(rt.seconds), rc = Median(rt.cpu_s);
    std::printf("| %s | %.3f |", item.c_str(), rs * 1e3);
    for (const Sample& sample : pp) {
      const double ps = Median(sample.seconds), pc = Median(sample.cpu_s);
      std::printf(" %.3f | %.2f | %.3f | %.2f |", ps * 1e3, ps > 0 ? rs / ps : 0.0, pc * 1e9 / b,
                  rc > 0 ? pc / rc : 0.0);
    }
    std::printf(" %.3f |\n", rc * 1e9 / b);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace prophet

int main(int argc, char** argv) { return prophet::Main(argc, argv); }
