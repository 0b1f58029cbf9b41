// A replay worker: the real engine (transport, scheduler, planner, fusion, credit, two-level
// path, heartbeats) driven by a recorded step profile instead of TensorFlow, so that many workers
// fit on one machine and their measured steps can be set beside the predictor's (which reads the
// same profile: ops/sim/simulation_request.h).
//
// Per step, as the simulator models the strategy (simulator.h):
//  - the accelerator is emulated on a virtual clock: launch, then the forward pass layer by
//    layer, each layer starting when the previous one ended and, crossing the barrier, when the
//    updates of its gradients from the last step are applied (the gates); the backward pass hands
//    each tensor to the engine at its profiled offset; tail and gap end the step. A late wake-up
//    of this thread delays the submissions it makes (that is what the machine's CPU does to a
//    real worker) but never shifts the virtual clock: the device's times stay the profile's;
//  - every tensor is a real push_pull of real bytes (its profiled size) under the engine's policy,
//    fused as ProphetStrategy(fusion="auto") fuses, with the link rate agreed by the start-up
//    probe (as prophet_tf/_link_probe.py does), and its sum is checked against the exact sum of
//    the values every worker put in (integers, exact in float32: a sum that took a wrong
//    partition, offset, tensor or round shows);
//  - updates run on `apply_threads` threads for their profiled time.
#ifndef PROPHET_OPS_REPLAY_REPLAY_H_
#define PROPHET_OPS_REPLAY_REPLAY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/common.h"
#include "ops/core/engine_options.h"
#include "ops/sim/simulator.h"

namespace prophet {

struct ReplayConfig {
  EngineOptions engine;   // rank, world, addresses, token, schedule, partitions, credit, two-level
  StepProfile profile;    // the times as this run plays them (already scaled)
  Encoding compression = Encoding::kNone;
  bool cross_barrier = true;
  int apply_threads = 2;
  // kFusionAuto sizes buckets for the link rate: `link_Bps` when positive, else the rate the
  // start-up probe agrees on; 0 sends every tensor alone; otherwise the bucket size.
  int64_t fusion_bytes = -1;
  double link_Bps = 0;
  // Run the strategy's start-up probe (timed, part of start-up) even where fusion does not need
  // its rate.
  bool probe = false;
  // Where fusion does not need its rate, the probe's bytes times this: a replay of this share of
  // the model's bytes over a link slowed as much then spends on the probe's bytes time_scale
  // times their wire time at full scale, as on every other byte.
  double probe_scale = 1.0;
  // The automatic bucket size times this: a replay that moves this share of the model's bytes
  // (and sizes for the modelled cluster's link rate) keeps the modelled cluster's buckets.
  double fusion_scale = 1.0;
  int warmup_steps = 3;
  int steps = 10;
  // Check every element of every sum (else a fixed sample of each, poisoned before each round).
  bool check_all = false;
  // CLOCK_REALTIME seconds at which the launcher started the job: start-up is measured from it.
  double launched_at_s = 0;
};

struct ReplayResult {
  int rank = 0;
  int world_size = 0;
  std::vector<double> periods_s;      // measured steps: one step's begin to the next's (virtual clock)
  double connect_s = 0;               // launched_at_s -> every peer connected (Engine::Start returned)
  double startup_s = 0;               // launched_at_s -> probe done, fusion declared
  double probe_s = 0;                 // the probe with its gathering of rates
  double probe_measured_Bps = 0;      // this worker's fastest probe round
  double probe_agreed_Bps = 0;        // the minimum over the workers
  uint64_t probe_bytes = 0;           // each probe round's push_pull
  // Where the probe chose the path (hierarchical auto): 1 two-level, 0 flat; -1 none chosen. With
  // the slowest worker's round on each path in lockstep (the period of its last rounds).
  int probe_two_level = -1;
  double probe_two_level_round_s = 0, probe_flat_round_s = 0;
  double fusion_link_Bps = 0;         // the rate buckets were sized for
  uint64_t fusion_bucket_bytes = 0;
  // The engine's sizes as this run used them (ScaleRuntimeBytes).
  uint64_t partition_bytes = 0, credit_bytes = 0, socket_unsent_bytes = 0;
  int connections = 0;                // this worker's peers (one connection each)
  // Over the measured steps: frames and bytes this worker sent and received, the process's CPU
  // (user + system), the wall time.
  uint64_t frames_sent = 0, frames_received = 0, bytes_sent = 0, bytes_received = 0;
  double cpu_s = 0, wall_s = 0;
  uint64_t peak_rss_bytes = 0;        // VmHWM at the end
  uint64_t gradient_bytes = 0;        // the profile's gradients (below the control priority)
  uint64_t sums_checked = 0;          // elements compared with the exact sum
  uint64_t ops_failed = 0;
  double longest_op_s = 0;            // the longest round: submission to completion
  std::string engine_stats;           // Engine::StatsJson at the end
};

// Fills `config` from a simulation request (the predictor's text: profile, runtime, network
// options), apart from the engine's identity (rank, world, addresses, token), which the caller
// sets.
Status ReplayConfigFromRequest(const std::string& request_text, ReplayConfig* config);

// The engine's sizes in bytes for a replay that moves `byte_scale` of the model's bytes, so that
// tensors are cut, released and queued in the sockets as the modelled cluster's are: the
// partition size, the byte credit (resolved for the workers first) and the sockets' unsent
// limit, each times byte_scale and at least kMinScaledBytes.
constexpr uint64_t kMinScaledBytes = 4096;
void ScaleRuntimeBytes(double byte_scale, EngineOptions* options);

// Runs one worker: start-up (connect, probe, fusion), warm-up and measured steps, shutdown.
// Fails with the first error (a failed operation, a wrong sum, a step that never finished).
Status RunReplay(const ReplayConfig& config, ReplayResult* result);

std::string ReplayResultJson(const ReplayResult& result);

// The value worker `rank` contributes at element `i` of tensor `tensor`, and the exact sum over
// `world_size` workers: small integers, exact in float32 and float64 at any N up to 2^12.
double ReplayValue(int rank, int tensor, uint64_t i);
double ReplaySum(int world_size, int tensor, uint64_t i);

// The link rate fusion sizes for, from a measured all-reduce goodput: the largest of the 1-2-5
// series of Gbit/s reached within kProbePayloadAllowance, at least kProbeMinGbps (the rule of
// prophet_tf/_link_probe.py, quantize_gbps, which every worker applies to the same gathered
// minimum).
constexpr double kProbePayloadAllowance = 0.7;
constexpr double kProbeMinGbps = 0.1;
double QuantizeLinkGbps(double gbps);

}  // namespace prophet

#endif  // PROPHET_OPS_REPLAY_REPLAY_H_
