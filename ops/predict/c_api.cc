// C entry points of the TensorFlow-free library (ctypes): the predictor (one simulation per call),
// its calibration of the CPU costs, the core's constants and option table that the Python package
// reads instead of keeping copies, and the check of the runtime's options.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/core/engine_options.h"
#include "ops/predict/calibrate.h"
#include "ops/sim/ideal_bound.h"
#include "ops/sim/simulation_request.h"
#include "ops/sim/simulator.h"

namespace {
char* CopyOut(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  if (out != nullptr) std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}
}  // namespace

extern "C" {

// Runs the simulation that `request` describes (see ops/sim/simulation_request.h). Returns 0 and
// sets *result to the prediction as JSON, or returns the status code and sets *result to the error
// message. Free *result with prophet_predict_free.
__attribute__((visibility("default"))) int prophet_predict(const char* request, char** result) {
  prophet::SimulationRequest parsed;
  prophet::Status s = prophet::ParseSimulationRequest(request != nullptr ? request : "", &parsed);
  prophet::StepPrediction prediction;
  if (s.ok()) s = prophet::Simulate(parsed.profile, parsed.network, parsed.runtime, parsed.options, &prediction);
  if (!s.ok()) {
    *result = CopyOut(s.message());
    return static_cast<int>(s.code());
  }
  *result = CopyOut(prophet::PredictionJson(prediction));
  return 0;
}

// The ideal bound of the setting that `request` describes (ops/sim/ideal_bound.h; the runtime's
// options and the simulation's are ignored). Same conventions as prophet_predict.
__attribute__((visibility("default"))) int prophet_predict_ideal(const char* request, char** result) {
  prophet::SimulationRequest parsed;
  prophet::Status s = prophet::ParseSimulationRequest(request != nullptr ? request : "", &parsed);
  prophet::IdealBound bound;
  if (s.ok()) s = prophet::ComputeIdealBound(parsed.profile, parsed.network, &bound);
  if (!s.ok()) {
    *result = CopyOut(s.message());
    return static_cast<int>(s.code());
  }
  *result = CopyOut(prophet::IdealBoundJson(bound));
  return 0;
}

// Measures the CPU costs the predictor charges (calibrate.h) on this machine, spending about
// `effort` x 5 s. Same conventions as prophet_predict: *result is the costs as JSON, or the error.
__attribute__((visibility("default"))) int prophet_predict_calibrate(double effort, char** result) {
  prophet::CpuCosts costs;
  const prophet::Status s = prophet::MeasureCpuCosts(effort, &costs);
  if (!s.ok()) {
    *result = CopyOut(s.message());
    return static_cast<int>(s.code());
  }
  *result = CopyOut(prophet::CpuCostsJson(costs));
  return 0;
}

__attribute__((visibility("default"))) void prophet_predict_free(char* result) { std::free(result); }

// LaneSliceFromBytes: the bytes from which a push_pull travels in slices over `lanes` lanes.
__attribute__((visibility("default"))) unsigned long long prophet_runtime_lane_slice_from_bytes(int lanes, int world_size) {
  return prophet::LaneSliceFromBytes(lanes, world_size);
}

// Writes the JSON object of RuntimeConstantsJson (schedule names, the option table, the control
// priority); returns the length it needs (call again with more room if that is >= len).
__attribute__((visibility("default"))) int prophet_runtime_constants(char* buf, int len) {
  const std::string json = prophet::RuntimeConstantsJson();
  if (buf != nullptr && len > 0) {
    const size_t n = std::min(json.size(), static_cast<size_t>(len) - 1);
    std::memcpy(buf, json.data(), n);
    buf[n] = '\0';
  }
  return static_cast<int>(json.size());
}

// Parses and checks the runtime's "key=value" lines as prophet_init does (ParseEngineOptions),
// without starting anything, so that bad options fail before TensorFlow loads. Returns 0 and sets
// *result to every option's resulting value as JSON (EngineOptionsJson), or the status code and
// the message. Free *result with prophet_predict_free.
__attribute__((visibility("default"))) int prophet_runtime_resolve(const char* config, char** result) {
  prophet::EngineOptions options;
  const prophet::Status s = prophet::ParseEngineOptions(config != nullptr ? config : "", &options);
  *result = CopyOut(s.ok() ? prophet::EngineOptionsJson(options) : s.message());
  return static_cast<int>(s.code());
}

}  // extern "C"
