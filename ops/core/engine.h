// The communication engine: one background thread owns every socket of the job.
//
// Op kernels call Submit() and return; the engine matches each request with the same request on
// the other workers by `name#round` (round = how many times this worker submitted that name
// before), moves the bytes, sums them at each partition's owner and calls `done` on its own
// thread. Requests may be submitted in any order on different workers.
#ifndef PROPHET_OPS_CORE_ENGINE_H_
#define PROPHET_OPS_CORE_ENGINE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/scheduler.h"
#include "ops/core/timeline.h"

namespace prophet {

struct EngineOptions {
  int rank = 0;
  int world_size = 1;
  std::vector<std::string> addresses;
  std::string token;
  std::string schedule = "priority";
  uint64_t partition_bytes = 4u << 20;
  uint64_t credit_bytes = 16u << 20;
  double replan_threshold = 0.2;    // prophet policy
  double timeout_s = 60.0;          // an operation not finished by then fails on this worker
  double connect_timeout_s = 60.0;  // bootstrap
  int socket_buffer_bytes = 4 << 20;
  std::string timeline_path;        // empty: no timeline
};

// Parses "key=value" lines (the C API's configuration string). Unknown keys are errors.
Status ParseEngineOptions(const std::string& text, EngineOptions* options);

enum class OpKind { kPushPull = 0, kBroadcast = 1, kAllgather = 2 };
const char* OpKindName(OpKind kind);

// Every worker's tensor for an allgather, valid only during the `done` callback.
struct GatherResult {
  std::vector<std::vector<int64_t>> shapes;  // by rank
  std::vector<const char*> data;
  std::vector<uint64_t> bytes;
};

struct OpRequest {
  OpKind kind = OpKind::kPushPull;
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  const void* input = nullptr;
  void* output = nullptr;  // same size as input; may alias it (unused by allgather)
  uint64_t bytes = 0;
  int64_t priority = 0;
  bool average = false;
  int root_rank = 0;
  // Called exactly once, on the engine thread (or inline from Submit when the engine refuses the
  // request). `gather` is non-null only for a successful allgather.
  std::function<void(const Status&, const GatherResult* gather)> done;
};

class Engine {
 public:
  // Binds, connects to every peer, starts the I/O thread.
  static Status Start(const EngineOptions& options, std::unique_ptr<Engine>* engine);
  ~Engine();  // fails what is pending, closes the connections gracefully, joins the thread

  void Submit(OpRequest request);
  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  const EngineOptions& options() const { return options_; }
  std::string StatsJson() const;
  // This worker's trace (disabled unless a timeline path was given); thread-safe.
  Timeline& timeline();

  struct Impl;

 private:
  explicit Engine(const EngineOptions& options);
  EngineOptions options_;
  std::unique_ptr<Impl> impl_;
};

// The process-wide engine used by the TensorFlow kernels.
Status InitGlobalEngine(const EngineOptions& options);
void ShutdownGlobalEngine();
Engine* GlobalEngine();  // nullptr before init

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_H_
