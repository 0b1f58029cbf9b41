// The engine's settings: every option defined once (engine_options.def), parsed from the C API's
// "key=value" lines and described to the Python package, which derives its own from that table.
#ifndef PROPHET_OPS_CORE_ENGINE_OPTIONS_H_
#define PROPHET_OPS_CORE_ENGINE_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/hosts.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/scheduler.h"

namespace prophet {

// The smallest socket_buffer_bytes accepted other than kSocketBufferAuto and 0.
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
// io_threads at most: one lane per core of a large host.
constexpr int kMaxIoThreads = 16;
// io_threads = kIoThreadsAuto: kAutoLanes lanes connected where the job spans several hosts
// (ResolveLanes), of which the start-up probe uses what the link needs: 8 keep pace with 100 Gbit/s
// at the CPU cost per byte measured on the machine of docs/benchmarks.md (lanes_for: 9 at its
// 0.54 ns per byte).
constexpr int kIoThreadsAuto = 0;
constexpr int kAutoLanes = 8;
// A push_pull of at least io_threads x this travels in slices, one per lane (engine.h). Small enough
// that most of a model's gradients are cut at 7 lanes (predicted ResNet50 at 100 Gbit/s, N = 8:
// 22.7 ms a step against 32.4 with 1 MiB), large enough that a slice is a few frames.
constexpr uint64_t kMinLaneSliceBytes = uint64_t{256} << 10;
// The bytes from which a push_pull of `element_size`-byte elements on `world_size` workers travels
// in slices over `lanes` lanes (0: never; one lane never slices): at least lanes x
// kMinLaneSliceBytes, and each slice at least world_size x kDefaultMinSplitBytes, so that
// MakePartitions still spreads every slice over every owner. Each lane cuts its slice on its own
// and the slices keep the tensor's name, so a slice below that became one partition on the same
// owner as its siblings: that owner received the whole tensor from every peer (predicted at
// N = 64, 25 Gbit/s, 3 lanes: ResNet50 387.7 ms a step against 71.1 unsliced).
uint64_t LaneSliceFromBytes(int lanes, int world_size);
// Whether a push_pull of `bytes` travels in slices (LaneSliceFromBytes; whole elements).
bool TravelsInSlices(uint64_t bytes, uint64_t element_size, int lanes, int world_size);
// The first element of `lane`'s slice of `elements` over `lanes` lanes (equal element counts;
// lane == lanes gives `elements`).
inline uint64_t LaneSliceStart(uint64_t elements, int lane, int lanes) {
  return elements * static_cast<uint64_t>(lane) / static_cast<uint64_t>(lanes);
}

// The byte credit a setting gives on `world_size` workers. Why it grows with N: a push's credit
// returns when its last byte is in the socket, and a socket holds about 1/(N-1) of what TCP
// queues below a host's sockets (simulator.h, KernelSendBufferBytes), so a push of
// partition_bytes holds its credit while the sockets ahead of it drain. A fixed 16 MiB kept
// only 4 pushes of 4 MiB going at once: VGG16 at N = 16 and 100 Gbit/s took 113 ms per step
// instead of 90 (predicted). One partition per peer keeps every connection busy; released
// pushes still wait in each connection's priority-ordered queue, where a more urgent frame
// overtakes them.
uint64_t ResolveCreditBytes(uint64_t setting, int world_size, uint64_t partition_bytes);

using Strings = std::vector<std::string>;

// What an option accepts beyond what its type does (engine_options.def): numbers at least (or
// above) a bound, and a few values outside it that mean something of their own; text one of a
// list of names.
struct Accepts {
  bool bounded = false;
  double bound = 0;
  bool bound_excluded = false;  // above `bound`, not at least
  static constexpr int kMaxSpecials = 2;
  int specials = 0;
  double special_value[kMaxSpecials] = {};
  const char* special_means[kMaxSpecials] = {};
  const char* const* names = nullptr;
  int name_count = 0;

  constexpr Accepts AtLeast(double b) const {
    Accepts a = *this;
    a.bounded = true, a.bound = b, a.bound_excluded = false;
    return a;
  }
  constexpr Accepts Above(double b) const {
    Accepts a = AtLeast(b);
    a.bound_excluded = true;
    return a;
  }
  constexpr Accepts Or(double value, const char* means) const {
    Accepts a = *this;
    a.special_value[a.specials] = value;
    a.special_means[a.specials] = means;
    ++a.specials;
    return a;
  }
  template <size_t N>
  constexpr Accepts OneOf(const char* const (&list)[N]) const {
    Accepts a = *this;
    a.names = list, a.name_count = static_cast<int>(N);
    return a;
  }
};

// Who sets an option (engine_options.def): kJob, the job's identity (the launcher or the cluster
// gives it); kUser, a user's setting; kPredicted, also modelled by the predictor.
enum OptionUse : unsigned { kJob = 1u, kUser = 2u, kPredicted = 4u };

struct EngineOptions {
#define PROPHET_OPTION(TYPE, NAME, DEFAULT, ACCEPTS, USE, ENV, DOC) TYPE NAME = DEFAULT;
#include "ops/core/engine_options.def"
#undef PROPHET_OPTION
  // Small control collectives by recursive doubling (small_allreduce.h): kSmallAllreduceAuto, the
  // default, where it is predicted faster (ExchangesThis). Not a user setting (no row of
  // engine_options.def): kSmallAllreduceNever (the owner path for every tensor) and
  // kSmallAllreduceAlways (every uncompressed tensor below N x 64 KiB that one frame carries) let
  // the C++ tests and benchmark run both paths side by side. Every worker of a job must agree.
  enum SmallAllreduceMode { kSmallAllreduceNever, kSmallAllreduceAuto, kSmallAllreduceAlways };
  SmallAllreduceMode small_allreduce = kSmallAllreduceAuto;
};

// Parses "key=value" lines (the C API's configuration string): each key an option of
// engine_options.def, its value checked against what the option accepts; then the options
// together (rank within world_size, an address per worker, a token or allow_no_token, ...).
// Unknown keys are errors. Options not named keep their value in `options`.
Status ParseEngineOptions(const std::string& text, EngineOptions* options);

// One option by its key, as ParseEngineOptions does for each line (the predictor parses the
// options it models with it).
Status ParseEngineOption(const std::string& key, const std::string& value, EngineOptions* options);

// The OptionUse bits of option `key`; 0 if the engine has no such option.
unsigned EngineOptionUse(const std::string& key);

// Every option's value, as one JSON object by key ({"rank": 0, ..., "addresses": [...], ...}).
std::string EngineOptionsJson(const EngineOptions& options);

// What the Python package reads instead of keeping copies, as one JSON object: the schedule
// names, the compressions, the control-priority band, the protocol version, and the option table
// ("options": one object per row of engine_options.def: name, type, default, accepts (the text
// the errors use), specials, choices, use, predicted, env, doc).
std::string RuntimeConstantsJson();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_OPTIONS_H_
