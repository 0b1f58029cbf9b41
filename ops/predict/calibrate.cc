#include "ops/predict/calibrate.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/engine.h"
#include "ops/core/reduce.h"

namespace prophet {

namespace {

double ThreadCpuNs() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) * 1e9 + static_cast<double>(t.tv_nsec);
}

double ProcessCpuNs() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e9 +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e3;
}

// Runs `body` until it has used about `cpu_ns` of this thread's CPU (at least twice); returns
// the CPU per call.
template <typename F>
double CpuPerCall(double cpu_ns, F body) {
  body();  // warm: pages touched, code in cache
  const double start = ThreadCpuNs();
  int calls = 0;
  while (calls < 2 || ThreadCpuNs() - start < cpu_ns) {
    body();
    ++calls;
  }
  return (ThreadCpuNs() - start) / calls;
}

// Free loopback ports (bound, read, closed: the engines bind them right after).
Status FreePorts(int n, std::vector<int>* ports) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      if (fd >= 0) ::close(fd);
      for (int f : fds) ::close(f);
      return Status(Code::kUnavailable, std::string("cannot find a free loopback port: ") + std::strerror(errno));
    }
    fds.push_back(fd);
    ports->push_back(ntohs(addr.sin_port));
  }
  for (int f : fds) ::close(f);
  return Status::OK();
}

// The sender's share of a raw TCP stream's CPU over loopback (each side's thread CPU).
Status TcpSendShare(double seconds, double* share) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listener, 1) != 0 || ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    if (listener >= 0) ::close(listener);
    return Status(Code::kUnavailable, std::string("cannot listen on loopback: ") + std::strerror(errno));
  }
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(client, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(client);
    ::close(listener);
    return Status(Code::kUnavailable, std::string("cannot connect on loopback: ") + std::strerror(errno));
  }
  const int server = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  constexpr size_t kChunk = 4u << 20;
  std::atomic<bool> stop{false};
  double send_cpu = 0, receive_cpu = 0;
  uint64_t received = 0;
  std::thread receiver([&] {
    std::vector<char> buffer(kChunk);
    const double start = ThreadCpuNs();
    while (true) {
      const ssize_t n = ::recv(server, buffer.data(), buffer.size(), 0);
      if (n <= 0) break;
      received += static_cast<uint64_t>(n);
    }
    receive_cpu = ThreadCpuNs() - start;
  });
  std::thread sender([&] {
    std::vector<char> buffer(kChunk, 1);
    const double start = ThreadCpuNs();
    // At least 16 chunks, however late this thread starts on a loaded machine.
    for (int chunks = 0; chunks < 16 || !stop.load(); ++chunks) {
      if (::send(client, buffer.data(), buffer.size(), 0) < 0) break;
    }
    send_cpu = ThreadCpuNs() - start;
    ::shutdown(client, SHUT_WR);
  });
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop.store(true);
  sender.join();
  receiver.join();
  ::close(client);
  ::close(server);
  if (received == 0 || send_cpu + receive_cpu <= 0) return Status(Code::kInternal, "the loopback stream moved nothing");
  *share = send_cpu / (send_cpu + receive_cpu);
  return Status::OK();
}

// Two engines of one job in this process over loopback.
class Pair {
 public:
  Status Start() {
    std::vector<int> ports;
    Status s = FreePorts(2, &ports);
    if (!s.ok()) return s;
    EngineOptions options[2];
    for (int r = 0; r < 2; ++r) {
      options[r].rank = r;
      options[r].world_size = 2;
      options[r].addresses = {"127.0.0.1:" + std::to_string(ports[0]), "127.0.0.1:" + std::to_string(ports[1])};
      options[r].token = "calibrate";
      options[r].connect_timeout_s = 20;
      options[r].timeout_s = 60;
    }
    Status statuses[2];
    std::thread other([&] { statuses[1] = Engine::Start(options[1], &engines_[1]); });
    statuses[0] = Engine::Start(options[0], &engines_[0]);
    other.join();
    return statuses[0].ok() ? statuses[1] : statuses[0];
  }
  // `count` push_pulls of `bytes` float32 bytes each (names NAME/0, NAME/1, ...), submitted at
  // once on both engines; waits for all of them.
  Status Run(const std::string& name, const std::vector<float>* in, std::vector<float>* out, uint64_t bytes,
             int count = 1) {
    std::mutex mu;
    std::condition_variable cv;
    int left = 2 * count;
    Status failed;
    for (int k = 0; k < count; ++k) {
      for (int r = 0; r < 2; ++r) {
        OpRequest q;
        q.kind = OpKind::kPushPull;
        q.name = name + "/" + std::to_string(k);
        q.dtype = DataType::kFloat32;
        q.shape = {static_cast<int64_t>(bytes / 4)};
        q.input = in[r].data() + static_cast<size_t>(k) * bytes / 4;
        q.output = out[r].data() + static_cast<size_t>(k) * bytes / 4;
        q.bytes = bytes;
        q.done = [&](const Status& s, const GatherResult*) {
          std::lock_guard<std::mutex> lock(mu);
          if (!s.ok() && failed.ok()) failed = s;
          if (--left == 0) cv.notify_all();
        };
        engines_[r]->Submit(std::move(q));
      }
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return left == 0; });
    return failed;
  }

 private:
  std::unique_ptr<Engine> engines_[2];
};

// Process CPU per call of `body` over about `seconds` of wall time (at least `min_calls`).
template <typename F>
Status ProcessCpuPerCall(double seconds, int min_calls, F body, double* per_call) {
  Status s = body();  // warm
  if (!s.ok()) return s;
  const double start = ProcessCpuNs();
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  int calls = 0;
  while (calls < min_calls || std::chrono::steady_clock::now() < until) {
    s = body();
    if (!s.ok()) return s;
    ++calls;
  }
  *per_call = (ProcessCpuNs() - start) / calls;
  return Status::OK();
}

void AppendField(const char* key, double value, bool first, std::string* out) {
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "%s\"%s\": %.6g", first ? "" : ", ", key, value);
  out->append(buffer);
}

}  // namespace

Status MeasureCpuCosts(double effort, CpuCosts* costs) {
  *costs = CpuCosts();
  effort = std::max(0.05, effort);
  const auto t0 = std::chrono::steady_clock::now();
  // Kernels, over buffers beyond the caches.
  constexpr size_t kElements = 8u << 20;  // 32 MiB of float32
  const double bytes = 4.0 * kElements;
  std::vector<float> a(kElements, 1.0f), b(kElements, 2.0f);
  std::vector<uint16_t> codes(kElements);
  costs->sum_byte_ns = CpuPerCall(3e8 * effort, [&] { SumInto(DataType::kFloat32, a.data(), b.data(), kElements); }) / bytes;
  costs->copy_byte_ns = CpuPerCall(3e8 * effort, [&] { std::memcpy(a.data(), b.data(), bytes); }) / bytes;
  const PayloadCodec fp16(Encoding::kFloat16, DataType::kFloat32);
  int scale = 0;
  const double encode = CpuPerCall(3e8 * effort, [&] { scale = fp16.Encode(b.data(), bytes, codes.data()); }) / bytes;
  const double decode =
      CpuPerCall(3e8 * effort, [&] { fp16.Decode(codes.data(), bytes / 2, scale, a.data()); }) / bytes;
  costs->cast_byte_ns = (encode + decode) / 2;
  a = std::vector<float>();
  b = std::vector<float>();
  codes = std::vector<uint16_t>();

  Status s = TcpSendShare(0.5 * effort, &costs->tcp_send_share);
  if (!s.ok()) return s;
  Pair pair;
  s = pair.Start();
  if (!s.ok()) return s;
  // Tiny push_pulls: 2 frames per operation (a push, its sum), each sent and received once. One
  // at a time, every frame wakes the threads involved; many at once, as a training step submits
  // them, a thread's turn handles several: that steady cost is the one charged.
  {
    constexpr int kBatch = 64;
    std::vector<float> in[2] = {std::vector<float>(kBatch, 1.0f), std::vector<float>(kBatch, 2.0f)};
    std::vector<float> out[2] = {std::vector<float>(kBatch), std::vector<float>(kBatch)};
    double per_op = 0;
    s = ProcessCpuPerCall(0.5 * effort, 100, [&] { return pair.Run("calibrate/small", in, out, 4); }, &per_op);
    if (!s.ok()) return s;
    costs->engine_lone_cpu_ns_per_frame = per_op / 2;
    s = ProcessCpuPerCall(1.0 * effort, 5, [&] { return pair.Run("calibrate/batch", in, out, 4, kBatch); }, &per_op);
    if (!s.ok()) return s;
    costs->engine_small_cpu_ns_per_frame = per_op / kBatch / 2;
    costs->message_send_ns = costs->engine_small_cpu_ns_per_frame / 2;
    costs->message_receive_ns = costs->engine_small_cpu_ns_per_frame / 2;
  }
  // Large push_pulls: each worker sends and receives the tensor's bytes (half its pushes, half
  // the sums of the half it owns) and adds half of them.
  {
    constexpr uint64_t kLarge = 32u << 20;
    std::vector<float> in[2] = {std::vector<float>(kLarge / 4, 1.0f), std::vector<float>(kLarge / 4, 2.0f)};
    std::vector<float> out[2] = {std::vector<float>(kLarge / 4), std::vector<float>(kLarge / 4)};
    double per_op = 0;
    s = ProcessCpuPerCall(1.5 * effort, 3, [&] { return pair.Run("calibrate/large", in, out, kLarge); }, &per_op);
    if (!s.ok()) return s;
    const double p = static_cast<double>(kLarge);
    costs->engine_large_bytes = p;
    costs->engine_large_cpu_ns_per_byte = per_op / p;
    // Per worker: p x (send + receive) + p / 2 x sum.
    const double io = std::max(0.0, (per_op / 2 - p / 2 * costs->sum_byte_ns) / p);
    costs->send_byte_ns = io * costs->tcp_send_share;
    costs->receive_byte_ns = io * (1 - costs->tcp_send_share);
  }
  costs->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return Status::OK();
}

std::string CpuCostsJson(const CpuCosts& c) {
  std::string out = "{";
  AppendField("send_byte_ns", c.send_byte_ns, true, &out);
  AppendField("receive_byte_ns", c.receive_byte_ns, false, &out);
  AppendField("sum_byte_ns", c.sum_byte_ns, false, &out);
  AppendField("cast_byte_ns", c.cast_byte_ns, false, &out);
  AppendField("copy_byte_ns", c.copy_byte_ns, false, &out);
  AppendField("message_send_ns", c.message_send_ns, false, &out);
  AppendField("message_receive_ns", c.message_receive_ns, false, &out);
  AppendField("engine_large_cpu_ns_per_byte", c.engine_large_cpu_ns_per_byte, false, &out);
  AppendField("engine_large_bytes", c.engine_large_bytes, false, &out);
  AppendField("engine_small_cpu_ns_per_frame", c.engine_small_cpu_ns_per_frame, false, &out);
  AppendField("engine_lone_cpu_ns_per_frame", c.engine_lone_cpu_ns_per_frame, false, &out);
  AppendField("tcp_send_share", c.tcp_send_share, false, &out);
  AppendField("seconds", c.seconds, false, &out);
  out += "}";
  return out;
}

}  // namespace prophet
