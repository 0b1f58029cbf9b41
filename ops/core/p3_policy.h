// P3, priority-based parameter propagation (Jayarajan, Wei, Gibson, Fedorova, Pekhimenko,
// SysML 2019; code: github.com/anandj91/p3, an MXNet 1.1 fork) as a SchedulerPolicy, for
// comparison with prophet.
//
// What its code does, and what this policy does alike:
//  - slicing (src/kvstore/kvstore_dist.h, EncodeDefaultKey): every array of at least
//    MXNET_KVSTORE_BIGARRAY_BOUND parameters (P3 sets its default to 40,000, from MXNet's
//    1,000,000) is cut into slices of that many parameters (the last one holds the rest), placed
//    on the servers round-robin; a smaller array is one slice on one server. Here the engine cuts
//    them (ScheduleTraits: 160,000 bytes, 40,000 float32 parameters, and nothing else cuts a
//    tensor); owners go round-robin from where the tensor's name hashes, not from server 0;
//  - priority (ps-lite/include/ps/internal/threadsafe_queue.h, ps-lite/src/van.cc): every
//    message enters one priority queue (the layer closest to the input first) and one sender
//    thread (Van::Sending) pops the most urgent and sends it;
//  - flow control (ps-lite/src/zmq_van.h): each connection's ZeroMQ socket has a send high-water
//    mark of 1 message (ZMQ_SNDHWM = 1), so the sender thread's blocking send waits while the
//    message before it to the same peer has not gone on into the kernel's socket buffer; while it
//    waits it holds the slice it popped, and nothing else is sent, to any peer. Here: a slice is
//    released only when no slice released before to the same peer is still waiting to leave this
//    worker (OnPushLeft), and the popped slice is held until then, blocking the others;
//  - the server answers a push with the summed values once every worker pushed (no pull
//    request): the runtime's push and RESULT.
// What differs, and why:
//  - a ZeroMQ pipe holds one message and its I/O thread may hold one more being written; here one
//    released slice per peer waits above the kernel;
//  - the kernel below is this runtime's (TCP_NOTSENT_LOWAT, sized send buffers), where P3 left
//    the kernel's autotuned buffers: P3's sockets could hold megabytes ahead of an urgent slice;
//  - control collectives (the loss, metric state) go first and are not held: P3 never saw them.
#ifndef PROPHET_OPS_CORE_P3_POLICY_H_
#define PROPHET_OPS_CORE_P3_POLICY_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "ops/core/scheduler.h"

namespace prophet {

// P3's slice, in bytes of float32 parameters (MXNET_KVSTORE_BIGARRAY_BOUND = 40,000 in its code).
constexpr uint64_t kP3SliceBytes = 160'000;

class P3Policy : public SchedulerPolicy {
 public:
  explicit P3Policy(const BandwidthOptions& bandwidth = BandwidthOptions()) : SchedulerPolicy(bandwidth) {}

  const char* name() const override { return "p3"; }
  void Enqueue(const SendTask& task) override;
  void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) override;
  void OnPushLeft(const SendTask& task) override;
  size_t queued() const override { return control_.size() + queue_.size() + (holding_ ? 1 : 0); }
  std::string Describe() const override;

  // The slice the sender thread holds while its peer's connection is full, or null.
  const SendTask* held() const { return holding_ ? &held_ : nullptr; }
  // Released slices to `peer` that have not left this worker.
  int unsent_to(int peer) const;

 private:
  PriorityTaskQueue control_;
  PriorityTaskQueue queue_;
  bool holding_ = false;
  SendTask held_;
  std::map<int, int> unsent_by_peer_;
  std::map<std::tuple<std::string, uint64_t, int>, int> unsent_;  // (name, round, partition) -> peer
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_P3_POLICY_H_
