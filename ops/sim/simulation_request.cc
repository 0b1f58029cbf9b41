#include "ops/sim/simulation_request.h"

#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <sstream>

#include "ops/core/engine_options.h"
#include "ops/core/small_allreduce.h"

namespace prophet {

namespace {

std::string Trim(const std::string& s) {
  const size_t first = s.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t\r") - first + 1);
}

bool ParseBool(const std::string& value, bool* out) {
  if (value == "1" || value == "true") {
    *out = true;
    return true;
  }
  if (value == "0" || value == "false") {
    *out = false;
    return true;
  }
  return false;
}

void AppendNumber(double value, std::string* out) {
  if (!std::isfinite(value)) {
    out->append("null");
    return;
  }
  char buffer[40];
  std::snprintf(buffer, sizeof(buffer), "%.9g", value);
  out->append(buffer);
}

// Setters of every option, by key.
std::map<std::string, std::function<bool(const std::string&)>> OptionSetters(SimulationRequest* r) {
  auto i64 = [](int64_t* field) {
    return [field](const std::string& v) {
      size_t used = 0;
      *field = std::stoll(v, &used);
      return used == v.size();
    };
  };
  auto u64 = [](uint64_t* field) {
    return [field](const std::string& v) {
      size_t used = 0;
      if (!v.empty() && v[0] == '-') return false;
      *field = std::stoull(v, &used);
      return used == v.size();
    };
  };
  auto integer = [](int* field) {
    return [field](const std::string& v) {
      size_t used = 0;
      *field = std::stoi(v, &used);
      return used == v.size();
    };
  };
  auto real = [](double* field) {
    return [field](const std::string& v) {
      size_t used = 0;
      *field = std::stod(v, &used);
      return used == v.size() && std::isfinite(*field);
    };
  };
  auto boolean = [](bool* field) { return [field](const std::string& v) { return ParseBool(v, field); }; };
  auto text = [](std::string* field) {
    return [field](const std::string& v) {
      *field = v;
      return true;
    };
  };
  return {
      {"launch_ns", i64(&r->profile.launch_ns)},
      {"backward_ns", i64(&r->profile.backward_ns)},
      {"tail_ns", i64(&r->profile.tail_ns)},
      {"gap_ns", i64(&r->profile.gap_ns)},
      {"workers", integer(&r->network.workers)},
      {"workers_per_host", integer(&r->network.workers_per_host)},
      {"loopback_Bps", real(&r->network.loopback_Bps)},
      {"link_Bps", real(&r->network.link_Bps)},
      {"ingress_limited", boolean(&r->network.ingress_limited)},
      {"latency_ns", i64(&r->network.latency_ns)},
      {"payload_efficiency", real(&r->network.payload_efficiency)},
      {"frame_overhead_bytes", u64(&r->network.frame_overhead_bytes)},
      {"max_socket_buffer_bytes", u64(&r->network.max_socket_buffer_bytes)},
      {"autotuned_socket_buffer_bytes", u64(&r->network.autotuned_socket_buffer_bytes)},
      {"sender_queue_s", real(&r->network.sender_queue_s)},
      {"sum_Bps", real(&r->network.sum_Bps)},
      {"message_send_ns", i64(&r->network.message_send_ns)},
      {"message_receive_ns", i64(&r->network.message_receive_ns)},
      {"send_byte_ns", real(&r->network.send_byte_ns)},
      {"receive_byte_ns", real(&r->network.receive_byte_ns)},
      {"sum_byte_ns", real(&r->network.sum_byte_ns)},
      {"cast_byte_ns", real(&r->network.cast_byte_ns)},
      {"copy_byte_ns", real(&r->network.copy_byte_ns)},
      {"shared_cores", integer(&r->network.shared_cores)},
      {"io_threads", integer(&r->network.io_threads)},
      {"schedule", text(&r->runtime.schedule)},
      {"cross_barrier", boolean(&r->runtime.cross_barrier)},
      {"apply_threads", integer(&r->runtime.apply_threads)},
      {"ring_chunk_bytes", u64(&r->runtime.ring_chunk_bytes)},
      {"ring_max_subdivs", integer(&r->runtime.ring_max_subdivs)},
      {"ring_message_ns", i64(&r->runtime.ring_message_ns)},
      {"fusion_bytes", i64(&r->runtime.fusion_bytes)},
      {"small_allreduce", [r](const std::string& v) { return ParseSmallAllreduce(v, &r->runtime.small_allreduce); }},
      {"warmup_steps", integer(&r->options.warmup_steps)},
      {"steps", integer(&r->options.steps)},
      {"timeline_path", text(&r->options.timeline_path)},
      {"timeline_workers", integer(&r->options.timeline_workers)},
      {"compression", [r](const std::string& v) { return ParseEncoding(v, &r->compression); }},
  };
}

// The engine's options that the predictor models (kPredicted in engine_options.def), parsed and
// checked as the engine does, into the models' fields.
void ModelEngineOptions(const EngineOptions& e, SimulationRequest* r) {
  r->runtime.partition_bytes = e.partition_bytes;
  r->runtime.credit_bytes = e.credit_bytes;
  r->runtime.replan_threshold = e.replan_threshold;
  r->runtime.hierarchical = e.hierarchical;
  r->runtime.heartbeat_ns = static_cast<int64_t>(e.heartbeat_s * 1e9);
  r->network.socket_buffer_bytes = e.socket_buffer_bytes;
  r->network.socket_unsent_bytes = static_cast<uint64_t>(e.socket_unsent_bytes);
}

}  // namespace

Status ParseSimulationRequest(const std::string& text, SimulationRequest* request) {
  *request = SimulationRequest();
  const auto setters = OptionSetters(request);
  EngineOptions engine;
  std::istringstream in(text);
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const std::string trimmed = Trim(line);
    if (trimmed.empty() || trimmed[0] == '#') continue;
    auto bad = [&](const std::string& why) {
      return Status(Code::kInvalidArgument, "simulation request line " + std::to_string(number) + " ('" +
                                                trimmed.substr(0, 120) + "'): " + why);
    };
    std::istringstream fields(trimmed);
    std::string kind;
    fields >> kind;
    try {
      if (kind == "option") {
        std::string assignment;
        std::getline(fields, assignment);
        assignment = Trim(assignment);
        const size_t eq = assignment.find('=');
        if (eq == std::string::npos) return bad("expected option KEY=VALUE");
        const std::string key = assignment.substr(0, eq), value = assignment.substr(eq + 1);
        auto it = setters.find(key);
        if (it != setters.end()) {
          if (!it->second(value)) return bad("invalid value '" + value + "' for " + key);
        } else if (EngineOptionUse(key) & kPredicted) {
          const Status s = ParseEngineOption(key, value, &engine);
          if (!s.ok()) return bad(s.message());
        } else {
          return bad("unknown option '" + key + "'");
        }
      } else if (kind == "layer") {
        ModelLayer layer;
        if (!(fields >> layer.forward_ns >> layer.backward_ns)) return bad("expected layer FORWARD_NS BACKWARD_NS NAME");
        std::getline(fields, layer.name);
        layer.name = Trim(layer.name);
        request->profile.layers.push_back(std::move(layer));
      } else if (kind == "tensor") {
        ModelTensor tensor;
        if (!(fields >> tensor.bytes >> tensor.element_size >> tensor.priority >> tensor.layer >> tensor.ready_ns >>
              tensor.apply_ns)) {
          return bad("expected tensor BYTES ELEMENT_SIZE PRIORITY LAYER READY_NS APPLY_NS NAME");
        }
        std::getline(fields, tensor.name);
        tensor.name = Trim(tensor.name);
        if (tensor.name.empty()) return bad("the tensor has no name");
        request->profile.tensors.push_back(std::move(tensor));
      } else {
        return bad("unknown line kind '" + kind + "' (expected option, layer or tensor)");
      }
    } catch (const std::exception&) {
      return bad("a number is out of range or malformed");
    }
  }
  ModelEngineOptions(engine, request);
  CompressGradients(request->compression, &request->profile);
  return Status::OK();
}

std::string PredictionJson(const StepPrediction& p) {
  std::string out = "{\"step_s\": ";
  AppendNumber(p.step_s, &out);
  out += ", \"periods_s\": [";
  for (size_t i = 0; i < p.periods_s.size(); ++i) {
    if (i > 0) out += ", ";
    AppendNumber(p.periods_s[i], &out);
  }
  out += "], \"bandwidth_samples_Bps\": [";
  for (size_t i = 0; i < p.bandwidth_samples_Bps.size(); ++i) {
    if (i > 0) out += ", ";
    AppendNumber(p.bandwidth_samples_Bps[i], &out);
  }
  out += "]";
  const std::pair<const char*, double> numbers[] = {
      {"single_step_s", p.single_step_s}, {"compute_s", p.compute_s},
      {"comm_s", p.comm_s},               {"wire_bytes_per_step", p.wire_bytes_per_step},
      {"overlap", p.overlap},             {"gate_wait_s", p.gate_wait_s},
      {"bandwidth_Bps", p.bandwidth_Bps}, {"messages_per_step", p.messages_per_step},
      {"io_busy_s", p.io_busy_s},
      {"exchanged_per_step", p.exchanged_per_step},
      {"stall_breaks", static_cast<double>(p.stall_breaks)}};
  for (const auto& entry : numbers) {
    out += ", \"";
    out += entry.first;
    out += "\": ";
    AppendNumber(entry.second, &out);
  }
  out += ", \"policy\": ";
  AppendJsonString(p.policy, &out);
  out += ", \"tensor_times\": [";
  for (size_t i = 0; i < p.tensor_times.size(); ++i) {
    const TensorTiming& t = p.tensor_times[i];
    if (i > 0) out += ", ";
    out += "{\"name\": ";
    AppendJsonString(t.name, &out);
    out += ", \"ready_s\": ";
    AppendNumber(t.ready_s, &out);
    out += ", \"done_s\": ";
    AppendNumber(t.done_s, &out);
    out += ", \"applied_s\": ";
    AppendNumber(t.applied_s, &out);
    out += "}";
  }
  out += "]}";
  return out;
}

std::string IdealBoundJson(const IdealBound& bound) {
  std::string out = "{\"step_s\": ";
  AppendNumber(bound.step_s, &out);
  out += ", \"compute_s\": ";
  AppendNumber(bound.compute_s, &out);
  out += ", \"comm_s\": ";
  AppendNumber(bound.comm_s, &out);
  out += ", \"wait_s\": ";
  AppendNumber(bound.wait_s, &out);
  out += ", \"gradient_bytes\": " + std::to_string(bound.gradient_bytes);
  out += ", \"binding_layer\": " + std::to_string(bound.binding_layer) + ", \"done_s\": [";
  for (size_t i = 0; i < bound.done_s.size(); ++i) {
    if (i > 0) out += ", ";
    AppendNumber(bound.done_s[i] >= 0 ? bound.done_s[i] : std::nan(""), &out);
  }
  out += "]}";
  return out;
}

}  // namespace prophet
