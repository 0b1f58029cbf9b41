// The communication engine: one background thread owns every socket of the job.
//
// Op kernels call Submit() and return; the engine matches each request with the same request on
// the other workers by `name#round` (round = how many times this worker submitted that name
// before), moves the bytes, sums them at each partition's owner and calls `done` on its own
// thread. Requests may be submitted in any order on different workers.
//
// Lanes (EngineOptions::io_threads; ResolveLanes): where one thread cannot move the bytes as fast
// as the link, the engine runs several lanes. A lane is what the rest of this file describes (a
// thread, a connection to every peer, a scheduler), and knows nothing of the others. Of the lanes
// connected, the first `active` carry requests (SetActiveLanes: all of them for an explicit
// io_threads, one until the strategy's start-up probe says how many the link needs for auto). A
// push_pull that TravelsInSlices (engine_options.h) travels as one slice per active lane
// (contiguous, equal element counts), its `done` called once every slice is back; every other
// request travels whole on the active lane its name hashes to; a tensor the fusion plan puts in a
// fused bucket travels whole on the lane its bucket was dealt to (FusionByLane, fuser.h), where
// that bucket forms. Every worker cuts and routes the same way, so each lane
// matches its requests as one engine does.
//
// Inside (docs/design.md, "Core file map"): engine.cc owns the thread, the submission queue, the
// pump and the lifecycle, and routes frames to operations; early_frames.* holds frames of
// operations not submitted here yet; failures.* spreads failures and reads peers' ends (lost,
// unresponsive, departed); timeouts.* probes and names stragglers; connection.* carries frames;
// the collectives (push_pull.*, broadcast.*, allgather.* on collective.*) do the rest.
#ifndef PROPHET_OPS_CORE_ENGINE_H_
#define PROPHET_OPS_CORE_ENGINE_H_

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/common.h"
#include "ops/core/engine_options.h"
#include "ops/core/timeline.h"

namespace prophet {

enum class OpKind { kPushPull = 0, kBroadcast = 1, kAllgather = 2 };
const char* OpKindName(OpKind kind);

// Every worker's tensor for an allgather, valid only during the `done` callback.
struct GatherResult {
  std::vector<std::vector<int64_t>> shapes;  // by rank
  std::vector<const char*> data;             // as it travelled (encoded with `encoding`)
  std::vector<uint64_t> bytes;               // of the tensor (decoded)
  Encoding encoding = Encoding::kNone;
  std::vector<int> scale_exp;                // by rank, when encoded
  // Writes rank `r`'s tensor (bytes[r]) to `dst`, decoding it if it travelled encoded.
  void CopyOut(size_t r, char* dst) const;
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
  // push_pull and allgather: float32 values travel as fp16 / bf16 (codec.h; other dtypes as they
  // are). Every worker must ask the same for the same operation.
  Encoding compression = Encoding::kNone;
  // Called exactly once, on the engine thread (or inline from Submit when the engine refuses the
  // request). `gather` is non-null only for a successful allgather.
  std::function<void(const Status&, const GatherResult* gather)> done;
  // Set by the engine on a fused bucket's push_pull (fuser.h): its partitions come from
  // BucketPartitions for this bucket size (fusion.h).
  uint64_t fusion_bucket_bytes = 0;
  // Set by the engine on a lane's slice of a push_pull: the whole request's trace events stand
  // for it (the lane traces its transfers only).
  bool lane_slice = false;
  // Set by the engine at submission (Engine::SetTwoLevel): whether a push_pull takes the
  // two-level path where the engine has hosts to take it over; a fused bucket takes its members'.
  bool two_level = true;
};


// One tensor of a fusion declaration (Engine::DeclareFusion): what its push_pull will be.
struct FusionDeclaration {
  std::string name;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  int64_t priority = 0;
  bool average = false;
  Encoding compression = Encoding::kNone;
};

class Engine {
 public:
  // Binds, connects to every peer (once per lane), starts the lanes' threads.
  static Status Start(const EngineOptions& options, std::unique_ptr<Engine>* engine);
  // Fails what is pending, sends what completed operations still owe the peers, tells them this
  // worker is leaving (kLeaving), closes the connections gracefully and joins the thread.
  ~Engine();
  // Stops as a killed process does: pending operations fail and the connections close without
  // the departure notice, so peers see a lost worker. For tests of fault handling.
  void StopWithoutNotice();

  void Submit(OpRequest request);
  // From the next submission on, push_pulls of these tensors travel fused into buckets of about
  // `bucket_bytes` (fusion.h, fuser.h; 0: none fused). Every worker must declare the same tensors
  // and size, before submitting them. A declaration replaces the previous one of its `group`
  // (e.g. one optimizer's gradients); it is refused (the status says why, through `done`, on the
  // engine thread) while a member of the previous one waits for the rest of its bucket.
  void DeclareFusion(const std::string& group, std::vector<FusionDeclaration> tensors, uint64_t bucket_bytes,
                     std::function<void(const Status&)> done = nullptr);
  // From the next submission on, requests travel on the first `lanes` lanes (1 to the lanes
  // connected), which share the byte credit. Every worker must call it at the same point of its
  // submissions (between steps, as the strategy does after its start-up probe), or the slices of
  // a tensor differ across workers and its push_pull fails.
  Status SetActiveLanes(int lanes);
  int active_lanes() const { return active_lanes_.load(); }
  // From the next submission on, push_pulls take the two-level path over the engine's hosts (on)
  // or the flat one (off). Only where `hierarchical` is auto and the hosts allow the two-level
  // path (hosts.h, UseTwoLevel), which is where the engine starts on it; the strategy's start-up
  // probe measures both and keeps the faster (prophet_tf/_link_probe.py). Every worker must call
  // it at the same point of its submissions, as SetActiveLanes, and between steps: a fused bucket
  // takes its first member's path.
  Status SetTwoLevel(bool on);
  bool two_level() const { return two_level_on_.load(); }
  // Whether SetTwoLevel may choose: hierarchical auto over hosts that allow the two-level path.
  bool PathChoosable() const;
  // Schedules with policy `schedule` from the next moment no partition is queued (between steps),
  // keeping the bandwidth measured so far. Fails for an unknown name.
  Status SetSchedule(const std::string& schedule);
  // PolicyStateJson of lane 0's policy (policies.h), read on its thread; "{}" if the engine does
  // not answer within 10 s.
  std::string SchedulerStateJson();
  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  const EngineOptions& options() const { return options_; }
  std::string StatsJson() const;
  // Bytes this worker has written to its peers so far (every connection; thread-safe, cheap).
  uint64_t BytesSent() const;
  // This worker's trace (disabled unless a timeline path was given); thread-safe.
  Timeline& timeline();

  struct Impl;  // one lane

 private:
  explicit Engine(const EngineOptions& options);
  // The lane that carries `request` whole, or -1: in slices on every active lane.
  int LaneOf(const OpRequest& request, int active_lanes);
  // Returns the request's round on that lane.
  uint64_t SubmitToLane(int lane, OpRequest request);
  void SubmitSliced(OpRequest request, int active_lanes);
  // Fails name#round on `lane` everywhere with `status` (a slice whose sibling failed).
  void CancelOnLane(int lane, const std::string& name, uint64_t round, const Status& status);

  EngineOptions options_;
  Timeline timeline_;  // every lane's events
  std::vector<std::unique_ptr<Impl>> lanes_;  // connected
  std::atomic<int> active_lanes_{1};
  // Whether push_pulls take the two-level path now (SetTwoLevel); the hosts are the lanes'.
  std::atomic<bool> two_level_on_{false};
  std::atomic<bool> path_chosen_{false};  // SetTwoLevel was called (the probe has run)
  // `buckets`: the lane's dealt buckets (FusionByLane), taken as they are; null: the lane plans.
  void DeclareOnLane(int lane, const std::string& group, std::vector<FusionDeclaration> tensors,
                     uint64_t bucket_bytes, std::function<void(const Status&)> done,
                     const std::vector<std::vector<int>>* buckets = nullptr);
  // Tensors a lane's fusion plan put in a fused bucket: they travel whole on that lane, where the
  // bucket forms; with the group that declared them.
  std::mutex fused_mu_;
  std::unordered_map<std::string, std::pair<int, std::string>> fused_lanes_;
};

// The lanes an engine with these options connects: io_threads, or for kIoThreadsAuto kAutoLanes
// where the job's workers span several hosts (hosts.h: the hosts option, else the addresses) and 1
// where they share one, and its cores.
int ResolveLanes(const EngineOptions& options);

// The process-wide engine used by the TensorFlow kernels.
Status InitGlobalEngine(const EngineOptions& options);
void ShutdownGlobalEngine();
Engine* GlobalEngine();  // nullptr before init

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ENGINE_H_
