// Predicts the step time of N workers from a one-worker profile: a discrete-event model of this
// runtime that replays the runtime's own scheduling code over a model of the network.
//
// What is replayed, not re-implemented: every simulated worker has the SchedulerPolicy that
// MakePolicy gives the engine (fifo, priority, prophet with its online profiler, planner and
// bandwidth monitor), fed the same events the engine feeds it (OnTensorReady, Enqueue,
// Dequeue under the byte credit, OnTransferDone, NextWakeupNs) with simulated time; tensors are
// cut and owned by MakePartitions, as in the engine, and with fusion (RuntimeModel::fusion_bytes)
// packed into buckets by PlanFusion and cut by PlanPartitions (fusion.h), as the engine's Fuser.
//
// What is modelled (the engine's behaviour, ops/core/engine.cc, and TensorFlow's around it):
//  - compute, per worker and step: a launch delay, the forward pass layer by layer, the backward
//    pass (each tensor is handed to the runtime at its profiled offset from the backward pass's
//    start), a tail until the train function returns, and a gap until the next step begins;
//  - compressed gradients (ModelTensor::encoding, CompressGradients): pushes, sums, the credit
//    and the bandwidth samples carry the encoded bytes, half the partition's; the policy is told
//    the tensor's bytes when it is ready, as the engine does;
//  - push_pull: every partition not owned by this worker is pushed to its owner; the owner adds
//    the N contributions (its own arrives when its tensor is ready there) and sends the sum back
//    to each other worker; a push's credit returns when it is written to its socket (bytescheduler
//    also holds its own window until the sum arrives); an owner is done with a
//    partition once the sum's frames are written to the sockets;
//  - links: LinkModel (per-host egress and ingress shared by the host's workers, loopback between
//    them, one connection per peer, frames in the engine's queue order);
//  - updates: a finished gradient's update runs on a pool of `apply_threads` threads for its
//    profiled time. Crossing the barrier: the next step's layer k starts its forward pass only
//    when the updates of layer k's tensors are done; the train function returns after the
//    backward pass and the control collectives. Without crossing it also waits for every
//    push_pull and update of the step;
//  - small push_pulls (RuntimeModel::small_allreduce): the engine's exchange by recursive
//    doubling (ExchangePlan, SmallAllreduceApplies), stage by stage; its frames bypass the policy
//    and the credit, as in the engine;
//  - per-message CPU cost (NetworkModel::message_send_ns / message_receive_ns) on each worker's
//    one I/O thread;
//  - heartbeats (RuntimeModel::heartbeat_ns): frames to every peer on every lane, four a period;
//  - MultiWorkerMirroredStrategy (schedule "mwms"): TensorFlow's CollectiveAllReduce in graph
//    mode packs every gradient into one all-reduce that starts after the backward pass: a ring
//    reduce-scatter + all-gather, 2(N-1) rounds over N x subdivisions chunks, then every update,
//    then the control collectives (the loss) as ring all-reduces.
// Not modelled: CPU contention between compute, the runtime and the kernel's network stack, the
// engine thread's own CPU time apart from summation and the per-message cost, TCP dynamics other
// than fair sharing.
#ifndef PROPHET_OPS_SIM_SIMULATOR_H_
#define PROPHET_OPS_SIM_SIMULATOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/common.h"
#include "ops/core/engine_options.h"
#include "ops/core/fusion.h"
#include "ops/core/hosts.h"

namespace prophet {

// One layer of the model, in forward order.
struct ModelLayer {
  std::string name;
  int64_t forward_ns = 0;
  int64_t backward_ns = 0;  // only drawn on the timeline; tensors carry their own ready offsets
};

// A collective the training step makes: a gradient, or a control collective (priority at or
// above kControlPriority: metrics, loss-scale flags), which has no update and no layer.
struct ModelTensor {
  std::string name;
  uint64_t bytes = 0;
  uint32_t element_size = 4;
  int64_t priority = 0;
  int layer = -1;           // index into StepProfile::layers whose forward pass reads it; -1: none
  int64_t ready_ns = 0;     // handed to the runtime this long after the backward pass started
  int64_t apply_ns = 0;     // its optimizer update
  // How its values travel (codec.h): kNone, or float32 values as fp16 / bf16, half the bytes
  // (element_size 4). Set by CompressGradients; mwms always sends the tensor's own bytes.
  Encoding encoding = Encoding::kNone;

  // Bytes on the wire of `tensor_bytes` of this tensor (a partition, or the whole tensor).
  uint64_t WireBytes(uint64_t tensor_bytes) const { return PayloadCodec(encoding, DataType::kFloat32).WireBytes(tensor_bytes); }
};

// One worker's step, as measured on one worker (see prophet_tf/predict for how it is recorded).
struct StepProfile {
  std::vector<ModelLayer> layers;
  std::vector<ModelTensor> tensors;
  int64_t launch_ns = 0;    // step begins -> first layer's forward pass
  int64_t backward_ns = 0;  // backward pass's start -> its end
  int64_t tail_ns = 0;      // the step's last work -> the train function returns
  int64_t gap_ns = 0;       // the train function returned -> the next step begins
};

// ProphetStrategy(compression=...): its gradients (priority below kControlPriority) of 4-byte
// elements travel as `compression`; control collectives never do. The strategy compresses
// gradients only and the engine float32 only; a profile records element sizes, not dtypes, and
// a gradient of 4-byte elements is float32 (TensorFlow differentiates floating-point variables
// only). kNone leaves every tensor as it travels uncompressed.
void CompressGradients(Encoding compression, StepProfile* profile);

struct NetworkModel {
  int workers = 2;
  // Workers placed on one host (worker w on host w / workers_per_host): they share the host's
  // NIC, and talk to each other over loopback at loopback_Bps, shared by the host's connections
  // between its own workers. Default 12.5 GB/s (100 Gbit/s), an assumption: about what several
  // TCP streams over Linux loopback move together on a current multi-core server (one stream
  // about 30-50 Gbit/s, bounded by the kernel's copies); shared memory would be faster.
  int workers_per_host = 1;
  double loopback_Bps = 12.5e9;
  double link_Bps = 125e6;          // per host and direction
  bool ingress_limited = true;      // false: only egress is shaped (emulated clusters)
  int64_t latency_ns = 0;           // one way, per frame
  double payload_efficiency = 1448.0 / 1538.0;  // TCP payload per Ethernet frame on the wire
  uint64_t frame_overhead_bytes = 96;           // the runtime's frame header + name + shape
  // What the kernel lets a connection hold (KernelSendBufferBytes): the runtime's socket options
  // (SO_SNDBUF as SendBufferRequest resolves it, 0: autotuned; TCP_NOTSENT_LOWAT, 0: none) and the kernel's limits: an SO_SNDBUF
  // request is capped at net.core.wmem_max (0: no cap), the autotuning at net.ipv4.tcp_wmem's
  // maximum (4 MiB by default).
  int socket_buffer_bytes = EngineOptions().socket_buffer_bytes;  // as SendBufferRequest takes it
  uint64_t max_socket_buffer_bytes = 0;
  uint64_t autotuned_socket_buffer_bytes = 4u << 20;
  uint64_t socket_unsent_bytes = static_cast<uint64_t>(EngineOptions().socket_unsent_bytes);
  // What TCP keeps queued below the sockets (the host's qdisc and NIC), as time at the link rate:
  // TCP small queues allow about 1 ms of each connection's pacing rate, which runs above its rate
  // while TCP probes for bandwidth; the connections leaving a host share it
  // (KernelSendBufferBytes).
  double sender_queue_s = 1e-3;
  double sum_Bps = 0;               // an owner's summation rate (0: instant)
  // CPU time of one frame on the engine's I/O thread, which handles a worker's frames one at a
  // time: sending (the frame's header, the system call, the queue) and receiving (the wake-up,
  // header parsing, routing to its operation). A frame enters its connection once its sender's
  // thread has spent message_send_ns on it, and reaches its operation once the receiver's thread
  // has spent message_receive_ns. 0 (the default; the golden predictions are without it): free.
  // Measured on this project's 2-core test machine (N engines in one process on loopback, small
  // push_pulls, process CPU per frame, both ends together: `bazel run -c opt
  // //ops/core/bench:small_allreduce_bench`): 10-14 us at N = 3-8, 14-24 us at N = 2 (under
  // load), so about 6 us each end (`--message_cost 6us,6us`); the split between the ends is an
  // assumption.
  int64_t message_send_ns = 0;
  int64_t message_receive_ns = 0;
  // CPU per byte on the same thread (ns per byte; 0, the default: free), measured on the machine
  // at hand by `python -m prophet_tf.predict calibrate`:
  //  - send_byte_ns: writing a frame's payload into its socket (the kernel's copy, TCP's work);
  //  - receive_byte_ns: reading a payload out of its socket;
  //  - sum_byte_ns: adding a received contribution into a sum (an owner's push, an exchange
  //    stage, a ring chunk), per byte of the sum's values;
  //  - cast_byte_ns: converting float32 values to or from 16 bits (compression), per float32 byte;
  //  - copy_byte_ns: a memory copy (fusion packs its members into the bucket and copies the sums
  //    back).
  // A frame's sending work occupies the thread before its bytes can enter the socket; where that
  // work is slower than the link, the frame leaves correspondingly later. Receiving overlaps the
  // arrival: the thread may start on a frame as soon as its first bytes could be in (at the
  // link's rate), and is done with it at the earliest one chunk's work after its last byte.
  double send_byte_ns = 0;
  double receive_byte_ns = 0;
  double sum_byte_ns = 0;
  double cast_byte_ns = 0;
  double copy_byte_ns = 0;
  // The I/O threads (lanes, EngineOptions::io_threads) of each worker's runtime: a frame's CPU is
  // charged to its lane's thread, routed as the engine routes (engine.h: a push_pull that
  // TravelsInSlices in slices, one per lane, each cut on its own; fused buckets and their copies dealt
  // over the lanes by DealBucketsToLanes, any other tensor on the lane its name hashes to). The lanes'
  // schedulers are modelled as one (one policy and one credit per worker), and a lane's fusion
  // plan as the whole plan's buckets it was dealt.
  int io_threads = 1;
  // > 0: every worker's I/O thread and updates (ModelTensor::apply_ns) run on one pool of this
  // many cores shared by all the workers (workers on one machine: the replay benchmark,
  // prophet_tf/bench/replay.py, and the emulated training benchmark, whose compute sleeps); 0:
  // each worker has a core of its own for them (a cluster).
  int shared_cores = 0;
};

// Whether any CPU cost of `network` is charged (message or byte costs).
bool ChargesCpu(const NetworkModel& network);

// Bytes a connection commits ahead of the NIC, which frames queued later cannot overtake: what
// the kernel lets the socket hold, unsent or sent and not yet acknowledged.
//  - Its send buffer bounds both: Linux caps an SO_SNDBUF request at net.core.wmem_max and then
//    doubles it (socket(7)), so a 4 MiB request commits up to 8 MiB (measured on the benchmark's
//    emulated cluster, veth + tbf at 983 Mbit/s: a saturated connection held 6.2-8.3 MB);
//    autotuned, it grows up to net.ipv4.tcp_wmem's maximum (4.2 MB measured at 2 Gbit/s).
//  - With TCP_NOTSENT_LOWAT the unsent part stays within socket_unsent_bytes, and what is sent
//    but still queued in the host is about sender_queue_s of the connection's rate: its share of
//    the host's egress when every connection leaving the host is busy (TCP small queues: about
//    1 ms of the socket's own pacing rate each, so about sender_queue_s of the link together).
//    (Measured on the emulated cluster with a 256 KiB limit, at 1 and 2 Gbit/s: 0.3 MB unsent, and 0.3 and 0.8 MB sent and
//    not yet acknowledged, which includes what has arrived but whose acknowledgement is late.)
uint64_t KernelSendBufferBytes(const NetworkModel& network);

// The runtime's options default to the engine's (engine_options.h).
struct RuntimeModel {
  std::string schedule = kDefaultSchedule;  // one of kScheduleNames, or mwms
  bool cross_barrier = true;
  uint64_t partition_bytes = EngineOptions().partition_bytes;
  uint64_t credit_bytes = EngineOptions().credit_bytes;
  double replan_threshold = kDefaultReplanThreshold;
  // The two-level path, as the engine's `hierarchical` option (hosts.h decides, over the
  // network's hosts x workers_per_host; two_level.h is the engine's side): every tensor is cut for
  // the hosts and each partition owned by a host; on every host one worker, the partition's
  // leader, first sums its host's contributions (sent to it over loopback), pushes that sum to the
  // owning host's leader through its policy and under its credit (as a push), the owner's leader
  // sums the hosts' and sends the sum to the other leaders, and every leader passes it on to its
  // host's workers. BytePS's and Horovod's hierarchical all-reduce: the network carries each
  // host's share once. Not with mwms (kOn is refused there, kAuto keeps the ring).
  Hierarchy hierarchical = EngineOptions().hierarchical;
  int apply_threads = 2;
  // mwms: TensorFlow's ring (ring_reducer.cc): chunks of at most ring_chunk_bytes, at most
  // ring_max_subdivs subdivisions per worker; each message costs ring_message_ns on arrival.
  uint64_t ring_chunk_bytes = 4u << 20;
  int ring_max_subdivs = 2;
  int64_t ring_message_ns = 0;
  // Fusion (fusion.h): kFusionAuto sizes buckets with FusionBucketBytes for the workers and the
  // link rate; 0 sends every tensor on its own; otherwise the bucket size in bytes.
  int64_t fusion_bytes = 0;
  // Small push_pulls by recursive doubling (small_allreduce.h), as the engine's setting of the
  // same name takes them (ExchangesThis): kSmallAllreduceAuto, the engine's default, the control
  // collectives its rule picks; kSmallAllreduceNever, the owner path for every tensor (for
  // comparisons and the golden predictions); kSmallAllreduceAlways, every tensor that fits (to
  // predict the exchange where the rule would not take it).
  EngineOptions::SmallAllreduceMode small_allreduce = EngineOptions::kSmallAllreduceAuto;
  // The engine's heartbeat_s in ns (0: off): four times a period every lane of every worker
  // sends a frame to every peer (Failures::Heartbeat), urgent, with no payload; the I/O threads
  // pay their per-message cost and the links carry their headers.
  int64_t heartbeat_ns = 0;
};

struct SimulationOptions {
  int warmup_steps = 5;   // simulated, not measured (tracing aside, as the benchmark does)
  int steps = 20;         // measured step periods
  // Chrome trace of the first `timeline_workers` workers; "{rank}" in the path is replaced.
  std::string timeline_path;
  int timeline_workers = 2;
};

// When one tensor went through worker 0's first measured step, from that step's begin.
struct TensorTiming {
  std::string name;
  double ready_s = -1;    // handed to the runtime
  double done_s = -1;     // its sum arrived (the op finished)
  double applied_s = -1;  // its update finished (gradients)
};

struct StepPrediction {
  double step_s = 0;                 // median measured period of worker 0
  std::vector<double> periods_s;     // every measured period of worker 0
  double single_step_s = 0;          // one worker: launch + forward + backward + tail + gap
  double compute_s = 0;              // forward + backward
  double comm_s = 0;                 // worker 0's NIC busy sending, per measured step
  double wire_bytes_per_step = 0;    // worker 0's bytes on the wire per measured step
  double overlap = 0;                // share of comm_s that did not lengthen the step, [0, 1]
  double gate_wait_s = 0;            // worker 0's forward passes waiting for updates, per step
  double bandwidth_Bps = 0;          // worker 0's bandwidth estimate as a measured step begins (median)
  std::vector<double> bandwidth_samples_Bps;  // that estimate at each measured step's beginning
  double messages_per_step = 0;      // frames worker 0 sent per measured step (every kind)
  // Worker 0's I/O thread busy with the charged CPU work (NetworkModel's costs) per measured step:
  // above the step time, one thread cannot keep up and the runtime needs more.
  double io_busy_s = 0;
  double exchanged_per_step = 0;     // collectives per step that go by exchange (small_allreduce.h)
  std::string policy;                // the policy's Describe() at the end (worker 0)
  uint64_t stall_breaks = 0;         // the policies' stall breaks over the whole run, all workers
  std::vector<TensorTiming> tensor_times;  // in StepProfile::tensors order
};

Status Simulate(const StepProfile& profile, const NetworkModel& network, const RuntimeModel& runtime,
                const SimulationOptions& options, StepPrediction* prediction);

}  // namespace prophet

#endif  // PROPHET_OPS_SIM_SIMULATOR_H_
