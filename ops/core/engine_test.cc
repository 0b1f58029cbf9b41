// The real engine over loopback TCP: several Engines in one process, one thread each for Start.
#include "ops/core/engine.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/testing.h"
#include "ops/core/wire.h"

namespace prophet {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMB = 1 << 20;

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

void Fail(const std::string& what, int line) {
  std::fprintf(stderr, "engine_test.cc:%d: %s\n", line, what.c_str());
  ++::prophet::testing::Failures();
}
#define FAIL(what) Fail(what, __LINE__)

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Free TCP ports: bound to port 0 at the same time (so they differ), then released.
std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ports.push_back(ntohs(addr.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

std::vector<EngineOptions> ClusterOptions(int n, double timeout_s = 20.0) {
  const std::vector<int> ports = FreePorts(n);
  std::vector<std::string> addresses;
  for (int p : ports) addresses.push_back("127.0.0.1:" + std::to_string(p));
  std::vector<EngineOptions> out(n);
  for (int r = 0; r < n; ++r) {
    out[r].rank = r;
    out[r].world_size = n;
    out[r].addresses = addresses;
    out[r].token = "engine-test";
    out[r].partition_bytes = kMB;
    out[r].timeout_s = timeout_s;
    out[r].connect_timeout_s = 10.0;
  }
  return out;
}

// Starts every engine on its own thread (Start blocks until all peers are connected).
std::vector<std::unique_ptr<Engine>> StartCluster(const std::vector<EngineOptions>& options,
                                                  std::vector<Status>* statuses = nullptr) {
  const size_t n = options.size();
  std::vector<std::unique_ptr<Engine>> engines(n);
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r)
    threads.emplace_back([&, r] { status[r] = Engine::Start(options[r], &engines[r]); });
  for (std::thread& t : threads) t.join();
  for (size_t r = 0; r < n; ++r)
    if (!status[r].ok() && statuses == nullptr) FAIL("rank " + std::to_string(r) + " failed to start: " + status[r].message());
  if (statuses) *statuses = status;
  return engines;
}

// A submitted operation whose `done` fulfils a promise.
struct Pending {
  std::shared_ptr<std::promise<Status>> promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
};

// Waits at most `seconds` (never hangs): a missing callback fails the test.
Status Await(Pending& p, int line, double seconds = 20.0) {
  if (p.future.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    Fail("no done callback within " + std::to_string(seconds) + " s", line);
    return Status(Code::kInternal, "test: no done callback");
  }
  return p.future.get();
}
#define AWAIT(p, ...) Await(p, __LINE__, ##__VA_ARGS__)

std::unique_ptr<Pending> PushPull(Engine* e, const std::string& name, DataType dtype, const std::vector<int64_t>& shape,
                                  const void* input, void* output, uint64_t bytes, bool average = false,
                                  int64_t priority = 0) {
  auto p = std::make_unique<Pending>();
  OpRequest r;
  r.kind = OpKind::kPushPull;
  r.name = name;
  r.dtype = dtype;
  r.shape = shape;
  r.input = input;
  r.output = output;
  r.bytes = bytes;
  r.average = average;
  r.priority = priority;
  auto promise = p->promise;
  r.done = [promise](const Status& s, const GatherResult*) { promise->set_value(s); };
  e->Submit(std::move(r));
  return p;
}

// One logical tensor of a push_pull test: inputs per rank, the expected output.
struct Case {
  std::string name;
  DataType dtype;
  uint64_t elements;
  bool average;
  bool in_place;  // output aliases input
  std::vector<std::vector<char>> input;   // by rank
  std::vector<std::vector<char>> output;  // by rank (unused when in_place)
  std::vector<char> expected;
  std::vector<std::unique_ptr<Pending>> pending;  // by rank

  uint64_t bytes() const { return elements * DataTypeSize(dtype); }
  void* out(int r) { return in_place ? input[r].data() : output[r].data(); }
};

// Values that make float32 sums exact (integers well below 2^24) and int64 values large and signed.
void Fill(Case& c, int world, uint64_t round) {
  c.input.assign(world, std::vector<char>(c.bytes()));
  c.output.assign(world, c.in_place ? std::vector<char>() : std::vector<char>(c.bytes(), 0x5a));
  c.pending.clear();
  c.pending.resize(world);
  c.expected.assign(c.bytes(), 0);
  for (uint64_t i = 0; i < c.elements; ++i) {
    if (c.dtype == DataType::kFloat32) {
      float sum = 0;
      for (int r = 0; r < world; ++r) {
        const float v = static_cast<float>(static_cast<int64_t>((i * 7 + r * 131 + round * 17) % 2001) - 1000);
        std::memcpy(c.input[r].data() + 4 * i, &v, 4);
        sum += v;
      }
      if (c.average) sum /= static_cast<float>(world);
      std::memcpy(c.expected.data() + 4 * i, &sum, 4);
    } else {
      int64_t sum = 0;
      for (int r = 0; r < world; ++r) {
        const int64_t v = (static_cast<int64_t>(i) * 1000003 + r * 999999937ll + static_cast<int64_t>(round)) *
                          ((i + r) % 3 == 0 ? -1 : 1);
        std::memcpy(c.input[r].data() + 8 * i, &v, 8);
        sum += v;
      }
      if (c.average) sum /= world;  // truncating, like tf.math.truncatediv
      std::memcpy(c.expected.data() + 8 * i, &sum, 8);
    }
  }
}

std::vector<Case> MakeCases(const std::string& prefix, const std::vector<uint64_t>& byte_sizes) {
  std::vector<Case> cases;
  for (DataType dtype : {DataType::kFloat32, DataType::kInt64}) {
    for (uint64_t bytes : byte_sizes) {
      for (bool average : {false, true}) {
        Case c;
        c.dtype = dtype;
        // Below 1 MB a size is an element count, from 1 MB on a byte count.
        c.elements = bytes < kMB ? bytes : bytes / DataTypeSize(dtype);
        c.average = average;
        c.in_place = (cases.size() % 3) == 1;
        c.name = prefix + "/" + DataTypeName(dtype) + "/" + std::to_string(c.elements) + (average ? "/mean" : "/sum");
        cases.push_back(std::move(c));
      }
    }
  }
  return cases;
}

// Submits every case on every engine, each engine in its own order (and from its own thread), then
// checks every output exactly.
void RunCases(std::vector<std::unique_ptr<Engine>>& engines, std::vector<Case>& cases, uint64_t round,
              int64_t late_rank = -1) {
  const int world = static_cast<int>(engines.size());
  for (Case& c : cases) Fill(c, world, round);
  std::vector<std::thread> submitters;
  for (int r = 0; r < world; ++r) {
    submitters.emplace_back([&, r] {
      std::vector<size_t> order(cases.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      if (r % 3 == 1) std::reverse(order.begin(), order.end());
      if (r % 3 == 2) std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(round * 10 + r)));
      if (r == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      for (size_t k = 0; k < order.size(); ++k) {
        Case& c = cases[order[k]];
        const std::vector<int64_t> shape = {static_cast<int64_t>(c.elements)};
        // Priorities differ per rank too: they order sends, never matching.
        c.pending[r] = PushPull(engines[r].get(), c.name, c.dtype, shape, c.input[r].data(), c.out(r), c.bytes(),
                                c.average, r == 0 ? static_cast<int64_t>(k) : -static_cast<int64_t>(k));
      }
    });
  }
  for (std::thread& t : submitters) t.join();
  for (Case& c : cases) {
    for (int r = 0; r < world; ++r) {
      const Status s = AWAIT(*c.pending[r]);
      if (!s.ok()) {
        FAIL("rank " + std::to_string(r) + " " + c.name + ": " + s.message());
        continue;
      }
      const char* got = static_cast<const char*>(c.out(r));
      if (std::memcmp(got, c.expected.data(), c.bytes()) != 0) {
        const size_t elem = DataTypeSize(c.dtype);
        uint64_t first = 0, wrong = 0;
        for (uint64_t i = 0; i < c.elements; ++i)
          if (std::memcmp(got + i * elem, c.expected.data() + i * elem, elem) != 0) {
            if (wrong++ == 0) first = i;
          }
        FAIL("rank " + std::to_string(r) + " " + c.name + " round " + std::to_string(round) + ": " +
             std::to_string(wrong) + " wrong elements, first at " + std::to_string(first));
      }
    }
  }
}

// 1 element, 1000 elements, 3 MB and 9 MB (3 and 9 partitions of 1 MB).
const std::vector<uint64_t> kSizes = {1, 1000, 3 * kMB, 9 * kMB};

TEST(PushPullTwoWorkersAnyOrder) {
  const auto t0 = Clock::now();
  std::vector<Case> cases = MakeCases("two", kSizes);
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  RunCases(engines, cases, 0);
  // Round 1 of the same names, with different values: matched by round, not mixed up.
  RunCases(engines, cases, 1);
  // One worker much later than the other: everything it receives first is held as early frames.
  RunCases(engines, cases, 2, /*late_rank=*/1);
  engines.clear();
  std::printf("two workers: %.2f s\n", SecondsSince(t0));
}

TEST(PushPullThreeWorkersAnyOrder) {
  const auto t0 = Clock::now();
  std::vector<Case> cases = MakeCases("three", kSizes);
  auto engines = StartCluster(ClusterOptions(3));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  RunCases(engines, cases, 0);
  RunCases(engines, cases, 1, /*late_rank=*/0);
  engines.clear();
  std::printf("three workers: %.2f s\n", SecondsSince(t0));
}

TEST(ConcurrentRoundsOfOneName) {
  // Three rounds of one name in flight at once; the two engines submit them from different threads.
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  constexpr int kRounds = 3;
  const uint64_t n = 300000;  // 1.2 MB: 2 partitions
  std::vector<std::vector<float>> in(2 * kRounds, std::vector<float>(n)), out(2 * kRounds, std::vector<float>(n));
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < kRounds; ++k)
      for (uint64_t i = 0; i < n; ++i) in[r * kRounds + k][i] = static_cast<float>((i % 100) * (k + 1) + r);
  std::vector<std::unique_ptr<Pending>> pending(2 * kRounds);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      for (int k = 0; k < kRounds; ++k)
        pending[r * kRounds + k] = PushPull(engines[r].get(), "grad", DataType::kFloat32, {static_cast<int64_t>(n)},
                                            in[r * kRounds + k].data(), out[r * kRounds + k].data(), 4 * n);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < kRounds; ++k) {
      const Status s = AWAIT(*pending[r * kRounds + k]);
      EXPECT_TRUE(s.ok());
      uint64_t wrong = 0;
      for (uint64_t i = 0; i < n; ++i) wrong += out[r * kRounds + k][i] != static_cast<float>((i % 100) * (k + 1) * 2 + 1);
      EXPECT_EQ(wrong, 0u);
    }
}

TEST(EmptyAndScalarTensors) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  float in0 = 1.5f, in1 = 2.25f, out0 = 0, out1 = 0;
  auto p0 = PushPull(engines[0].get(), "scalar", DataType::kFloat32, {}, &in0, &out0, 4);
  auto p1 = PushPull(engines[1].get(), "scalar", DataType::kFloat32, {}, &in1, &out1, 4);
  auto e0 = PushPull(engines[0].get(), "empty", DataType::kFloat32, {0, 3}, nullptr, nullptr, 0);
  auto e1 = PushPull(engines[1].get(), "empty", DataType::kFloat32, {0, 3}, nullptr, nullptr, 0);
  EXPECT_TRUE(AWAIT(*p0).ok());
  EXPECT_TRUE(AWAIT(*p1).ok());
  EXPECT_EQ(out0, 3.75f);
  EXPECT_EQ(out1, 3.75f);
  EXPECT_TRUE(AWAIT(*e0).ok());
  EXPECT_TRUE(AWAIT(*e1).ok());
}

TEST(ShapeMismatchFailsOnBothWorkers) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  // Same byte size, different shapes.
  std::vector<float> a(20, 1.0f), b(20, 2.0f), oa(20), ob(20);
  auto p0 = PushPull(engines[0].get(), "dense/kernel", DataType::kFloat32, {4, 5}, a.data(), oa.data(), 80);
  auto p1 = PushPull(engines[1].get(), "dense/kernel", DataType::kFloat32, {5, 4}, b.data(), ob.data(), 80);
  for (auto* p : {p0.get(), p1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'dense/kernel'"));
    EXPECT_TRUE(Contains(s.message(), "[4, 5]") && Contains(s.message(), "[5, 4]"));
    std::printf("mismatch: %s\n", s.message().c_str());
  }
  // Different sizes (and several partitions on one side): still a clean failure on both.
  std::vector<float> c(3 * kMB / 4, 1.0f), oc(c.size()), d(1000, 1.0f), od(1000);
  auto q0 = PushPull(engines[0].get(), "conv/kernel", DataType::kFloat32, {static_cast<int64_t>(c.size())}, c.data(),
                     oc.data(), 4 * c.size());
  auto q1 = PushPull(engines[1].get(), "conv/kernel", DataType::kFloat32, {1000}, d.data(), od.data(), 4000);
  for (auto* p : {q0.get(), q1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'conv/kernel'"));
    EXPECT_TRUE(Contains(s.message(), "[786432]") && Contains(s.message(), "[1000]"));
  }
  // A dtype mismatch names both dtypes.
  std::vector<int64_t> e(4, 1), oe(4);
  std::vector<double> f(4, 1.0), of(4);
  auto r0 = PushPull(engines[0].get(), "step", DataType::kInt64, {4}, e.data(), oe.data(), 32);
  auto r1 = PushPull(engines[1].get(), "step", DataType::kFloat64, {4}, f.data(), of.data(), 32);
  for (auto* p : {r0.get(), r1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "int64") && Contains(s.message(), "float64"));
  }
  // The engines still work afterwards.
  float x = 1, y = 2, ox = 0, oy = 0;
  auto s0 = PushPull(engines[0].get(), "after", DataType::kFloat32, {1}, &x, &ox, 4);
  auto s1 = PushPull(engines[1].get(), "after", DataType::kFloat32, {1}, &y, &oy, 4);
  EXPECT_TRUE(AWAIT(*s0).ok());
  EXPECT_TRUE(AWAIT(*s1).ok());
  EXPECT_EQ(ox, 3.0f);
  EXPECT_EQ(oy, 3.0f);
}

// Redirects stderr (where the engine logs) to a file for the lifetime of the object.
class CaptureStderr {
 public:
  CaptureStderr() {
    std::fflush(stderr);
    file_ = std::tmpfile();
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  std::string Finish() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    std::rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), file_)) > 0) text_.append(buf, n);
    std::fclose(file_);
    std::fprintf(stderr, "%s", text_.c_str());  // keep the log visible
    return text_;
  }
  ~CaptureStderr() { Finish(); }

 private:
  FILE* file_ = nullptr;
  int saved_ = -1;
  std::string text_;
};

int ConnectTo(int port, double timeout_s) {
  const auto t0 = Clock::now();
  while (SecondsSince(t0) < timeout_s) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// Reads until EOF or `len` bytes, with a deadline. Returns the bytes read.
size_t ReadSome(int fd, char* buf, size_t len, double timeout_s) {
  size_t got = 0;
  const auto t0 = Clock::now();
  while (got < len && SecondsSince(t0) < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf + got, len - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return got;
}

bool ClosedByPeer(int fd, double timeout_s) {
  char c;
  const auto t0 = Clock::now();
  while (SecondsSince(t0) < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, &c, 1, 0);
    return n <= 0;
  }
  return false;
}

TEST(GarbageClientsAreDroppedAndTheRealPeerConnects) {
  const std::vector<EngineOptions> options = ClusterOptions(2);
  const int port0 = std::stoi(options[0].addresses[0].substr(options[0].addresses[0].rfind(':') + 1));
  CaptureStderr capture;
  std::unique_ptr<Engine> e0, e1;
  Status s0, s1;
  std::thread t0([&] { s0 = Engine::Start(options[0], &e0); });

  // 1. A Hello-sized block of junk: answered with a refusal naming the problem, then closed.
  const int junk = ConnectTo(port0, 5.0);
  EXPECT_TRUE(junk >= 0);
  if (junk >= 0) {
    char bytes[sizeof(Hello)];
    for (size_t i = 0; i < sizeof(bytes); ++i) bytes[i] = static_cast<char>(0xA5 ^ (i * 37));
    EXPECT_EQ(::send(junk, bytes, sizeof(bytes), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(bytes)));
    HelloReply reply{};
    EXPECT_EQ(ReadSome(junk, reinterpret_cast<char*>(&reply), sizeof(reply), 5.0), sizeof(reply));
    reply.reason[sizeof(reply.reason) - 1] = '\0';
    EXPECT_EQ(reply.accepted, 0);
    EXPECT_TRUE(Contains(reply.reason, "bad magic"));
    EXPECT_TRUE(ClosedByPeer(junk, 5.0));
    ::close(junk);
  }
  // 2. An HTTP request that ends before a Hello's worth of bytes: dropped.
  const int http = ConnectTo(port0, 5.0);
  EXPECT_TRUE(http >= 0);
  if (http >= 0) {
    const char req[] = "GET / HTTP/1.0\r\n\r\n";
    ::send(http, req, sizeof(req) - 1, MSG_NOSIGNAL);
    ::shutdown(http, SHUT_WR);
    EXPECT_TRUE(ClosedByPeer(http, 5.0));
    ::close(http);
  }
  // 3. A well-formed Hello from a rank that does not exist: refused.
  const int liar = ConnectTo(port0, 5.0);
  if (liar >= 0) {
    Hello h{kFrameMagic, kProtocolVersion, 0, 7, 2, HashString(options[0].token)};
    ::send(liar, &h, sizeof(h), MSG_NOSIGNAL);
    HelloReply reply{};
    EXPECT_EQ(ReadSome(liar, reinterpret_cast<char*>(&reply), sizeof(reply), 5.0), sizeof(reply));
    reply.reason[sizeof(reply.reason) - 1] = '\0';
    EXPECT_EQ(reply.accepted, 0);
    EXPECT_TRUE(Contains(reply.reason, "rank 7"));
    ::close(liar);
  }

  // The real peer still connects.
  std::thread t1([&] { s1 = Engine::Start(options[1], &e1); });
  t0.join();
  t1.join();
  const std::string log = capture.Finish();
  EXPECT_TRUE(s0.ok());
  EXPECT_TRUE(s1.ok());
  if (!s0.ok()) FAIL("rank 0: " + s0.message());
  if (!s1.ok()) FAIL("rank 1: " + s1.message());
  EXPECT_TRUE(Contains(log, "rejected a connection") && Contains(log, "bad magic"));
  EXPECT_TRUE(Contains(log, "dropped an incoming connection"));
  EXPECT_TRUE(Contains(log, "unexpected rank 7"));
  if (!e0 || !e1) return;
  int64_t a = 40, b = 2, oa = 0, ob = 0;
  auto p0 = PushPull(e0.get(), "x", DataType::kInt64, {1}, &a, &oa, 8);
  auto p1 = PushPull(e1.get(), "x", DataType::kInt64, {1}, &b, &ob, 8);
  EXPECT_TRUE(AWAIT(*p0).ok());
  EXPECT_TRUE(AWAIT(*p1).ok());
  EXPECT_EQ(oa, 42);
  EXPECT_EQ(ob, 42);
}

TEST(BadJobTokenIsRejectedClearly) {
  std::vector<EngineOptions> options = ClusterOptions(2);
  options[0].token = "job-a";
  options[1].token = "job-b";
  options[0].connect_timeout_s = 1.0;  // rank 0 waits for a rank 1 that never passes
  options[1].connect_timeout_s = 5.0;
  CaptureStderr capture;
  const auto t0 = Clock::now();
  std::vector<Status> status;
  auto engines = StartCluster(options, &status);
  const double elapsed = SecondsSince(t0);
  const std::string log = capture.Finish();
  EXPECT_TRUE(!engines[0] && !engines[1]);
  // The connecting side is told why at once.
  EXPECT_TRUE(status[1].code() == Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(status[1].message(), "job token mismatch"));
  EXPECT_TRUE(Contains(status[1].message(), options[1].addresses[0]));
  // The listening side logs the refusal and gives up at its deadline, naming the missing rank.
  EXPECT_TRUE(status[0].code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(status[0].message(), "rank(s) 1"));
  EXPECT_TRUE(Contains(log, "job token mismatch"));
  EXPECT_TRUE(elapsed < 5.0);
  std::printf("bad token: rank 1: %s\nrank 0: %s\n", status[1].message().c_str(), status[0].message().c_str());
}

TEST(DeadPeerFailsPendingOpsWithUnavailable) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  // A large op (some partitions pushed to rank 1, held there as early frames) and a small one.
  std::vector<float> big(9 * kMB / 4, 1.0f), big_out(big.size());
  float small = 1, small_out = 0;
  auto p_big = PushPull(engines[0].get(), "orphan/big", DataType::kFloat32, {static_cast<int64_t>(big.size())},
                        big.data(), big_out.data(), 4 * big.size());
  auto p_small = PushPull(engines[0].get(), "orphan/small", DataType::kFloat32, {1}, &small, &small_out, 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(p_big->future.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  const auto killed = Clock::now();
  engines[1].reset();  // rank 1 goes away
  for (auto* p : {p_big.get(), p_small.get()}) {
    const Status s = AWAIT(*p, 1.0);
    EXPECT_TRUE(s.code() == Code::kUnavailable);
    EXPECT_TRUE(Contains(s.message(), "rank 1"));
  }
  const double waited = SecondsSince(killed);
  std::printf("dead peer noticed after %.3f s\n", waited);
  EXPECT_TRUE(waited < 1.0);
  // Later requests fail at once, with the same reason.
  float z = 0, oz = 0;
  auto p_after = PushPull(engines[0].get(), "after", DataType::kFloat32, {1}, &z, &oz, 4);
  const Status s = AWAIT(*p_after, 1.0);
  EXPECT_TRUE(s.code() == Code::kUnavailable && Contains(s.message(), "rank 1"));
}

TEST(OpWithoutPeerSubmissionTimesOut) {
  auto engines = StartCluster(ClusterOptions(2, /*timeout_s=*/0.5));
  if (!engines[0] || !engines[1]) return;
  std::vector<float> in(1000, 1.0f), out(1000);
  const auto t0 = Clock::now();
  auto p = PushPull(engines[0].get(), "lonely", DataType::kFloat32, {1000}, in.data(), out.data(), 4000);
  const Status s = AWAIT(*p, 5.0);
  const double elapsed = SecondsSince(t0);
  std::printf("timeout after %.3f s: %s\n", elapsed, s.message().c_str());
  EXPECT_TRUE(s.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(s.message(), "'lonely'") && Contains(s.message(), "rank(s) 1"));
  EXPECT_TRUE(elapsed >= 0.45 && elapsed < 1.5);
  // The engine is still usable for operations both workers submit.
  float a = 1, b = 2, oa = 0, ob = 0;
  auto q0 = PushPull(engines[0].get(), "together", DataType::kFloat32, {1}, &a, &oa, 4);
  auto q1 = PushPull(engines[1].get(), "together", DataType::kFloat32, {1}, &b, &ob, 4);
  EXPECT_TRUE(AWAIT(*q0).ok());
  EXPECT_TRUE(AWAIT(*q1).ok());
  EXPECT_EQ(oa, 3.0f);
}

TEST(SingleWorkerReturnsInput) {
  EngineOptions o;
  o.rank = 0;
  o.world_size = 1;
  std::unique_ptr<Engine> e;
  EXPECT_TRUE(Engine::Start(o, &e).ok());
  if (!e) return;
  std::vector<int64_t> in = {1, -2, 3}, out(3);
  auto p = PushPull(e.get(), "solo", DataType::kInt64, {3}, in.data(), out.data(), 24, /*average=*/true);
  EXPECT_TRUE(AWAIT(*p).ok());
  EXPECT_TRUE(out == in);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
