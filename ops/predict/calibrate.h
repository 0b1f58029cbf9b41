// The CPU costs the predictor charges on a worker's I/O thread (NetworkModel in
// ops/sim/simulator.h), measured on the machine at hand: `python -m prophet_tf.predict
// calibrate --out costs.json`, so that a user predicts with their own hosts' costs.
//
// What is measured (CPU time of the threads doing the work, not wall time, so that other load
// on the machine slows the measurement rather than inflating it):
//  - sum_byte_ns: the engine's summation kernel (SumInto, float32), out += in over buffers larger
//    than the caches;
//  - cast_byte_ns: the payload codec's fp16 encode and decode, the mean per float32 byte;
//  - copy_byte_ns: memcpy between such buffers;
//  - send_byte_ns, receive_byte_ns: two real engines in this process over loopback exchanging
//    large push_pulls: their CPU per byte, less the summation's share, split between sending and
//    receiving as a raw TCP stream over loopback splits it (each side's thread CPU);
//  - message_send_ns, message_receive_ns: the same engines exchanging tiny push_pulls, many at
//    once as a step submits them: CPU per frame (its header, system calls, its share of the
//    engine's turn, the op's hand-off), split evenly between the ends. One at a time (every frame
//    wakes both threads) a frame costs more; that figure is reported beside it.
// On loopback the sender's system calls also run the receiving side of TCP; between hosts the
// receiver's CPU does. Calibrate on two hosts of the cluster for its NICs' split.
#ifndef PROPHET_OPS_PREDICT_CALIBRATE_H_
#define PROPHET_OPS_PREDICT_CALIBRATE_H_

#include <string>

#include "ops/core/common.h"

namespace prophet {

struct CpuCosts {
  double send_byte_ns = 0;
  double receive_byte_ns = 0;
  double sum_byte_ns = 0;
  double cast_byte_ns = 0;
  double copy_byte_ns = 0;
  double message_send_ns = 0;
  double message_receive_ns = 0;
  // The engines' measurements behind them (a check: the model with these costs against them).
  double engine_large_cpu_ns_per_byte = 0;  // process CPU per byte of a large push_pull's tensor
  double engine_large_bytes = 0;
  double engine_small_cpu_ns_per_frame = 0;  // tiny push_pulls, many at once (the cost charged)
  double engine_lone_cpu_ns_per_frame = 0;   // tiny push_pulls one at a time
  double tcp_send_share = 0;                // the sender's share of a raw TCP stream's CPU
  double seconds = 0;                       // how long the calibration took
};

// `effort` scales how much is measured (1: about 5-10 s on a quiet 2-core machine).
Status MeasureCpuCosts(double effort, CpuCosts* costs);
std::string CpuCostsJson(const CpuCosts& costs);

}  // namespace prophet

#endif  // PROPHET_OPS_PREDICT_CALIBRATE_H_
