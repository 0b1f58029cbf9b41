// Start-up of a job over loopback TCP: the authenticated handshake, hostile and idle connections,
// misconfigured peers, peers that die or never answer. Every worker runs Listen + ConnectAll on
// its own thread; hand-written clients play the hostile or misconfigured parts.
#include "ops/core/transport.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/handshake.h"
#include "ops/core/socket_testing.h"
#include "ops/core/testing.h"
#include "ops/core/wire.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

using Clock = std::chrono::steady_clock;

std::string Hex(const uint8_t* p, size_t n) {
  std::string out;
  char b[3];
  for (size_t i = 0; i < n; ++i) {
    std::snprintf(b, sizeof(b), "%02x", p[i]);
    out += b;
  }
  return out;
}

using testing::CaptureStderr;
using testing::ConnectTo;
using testing::ListenOn;
using testing::Loopback;
using testing::ReadSome;
using testing::SecondsSince;

int PortOf(const std::string& address) { return std::stoi(address.substr(address.rfind(':') + 1)); }

std::vector<BootstrapOptions> Job(int n, double connect_timeout_s = 10.0) {
  const std::vector<std::string> addresses = testing::LoopbackAddresses(n);
  std::vector<BootstrapOptions> out(n);
  for (int r = 0; r < n; ++r) {
    out[r].rank = r;
    out[r].world_size = n;
    out[r].addresses = addresses;
    out[r].token = "transport-test-token";
    out[r].connect_timeout_s = connect_timeout_s;
    out[r].handshake_timeout_s = 1.0;
  }
  return out;
}

// One worker's start-up on its own thread.
struct Worker {
  Status status;
  std::vector<int> fds;
  double seconds = 0;
  std::thread thread;

  void Start(const BootstrapOptions& o) {
    thread = std::thread([this, o] {
      const auto t0 = Clock::now();
      int listen_fd = -1;
      status = Listen(o, &listen_fd);
      if (status.ok()) status = ConnectAll(o, listen_fd, &fds);
      seconds = SecondsSince(t0);
    });
  }
  void Join() {
    if (thread.joinable()) thread.join();
  }
  ~Worker() {
    Join();
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }
};

bool SendBytes(int fd, const void* data, size_t len) {
  return ::send(fd, data, len, MSG_NOSIGNAL) == static_cast<ssize_t>(len);
}

// The connector's side of the handshake, written out by hand, with any token and claimed rank.
// Returns the final verdict (status kRejected with the reason, or kAccepted); `fd_out` keeps the
// connection open when given.
Verdict HandshakeAs(int port, int rank, int world_size, int acceptor_rank, const std::string& token,
                    int* fd_out = nullptr, std::string* client_bytes = nullptr, int lane = 0, int lanes = 1) {
  Verdict result = MakeVerdict(VerdictStatus::kRejected, "test client: no answer");
  const int fd = ConnectTo(port, 5.0);
  if (fd < 0) return result;
  ClientHello h{};
  h.prefix = HelloPrefix{kFrameMagic, kProtocolVersion, 0};
  h.rank = rank;
  h.world_size = world_size;
  h.acceptor_rank = acceptor_rank;
  h.lane = static_cast<uint16_t>(lane);
  h.lanes = static_cast<uint16_t>(lanes);
  RandomNonce(h.nonce);
  SendBytes(fd, &h, sizeof(h));
  if (client_bytes) client_bytes->assign(reinterpret_cast<const char*>(&h), sizeof(h));
  Verdict v{};
  if (ReadSome(fd, &v, sizeof(v), 5.0) == sizeof(v) && v.status == static_cast<uint16_t>(VerdictStatus::kChallenge)) {
    Challenge c{};
    ReadSome(fd, &c, sizeof(c), 5.0);
    ClientProof proof{};
    HandshakeMac(token, HandshakeRole::kConnector, HandshakeParams{world_size, rank, acceptor_rank}, h.nonce, c.nonce,
                 proof.mac);
    SendBytes(fd, &proof, sizeof(proof));
    if (client_bytes) client_bytes->append(reinterpret_cast<const char*>(&proof), sizeof(proof));
    ReadSome(fd, &v, sizeof(v), 5.0);
  }
  v.reason[sizeof(v.reason) - 1] = '\0';
  result = v;
  if (fd_out) *fd_out = fd;
  else ::close(fd);
  return result;
}

// Whether a connection of this process to 127.0.0.1:port has received at least `bytes` (the
// kernel's count, TCP_INFO): how far a worker thread's handshake with that acceptor has come.
bool SomeConnectionToPortReceived(int port, uint64_t bytes) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return false;
  bool found = false;
  while (dirent* entry = ::readdir(dir)) {
    const int fd = std::atoi(entry->d_name);
    sockaddr_in peer{};
    socklen_t len = sizeof(peer);
    if (fd <= 2 || ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0 || peer.sin_family != AF_INET ||
        ntohs(peer.sin_port) != port)
      continue;
    tcp_info info{};
    socklen_t info_len = sizeof(info);
    if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &info_len) == 0 && info.tcpi_bytes_received >= bytes) {
      found = true;
      break;
    }
  }
  ::closedir(dir);
  return found;
}

// Every pair of the job can talk over the sockets ConnectAll returned, on every lane: what one
// worker sends on lane l to another arrives on that worker's lane l from it.
void ExpectConnectedPairwise(std::vector<Worker>& workers, int lanes = 1) {
  const int n = static_cast<int>(workers.size());
  for (int l = 0; l < lanes; ++l)
    for (int a = 0; a < n; ++a)
      for (int b = 0; b < n; ++b) {
        if (a == b) continue;
        if (static_cast<int>(workers[a].fds.size()) != n * lanes ||
            static_cast<int>(workers[b].fds.size()) != n * lanes) {
          EXPECT_TRUE(false);
          return;
        }
        const char ping = static_cast<char>('A' + a + 8 * l);
        EXPECT_TRUE(SendBytes(workers[a].fds[l * n + b], &ping, 1));
        char got = 0;
        EXPECT_EQ(ReadSome(workers[b].fds[l * n + a], &got, 1, 5.0), 1u);
        EXPECT_EQ(got, ping);
      }
}

TEST(HandshakeMacIsHmacSha256OverTheTranscript) {
  // Expected values computed independently with Python's hmac module (9 = kProtocolVersion):
  //   hmac.new(b"job-token", label + b"\0" + struct.pack("<4I", 9, 3, 2, 0) + nonce_c + nonce_a, "sha256")
  uint8_t nonce_c[kNonceBytes], nonce_a[kNonceBytes];
  for (size_t i = 0; i < kNonceBytes; ++i) {
    nonce_c[i] = static_cast<uint8_t>(1 + i);
    nonce_a[i] = static_cast<uint8_t>(0x40 + i);
  }
  const HandshakeParams params{3, 2, 0};
  uint8_t mac_a[kMacBytes], mac_c[kMacBytes], other[kMacBytes];
  HandshakeMac("job-token", HandshakeRole::kAcceptor, params, nonce_c, nonce_a, mac_a);
  HandshakeMac("job-token", HandshakeRole::kConnector, params, nonce_c, nonce_a, mac_c);
  EXPECT_EQ(Hex(mac_a, kMacBytes), std::string("b30910b6e4247e33678029fab084db740b4fc042d6fde1169e31a8ffed4bdc86"));
  EXPECT_EQ(Hex(mac_c, kMacBytes), std::string("3dce2dbe18d285a826dfe1356ff72308de2bd565489eb3f4312e653d466a8ab3"));
  EXPECT_TRUE(MacEqual(mac_a, mac_a));
  EXPECT_TRUE(!MacEqual(mac_a, mac_c));
  // Every input changes the MAC.
  HandshakeMac("job-token2", HandshakeRole::kAcceptor, params, nonce_c, nonce_a, other);
  EXPECT_TRUE(!MacEqual(mac_a, other));
  HandshakeMac("job-token", HandshakeRole::kAcceptor, HandshakeParams{3, 1, 0}, nonce_c, nonce_a, other);
  EXPECT_TRUE(!MacEqual(mac_a, other));
  nonce_a[7] ^= 1;
  HandshakeMac("job-token", HandshakeRole::kAcceptor, params, nonce_c, nonce_a, other);
  EXPECT_TRUE(!MacEqual(mac_a, other));
  uint8_t n1[kNonceBytes], n2[kNonceBytes];
  EXPECT_TRUE(RandomNonce(n1).ok() && RandomNonce(n2).ok());
  EXPECT_TRUE(std::memcmp(n1, n2, kNonceBytes) != 0);
}

TEST(ThreeWorkersForm) {
  std::vector<BootstrapOptions> o = Job(3);
  std::vector<Worker> w(3);
  for (int r = 2; r >= 0; --r) w[r].Start(o[r]);  // any start order
  for (auto& x : w) x.Join();
  for (auto& x : w) EXPECT_TRUE(x.status.ok());
  if (!w[0].status.ok() || !w[1].status.ok() || !w[2].status.ok()) return;
  ExpectConnectedPairwise(w);
}

// Engine lanes (io_threads): every pair gets one connection per lane, and each stream joins the
// same lane on both sides.
TEST(FourWorkersFormWithThreeLanes) {
  std::vector<BootstrapOptions> o = Job(4);
  for (auto& x : o) x.lanes = 3;
  std::vector<Worker> w(4);
  for (int r = 3; r >= 0; --r) w[r].Start(o[r]);
  for (auto& x : w) x.Join();
  for (auto& x : w) EXPECT_TRUE(x.status.ok());
  for (const auto& x : w)
    if (!x.status.ok()) return;
  ExpectConnectedPairwise(w, 3);
}

// The data connections' options (TuneSocket): a limit on unsent data and autotuned buffers by
// default; an explicit buffer size when asked (Linux doubles it).
TEST(DataConnectionsHoldLittleUnsentData) {
  for (const bool explicit_buffer : {false, true}) {
    std::vector<BootstrapOptions> o = Job(2);
    for (BootstrapOptions& x : o) {
      x.socket_unsent_bytes = explicit_buffer ? 0 : 123456;
      x.send_buffer_bytes = x.receive_buffer_bytes = explicit_buffer ? 256 << 10 : 0;
    }
    std::vector<Worker> w(2);
    for (int r = 0; r < 2; ++r) w[r].Start(o[r]);
    for (auto& x : w) x.Join();
    EXPECT_TRUE(w[0].status.ok() && w[1].status.ok());
    if (!w[0].status.ok() || !w[1].status.ok()) return;
    const int fd = w[0].fds[1];
    int lowat = 0, sndbuf = 0;
    socklen_t len = sizeof(lowat);
    ::getsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &lowat, &len);
    len = sizeof(sndbuf);
    ::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len);
    if (explicit_buffer) {
      EXPECT_EQ(sndbuf, 512 << 10);
      EXPECT_EQ(lowat, 0);  // not set: the kernel's default (net.ipv4.tcp_notsent_lowat)
    } else {
      EXPECT_EQ(lowat, 123456);
      EXPECT_TRUE(sndbuf != 512 << 10 && sndbuf > 0);  // what autotuning gives
    }
  }
}

TEST(ListensOnTheConfiguredHostOnly) {
  std::vector<BootstrapOptions> o = Job(2, 3.0);
  int fd = -1;
  EXPECT_TRUE(Listen(o[0], &fd).ok());
  // Another address of the loopback network is still free on that port: not every interface.
  const int other = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.2", &addr.sin_addr);
  addr.sin_port = htons(static_cast<uint16_t>(PortOf(o[0].addresses[0])));
  EXPECT_EQ(::bind(other, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(other);
  ::close(fd);
}

TEST(AnAddressOfAnotherMachineFallsBackToEveryInterfaceOrFailsWithBindHost) {
  std::vector<BootstrapOptions> o = Job(2, 3.0);
  const int port = PortOf(o[0].addresses[0]);
  // TEST-NET-1: never an address of this machine, like a Kubernetes Service address.
  o[0].addresses[0] = "192.0.2.1:" + std::to_string(port);
  {
    CaptureStderr capture;
    int fd = -1;
    EXPECT_TRUE(Listen(o[0], &fd).ok());
    const std::string log = capture.Finish();
    EXPECT_TRUE(Contains(log, "not an address of this machine") && Contains(log, "PROPHET_BIND_HOST"));
    const int c = ConnectTo(port, 2.0);  // reachable on loopback: every interface
    EXPECT_TRUE(c >= 0);
    if (c >= 0) ::close(c);
    if (fd >= 0) ::close(fd);
  }
  o[0].bind_host = "127.0.0.1";
  int fd = -1;
  EXPECT_TRUE(Listen(o[0], &fd).ok());
  if (fd >= 0) ::close(fd);
  o[0].bind_host = "192.0.2.1";  // chosen explicitly: no fallback
  const Status s = Listen(o[0], &fd);
  EXPECT_TRUE(!s.ok() && Contains(s.message(), "bind_host") && Contains(s.message(), "not an address of this machine"));
}

TEST(IdleAndGarbageConnectionsDoNotStopTheJob) {
  std::vector<BootstrapOptions> o = Job(2, 20.0);
  const int port0 = PortOf(o[0].addresses[0]);
  CaptureStderr capture;
  std::vector<Worker> w(2);
  w[0].Start(o[0]);
  std::vector<int> idle;
  for (int i = 0; i < 200; ++i) {
    const int fd = ConnectTo(port0, 5.0);
    if (fd >= 0) idle.push_back(fd);
  }
  EXPECT_EQ(idle.size(), 200u);
  // Garbage of a hello's size, and an HTTP request: dropped.
  const int junk = ConnectTo(port0, 5.0);
  char bytes[sizeof(ClientHello)];
  for (size_t i = 0; i < sizeof(bytes); ++i) bytes[i] = static_cast<char>(0xA5 ^ (i * 37));
  SendBytes(junk, bytes, sizeof(bytes));
  const int http = ConnectTo(port0, 5.0);
  const char req[] = "GET / HTTP/1.0\r\n\r\n";
  SendBytes(http, req, sizeof(req) - 1);
  const auto t0 = Clock::now();
  w[1].Start(o[1]);
  w[1].Join();
  const double formed_after = SecondsSince(t0);
  w[0].Join();
  const std::string log = capture.Finish();
  EXPECT_TRUE(w[0].status.ok() && w[1].status.ok());
  if (!w[0].status.ok()) std::printf("rank 0: %s\n", w[0].status.message().c_str());
  if (!w[1].status.ok()) std::printf("rank 1: %s\n", w[1].status.message().c_str());
  std::printf("job formed %.3f s after rank 1 started, with 200 idle connections open\n", formed_after);
  EXPECT_TRUE(Contains(log, "bad magic"));
  for (int fd : idle) ::close(fd);
  ::close(junk);
  ::close(http);
  if (w[0].status.ok() && w[1].status.ok()) ExpectConnectedPairwise(w);
}

// Sends a hello (of any version, world size, claimed ranks or heartbeat) and returns the first
// verdict: a stranger's side of the handshake.
Verdict HelloAs(int port, const ClientHello& hello) {
  Verdict v = MakeVerdict(VerdictStatus::kRejected, "test client: no answer");
  const int fd = ConnectTo(port, 5.0);
  if (fd < 0) return v;
  SendBytes(fd, &hello, sizeof(hello));
  if (ReadSome(fd, &v, sizeof(v), 5.0) != sizeof(v)) v = MakeVerdict(VerdictStatus::kRejected, "test client: no answer");
  v.reason[sizeof(v.reason) - 1] = '\0';
  ::close(fd);
  return v;
}

ClientHello GoodHello(int rank, int world_size, int acceptor_rank) {
  ClientHello h{};
  h.prefix = HelloPrefix{kFrameMagic, kProtocolVersion, 0};
  h.rank = rank;
  h.world_size = world_size;
  h.acceptor_rank = acceptor_rank;
  h.lanes = 1;
  RandomNonce(h.nonce);
  return h;
}

TEST(ReplayedHandshakeIsRejectedAndTheJobStillForms) {
  std::vector<BootstrapOptions> o = Job(2, 30.0);
  const int port0 = PortOf(o[0].addresses[0]);
  // Record a genuine handshake: the test plays rank 1 with the right token against rank 0.
  std::string recorded;
  {
    std::vector<Worker> w(1);
    w[0].Start(o[0]);
    int fd = -1;
    const Verdict v = HandshakeAs(port0, 1, 2, 0, o[0].token, &fd, &recorded);
    EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kAccepted));
    // Finish start-up like a real worker, so rank 0 completes.
    StartupNotice ready{kStartupNoticeMagic, static_cast<uint8_t>(NoticeKind::kReady), 0, 0};
    SendBytes(fd, &ready, sizeof(ready));
    w[0].Join();
    EXPECT_TRUE(w[0].status.ok());
    ::close(fd);
  }
  EXPECT_EQ(recorded.size(), sizeof(ClientHello) + sizeof(ClientProof));
  // Replay those bytes against a fresh start-up of the same job.
  CaptureStderr capture;
  std::vector<Worker> w(2);
  w[0].Start(o[0]);
  const int fd = ConnectTo(port0, 5.0);
  SendBytes(fd, recorded.data(), recorded.size());
  Verdict first{}, final_verdict{};
  Challenge c{};
  EXPECT_EQ(ReadSome(fd, &first, sizeof(first), 5.0), sizeof(first));
  EXPECT_EQ(ReadSome(fd, &c, sizeof(c), 5.0), sizeof(c));
  EXPECT_EQ(ReadSome(fd, &final_verdict, sizeof(final_verdict), 5.0), sizeof(final_verdict));
  final_verdict.reason[sizeof(final_verdict.reason) - 1] = '\0';
  EXPECT_EQ(final_verdict.status, static_cast<uint16_t>(VerdictStatus::kRejected));
  EXPECT_TRUE(Contains(final_verdict.reason, "job token mismatch"));
  ::close(fd);
  // The replay did not end rank 0's start-up: the real rank 1 still joins.
  w[1].Start(o[1]);
  w[0].Join();
  w[1].Join();
  const std::string log = capture.Finish();
  EXPECT_TRUE(w[0].status.ok() && w[1].status.ok());
  EXPECT_TRUE(Contains(log, "rejected a connection from") && Contains(log, "replayed a recorded handshake"));
  if (w[0].status.ok() && w[1].status.ok()) ExpectConnectedPairwise(w);
}

TEST(StrangersAreRejectedWithTheReasonAndCannotStopTheJob) {
  std::vector<BootstrapOptions> o = Job(2, 30.0);
  const int port0 = PortOf(o[0].addresses[0]);
  CaptureStderr capture;
  std::vector<Worker> w(2);
  w[0].Start(o[0]);
  // Each of these must not end rank 0's start-up: a stranger that has not proven the token could
  // otherwise stop a job with 8 bytes of another version.
  ClientHello other_version = GoodHello(1, 2, 0);
  other_version.prefix.version = kProtocolVersion + 1;
  ClientHello world5 = GoodHello(1, 5, 0);
  ClientHello wrong_acceptor = GoodHello(1, 2, 1);
  ClientHello heartbeat = GoodHello(1, 2, 0);
  heartbeat.heartbeat_ms = 2000;
  ClientHello lower_rank = GoodHello(0, 2, 0);
  ClientHello lanes = GoodHello(1, 2, 0);
  lanes.lanes = 2;
  const struct {
    const ClientHello* hello;
    const char* reason;
  } strangers[] = {{&other_version, "protocol version"},
                   {&world5, "world size 5"},
                   {&wrong_acceptor, "expecting rank 1"},
                   {&heartbeat, "heartbeat_s 2 s"},
                   {&lower_rank, "rank 0 cannot connect"},
                   {&lanes, "io_threads 2 but rank 0 uses 1"}};
  for (const auto& stranger : strangers) {
    const Verdict v = HelloAs(port0, *stranger.hello);
    EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kRejected));
    if (!Contains(v.reason, stranger.reason)) std::printf("expected '%s' in: %s\n", stranger.reason, v.reason);
    EXPECT_TRUE(Contains(v.reason, stranger.reason));
  }
  const Verdict forged = HandshakeAs(port0, 1, 2, 0, "not-the-token");
  EXPECT_EQ(forged.status, static_cast<uint16_t>(VerdictStatus::kRejected));
  EXPECT_TRUE(Contains(forged.reason, "job token mismatch"));
  // Rank 0 is still waiting: the real rank 1 joins and the job forms.
  w[1].Start(o[1]);
  w[0].Join();
  w[1].Join();
  const std::string log = capture.Finish();
  EXPECT_TRUE(w[0].status.ok() && w[1].status.ok());
  EXPECT_TRUE(Contains(log, "still waiting for the workers of this job"));
  if (w[0].status.ok() && w[1].status.ok()) ExpectConnectedPairwise(w);
}

TEST(WhatWasRejectedIsNamedWhenTheRealPeerNeverArrives) {
  std::vector<BootstrapOptions> o = Job(2, 2.0);
  Worker w;
  w.Start(o[0]);
  const Verdict v = HelloAs(PortOf(o[0].addresses[0]), GoodHello(1, 5, 0));
  EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kRejected));
  w.Join();
  std::printf("after %.3f s: %s\n", w.seconds, w.status.message().c_str());
  EXPECT_TRUE(w.status.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(w.status.message(), "rank(s) 1 did not connect to this worker"));
  EXPECT_TRUE(Contains(w.status.message(), "rejected meanwhile: 127.0.0.1:") &&
              Contains(w.status.message(), "(claiming rank 1), world size 5, expected 2"));
}

// A misconfigured worker is rejected by the worker it connects to: it fails at once with the
// reason (and its launcher stops the job); the worker that rejected it waits for the real peer
// and, when its own connect timeout ends, names what it rejected.
void ExpectConnectorFailsAtOnceAndAcceptorNamesIt(const BootstrapOptions& acceptor, const BootstrapOptions& connector,
                                                  const std::string& reason) {
  std::vector<Worker> w(2);
  w[0].Start(acceptor);
  w[1].Start(connector);
  w[1].Join();
  w[0].Join();
  std::printf("%s: connector after %.3f s: %s\n  acceptor after %.3f s: %s\n", reason.c_str(), w[1].seconds,
              w[1].status.message().c_str(), w[0].seconds, w[0].status.message().c_str());
  EXPECT_TRUE(w[1].status.code() == Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(w[1].status.message(), reason) && Contains(w[1].status.message(), acceptor.addresses[0]));
  EXPECT_TRUE(w[1].seconds < 10.0);  // its connect timeout is 20 s
  EXPECT_TRUE(w[0].status.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(w[0].status.message(), "rejected meanwhile") && Contains(w[0].status.message(), reason));
  EXPECT_TRUE(w[0].seconds >= acceptor.connect_timeout_s - 0.2);  // the rejection did not end it
}

TEST(TokenMismatchFailsTheConnectorAtOnce) {
  std::vector<BootstrapOptions> o = Job(2, 20.0);
  o[0].connect_timeout_s = 4.0;
  o[1].token = "another-job";
  ExpectConnectorFailsAtOnceAndAcceptorNamesIt(o[0], o[1], "job token mismatch");
}

TEST(WorldSizeMismatchFailsTheConnectorAtOnce) {
  std::vector<BootstrapOptions> o = Job(3, 20.0);
  o[0].connect_timeout_s = 4.0;
  BootstrapOptions small = o[1];
  small.world_size = 2;
  small.addresses.resize(2);
  ExpectConnectorFailsAtOnceAndAcceptorNamesIt(o[0], small, "world size 2");
}

TEST(DifferentHeartbeatSettingsFailTheConnectorAtOnce) {
  std::vector<BootstrapOptions> o = Job(2, 20.0);
  o[0].connect_timeout_s = 4.0;
  o[0].heartbeat_s = 2.0;
  o[1].heartbeat_s = 0.0;
  ExpectConnectorFailsAtOnceAndAcceptorNamesIt(o[0], o[1], "heartbeat_s");
}

// Lanes multiply the sockets: a worker that runs out of file descriptors says so, with the fix,
// instead of waiting for peers it can no longer reach.
TEST(RunningOutOfFileDescriptorsIsNamedWithTheFix) {
  int open = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (::readdir(dir) != nullptr) ++open;
    ::closedir(dir);
  }
  rlimit saved{};
  EXPECT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  std::vector<BootstrapOptions> o = Job(3, 10.0);
  for (auto& x : o) x.lanes = 4;
  std::vector<Worker> w(3);
  // Room for the 3 listeners and a few of the 24 sockets the job needs in this process.
  rlimit low = saved;
  low.rlim_cur = static_cast<rlim_t>(open + 8);
  EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  for (int r = 0; r < 3; ++r) w[r].Start(o[r]);
  for (auto& x : w) x.Join();
  EXPECT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  bool named = false;
  for (const auto& x : w) {
    EXPECT_TRUE(!x.status.ok());
    if (Contains(x.status.message(), "no file descriptor left") && Contains(x.status.message(), "ulimit -n")) named = true;
    std::printf("%s\n", x.status.message().c_str());
  }
  EXPECT_TRUE(named);
}

TEST(DifferentIoThreadsFailTheConnectorAtOnce) {
  std::vector<BootstrapOptions> o = Job(2, 20.0);
  o[0].connect_timeout_s = 4.0;
  o[1].lanes = 2;
  ExpectConnectorFailsAtOnceAndAcceptorNamesIt(o[0], o[1], "io_threads 2");
}

TEST(AWorkerOfProtocolVersion1IsToldWhyAndTheJobStillForms) {
  // Its hello: magic, version, reserved, rank, world, token hash; its reply has Verdict's layout.
  std::vector<BootstrapOptions> p = Job(2, 20.0);
  std::vector<Worker> w(2);
  w[0].Start(p[0]);
  const int fd = ConnectTo(PortOf(p[0].addresses[0]), 5.0);
  struct {
    uint32_t magic;
    uint16_t version, reserved;
    int32_t rank, world;
    uint64_t token_hash;
  } __attribute__((packed)) v1{kFrameMagic, 1, 0, 1, 2, 0};
  SendBytes(fd, &v1, sizeof(v1));
  Verdict reply{};
  EXPECT_EQ(ReadSome(fd, &reply, sizeof(reply), 5.0), sizeof(reply));
  reply.reason[sizeof(reply.reason) - 1] = '\0';
  EXPECT_EQ(reply.status, 0);
  EXPECT_TRUE(Contains(reply.reason, "protocol version 1"));
  ::close(fd);
  w[1].Start(p[1]);
  w[0].Join();
  w[1].Join();
  EXPECT_TRUE(w[0].status.ok() && w[1].status.ok());
}

TEST(ARankIsAcceptedOncePerJob) {
  std::vector<BootstrapOptions> o = Job(3, 20.0);
  const int port0 = PortOf(o[0].addresses[0]);
  CaptureStderr capture;
  std::vector<Worker> w(3);
  w[0].Start(o[0]);
  w[1].Start(o[1]);
  // Rank 1 connects to rank 0; once rank 0 has accepted it (rank 1 received the final verdict,
  // however long that takes), someone holding the token claims rank 1 again.
  const uint64_t handshake_replies = 2 * sizeof(Verdict) + sizeof(Challenge);  // challenge, verdict
  const auto t0 = Clock::now();
  while (!SomeConnectionToPortReceived(port0, handshake_replies) && SecondsSince(t0) < 10.0)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_TRUE(SomeConnectionToPortReceived(port0, handshake_replies));
  const Verdict v = HandshakeAs(port0, 1, 3, 0, o[0].token);
  EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kRejected));
  EXPECT_TRUE(Contains(v.reason, "rank 1 is already connected"));
  // The job still forms.
  w[2].Start(o[2]);
  for (auto& x : w) x.Join();
  const std::string log = capture.Finish();
  for (auto& x : w) EXPECT_TRUE(x.status.ok());
  EXPECT_TRUE(Contains(log, "rejected a second connection claiming rank 1"));
  if (w[0].status.ok() && w[1].status.ok() && w[2].status.ok()) ExpectConnectedPairwise(w);
}

TEST(ConnectTimeoutIsHonouredAgainstAListenerThatNeverAnswers) {
  std::vector<BootstrapOptions> o = Job(2, 2.0);
  const int port0 = PortOf(o[0].addresses[0]);
  // A listener that never accepts, its backlog full: further SYNs are dropped.
  const int lst = ListenOn(port0, 0);
  EXPECT_TRUE(lst >= 0);
  const sockaddr_in addr = Loopback(port0);
  std::vector<int> fill;
  for (int i = 0; i < 3; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    fill.push_back(fd);
  }
  Worker w;
  w.Start(o[1]);
  w.Join();
  std::printf("gave up after %.3f s: %s\n", w.seconds, w.status.message().c_str());
  EXPECT_TRUE(w.status.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(w.status.message(), "could not connect to rank 0") &&
              Contains(w.status.message(), "within 2 s"));
  // The last attempt was cut short by the 2 s deadline: it must not claim the attempt's own 5 s.
  EXPECT_TRUE(!Contains(w.status.message(), "request within 5 s"));
  // Soon after the deadline: the slack is for a loaded or much slower machine; a connect left to
  // the kernel's SYN retries would take minutes, the default connect timeout is 60 s.
  EXPECT_TRUE(w.seconds < 2.0 + 5.0);
  for (int fd : fill) ::close(fd);
  ::close(lst);
}

TEST(APeerThatConnectedAndDiedIsNamedAtOnce) {
  // Rank 1 (played by the test) completes its handshake with rank 0, then its process dies while
  // the job waits for rank 2: rank 0 and rank 2 both fail at once, naming rank 1.
  std::vector<BootstrapOptions> o = Job(3, 20.0);
  std::vector<Worker> w(3);
  w[0].Start(o[0]);
  int fd = -1;
  const Verdict v = HandshakeAs(PortOf(o[0].addresses[0]), 1, 3, 0, o[0].token, &fd);
  EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kAccepted));
  // Rank 1's listener: accepts rank 2's connection attempt, then goes away with the process.
  const int lst1 = ListenOn(PortOf(o[0].addresses[1]), 16);
  EXPECT_TRUE(lst1 >= 0);
  w[2].Start(o[2]);
  pollfd p{lst1, POLLIN, 0};
  EXPECT_TRUE(::poll(&p, 1, 5000) == 1);  // rank 2 reached rank 1
  const auto died = Clock::now();
  ::close(lst1);  // the process dies: its listener and its connection close
  ::close(fd);
  w[0].Join();
  w[2].Join();
  for (int r : {0, 2}) {
    std::printf("rank %d after %.3f s: %s\n", r, SecondsSince(died), w[r].status.message().c_str());
    EXPECT_TRUE(w[r].status.code() == Code::kUnavailable);
    EXPECT_TRUE(Contains(w[r].status.message(), "rank 1"));
    EXPECT_TRUE(Contains(w[r].status.message(), "exited") || Contains(w[r].status.message(), "crashed"));
  }
  EXPECT_TRUE(SecondsSince(died) < 10.0);  // the connect timeout is 20 s
}

// Starts rank 0 of `o` (every worker with two lanes) on `w` and connects to it as `rank` on lane 1
// only; returns that connection. Rank 0 then holds the peer's lane 1 but not its lane 0, which
// carries kReady.
int StartWithLaneOneOf(std::vector<BootstrapOptions>& o, int rank, Worker* w) {
  for (auto& x : o) x.lanes = 2;
  w->Start(o[0]);
  int fd = -1;
  const Verdict v = HandshakeAs(PortOf(o[0].addresses[0]), rank, static_cast<int>(o.size()), 0, o[0].token, &fd,
                                nullptr, /*lane=*/1, /*lanes=*/2);
  EXPECT_EQ(v.status, static_cast<uint16_t>(VerdictStatus::kAccepted));
  return fd;
}

TEST(APeerThatAbortsBeforeItsLaneZeroConnectsIsHeardOnItsOtherLanes) {
  std::vector<BootstrapOptions> o = Job(3, 20.0);
  Worker w;
  const int fd = StartWithLaneOneOf(o, 2, &w);
  const std::string reason = "test: rank 2 gave up";
  const StartupNotice abort{kStartupNoticeMagic, static_cast<uint8_t>(NoticeKind::kAbort),
                            static_cast<uint8_t>(Code::kFailedPrecondition), static_cast<uint16_t>(reason.size())};
  const auto sent = Clock::now();
  EXPECT_TRUE(SendBytes(fd, &abort, sizeof(abort)) && SendBytes(fd, reason.data(), reason.size()));
  w.Join();
  std::printf("rank 0 after %.3f s: %s\n", SecondsSince(sent), w.status.message().c_str());
  EXPECT_TRUE(w.status.code() == Code::kFailedPrecondition);
  EXPECT_TRUE(Contains(w.status.message(), "failed on rank 2: " + reason));
  EXPECT_TRUE(SecondsSince(sent) < 10.0);  // the connect timeout is 20 s
  ::close(fd);
}

TEST(APeerThatDiesBeforeItsLaneZeroConnectsIsNamedAtOnce) {
  std::vector<BootstrapOptions> o = Job(2, 20.0);
  Worker w;
  const int fd = StartWithLaneOneOf(o, 1, &w);
  const auto died = Clock::now();
  ::close(fd);
  w.Join();
  std::printf("rank 0 after %.3f s: %s\n", SecondsSince(died), w.status.message().c_str());
  EXPECT_TRUE(w.status.code() == Code::kUnavailable);
  EXPECT_TRUE(Contains(w.status.message(), "rank 1") && Contains(w.status.message(), "exited"));
  EXPECT_TRUE(SecondsSince(died) < 10.0);
}

TEST(AWorkerThatFailsTellsEveryLaneConnected) {
  // Rank 0 fails at its deadline with only rank 1's lane 1 connected: rank 1 reads why there.
  std::vector<BootstrapOptions> o = Job(2, 4.0);
  Worker w;
  const int fd = StartWithLaneOneOf(o, 1, &w);
  w.Join();
  EXPECT_TRUE(w.status.code() == Code::kDeadlineExceeded);
  StartupNotice notice{};
  EXPECT_EQ(ReadSome(fd, &notice, sizeof(notice), 5.0), sizeof(notice));
  EXPECT_EQ(notice.magic, kStartupNoticeMagic);
  EXPECT_EQ(notice.kind, static_cast<uint8_t>(NoticeKind::kAbort));
  EXPECT_EQ(notice.code, static_cast<uint8_t>(Code::kDeadlineExceeded));
  std::string reason(notice.reason_len, '\0');
  EXPECT_EQ(ReadSome(fd, reason.data(), reason.size(), 5.0), reason.size());
  EXPECT_TRUE(Contains(reason, "rank(s) 1 did not connect to this worker"));
  ::close(fd);
}

TEST(APeerThatNeverCameIsNamedWithTheReason) {
  std::vector<BootstrapOptions> o = Job(2, 1.5);
  Worker w;
  w.Start(o[1]);
  w.Join();
  EXPECT_TRUE(w.status.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(w.status.message(), "could not connect to rank 0") &&
              Contains(w.status.message(), "connection refused") && Contains(w.status.message(), "is that worker started"));
  Worker a;
  a.Start(o[0]);
  a.Join();
  EXPECT_TRUE(a.status.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(a.status.message(), "rank(s) 1 did not connect to this worker"));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
