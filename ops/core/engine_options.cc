#include "ops/core/engine_options.h"

#include <algorithm>
#include <charconv>
#include <sstream>

#include "ops/core/codec.h"
#include "ops/core/wire.h"

namespace prophet {

uint64_t ResolveCreditBytes(uint64_t setting, int world_size, uint64_t partition_bytes) {
  if (setting != kCreditAuto) return setting;
  const uint64_t peers = static_cast<uint64_t>(std::max(world_size - 1, 1));
  return std::max(kMinCreditBytes, peers * partition_bytes);
}

Status ParseEngineOptions(const std::string& text, EngineOptions* o) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return Status(Code::kInvalidArgument, "bad option line '" + line + "'");
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    try {
      if (key == "rank") o->rank = std::stoi(value);
      else if (key == "world_size") o->world_size = std::stoi(value);
      else if (key == "addresses") {
        o->addresses.clear();
        std::istringstream parts(value);
        std::string a;
        while (std::getline(parts, a, ',')) o->addresses.push_back(a);
      } else if (key == "token") o->token = value;
      else if (key == "allow_no_token") o->allow_no_token = value == "1";
      else if (key == "bind_host") o->bind_host = value;
      else if (key == "schedule") o->schedule = value;
      else if (key == "partition_bytes") o->partition_bytes = std::stoull(value);
      else if (key == "credit_bytes") o->credit_bytes = std::stoull(value);
      else if (key == "timeout_s") o->timeout_s = std::stod(value);
      else if (key == "replan_threshold") o->replan_threshold = std::stod(value);
      else if (key == "connect_timeout_s") o->connect_timeout_s = std::stod(value);
      else if (key == "heartbeat_s") o->heartbeat_s = std::stod(value);
      else if (key == "socket_buffer_bytes") o->socket_buffer_bytes = std::stoi(value);
      else if (key == "socket_unsent_bytes") o->socket_unsent_bytes = std::stoi(value);
      else if (key == "max_early_bytes") o->max_early_bytes = std::stoull(value);
      else if (key == "timeline_path") o->timeline_path = value;
      else if (key == "hierarchical") {
        if (!ParseHierarchy(value, &o->hierarchical))
          return Status(Code::kInvalidArgument, "runtime option hierarchical must be off, on or auto, got '" + value + "'");
      } else if (key == "hosts") {
        o->hosts.clear();
        std::istringstream parts(value);
        std::string h;
        while (std::getline(parts, h, ',')) o->hosts.push_back(h);
      }
      else return Status(Code::kInvalidArgument, "unknown runtime option '" + key + "'");
    } catch (const std::exception&) {
      return Status(Code::kInvalidArgument, "runtime option " + key + " has an invalid value '" + value + "'");
    }
  }
  if (o->world_size < 1) return Status(Code::kInvalidArgument, "world_size must be at least 1");
  if (o->rank < 0 || o->rank >= o->world_size)
    return Status(Code::kInvalidArgument, "rank " + std::to_string(o->rank) + " outside [0, " +
                                              std::to_string(o->world_size) + ")");
  if (o->world_size > 1 && static_cast<int>(o->addresses.size()) != o->world_size)
    return Status(Code::kInvalidArgument, std::to_string(o->addresses.size()) + " addresses for " +
                                              std::to_string(o->world_size) + " workers");
  if (o->world_size > 1 && o->token.empty() && !o->allow_no_token)
    return Status(Code::kInvalidArgument,
                  "a job of " + std::to_string(o->world_size) +
                      " workers needs a job token, and none was given: set the same random PROPHET_JOB_TOKEN on "
                      "every worker (e.g. export PROPHET_JOB_TOKEN=$(python3 -c 'import secrets; "
                      "print(secrets.token_hex(16))'); python -m prophet_tf.launch sets one for you), or opt out "
                      "explicitly with allow_no_token=True (or PROPHET_ALLOW_NO_TOKEN=1), which lets any process "
                      "that can reach the workers' ports join the job");
  if (o->partition_bytes != kPartitionAuto && o->partition_bytes < 64)
    return Status(Code::kInvalidArgument, "partition_bytes must be 0 (the schedule's) or at least 64, got " +
                                              std::to_string(o->partition_bytes));
  if (o->timeout_s <= 0) return Status(Code::kInvalidArgument, "timeout_s must be positive");
  const uint64_t partition_bytes = ResolvePartitionBytes(o->partition_bytes, o->schedule);
  if (o->max_early_bytes < partition_bytes)
    return Status(Code::kInvalidArgument, "max_early_bytes (" + std::to_string(o->max_early_bytes) +
                                              ") must be at least partition_bytes (" +
                                              std::to_string(partition_bytes) + ")");
  if (o->socket_buffer_bytes < kSocketBufferAuto ||
      (o->socket_buffer_bytes > 0 && o->socket_buffer_bytes < kMinSocketBufferBytes))
    return Status(Code::kInvalidArgument,
                  "socket_buffer_bytes must be -1 (send buffers sized for the workers, the default), 0 (the "
                  "kernel's autotuning) or at least " +
                      std::to_string(kMinSocketBufferBytes) + ", got " + std::to_string(o->socket_buffer_bytes) +
                      ": a receive buffer smaller than two TCP segments (64 KiB each over loopback) closes the window "
                      "below one segment, and the connection then moves a few bytes per retransmission timeout");
  if (o->socket_unsent_bytes < 0)
    return Status(Code::kInvalidArgument, "socket_unsent_bytes must be 0 (no limit) or positive, got " +
                                              std::to_string(o->socket_unsent_bytes));
  if (o->heartbeat_s < 0 || (o->heartbeat_s > 0 && o->heartbeat_s < 0.2))
    return Status(Code::kInvalidArgument, "heartbeat_s must be 0 (off) or at least 0.2 s, got " +
                                              SecondsString(o->heartbeat_s));
  return Status::OK();
}

namespace {
// The shortest text that reads back as the same double.
std::string Number(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}
}  // namespace

std::string RuntimeConstantsJson() {
  const EngineOptions d;
  std::ostringstream os;
  os << "{\"schedules\": [";
  bool first = true;
  for (const char* name : kScheduleNames) {
    os << (first ? "" : ", ") << '"' << name << '"';
    first = false;
  }
  os << "], \"compressions\": [";
  first = true;
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
    os << (first ? "" : ", ") << '"' << EncodingName(e) << '"';
    first = false;
  }
  os << "], \"control_priority\": " << kControlPriority << ", \"protocol_version\": " << kProtocolVersion
     << ", \"defaults\": {\"schedule\": \"" << d.schedule
     << "\", \"partition_bytes\": " << d.partition_bytes << ", \"credit_bytes\": " << d.credit_bytes
     << ", \"replan_threshold\": " << Number(d.replan_threshold) << ", \"timeout_s\": " << Number(d.timeout_s)
     << ", \"connect_timeout_s\": " << Number(d.connect_timeout_s) << ", \"heartbeat_s\": " << Number(d.heartbeat_s)
     << ", \"socket_buffer_bytes\": " << d.socket_buffer_bytes << ", \"socket_unsent_bytes\": "
     << d.socket_unsent_bytes << ", \"max_early_bytes\": " << d.max_early_bytes << ", \"hierarchical\": \""
     << HierarchyName(d.hierarchical) << "\"}, \"schedule_traits\": " << ScheduleTraitsJson() << "}";
  return os.str();
}

int SendBufferRequest(int setting, int world_size, int64_t wmem_max) {
  if (setting != kSocketBufferAuto) return std::max(setting, 0);
  if (world_size < 3) return 0;
  const int64_t committed = std::max(kMinAutoSendBufferBytes, kSocketBudgetBytes / (world_size - 1));
  const int64_t request = committed / 2;
  if (wmem_max <= 0 || request > wmem_max) return 0;
  return static_cast<int>(request);
}

}  // namespace prophet
