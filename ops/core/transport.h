// Connection set-up between the workers of one job.
//
// Every pair of ranks shares one persistent TCP connection: the higher rank connects to the lower
// rank's listening port (retrying until the deadline, since peers start at different times), sends
// a Hello with its rank, the world size, the protocol version and a hash of the job token, and the
// lower rank answers. A connection that fails the handshake is logged and dropped; the listener
// keeps waiting for the right peer, so a port scanner or a worker of another job cannot crash it.
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
  std::string token;                   // job token; peers must present the same one
  double connect_timeout_s = 60.0;
  int socket_buffer_bytes = 4 << 20;   // SO_SNDBUF / SO_RCVBUF; 0 keeps the kernel's autotuning
};

// Splits "host:port"; accepts "[v6]:port".
Status ParseAddress(const std::string& address, std::string* host, int* port);

// Opens the listener for this rank. Kept separate so that "port in use" is reported at once.
Status Listen(const BootstrapOptions& options, int* listen_fd);

// Connects every pair. On success `fds[r]` is the connected, non-blocking, TCP_NODELAY socket to
// rank r (and -1 for this rank). Closes `listen_fd`.
Status ConnectAll(const BootstrapOptions& options, int listen_fd, std::vector<int>* fds);

// Socket options used on every data connection.
void TuneSocket(int fd, int buffer_bytes);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_TRANSPORT_H_
