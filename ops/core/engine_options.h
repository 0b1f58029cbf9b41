// The engine's settings: their defaults (the one home every other layer, Python included, reads),
// and parsing them from the C API's "key=value" lines.
#ifndef PROPHET_OPS_CORE_ENGINE_OPTIONS_H_
#define PROPHET_OPS_CORE_ENGINE_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/hosts.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/scheduler.h"

namespace prophet {

// The smallest socket_buffer_bytes accepted (see ParseEngineOptions).
constexpr int kMinSocketBufferBytes = 128 << 10;
// socket_buffer_bytes = kSocketBufferAuto (the default): each connection's send buffer is sized
// for the workers (SendBufferRequest), receive buffers are the kernel's.
constexpr int kSocketBufferAuto = -1;
// With kSocketBufferAuto and 3 or more workers, what a worker lets the kernel hold below all its
// sockets together (unsent, queued in the host, in flight), and at least this per connection.
constexpr int64_t kSocketBudgetBytes = int64_t{4} << 20;
constexpr int64_t kMinAutoSendBufferBytes = int64_t{512} << 10;

// The SO_SNDBUF request for each of a worker's connections (0: leave it to the kernel's
// autotuning) for a socket_buffer_bytes setting on `world_size` workers, where the kernel caps a
// request at `wmem_max` (net.core.wmem_max; <= 0: unknown). An explicit size is itself. Auto: with
// 2 workers the autotuning, whose limit (net.ipv4.tcp_wmem's maximum, 4 MiB by default) is already
// the budget; with N >= 3, max(kMinAutoSendBufferBytes, kSocketBudgetBytes / (N - 1)), halved
// because Linux doubles a request. Why: bytes in the kernel leave in the order written, and TCP
// small queues let each socket keep about 1 ms of its own rate below it, up to
// tcp_limit_output_bytes (4 MiB on Linux 6.6+): with N - 1 sockets each autotuned up to 4 MiB, the
// next step's most urgent push and sum waited behind (N - 1) x 4 MiB, 1 ms of a 100 Gbit/s link
// (predicted ResNet50 on 100 TFLOP/s accelerators: 17.3 -> 15.8 ms at N = 4, 17.6 -> 15.9 at 8,
// 18.3 -> 16.9 at 16; slower links do not fill the sockets and do not change). Autotuning where
// the kernel would cap the request (a fixed buffer smaller than intended would limit every flow
// to buffer / round trip).
int SendBufferRequest(int setting, int world_size, int64_t wmem_max);

// credit_bytes = kCreditAuto: max(kMinCreditBytes, (N - 1) x partition_bytes) (ResolveCreditBytes).
constexpr uint64_t kCreditAuto = 0;
constexpr uint64_t kMinCreditBytes = 16u << 20;

// The byte credit a setting gives on `world_size` workers. Why it grows with N: a push's credit
// returns when its last byte is in the socket, and a socket holds about 1/(N-1) of what TCP
// queues below a host's sockets (simulator.h, KernelSendBufferBytes), so a push of
// partition_bytes holds its credit while the sockets ahead of it drain. A fixed 16 MiB kept
// only 4 pushes of 4 MiB going at once: VGG16 at N = 16 and 100 Gbit/s took 113 ms per step
// instead of 90 (predicted). One partition per peer keeps every connection busy; released
// pushes still wait in each connection's priority-ordered queue, where a more urgent frame
// overtakes them.
uint64_t ResolveCreditBytes(uint64_t setting, int world_size, uint64_t partition_bytes);

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> addresses;
  std::string token;
  bool allow_no_token = false;      // a multi-worker job without a token only if the user said so
  std::string bind_host;            // see BootstrapOptions::bind_host
  std::string schedule = kDefaultSchedule;  // one of kScheduleNames
  // Tensors are cut into partitions of at most this size. kPartitionAuto: the schedule's
  // (schedule_traits.h: 4 MiB for prophet, priority and fifo; ByteScheduler's and P3's own).
  uint64_t partition_bytes = kPartitionAuto;
  // Bytes of released pushes that have not left this worker yet (their last byte is not in the
  // socket). kCreditAuto: the schedule's (bytescheduler: its credit on sums), else ResolveCreditBytes
  // from N and partition_bytes (ResolveScheduleCreditBytes).
  uint64_t credit_bytes = kCreditAuto;
  double replan_threshold = kDefaultReplanThreshold;  // prophet policy
  double timeout_s = 60.0;          // an operation not finished by then fails on this worker
  double connect_timeout_s = 60.0;  // bootstrap
  // > 0: a peer from which nothing arrived for this long is declared lost (a stopped or frozen
  // process), long before timeout_s. Every worker must use the same value (checked at start-up).
  double heartbeat_s = 0.0;
  // SO_SNDBUF / SO_RCVBUF of every connection. 0 leaves both to the kernel's autotuning, which
  // sizes them for the bandwidth-delay product of each link (a fixed size caps a long fat link);
  // kSocketBufferAuto sizes the send buffers for the workers (SendBufferRequest); a size sets both.
  int socket_buffer_bytes = kSocketBufferAuto;  // kSocketBufferAuto, 0, or at least kMinSocketBufferBytes
  // TCP_NOTSENT_LOWAT of every connection: how much a socket holds that TCP has not sent yet
  // (0: no limit). Bytes handed to the kernel leave in the order written, so everything it holds
  // goes before a more urgent gradient written later; this keeps that small, while the bytes in
  // flight (the congestion window) stay TCP's to size.
  int socket_unsent_bytes = 256 << 10;
  // Memory for frames whose operation this worker has not submitted yet (a faster peer's
  // partitions, a broadcast to a worker that starts late), and the most one allgather
  // contribution may hold. Beyond it the operation fails everywhere and the sender is dropped.
  uint64_t max_early_bytes = uint64_t{4} << 30;
  std::string timeline_path;        // empty: no timeline
  // The two-level push_pull (two_level.h): sum on each host first, then across hosts, so the
  // network carries each host's share once. Off by default; auto takes it when the job spans
  // several hosts and some host has several workers (hosts.h). Every worker must use the same
  // (checked at start-up).
  Hierarchy hierarchical = Hierarchy::kOff;
  // One host label per rank, ranks with equal labels sharing a host. Empty: the host part of each
  // address (workers whose addresses name the same host share it).
  std::vector<std::string> hosts;
  // Small control collectives by recursive doubling (small_allreduce.h): kSmallAllreduceAuto, the
  // default, where it is predicted faster (ExchangesThis). Not a user setting (no key of
  // ParseEngineOptions): kSmallAllreduceNever (the owner path for every tensor) and
  // kSmallAllreduceAlways (every uncompressed tensor below N x 64 KiB that one frame carries) let
  // the C++ tests and benchmark run both paths side by side. Every worker of a job must agree.
  enum SmallAllreduceMode { kSmallAllreduceNever, kSmallAllreduceAuto, kSmallAllreduceAlways };
  SmallAllreduceMode small_allreduce = kSmallAllreduceAuto;
};

// Parses "key=value" lines (the C API's configuration string). Unknown keys are errors.
Status ParseEngineOptions(const std::string& text, EngineOptions* options);

// What the Python package reads instead of keeping copies: the schedule names, the default of
// every tunable option, and the control-priority band, as one JSON object.
std::string RuntimeConstantsJson();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_OPTIONS_H_
