// The ideal bound: the shortest step period that ANY schedule of the gradients' communication
// could reach on a setting (the model's per-layer compute and gradients, N workers, the link rate),
// beside the naive bound max(compute, communication). docs/design.md ("The ideal bound") states the
// model and why it is a lower bound; in short:
//
// Relaxation of the runtime (every simplification can only make a step shorter):
//  - the workers follow one timeline (identical accelerators, started together);
//  - the links of the N hosts are pooled: a gradient of S bytes needs 2(N-1)/N x S bytes of every
//    host's egress (S: the bytes that travel, half the tensor's for a compressed gradient; the
//    all-reduce optimum: any all-reduce moves 2(N-1) x S bytes in all, and N
//    hosts send at most N x link rate together), carried as a fluid (any split, preemptive, no
//    per-message cost, no frame header, no protocol) at link rate x payload_efficiency
//    (TCP/IP/Ethernet headers per byte), starting when the gradient is ready, finished one one-way
//    latency after its last byte left;
//  - updates take no time, and nothing else (summation, CPU) costs anything.
// What stays: the accelerator runs one step's forward pass layer by layer, then its backward pass
// (gradient t is ready `ready_ns` after the backward pass began), then, after the profile's tail,
// gap and launch, the next step's forward pass; layer k's next forward pass starts only once the
// all-reduce of layer k's gradients is complete (crossing the barrier, the best any runtime does);
// the step returns only once its control collectives are complete.
//
// In that relaxation the optimum is known exactly. Any schedule must finish a step's gradients
// before the next step's backward pass starts (each layer's forward pass waits for its own), so
// every step's communication starts on an idle link, and the link serving the gradients in the
// order they are needed (control collectives, then layer 1, 2, ...), preemptively, finishes every
// prefix of that order at the earliest possible time: no other order can start any forward pass
// sooner. With D_k the completion of layer k's gradients under that order (from the backward
// pass's start), the period is the longest path of
//     x_1 = max(max(backward, D_control) + tail + gap + launch, D_1)
//     x_k = max(x_{k-1} + forward_{k-1}, D_k)          period = x_L + forward_L
// and at least every gradient's bytes over the link (gradients no layer reads).
#ifndef PROPHET_OPS_SIM_IDEAL_BOUND_H_
#define PROPHET_OPS_SIM_IDEAL_BOUND_H_

#include <vector>

#include "ops/core/common.h"
#include "ops/sim/simulator.h"

namespace prophet {

struct IdealBound {
  double step_s = 0;        // the bound: the shortest period any schedule reaches
  double compute_s = 0;     // launch + forward + backward + tail + gap: the step without waiting
  double comm_s = 0;        // every gradient's 2(N-1)/N share of the link, at the payload rate
  double wait_s = 0;        // step_s - compute_s: what even the best schedule waits for gradients
  uint64_t gradient_bytes = 0;  // every gradient's bytes as they travel (compressed: ModelTensor::encoding)
  int binding_layer = -1;   // the last layer whose gradients the bound waits for (-1: none)
  std::vector<double> done_s;  // per layer: its gradients' completion, from the backward start
};

// Uses the profile's layers, tensors (bytes, encoding, priority, layer, ready_ns; not apply_ns) and launch,
// backward, tail and gap, and the network's workers, link_Bps, payload_efficiency and latency_ns.
Status ComputeIdealBound(const StepProfile& profile, const NetworkModel& network, IdealBound* bound);

}  // namespace prophet

#endif  // PROPHET_OPS_SIM_IDEAL_BOUND_H_
