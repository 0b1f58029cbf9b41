// C entry points for prophet_tf/runtime.py (ctypes): starting, stopping and inspecting the engine.
// They live in the op library so that the kernels and Python share one engine per process.
#include <algorithm>
#include <chrono>
#include <future>
#include <memory>
#include <sstream>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ops/core/engine.h"
#include "ops/core/fuser.h"
#include "ops/core/fusion.h"
#include "ops/core/gate.h"
#include "ops/core/step_meter.h"

namespace {
void CopyOut(const std::string& text, char* buf, int len) {
  if (buf == nullptr || len <= 0) return;
  std::snprintf(buf, static_cast<size_t>(len), "%s", text.c_str());
}
}  // namespace

extern "C" {

// `config` holds "key=value" lines (see ParseEngineOptions). Returns 0 on success, otherwise the
// status code, with the message in `error`.
__attribute__((visibility("default"))) int prophet_init(const char* config, char* error, int error_len) {
  prophet::EngineOptions options;
  prophet::Status s = prophet::ParseEngineOptions(config ? config : "", &options);
  if (s.ok()) s = prophet::InitGlobalEngine(options);
  if (!s.ok()) {
    CopyOut(s.message(), error, error_len);
    return static_cast<int>(s.code());
  }
  return 0;
}

__attribute__((visibility("default"))) void prophet_shutdown() { prophet::ShutdownGlobalEngine(); }

// Engine::SetSchedule. Returns 0, or the status code with the message in `error`.
__attribute__((visibility("default"))) int prophet_set_schedule(const char* schedule, char* error, int error_len) {
  prophet::Engine* e = prophet::GlobalEngine();
  prophet::Status s = e ? e->SetSchedule(schedule ? schedule : "")
                        : prophet::Status(prophet::Code::kFailedPrecondition, "the runtime is not running");
  if (!s.ok()) {
    CopyOut(s.message(), error, error_len);
    return static_cast<int>(s.code());
  }
  return 0;
}

// Engine::SetActiveLanes. Returns 0, or the status code with the message in `error`.
__attribute__((visibility("default"))) int prophet_set_io_threads(int lanes, char* error, int error_len) {
  prophet::Engine* e = prophet::GlobalEngine();
  prophet::Status s = e ? e->SetActiveLanes(lanes)
                        : prophet::Status(prophet::Code::kFailedPrecondition, "the runtime is not running");
  if (!s.ok()) {
    CopyOut(s.message(), error, error_len);
    return static_cast<int>(s.code());
  }
  return 0;
}

// Engine::SetTwoLevel. Returns 0, or the status code with the message in `error`.
__attribute__((visibility("default"))) int prophet_set_two_level(int on, char* error, int error_len) {
  prophet::Engine* e = prophet::GlobalEngine();
  prophet::Status s = e ? e->SetTwoLevel(on != 0)
                        : prophet::Status(prophet::Code::kFailedPrecondition, "the runtime is not running");
  if (!s.ok()) {
    CopyOut(s.message(), error, error_len);
    return static_cast<int>(s.code());
  }
  return 0;
}

// Engine::DeclareFusion. `tensors`: one line per tensor, as prophet::FusionDeclarationLine
// writes it (fuser.h); `bucket_bytes` as ResolveFusionBytes's setting (-1: automatic, for links of `link_Bps`
// bytes/s, 0: the assumed rate; 0: none fused). Waits for the engine to apply it. Returns 0, or the
// status code with the message in `error`.
__attribute__((visibility("default"))) int prophet_declare_fusion(const char* group, const char* tensors,
                                                                  long long bucket_bytes, double link_Bps,
                                                                  char* error, int error_len) {
  prophet::Engine* e = prophet::GlobalEngine();
  prophet::Status s = e ? prophet::Status::OK()
                        : prophet::Status(prophet::Code::kFailedPrecondition, "the runtime is not running");
  std::vector<prophet::FusionDeclaration> declared;
  std::istringstream lines(tensors ? tensors : "");
  std::string line;
  while (s.ok() && std::getline(lines, line)) {
    if (line.empty()) continue;
    prophet::FusionDeclaration d;
    if (!prophet::ParseFusionDeclarationLine(line, &d))
      s = prophet::Status(prophet::Code::kInvalidArgument, "bad fusion declaration line '" + line + "'");
    declared.push_back(std::move(d));
  }
  if (s.ok()) {
    auto applied = std::make_shared<std::promise<prophet::Status>>();
    std::future<prophet::Status> answer = applied->get_future();
    const uint64_t bytes = prophet::ResolveFusionBytes(bucket_bytes, e->world_size(), link_Bps);
    e->DeclareFusion(group ? group : "", std::move(declared), bytes,
                     [applied](const prophet::Status& status) { applied->set_value(status); });
    s = answer.wait_for(std::chrono::seconds(60)) == std::future_status::ready
            ? answer.get()
            : prophet::Status(prophet::Code::kDeadlineExceeded, "the runtime did not apply the fusion declaration within 60 s");
  }
  if (!s.ok()) {
    CopyOut(s.message(), error, error_len);
    return static_cast<int>(s.code());
  }
  return 0;
}

// Engine::SchedulerStateJson ("{}" without an engine); returns the length it needs (call again with
// more room if that is >= len).
__attribute__((visibility("default"))) int prophet_scheduler_state(char* buf, int len) {
  prophet::Engine* e = prophet::GlobalEngine();
  const std::string json = e ? e->SchedulerStateJson() : "{}";
  CopyOut(json, buf, len);
  return static_cast<int>(json.size());
}

__attribute__((visibility("default"))) int prophet_is_initialized() {
  return prophet::GlobalEngine() != nullptr ? 1 : 0;
}

__attribute__((visibility("default"))) int prophet_rank() {
  prophet::Engine* e = prophet::GlobalEngine();
  return e ? e->rank() : -1;
}

__attribute__((visibility("default"))) int prophet_world_size() {
  prophet::Engine* e = prophet::GlobalEngine();
  return e ? e->world_size() : -1;
}

// Writes a JSON object of counters; returns the length it needs (call again with more room if
// that is >= len).
__attribute__((visibility("default"))) int prophet_stats(char* buf, int len) {
  prophet::Engine* e = prophet::GlobalEngine();
  const std::string json = e ? e->StatsJson() : "{}";
  CopyOut(json, buf, len);
  return static_cast<int>(json.size());
}

// Adds a span (start_ns < end_ns) or, with end_ns <= start_ns, an instant to this worker's trace,
// e.g. the strategy's step markers. Times are CLOCK_MONOTONIC nanoseconds (time.monotonic_ns()).
__attribute__((visibility("default"))) void prophet_timeline_event(const char* track, const char* name,
                                                                   long long start_ns, long long end_ns) {
  prophet::Engine* e = prophet::GlobalEngine();
  if (e == nullptr || !e->timeline().enabled()) return;
  if (end_ns > start_ns) e->timeline().Complete(track, name, start_ns, end_ns);
  else e->timeline().Instant(track, name, start_ns);
}

// Number of deferred updates (crossing the barrier) not applied yet, over all variables.
__attribute__((visibility("default"))) long long prophet_pending_updates() {
  return static_cast<long long>(prophet::GlobalGates().pending());
}

// The step report (ops/core/step_meter.h; prophet_tf/_keras/step_report.py). A step is a call of
// the train function: begin before it, end after it returns.
__attribute__((visibility("default"))) void prophet_step_meter_reset() { prophet::GlobalStepMeter().Reset(); }

__attribute__((visibility("default"))) void prophet_step_begin() {
  prophet::GlobalStepMeter().BeginStep(prophet::NowNs());
}

// Ends the step and writes, in this order, up to `n` of: step_ns, wait_ns, gate_wait_ns,
// barrier_wait_ns, gate_lower_ns, gate_upper_ns, first_gradient_ns, forward_reference_ns.
// Returns how many it wrote.
__attribute__((visibility("default"))) int prophet_step_end(long long* out, int n) {
  const prophet::StepMeasure m = prophet::GlobalStepMeter().EndStep(prophet::NowNs());
  const long long values[] = {m.step_ns,         m.wait_ns,        m.gate_wait_ns,      m.barrier_wait_ns,
                              m.gate_lower_ns,   m.gate_upper_ns,  m.first_gradient_ns, m.forward_reference_ns};
  const int count = std::min<int>(n, static_cast<int>(sizeof(values) / sizeof(values[0])));
  for (int i = 0; i < count; ++i) out[i] = values[i];
  return count;
}

// Bytes this worker has written to its peers since start-up (0 without a runtime).
__attribute__((visibility("default"))) long long prophet_bytes_sent() {
  prophet::Engine* e = prophet::GlobalEngine();
  return e != nullptr ? static_cast<long long>(e->BytesSent()) : 0;
}

// Writes out what the timeline has buffered (e.g. before a process leaves through _exit).
__attribute__((visibility("default"))) void prophet_timeline_flush() {
  prophet::Engine* e = prophet::GlobalEngine();
  if (e != nullptr) e->timeline().Flush();
}

__attribute__((visibility("default"))) int prophet_timeline_enabled() {
  prophet::Engine* e = prophet::GlobalEngine();
  return e != nullptr && e->timeline().enabled() ? 1 : 0;
}

}  // extern "C"
