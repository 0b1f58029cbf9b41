// Connection set-up between the workers of one job.
//
// Every pair of ranks shares one persistent TCP connection per engine lane (BootstrapOptions::lanes,
// usually one): the higher rank connects to the lower rank's listening port (retrying until the
// deadline, since peers start at different times) and both authenticate with the job token
// (handshake.h). One thread runs the whole start-up with
// non-blocking sockets: connection attempts, any number of incoming handshakes at once (each with
// a short deadline, so idle or garbage connections cannot starve the real peers), and the final
// exchange that tells every worker that the whole job has formed.
//
// Nothing a connection sends before it has proven the job token ends or stalls start-up: an
// incoming connection that cannot join this job (another protocol version, world size, cluster
// description or heartbeat, a job token that does not verify, a replayed handshake) is rejected
// and told why, and the worker goes on waiting for the real peer; if that one has not come by
// `connect_timeout_s`, the error names what was rejected meanwhile. The connecting side trusts
// the answer of the address it dialled (its own cluster description names it): a worker that is
// rejected fails at once with the reason, so a misconfigured worker still stops at once.
// What ends start-up early, on every worker it reaches:
//  - a rejection by the peer this worker dialled, or a peer it dialled that cannot prove the
//    token;
//  - a peer seen during this start-up that goes away (its connection closes, or its port that
//    accepted a connection now refuses): it exited or crashed;
//  - a kAbort notice from a connected (authenticated) peer whose own start-up failed.
// Peers never seen (connections refused, no answer) are retried until `connect_timeout_s`: they
// may simply not be started yet; a progress line every 10 s names them and the last problem.
// Connections that send garbage or nothing are dropped and logged; they do not end start-up.
#ifndef PROPHET_OPS_CORE_TRANSPORT_H_
#define PROPHET_OPS_CORE_TRANSPORT_H_

#include <string>
#include <vector>

#include "ops/core/common.h"

namespace prophet {

struct BootstrapOptions {
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> addresses;  // "host:port" per rank
  std::string token;                   // job token; peers must prove they hold the same one
  // Address to listen on instead of the host of addresses[rank] (the port stays). Empty: that
  // host, or every interface if it is not an address of this machine (see Listen).
  std::string bind_host;
  double connect_timeout_s = 60.0;
  double handshake_timeout_s = 5.0;    // per connection: idle connections are dropped after it
  double heartbeat_s = 0.0;            // the engine's; peers must use the same (checked here)
  // Socket options of the data connections (engine_options.def has the defaults and says why);
  // 0 leaves each to the kernel.
  int send_buffer_bytes = 0;           // SO_SNDBUF
  int receive_buffer_bytes = 0;        // SO_RCVBUF
  int socket_unsent_bytes = 0;         // TCP_NOTSENT_LOWAT
  // The path push_pulls take (hosts.h, PathTag: 0 flat, else a digest of the hosts): carried in
  // the hello's flags; peers must use the same (checked here).
  uint16_t path_tag = 0;
  // Connections per pair of workers, one per engine lane (EngineOptions::io_threads); peers must
  // use the same (checked here). kReady travels on lane 0; kAbort on every lane held until this
  // worker has sent its kReady (handshake.h).
  int lanes = 1;
};

// Splits "host:port"; accepts "[v6]:port".
Status ParseAddress(const std::string& address, std::string* host, int* port);

// Opens the listener for this rank, on the host of addresses[rank] (or `bind_host`). Kept
// separate so that "port in use" is reported at once. When the configured host is not an address
// of this machine (EADDRNOTAVAIL: e.g. a Kubernetes Service name, whose address belongs to no
// pod) or does not resolve yet, and no bind_host was given, it listens on every interface instead
// and logs a warning saying so and how to choose (the handshake still authenticates every peer).
Status Listen(const BootstrapOptions& options, int* listen_fd);

// Connects every pair (`lanes` times) and waits until every worker of the job is connected to
// every other. On success `fds[lane * world_size + r]` is the connected, non-blocking, TCP_NODELAY
// socket to rank r on that lane (and -1 for this rank). Closes `listen_fd`.
Status ConnectAll(const BootstrapOptions& options, int listen_fd, std::vector<int>* fds);

// Socket options used on every data connection.
void TuneSocket(int fd, int send_buffer_bytes, int receive_buffer_bytes, int unsent_bytes);

// net.core.wmem_max, the kernel's cap on an SO_SNDBUF request; 0 when it cannot be read.
int64_t KernelMaxSendBufferBytes();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_TRANSPORT_H_
