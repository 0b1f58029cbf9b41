// The text form of a simulation request and the JSON form of its prediction, for the C entry point
// of the predictor (ops/predict/c_api.cc; prophet_tf/predict writes the requests).
//
// A request is lines of text ('#' starts a comment):
//   option KEY=VALUE
//   layer FORWARD_NS BACKWARD_NS NAME
//   tensor BYTES ELEMENT_SIZE PRIORITY LAYER READY_NS APPLY_NS NAME
// Layers are in forward order; LAYER is a layer's index or -1. NAME runs to the end of the line.
// Option keys are the fields of StepProfile (launch_ns, backward_ns, tail_ns, gap_ns),
// NetworkModel, RuntimeModel and SimulationOptions, by their C++ names, and compression
// (SimulationRequest::compression). The engine's options that the predictor models (kPredicted in
// engine_options.def) are parsed and checked as the engine parses them; a request that leaves one
// out predicts the engine's default.
#ifndef PROPHET_OPS_SIM_SIMULATION_REQUEST_H_
#define PROPHET_OPS_SIM_SIMULATION_REQUEST_H_

#include <string>

#include "ops/core/common.h"
#include "ops/sim/ideal_bound.h"
#include "ops/sim/simulator.h"

namespace prophet {

struct SimulationRequest {
  // ProphetStrategy(compression=...), applied to the profile's tensors once they are all read
  // (CompressGradients); option compression=none|fp16|bf16.
  Encoding compression = Encoding::kNone;
  StepProfile profile;
  NetworkModel network;
  RuntimeModel runtime;
  SimulationOptions options;
};

// Fails with a message naming the line and what is wrong with it.
Status ParseSimulationRequest(const std::string& text, SimulationRequest* request);

// {"step_s": ..., "periods_s": [...], ..., "tensor_times": [{"name": ..., ...}, ...]}
std::string PredictionJson(const StepPrediction& prediction);

// {"step_s": ..., "compute_s": ..., "comm_s": ..., "wait_s": ..., "binding_layer": ..., "done_s": [...]}
std::string IdealBoundJson(const IdealBound& bound);

}  // namespace prophet

#endif  // PROPHET_OPS_SIM_SIMULATION_REQUEST_H_
