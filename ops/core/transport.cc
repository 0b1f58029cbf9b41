#include "ops/core/transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <list>
#include <memory>

#include "ops/core/handshake.h"
#include "ops/core/hosts.h"
#include "ops/core/wire.h"

namespace prophet {

namespace {

constexpr int64_t kNsPerSecond = 1000000000;
// One TCP connection attempt: a peer whose SYNs vanish is retried with a fresh socket (and a
// fresh name resolution: in Kubernetes a pod's address appears when it starts).
constexpr int64_t kAttemptTimeoutNs = 5 * kNsPerSecond;
constexpr int64_t kProgressLogNs = 10 * kNsPerSecond;
constexpr int64_t kPollSliceMs = 100;  // the deadline is honoured to within this
// Incoming connections that have not sent a hello yet; beyond this the oldest is dropped, so a
// flood cannot exhaust file descriptors while real peers still get through.
constexpr size_t kMaxPendingIncoming = 512;
constexpr int kDroppedLogLines = 5;
// Rejected connections named in the timeout message (the count says how many more there were).
constexpr size_t kRejectedNamed = 4;

std::string Errno(int err) { return std::string(std::strerror(err)); }

void SetNonBlocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

std::string SockaddrString(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (a.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    return "[" + std::string(host) + "]:" + std::to_string(port);
  }
  return "?";
}

// Every address `host` resolves to, with `port`.
Status ResolveAll(const std::string& host, int port, bool passive, std::vector<sockaddr_storage>* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    return Status(Code::kUnavailable, "cannot resolve host '" + host + "': " + gai_strerror(rc));
  out->clear();
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    sockaddr_storage s{};
    std::memcpy(&s, ai->ai_addr, ai->ai_addrlen);
    out->push_back(s);
  }
  ::freeaddrinfo(res);
  return Status::OK();
}

uint32_t HeartbeatMs(double heartbeat_s) { return static_cast<uint32_t>(heartbeat_s * 1000 + 0.5); }
// A hello's path tag (BootstrapOptions::path_tag) in words.
std::string PathName(uint16_t tag) {
  if (tag == 0) return "the flat path";
  const std::string hosts = "hosts digest " + std::to_string(tag & ~kPathChosenAtStartUp);
  return (tag & kPathChosenAtStartUp) ? "the path the start-up probe chooses (hierarchical auto, " + hosts + ")"
                                      : "the two-level path (hierarchical on, " + hosts + ")";
}

socklen_t SockaddrLen(const sockaddr_storage& a) {
  return a.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
}

// Sends all of a small handshake message on a non-blocking socket. Its send buffer is empty at
// this point, so this does not wait in practice; the deadline bounds a peer that reads nothing.
bool SendAll(int fd, const void* data, size_t len) {
  const char* p = static_cast<const char*>(data);
  const int64_t deadline = NowNs() + kNsPerSecond;
  while (len > 0) {
    const ssize_t n = ::send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && NowNs() < deadline) {
      pollfd pfd{fd, POLLOUT, 0};
      ::poll(&pfd, 1, 10);
      continue;
    }
    return false;
  }
  return true;
}

enum class ReadResult { kPartial, kComplete, kClosed };

// Reads up to `want` bytes in total into `buf` without reading past them: whatever follows on the
// socket (the engine's first frames) stays there.
ReadResult ReadUpTo(int fd, std::string* buf, size_t want, int* err) {
  while (buf->size() < want) {
    char chunk[512];
    const size_t ask = std::min(sizeof(chunk), want - buf->size());
    const ssize_t n = ::recv(fd, chunk, ask, 0);
    if (n > 0) {
      buf->append(chunk, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return ReadResult::kPartial;
    *err = n == 0 ? 0 : errno;
    return ReadResult::kClosed;
  }
  return ReadResult::kComplete;
}

// One handshake in progress, in either direction.
struct Session {
  enum Stage {
    kConnecting,     // outgoing: TCP connect in progress
    kAwaitVerdict,   // outgoing: ClientHello sent, waiting for kChallenge or a rejection
    kAwaitChallenge, // outgoing: nonce_a + mac_a
    kAwaitFinal,     // outgoing: proof sent, waiting for the final verdict
    kAwaitPrefix,    // incoming: the first bytes of a hello
    kAwaitHello,     // incoming: the rest of the ClientHello
    kAwaitProof,     // incoming: the connector's MAC
  };
  int fd = -1;
  bool outgoing = false;
  int peer = -1;  // outgoing: the rank dialled; incoming: the claimed rank, once known
  int lane = 0;   // outgoing: the lane dialled; incoming: the claimed lane, once known
  Stage stage = kConnecting;
  std::string in;
  size_t want = 0;
  int64_t deadline_ns = 0;
  int64_t opened_ns = 0;
  std::string from;  // remote address, for messages
  ClientHello hello{};
  uint8_t nonce_a[kNonceBytes] = {};
  bool acceptor_proved_token = false;

  void Expect(Stage next, size_t bytes) {
    stage = next;
    in.clear();
    want = bytes;
  }
};

// A lower rank this worker connects to, on one lane.
struct Dialled {
  int64_t next_attempt_ns = 0;
  int attempts = 0;
  int refusals = 0;
  // A TCP connection to it succeeded during this start-up: from then on a refusal means it died.
  bool seen = false;
  std::string last_problem;
};

// A connected, authenticated peer on one lane; on lane 0, until its kReady arrives.
struct Connected {
  int fd = -1;
  std::string in;
  bool have_header = false;
  StartupNotice header{};
  bool ready = false;
};

class Bootstrap {
 public:
  Bootstrap(const BootstrapOptions& o, int listen_fd)
      : o_(o),
        n_(o.world_size),
        lanes_(std::max(o.lanes, 1)),
        listen_fd_(listen_fd),
        dialled_(static_cast<size_t>(n_) * lanes_),
        peers_(static_cast<size_t>(n_) * lanes_) {
    start_ns_ = NowNs();
    deadline_ns_ = start_ns_ + static_cast<int64_t>(o.connect_timeout_s * 1e9);
    handshake_ns_ = static_cast<int64_t>(o.handshake_timeout_s * 1e9);
    next_progress_ns_ = start_ns_ + kProgressLogNs;
  }

  Status Run(std::vector<int>* fds);

 private:
  // --- connecting to lower ranks ---
  void Dial(int peer, int lane, int64_t now);
  void OnConnectFailed(int peer, int lane, int err);
  void OnConnected(Session& s);
  void OnOutgoingData(Session& s);
  void RetryLater(Session& s, const std::string& problem);
  // --- connections from higher ranks ---
  void AcceptAll(int64_t now);
  void OnIncomingData(Session& s);
  void Drop(Session& s, const std::string& why);
  void Reject(Session& s, const std::string& to_peer, const std::string& what);
  std::string RejectedMeanwhile() const;
  // --- after the handshake ---
  void Establish(Session& s);
  void OnNotice(int peer, int lane);
  void SendReady();
  // --- everything else ---
  void Fatal(Code code, const std::string& message) {
    if (fatal_.ok()) fatal_ = Status(code, message);
  }
  void Close(Session& s) {
    if (s.fd >= 0) ::close(s.fd);
    s.fd = -1;
  }
  void Expire(int64_t now);
  std::string Waiting(bool final) const;
  Status Failed(const Status& status);
  void LogDropped() const;
  // dialled_ and peers_ hold one entry per peer and lane.
  size_t Slot(int peer, int lane) const { return static_cast<size_t>(lane) * n_ + peer; }
  // Every lane of `peer` is connected.
  bool FullyConnected(int peer) const {
    for (int l = 0; l < lanes_; ++l)
      if (peers_[Slot(peer, l)].fd < 0) return false;
    return true;
  }
  bool AllConnected() const {
    for (int r = 0; r < n_; ++r)
      if (r != o_.rank && !FullyConnected(r)) return false;
    return true;
  }
  bool AllReady() const {
    for (int r = 0; r < n_; ++r)
      if (r != o_.rank && !peers_[Slot(r, 0)].ready) return false;
    return true;
  }
  std::string TooManyFiles() const {
    return Me() + " has no file descriptor left for its " + std::to_string(static_cast<size_t>(n_ - 1) * lanes_) +
           " connections (" + std::to_string(n_ - 1) + " peers x " + std::to_string(lanes_) +
           " io_threads lanes): raise the open-file limit (ulimit -n; the hard limit, ulimit -Hn, bounds what the "
           "runtime can raise it to) or set io_threads=1";
  }
  std::string Me() const { return "rank " + std::to_string(o_.rank) + " (" + o_.addresses[o_.rank] + ")"; }
  std::string Rank(int r) const { return "rank " + std::to_string(r) + " at " + o_.addresses[r]; }

  const BootstrapOptions& o_;
  const int n_;
  const int lanes_;
  int listen_fd_;
  int64_t start_ns_ = 0, deadline_ns_ = 0, handshake_ns_ = 0, next_progress_ns_ = 0;
  std::vector<Dialled> dialled_;
  std::vector<Connected> peers_;
  std::list<Session> sessions_;
  bool ready_sent_ = false;
  Status fatal_;
  int dropped_ = 0;
  std::string first_drop_;
  // Connections that spoke the handshake but could not join ("127.0.0.1:52904, world size 5,
  // expected 2"): named if the real peer never arrives.
  std::vector<std::string> rejected_;
  int rejected_total_ = 0;
};

void Bootstrap::Dial(int peer, int lane, int64_t now) {
  Dialled& d = dialled_[Slot(peer, lane)];
  d.attempts++;
  // Quick retries first (peers start within moments of each other), then a slower pace.
  d.next_attempt_ns = now + (d.attempts < 20 ? 50 : 250) * int64_t{1000000};
  std::string host;
  int port = 0;
  Status st = ParseAddress(o_.addresses[peer], &host, &port);
  std::vector<sockaddr_storage> addrs;
  if (st.ok()) st = ResolveAll(host, port, false, &addrs);
  if (!st.ok()) {
    // Name lookups block this thread: not more than one a second per peer.
    d.next_attempt_ns = std::max(d.next_attempt_ns, now + kNsPerSecond);
    d.last_problem = st.message();
    return;
  }
  const sockaddr_storage& addr = addrs.front();
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE) return Fatal(Code::kUnavailable, TooManyFiles());
    d.last_problem = "socket(): " + Errno(errno);
    return;
  }
  sessions_.emplace_back();
  Session& s = sessions_.back();
  s.fd = fd;
  s.outgoing = true;
  s.peer = peer;
  s.lane = lane;
  s.from = SockaddrString(addr);
  s.opened_ns = now;
  s.stage = Session::kConnecting;
  s.deadline_ns = std::min(deadline_ns_, now + kAttemptTimeoutNs);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), SockaddrLen(addr)) == 0) {
    OnConnected(s);
  } else if (errno != EINPROGRESS) {
    const int err = errno;
    Close(s);
    OnConnectFailed(peer, lane, err);
  }
}

void Bootstrap::OnConnectFailed(int peer, int lane, int err) {
  Dialled& d = dialled_[Slot(peer, lane)];
  if (err == ECONNREFUSED) {
    d.refusals++;
    if (d.seen) {
      Fatal(Code::kUnavailable,
            Rank(peer) + " accepted a connection earlier in this start-up and now refuses connections: that "
                         "worker exited, crashed or gave up during start-up; see its log");
      return;
    }
    d.last_problem = "connection refused " + std::to_string(d.refusals) + " time(s): nothing listens there (yet)";
    return;
  }
  d.last_problem = Errno(err);
}

void Bootstrap::OnConnected(Session& s) {
  dialled_[Slot(s.peer, s.lane)].seen = true;
  ClientHello& h = s.hello;
  h.prefix = HelloPrefix{kFrameMagic, kProtocolVersion, o_.path_tag};
  h.rank = o_.rank;
  h.world_size = n_;
  h.acceptor_rank = s.peer;
  h.heartbeat_ms = HeartbeatMs(o_.heartbeat_s);
  h.lane = static_cast<uint16_t>(s.lane);
  h.lanes = static_cast<uint16_t>(lanes_);
  Status st = RandomNonce(h.nonce);
  if (!st.ok()) return Fatal(st.code(), st.message());
  if (!SendAll(s.fd, &h, sizeof(h))) return RetryLater(s, "the connection closed before the handshake");
  s.Expect(Session::kAwaitVerdict, sizeof(Verdict));
  s.deadline_ns = std::min(deadline_ns_, NowNs() + handshake_ns_);
}

void Bootstrap::RetryLater(Session& s, const std::string& problem) {
  dialled_[Slot(s.peer, s.lane)].last_problem = problem;
  Close(s);
}

void Bootstrap::OnOutgoingData(Session& s) {
  int err = 0;
  const ReadResult r = ReadUpTo(s.fd, &s.in, s.want, &err);
  if (r == ReadResult::kClosed)
    return RetryLater(s, "rank " + std::to_string(s.peer) + " closed the connection during the handshake" +
                             (err ? " (" + Errno(err) + ")" : ""));
  if (r == ReadResult::kPartial) return;
  const int peer = s.peer;
  if (s.stage == Session::kAwaitVerdict || s.stage == Session::kAwaitFinal) {
    Verdict v;
    std::memcpy(&v, s.in.data(), sizeof(v));
    v.reason[sizeof(v.reason) - 1] = '\0';
    if (v.magic != kFrameMagic) {
      Close(s);
      return Fatal(Code::kFailedPrecondition,
                   Rank(peer) + " is answered by something that is not a prophet_tf worker (bad magic in its reply): "
                                "check the addresses in TF_CONFIG");
    }
    const auto status = static_cast<VerdictStatus>(v.status);
    if (status == VerdictStatus::kRejected) {
      Close(s);
      return Fatal(Code::kFailedPrecondition, Rank(peer) + " rejected this worker: " + v.reason);
    }
    if (status == VerdictStatus::kAborted) {
      Close(s);
      return Fatal(Code::kUnavailable, "the start-up of the job failed on rank " + std::to_string(peer) + ": " + v.reason);
    }
    if (s.stage == Session::kAwaitVerdict && status == VerdictStatus::kChallenge) {
      s.Expect(Session::kAwaitChallenge, sizeof(Challenge));
      s.deadline_ns = std::min(deadline_ns_, NowNs() + handshake_ns_);
      return;
    }
    if (s.stage == Session::kAwaitFinal && status == VerdictStatus::kAccepted && s.acceptor_proved_token)
      return Establish(s);
    Close(s);
    if (s.stage == Session::kAwaitFinal && status == VerdictStatus::kAccepted)
      return Fatal(Code::kFailedPrecondition,
                   "job token mismatch: " + Rank(peer) + " accepted this worker without proving that it holds the "
                   "job token: it is not a worker of this job");
    return Fatal(Code::kFailedPrecondition, Rank(peer) + " broke the handshake protocol (verdict " +
                                                std::to_string(v.status) + "): is it the same prophet_tf version?");
  }
  if (s.stage == Session::kAwaitChallenge) {
    Challenge c;
    std::memcpy(&c, s.in.data(), sizeof(c));
    std::memcpy(s.nonce_a, c.nonce, kNonceBytes);
    const HandshakeParams params{n_, o_.rank, peer};
    uint8_t expected[kMacBytes];
    HandshakeMac(o_.token, HandshakeRole::kAcceptor, params, s.hello.nonce, c.nonce, expected);
    s.acceptor_proved_token = MacEqual(expected, c.mac);
    // The proof goes out even when the acceptor's did not verify: then the acceptor's check fails
    // too, and both sides report the mismatch at once.
    ClientProof proof;
    HandshakeMac(o_.token, HandshakeRole::kConnector, params, s.hello.nonce, c.nonce, proof.mac);
    if (!SendAll(s.fd, &proof, sizeof(proof)))
      return RetryLater(s, "rank " + std::to_string(peer) + " closed the connection during the handshake");
    s.Expect(Session::kAwaitFinal, sizeof(Verdict));
    s.deadline_ns = std::min(deadline_ns_, NowNs() + handshake_ns_);
    if (!s.acceptor_proved_token) {
      // Wait for the acceptor's own verdict (it names the mismatch from its side) briefly.
      s.deadline_ns = std::min(s.deadline_ns, NowNs() + kNsPerSecond);
    }
  }
}

void Bootstrap::AcceptAll(int64_t now) {
  while (true) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof(from);
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {  // EAGAIN, or a connection that went away before we got to it; or no descriptor left
      if (errno == EMFILE || errno == ENFILE) Fatal(Code::kUnavailable, TooManyFiles());
      return;
    }
    size_t pending = 0;
    Session* oldest = nullptr;
    for (Session& s : sessions_) {
      if (s.outgoing || s.fd < 0 || s.stage != Session::kAwaitPrefix) continue;
      pending++;
      if (oldest == nullptr || s.opened_ns < oldest->opened_ns) oldest = &s;
    }
    if (pending >= kMaxPendingIncoming && oldest != nullptr)
      Drop(*oldest, "dropped to make room: more than " + std::to_string(kMaxPendingIncoming) +
                        " connections were waiting to send a handshake");
    sessions_.emplace_back();
    Session& s = sessions_.back();
    s.fd = fd;
    s.outgoing = false;
    s.from = SockaddrString(from);
    s.opened_ns = now;
    s.Expect(Session::kAwaitPrefix, sizeof(HelloPrefix));
    s.deadline_ns = std::min(deadline_ns_, now + handshake_ns_);
  }
}

void Bootstrap::Drop(Session& s, const std::string& why) {
  dropped_++;
  const std::string line = "a connection from " + s.from + " " + why;
  if (first_drop_.empty()) first_drop_ = line;
  if (dropped_ <= kDroppedLogLines) PROPHET_WARN("start-up: dropped %s", line.c_str());
  Close(s);
}

// A connection that speaks the handshake but cannot join this job (another version, world size,
// cluster, heartbeat or job token). Until it has proven the token it is a stranger: it may not
// end this start-up, which goes on waiting for the real peer. It is told why (a misconfigured
// worker then fails at once with the reason), and named in the timeout message if the real peer
// never arrives.
void Bootstrap::Reject(Session& s, const std::string& to_peer, const std::string& what) {
  const Verdict v = MakeVerdict(VerdictStatus::kRejected, to_peer);
  SendAll(s.fd, &v, sizeof(v));
  Close(s);
  const std::string claimed = s.peer >= 0 ? " (claiming rank " + std::to_string(s.peer) + ")" : "";
  PROPHET_WARN("start-up: rejected a connection from %s%s: %s; still waiting for the workers of this job",
               s.from.c_str(), claimed.c_str(), what.c_str());
  if (rejected_.size() < kRejectedNamed) rejected_.push_back(s.from + claimed + ", " + what);
  rejected_total_++;
}

std::string Bootstrap::RejectedMeanwhile() const {
  if (rejected_total_ == 0) return "";
  std::string out = "; rejected meanwhile: ";
  for (size_t i = 0; i < rejected_.size(); ++i) out += (i ? "; " : "") + rejected_[i];
  const int more = rejected_total_ - static_cast<int>(rejected_.size());
  if (more > 0) out += "; and " + std::to_string(more) + " more";
  return out;
}

void Bootstrap::OnIncomingData(Session& s) {
  int err = 0;
  const ReadResult r = ReadUpTo(s.fd, &s.in, s.want, &err);
  if (r == ReadResult::kClosed) {
    if (s.stage == Session::kAwaitPrefix && s.in.empty()) {
      Close(s);  // a port probe (connect, then close): not worth a line
      dropped_++;
      return;
    }
    return Drop(s, "closed during the handshake");
  }
  if (r == ReadResult::kPartial) return;
  const std::string me = "rank " + std::to_string(o_.rank);
  if (s.stage == Session::kAwaitPrefix) {
    HelloPrefix p;
    std::memcpy(&p, s.in.data(), sizeof(p));
    if (p.magic != kFrameMagic) return Drop(s, "sent no prophet_tf handshake (bad magic)");
    if (p.version != kProtocolVersion) {
      return Reject(s,
                    "protocol version " + std::to_string(p.version) + " but " + me + " speaks " +
                        std::to_string(kProtocolVersion) + ": install the same prophet_tf on every worker",
                    "protocol version " + std::to_string(p.version) + ", expected " +
                        std::to_string(kProtocolVersion) + " (install the same prophet_tf on every worker)");
    }
    s.hello.prefix = p;
    s.Expect(Session::kAwaitHello, sizeof(ClientHello) - sizeof(HelloPrefix));
    return;
  }
  if (s.stage == Session::kAwaitHello) {
    std::memcpy(reinterpret_cast<char*>(&s.hello) + sizeof(HelloPrefix), s.in.data(), s.in.size());
    const ClientHello& h = s.hello;
    s.peer = h.rank;
    if (h.world_size != n_)
      return Reject(s,
                    "world size " + std::to_string(h.world_size) + " but " + me + " was started with " +
                        std::to_string(n_) + ": every worker needs the same TF_CONFIG cluster",
                    "world size " + std::to_string(h.world_size) + ", expected " + std::to_string(n_) +
                        " (every worker needs the same TF_CONFIG cluster)");
    if (h.acceptor_rank != o_.rank)
      return Reject(s,
                    "you connected to " + o_.addresses[o_.rank] + " expecting rank " +
                        std::to_string(h.acceptor_rank) + ", but that is " + me +
                        ": the cluster addresses differ between the workers",
                    "it expected rank " + std::to_string(h.acceptor_rank) + " here, this is " + me +
                        " (the cluster addresses differ between the workers)");
    if (h.heartbeat_ms != HeartbeatMs(o_.heartbeat_s))
      return Reject(s,
                    "heartbeat_s " + SecondsString(h.heartbeat_ms / 1e3) + " but " + me + " uses " +
                        SecondsString(o_.heartbeat_s) + ": every worker needs the same heartbeat_s",
                    "heartbeat_s " + SecondsString(h.heartbeat_ms / 1e3) + ", expected " +
                        SecondsString(o_.heartbeat_s) + " (every worker needs the same heartbeat_s)");
    if (h.prefix.flags != o_.path_tag)
      return Reject(s,
                    "push_pulls take " + PathName(h.prefix.flags) + " but " + me + " takes " + PathName(o_.path_tag) +
                        ": every worker needs the same hierarchical setting and sees the same hosts (the same cluster "
                        "addresses, or the same hosts option)",
                    "push_pulls take " + PathName(h.prefix.flags) + ", expected " + PathName(o_.path_tag) +
                        " (every worker needs the same hierarchical setting and the same hosts)");
    if (h.lanes != lanes_)
      return Reject(s,
                    "io_threads " + std::to_string(h.lanes) + " but " + me + " uses " + std::to_string(lanes_) +
                        ": every worker needs the same io_threads",
                    "io_threads " + std::to_string(h.lanes) + ", expected " + std::to_string(lanes_) +
                        " (every worker needs the same io_threads)");
    if (h.lane >= lanes_)
      return Reject(s, "lane " + std::to_string(h.lane) + " does not exist (io_threads " + std::to_string(lanes_) + ")",
                    "lane " + std::to_string(h.lane) + " of " + std::to_string(lanes_));
    s.lane = h.lane;
    if (h.rank <= o_.rank || h.rank >= n_)
      return Reject(s,
                    "rank " + std::to_string(h.rank) + " cannot connect to " + me +
                        " (only higher ranks connect to lower ones): do two workers have the same task index?",
                    "only ranks " + std::to_string(o_.rank + 1) + ".." + std::to_string(n_ - 1) +
                        " connect here (do two workers have the same task index?)");
    Status st = RandomNonce(s.nonce_a);
    if (!st.ok()) return Fatal(st.code(), st.message());
    const Verdict v = MakeVerdict(VerdictStatus::kChallenge);
    Challenge c;
    std::memcpy(c.nonce, s.nonce_a, kNonceBytes);
    HandshakeMac(o_.token, HandshakeRole::kAcceptor, HandshakeParams{n_, h.rank, o_.rank}, h.nonce, s.nonce_a, c.mac);
    std::string out(reinterpret_cast<const char*>(&v), sizeof(v));
    out.append(reinterpret_cast<const char*>(&c), sizeof(c));
    if (!SendAll(s.fd, out.data(), out.size())) return Drop(s, "closed during the handshake");
    s.Expect(Session::kAwaitProof, sizeof(ClientProof));
    s.deadline_ns = std::min(deadline_ns_, NowNs() + handshake_ns_);
    return;
  }
  // kAwaitProof
  ClientProof proof;
  std::memcpy(&proof, s.in.data(), sizeof(proof));
  uint8_t expected[kMacBytes];
  HandshakeMac(o_.token, HandshakeRole::kConnector, HandshakeParams{n_, s.peer, o_.rank}, s.hello.nonce, s.nonce_a,
               expected);
  const std::string who = "rank " + std::to_string(s.peer) + " (from " + s.from + ")";
  if (!MacEqual(expected, proof.mac))
    return Reject(s,
                  "job token mismatch: " + me + " could not verify your proof of the job token; "
                  "PROPHET_JOB_TOKEN must be identical on every worker",
                  "job token mismatch (its PROPHET_JOB_TOKEN differs from this worker's, or it replayed a "
                  "recorded handshake)");
  if (peers_[Slot(s.peer, s.lane)].fd >= 0) {
    // Authenticated, but the rank is taken: keep the first, refuse the second, say so.
    const Verdict v = MakeVerdict(VerdictStatus::kRejected,
                                  "rank " + std::to_string(s.peer) + " is already connected to " + me +
                                      ": do two workers have the same task index?");
    SendAll(s.fd, &v, sizeof(v));
    PROPHET_WARN("start-up: rejected a second connection claiming %s: that rank is already connected "
                 "(two workers with the same task index?)", who.c_str());
    Close(s);
    return;
  }
  const Verdict v = MakeVerdict(VerdictStatus::kAccepted);
  if (!SendAll(s.fd, &v, sizeof(v))) return Drop(s, "closed during the handshake");
  Establish(s);
}

void Bootstrap::Establish(Session& s) {
  peers_[Slot(s.peer, s.lane)].fd = s.fd;
  s.fd = -1;
}

void Bootstrap::SendReady() {
  ready_sent_ = true;
  StartupNotice ready{kStartupNoticeMagic, static_cast<uint8_t>(NoticeKind::kReady), 0, 0};
  for (int r = 0; r < n_; ++r)
    if (peers_[Slot(r, 0)].fd >= 0 && !SendAll(peers_[Slot(r, 0)].fd, &ready, sizeof(ready)))
      Fatal(Code::kUnavailable, Rank(r) + " closed its connection during start-up: that worker exited, crashed "
                                          "or gave up; see its log");
}

void Bootstrap::OnNotice(int peer, int lane) {
  Connected& c = peers_[Slot(peer, lane)];
  int err = 0;
  const size_t want = c.have_header ? sizeof(StartupNotice) + c.header.reason_len : sizeof(StartupNotice);
  const ReadResult r = ReadUpTo(c.fd, &c.in, want, &err);
  if (r == ReadResult::kClosed)
    return Fatal(Code::kUnavailable, Rank(peer) + " closed its connection during start-up" +
                                         (err ? " (" + Errno(err) + ")" : "") +
                                         ": that worker exited, crashed or gave up; see its log");
  if (r == ReadResult::kPartial) return;
  if (!c.have_header) {
    std::memcpy(&c.header, c.in.data(), sizeof(StartupNotice));
    // kReady comes on lane 0 only; kAbort on every lane connected (Failed).
    if (c.header.magic != kStartupNoticeMagic || c.header.reason_len > kMaxNoticeReasonBytes ||
        !((lane == 0 && c.header.kind == static_cast<uint8_t>(NoticeKind::kReady)) ||
          c.header.kind == static_cast<uint8_t>(NoticeKind::kAbort)))
      return Fatal(Code::kInternal, Rank(peer) + " sent an invalid start-up notice on lane " + std::to_string(lane));
    c.have_header = true;
    if (c.header.reason_len > 0) return OnNotice(peer, lane);  // the reason may already be here
  }
  if (c.header.kind == static_cast<uint8_t>(NoticeKind::kAbort)) {
    const std::string reason = c.in.substr(sizeof(StartupNotice));
    const Code code = c.header.code == static_cast<uint8_t>(Code::kDeadlineExceeded) ? Code::kDeadlineExceeded
                      : c.header.code == static_cast<uint8_t>(Code::kFailedPrecondition) ? Code::kFailedPrecondition
                                                                                         : Code::kUnavailable;
    return Fatal(code, "the start-up of the job failed on rank " + std::to_string(peer) + ": " + reason);
  }
  c.ready = true;
}

void Bootstrap::Expire(int64_t now) {
  for (Session& s : sessions_) {
    if (s.fd < 0 || now < s.deadline_ns) continue;
    if (!s.outgoing) {
      Drop(s, "sent no complete handshake within " + SecondsString(o_.handshake_timeout_s));
      continue;
    }
    if (s.stage == Session::kConnecting) {
      // The attempt's own limit, or less when the job's connect deadline cut it short.
      RetryLater(s, "no answer to the connection request within " +
                        SecondsString(static_cast<double>(s.deadline_ns - s.opened_ns) / kNsPerSecond) +
                        " (packets dropped: a firewall, a wrong address, or the host is down)");
    } else if (s.stage == Session::kAwaitFinal && !s.acceptor_proved_token) {
      Close(s);
      Fatal(Code::kFailedPrecondition,
            "job token mismatch: " + Rank(s.peer) + " could not prove that it holds this job's token: "
            "PROPHET_JOB_TOKEN must be identical on every worker (or that address is not a worker of this job)");
    } else {
      RetryLater(s, "the connection was accepted but rank " + std::to_string(s.peer) +
                        " did not complete the handshake within " + SecondsString(o_.handshake_timeout_s) +
                        " (a stopped or hung process, or not a prophet_tf worker)");
    }
  }
}

// What start-up is still waiting for, e.g. for the timeout message or the progress log.
std::string Bootstrap::Waiting(bool final) const {
  std::string out;
  auto add = [&](const std::string& part) { out += (out.empty() ? "" : "; ") + part; };
  const std::string within = final ? " within " + SecondsString(o_.connect_timeout_s) : " yet";
  for (int r = 0; r < o_.rank; ++r) {
    if (FullyConnected(r)) continue;
    int lane = 0;
    while (peers_[Slot(r, lane)].fd >= 0) ++lane;
    const Dialled& d = dialled_[Slot(r, lane)];
    add("could not connect to " + Rank(r) + within + " (" + std::to_string(d.attempts) + (d.attempts == 1 ? " attempt" : " attempts") +
        (d.last_problem.empty() ? "" : "; last problem: " + d.last_problem) +
        "): is that worker started, with the same TF_CONFIG, and reachable?");
  }
  std::string missing;
  for (int r = o_.rank + 1; r < n_; ++r)
    if (!FullyConnected(r)) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  if (!missing.empty())
    add("rank(s) " + missing + " did not connect to this worker (" + o_.addresses[o_.rank] + ")" + within +
        ": are they started with the same TF_CONFIG and PROPHET_JOB_TOKEN?" + RejectedMeanwhile());
  if (out.empty()) {
    std::string unready;
    for (int r = 0; r < n_; ++r)
      if (r != o_.rank && !peers_[Slot(r, 0)].ready) unready += (unready.empty() ? "" : ", ") + std::to_string(r);
    add("every worker connected to this one, but rank(s) " + unready + " did not finish connecting to the others" +
        within + " (see their logs)");
  }
  return out;
}

void Bootstrap::LogDropped() const {
  if (dropped_ > kDroppedLogLines)
    PROPHET_WARN("start-up: dropped %d connections in all that were not workers of this job (the first: %s)",
                 dropped_, first_drop_.c_str());
}

Status Bootstrap::Failed(const Status& status) {
  // Tell the connected peers why, so that they fail now too instead of at their deadline.
  const std::string reason = status.message().substr(0, kMaxNoticeReasonBytes);
  StartupNotice abort{kStartupNoticeMagic, static_cast<uint8_t>(NoticeKind::kAbort),
                      static_cast<uint8_t>(status.code()), static_cast<uint16_t>(reason.size())};
  std::string notice(reinterpret_cast<const char*>(&abort), sizeof(abort));
  notice += reason;
  // Before this worker's kReady also on lanes 1 and up, which its peers read until they send
  // theirs: one that does not hold lane 0 yet hears it there. After, a peer's engine may already
  // be reading those lanes, and lane 0 is held everywhere.
  for (size_t i = 0; i < peers_.size(); ++i) {
    Connected& c = peers_[i];
    if (c.fd < 0) continue;
    if (i < static_cast<size_t>(n_) || !ready_sent_) SendAll(c.fd, notice.data(), notice.size());
    ::close(c.fd);
    c.fd = -1;
  }
  // Connectors in the middle of their handshake, or still in the listen queue, hear it too.
  if (listen_fd_ >= 0) AcceptAll(NowNs());
  const Verdict v = MakeVerdict(VerdictStatus::kAborted, status.message());
  for (Session& s : sessions_) {
    if (s.fd >= 0 && !s.outgoing) SendAll(s.fd, &v, sizeof(v));
    Close(s);
  }
  LogDropped();
  return status;
}

Status Bootstrap::Run(std::vector<int>* fds) {
  std::vector<pollfd> pfds;
  std::vector<Session*> owners;  // parallel to pfds: the session, or nullptr
  std::vector<int> notice_peer;  // parallel to pfds: the connected peer's slot (peer and lane), or -1
  while (true) {
    int64_t now = NowNs();
    if (!fatal_.ok()) return Failed(fatal_);
    if (!ready_sent_ && AllConnected()) SendReady();
    if (!fatal_.ok()) return Failed(fatal_);
    if (ready_sent_ && AllReady()) break;
    if (now >= deadline_ns_) return Failed(Status(Code::kDeadlineExceeded, Waiting(true)));
    if (now >= next_progress_ns_) {
      PROPHET_WARN("start-up: still waiting after %.0f s (connect_timeout_s %s): %s", (now - start_ns_) / 1e9,
                   SecondsString(o_.connect_timeout_s).c_str(), Waiting(false).c_str());
      next_progress_ns_ = now + kProgressLogNs;
    }
    for (int l = 0; l < lanes_; ++l)
      for (int r = 0; r < o_.rank; ++r) {
        if (peers_[Slot(r, l)].fd >= 0 || now < dialled_[Slot(r, l)].next_attempt_ns) continue;
        const bool dialling = std::any_of(sessions_.begin(), sessions_.end(), [r, l](const Session& s) {
          return s.fd >= 0 && s.outgoing && s.peer == r && s.lane == l;
        });
        if (!dialling) Dial(r, l, now);
      }
    if (!fatal_.ok()) continue;
    sessions_.remove_if([](const Session& s) { return s.fd < 0; });

    pfds.clear();
    owners.clear();
    notice_peer.clear();
    int64_t wake_ns = std::min(deadline_ns_, now + kPollSliceMs * 1000000);
    if (listen_fd_ >= 0) {
      pfds.push_back({listen_fd_, POLLIN, 0});
      owners.push_back(nullptr);
      notice_peer.push_back(-1);
    }
    for (Session& s : sessions_) {
      pfds.push_back({s.fd, static_cast<short>(s.stage == Session::kConnecting ? POLLOUT : POLLIN), 0});
      owners.push_back(&s);
      notice_peer.push_back(-1);
      wake_ns = std::min(wake_ns, s.deadline_ns);
    }
    for (int r = 0; r < n_; ++r) {
      // A peer that is ready may already be sending the engine's frames: leave them unread. Its
      // kReady comes on lane 0. Until this worker has sent its own kReady, no peer can have
      // finished start-up, so none sends an engine frame yet: lanes 1 and up carry nothing but
      // an abort (or their close), which is how a peer that fails before this worker holds its
      // lane 0 is heard at once. Lanes 1 and up first: a peer that fails sends its abort there
      // before it closes a lane 0 still in its handshake, whose close says less.
      for (int l = ready_sent_ ? 0 : lanes_ - 1; l >= 0; --l) {
        const Connected& c = peers_[Slot(r, l)];
        if (c.fd < 0 || c.ready) continue;
        pfds.push_back({c.fd, POLLIN, 0});
        owners.push_back(nullptr);
        notice_peer.push_back(static_cast<int>(Slot(r, l)));
      }
    }
    for (int l = 0; l < lanes_; ++l)
      for (int r = 0; r < o_.rank; ++r)
        if (peers_[Slot(r, l)].fd < 0) wake_ns = std::min(wake_ns, std::max(now, dialled_[Slot(r, l)].next_attempt_ns));
    const int timeout_ms = static_cast<int>(std::max<int64_t>(0, (wake_ns - now + 999999) / 1000000));
    const int ready = ::poll(pfds.data(), pfds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) return Failed(Status(Code::kInternal, "poll(): " + Errno(errno)));
    now = NowNs();
    for (size_t i = 0; ready > 0 && i < pfds.size() && fatal_.ok(); ++i) {
      if (pfds[i].revents == 0) continue;
      if (notice_peer[i] >= 0) {
        OnNotice(notice_peer[i] % n_, notice_peer[i] / n_);
        continue;
      }
      Session* s = owners[i];
      if (s == nullptr) {
        AcceptAll(now);
        continue;
      }
      if (s->fd < 0) continue;  // closed by an earlier event of this round
      if (s->stage == Session::kConnecting) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) {
          OnConnected(*s);
        } else {
          const int peer = s->peer, lane = s->lane;
          Close(*s);
          OnConnectFailed(peer, lane, err);
        }
      } else if (s->outgoing) {
        OnOutgoingData(*s);
      } else {
        OnIncomingData(*s);
      }
    }
    if (fatal_.ok()) Expire(NowNs());
  }
  LogDropped();
  for (Session& s : sessions_) Close(s);
  fds->assign(peers_.size(), -1);
  for (size_t i = 0; i < peers_.size(); ++i) (*fds)[i] = peers_[i].fd;
  return Status::OK();
}

int OpenListener(const sockaddr_storage& addr, int* err) {
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    // The IPv6 wildcard also takes IPv4 connections.
    if (IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  }
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), SockaddrLen(addr)) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  SetNonBlocking(fd);
  return fd;
}

}  // namespace

Status ParseAddress(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size())
    return Status(Code::kInvalidArgument,
                  "address '" + address + "' has no port; expected host:port, e.g. 10.0.0.1:2222");
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  char* end = nullptr;
  const long p = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535)
    return Status(Code::kInvalidArgument, "address '" + address + "' has an invalid port; expected 1-65535");
  *port = static_cast<int>(p);
  if (host->empty()) return Status(Code::kInvalidArgument, "address '" + address + "' has no host");
  return Status::OK();
}

void TuneSocket(int fd, int send_buffer_bytes, int receive_buffer_bytes, int unsent_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (send_buffer_bytes > 0) ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &send_buffer_bytes, sizeof(send_buffer_bytes));
  if (receive_buffer_bytes > 0)
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &receive_buffer_bytes, sizeof(receive_buffer_bytes));
  // Writes stop, and EPOLLOUT waits, while the socket holds this much that TCP has not sent; the
  // bytes in flight are TCP's to size. What is queued behind stays in the engine's priority-ordered
  // queue, where a more urgent frame can still overtake it.
  if (unsent_bytes > 0) ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &unsent_bytes, sizeof(unsent_bytes));
  // Detect a peer whose host vanished without closing the connection.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

Status Listen(const BootstrapOptions& o, int* listen_fd) {
  std::string host;
  int port = 0;
  Status s = ParseAddress(o.addresses[o.rank], &host, &port);
  if (!s.ok()) return s;
  const std::string where = "rank " + std::to_string(o.rank) + ", address " + o.addresses[o.rank];
  const bool chosen = !o.bind_host.empty();
  std::vector<sockaddr_storage> candidates;
  s = ResolveAll(chosen ? o.bind_host : host, port, /*passive=*/true, &candidates);
  if (!s.ok() && chosen)
    return Status(Code::kInvalidArgument, "bind_host (PROPHET_BIND_HOST) '" + o.bind_host + "': " + s.message());
  int err = 0;
  int fd = -1;
  std::string tried;
  for (const sockaddr_storage& a : candidates) {
    fd = OpenListener(a, &err);
    if (fd >= 0) break;
    tried += (tried.empty() ? "" : ", ") + SockaddrString(a);
    if (err != EADDRNOTAVAIL) break;
  }
  if (fd < 0 && !chosen && (!s.ok() || err == EADDRNOTAVAIL)) {
    // Kubernetes and other NATed set-ups name a worker by an address the worker itself cannot own
    // (a Service); its peers reach it through that name while it listens on its own interfaces.
    PROPHET_WARN("%s: '%s' %s, so this worker listens on every interface (port %d) instead; peers are still "
                 "authenticated by the job token. Set PROPHET_BIND_HOST (runtime option bind_host) to this machine's "
                 "own address (e.g. the pod IP) to listen on that one only.",
                 where.c_str(), host.c_str(),
                 s.ok() ? ("resolves to " + tried + ", which is not an address of this machine").c_str()
                        : ("does not resolve here (" + s.message() + ")").c_str(),
                 port);
    sockaddr_storage any{};
    auto* in6 = reinterpret_cast<sockaddr_in6*>(&any);
    in6->sin6_family = AF_INET6;
    in6->sin6_addr = in6addr_any;
    in6->sin6_port = htons(static_cast<uint16_t>(port));
    fd = OpenListener(any, &err);
    if (fd < 0 && err == EAFNOSUPPORT) {  // a host without IPv6
      sockaddr_storage any4{};
      auto* in4 = reinterpret_cast<sockaddr_in*>(&any4);
      in4->sin_family = AF_INET;
      in4->sin_addr.s_addr = htonl(INADDR_ANY);
      in4->sin_port = htons(static_cast<uint16_t>(port));
      fd = OpenListener(any4, &err);
    }
  }
  if (fd >= 0) {
    *listen_fd = fd;
    return Status::OK();
  }
  if (err == EADDRINUSE)
    return Status(Code::kUnavailable,
                  "port " + std::to_string(port) + " (" + where +
                      ") is already in use: another process holds it (a stale worker? see `ss -ltnp "
                      "'sport = :" + std::to_string(port) + "'`); stop it or choose another port in TF_CONFIG");
  if (err == EADDRNOTAVAIL)
    return Status(Code::kInvalidArgument, "cannot listen on bind_host (PROPHET_BIND_HOST) '" + o.bind_host +
                                              "' (" + tried + "): it is not an address of this machine");
  return Status(Code::kUnavailable, "cannot listen on " + (tried.empty() ? host : tried) + " port " +
                                        std::to_string(port) + " (" + where + "): " + Errno(err));
}

Status ConnectAll(const BootstrapOptions& o, int listen_fd, std::vector<int>* fds) {
  Bootstrap bootstrap(o, listen_fd);
  Status s = bootstrap.Run(fds);
  ::close(listen_fd);
  if (!s.ok()) {
    fds->assign(static_cast<size_t>(o.world_size) * std::max(o.lanes, 1), -1);
    return s;
  }
  for (int fd : *fds)
    if (fd >= 0) TuneSocket(fd, o.send_buffer_bytes, o.receive_buffer_bytes, o.socket_unsent_bytes);
  return Status::OK();
}

int64_t KernelMaxSendBufferBytes() {
  std::ifstream in("/proc/sys/net/core/wmem_max");
  int64_t bytes = 0;
  if (!(in >> bytes) || bytes < 0) return 0;
  return bytes;
}

}  // namespace prophet
