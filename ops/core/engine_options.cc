#include "ops/core/engine_options.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <sstream>
#include <system_error>

#include "ops/core/codec.h"
#include "ops/core/hosts.h"
#include "ops/core/partition.h"
#include "ops/core/wire.h"

namespace prophet {

uint64_t LaneSliceFromBytes(int lanes, int world_size) {
  if (lanes <= 1) return 0;
  const uint64_t slice = std::max<uint64_t>(kMinLaneSliceBytes, static_cast<uint64_t>(std::max(world_size, 1)) * kDefaultMinSplitBytes);
  return static_cast<uint64_t>(lanes) * slice;
}

bool TravelsInSlices(uint64_t bytes, uint64_t element_size, int lanes, int world_size) {
  const uint64_t from = LaneSliceFromBytes(lanes, world_size);
  return from > 0 && element_size > 0 && bytes % element_size == 0 && bytes >= from;
}

uint64_t ResolveCreditBytes(uint64_t setting, int world_size, uint64_t partition_bytes) {
  if (setting != kCreditAuto) return setting;
  const uint64_t peers = static_cast<uint64_t>(std::max(world_size - 1, 1));
  return std::max(kMinCreditBytes, peers * partition_bytes);
}

namespace {

// The shortest text that reads back as the same double.
std::string Number(double value) {
  char buffer[32];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string Lower(std::string text) {
  for (char& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// Parsing a value of each option type: the whole text, or false.
bool ParseValue(const std::string& text, int* out) {
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}
bool ParseValue(const std::string& text, uint64_t* out) {
  const char* end = text.data() + text.size();
  const auto r = std::from_chars(text.data(), end, *out);
  return r.ec == std::errc() && r.ptr == end;
}
bool ParseValue(const std::string& text, double* out) {
  size_t used = 0;
  try {
    *out = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used == text.size() && std::isfinite(*out);
}
bool ParseValue(const std::string& text, bool* out) {
  const std::string t = Lower(text);
  if (t == "1" || t == "true" || t == "yes") *out = true;
  else if (t == "0" || t == "false" || t == "no") *out = false;
  else return false;
  return true;
}
bool ParseValue(const std::string& text, std::string* out) {
  *out = text;
  return true;
}
bool ParseValue(const std::string& text, Strings* out) {
  out->clear();
  std::istringstream parts(text);
  std::string part;
  while (std::getline(parts, part, ',')) out->push_back(part);
  return true;
}
bool ParseValue(const std::string& text, Hierarchy* out) { return ParseHierarchy(Lower(text), out); }

// Whether a parsed value is one the option accepts (its type's own checks are the parser's).
bool Within(double value, const Accepts& a) {
  for (int i = 0; i < a.specials; ++i)
    if (value == a.special_value[i]) return true;
  if (!a.bounded) return true;
  return a.bound_excluded ? value > a.bound : value >= a.bound;
}
bool Within(int value, const Accepts& a) { return Within(static_cast<double>(value), a); }
bool Within(uint64_t value, const Accepts& a) { return Within(static_cast<double>(value), a); }
bool Within(const std::string& value, const Accepts& a) {
  if (a.names == nullptr) return true;
  for (int i = 0; i < a.name_count; ++i)
    if (value == a.names[i]) return true;
  return false;
}
template <typename T>
bool Within(const T&, const Accepts&) {
  return true;
}

// What each type is called in the option table and in errors.
const char* TypeName(const int*) { return "int"; }
const char* TypeName(const uint64_t*) { return "uint"; }
const char* TypeName(const double*) { return "float"; }
const char* TypeName(const bool*) { return "bool"; }
const char* TypeName(const std::string*) { return "string"; }
const char* TypeName(const Strings*) { return "list"; }
const char* TypeName(const Hierarchy*) { return "string"; }

const char* Noun(const char* type) {
  const std::string t = type;
  if (t == "int") return "an integer";
  if (t == "uint") return "a whole number";
  if (t == "float") return "a number";
  if (t == "bool") return "true or false (1 or 0)";
  if (t == "list") return "a comma-separated list";
  return "text";
}

// "a, b or c".
std::string Enumeration(const std::vector<std::string>& parts) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? "" : i + 1 == parts.size() ? " or " : ", ") + parts[i];
  return out;
}

// "-1 (sized for the workers), 0 (the kernel's autotuning) or an integer of at least 131072".
std::string Describe(const char* type, const Accepts& a) {
  std::vector<std::string> parts;
  if (a.names != nullptr) {
    for (int i = 0; i < a.name_count; ++i) parts.push_back(a.names[i]);
    return "one of " + Enumeration(parts);
  }
  for (int i = 0; i < a.specials; ++i) parts.push_back(Number(a.special_value[i]) + " (" + a.special_means[i] + ")");
  std::string main = Noun(type);
  if (a.bounded) main += std::string(a.bound_excluded ? " above " : " of at least ") + Number(a.bound);
  parts.push_back(main);
  return Enumeration(parts);
}

template <typename T>
Status ParseChecked(const char* name, const std::string& text, const Accepts& accepts, T* field) {
  T value = *field;
  if (!ParseValue(text, &value) || !Within(value, accepts))
    return Status(Code::kInvalidArgument, std::string("runtime option ") + name + " must be " +
                                              Describe(TypeName(field), accepts) + ", got '" + text + "'");
  *field = value;
  return Status::OK();
}

// JSON of a value of each option type.
std::string Json(int value) { return std::to_string(value); }
std::string Json(uint64_t value) { return std::to_string(value); }
std::string Json(double value) { return Number(value); }
std::string Json(bool value) { return value ? "true" : "false"; }
std::string Json(const std::string& value) {
  std::string out;
  AppendJsonString(value, &out);
  return out;
}
std::string Json(const char* value) { return Json(std::string(value)); }
std::string Json(const Strings& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + Json(values[i]);
  return out + "]";
}
std::string Json(Hierarchy value) { return Json(HierarchyName(value)); }

// One row of the option table, as RuntimeConstantsJson describes it.
std::string OptionJson(const char* name, const char* type, const std::string& default_json, const Accepts& a,
                       unsigned use, const char* env, const char* doc) {
  std::string out = "{\"name\": " + Json(name) + ", \"type\": " + Json(type) + ", \"default\": " + default_json +
                    ", \"accepts\": " +
                    Json(a.bounded || a.specials > 0 || a.names != nullptr ? Describe(type, a) : "") +
                    ", \"specials\": [";
  for (int i = 0; i < a.specials; ++i)
    out += (i ? ", [" : "[") + Number(a.special_value[i]) + ", " + Json(a.special_means[i]) + "]";
  out += "], \"choices\": [";
  for (int i = 0; i < a.name_count; ++i) out += (i ? ", " : "") + Json(a.names[i]);
  out += "], \"use\": " + Json((use & kJob) ? "job" : "user") + ", \"predicted\": " + Json((use & kPredicted) != 0) +
         ", \"env\": " + (*env ? Json(env) : std::string("null")) + ", \"doc\": " + Json(doc) + "}";
  return out;
}

}  // namespace

Status ParseEngineOption(const std::string& key, const std::string& value, EngineOptions* o) {
#define PROPHET_OPTION(TYPE, NAME, DEFAULT, ACCEPTS, USE, ENV, DOC) \
  if (key == #NAME) return ParseChecked(#NAME, value, ACCEPTS, &o->NAME);
#include "ops/core/engine_options.def"
#undef PROPHET_OPTION
  return Status(Code::kInvalidArgument, "unknown runtime option '" + key + "'");
}

unsigned EngineOptionUse(const std::string& key) {
#define PROPHET_OPTION(TYPE, NAME, DEFAULT, ACCEPTS, USE, ENV, DOC) \
  if (key == #NAME) return USE;
#include "ops/core/engine_options.def"
#undef PROPHET_OPTION
  return 0;
}

Status ParseEngineOptions(const std::string& text, EngineOptions* o) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return Status(Code::kInvalidArgument, "bad option line '" + line + "'");
    const Status s = ParseEngineOption(line.substr(0, eq), line.substr(eq + 1), o);
    if (!s.ok()) return s;
  }
  if (o->rank >= o->world_size)
    return Status(Code::kInvalidArgument, "rank " + std::to_string(o->rank) + " outside [0, " +
                                              std::to_string(o->world_size) + ")");
  if (o->world_size > 1 && static_cast<int>(o->addresses.size()) != o->world_size)
    return Status(Code::kInvalidArgument, std::to_string(o->addresses.size()) + " addresses for " +
                                              std::to_string(o->world_size) + " workers");
  if (!o->hosts.empty() && static_cast<int>(o->hosts.size()) != o->world_size)
    return Status(Code::kInvalidArgument, "hosts names " + std::to_string(o->hosts.size()) + " host(s) for " +
                                              std::to_string(o->world_size) +
                                              " workers: give one host label per rank, in rank order");
  if (o->world_size > 1 && o->token.empty() && !o->allow_no_token)
    return Status(Code::kInvalidArgument,
                  "a job of " + std::to_string(o->world_size) +
                      " workers needs a job token, and none was given: set the same random PROPHET_JOB_TOKEN on "
                      "every worker (e.g. export PROPHET_JOB_TOKEN=$(python3 -c 'import secrets; "
                      "print(secrets.token_hex(16))'); python -m prophet_tf.launch sets one for you), or opt out "
                      "explicitly with allow_no_token=True (or PROPHET_ALLOW_NO_TOKEN=1), which lets any process "
                      "that can reach the workers' ports join the job");
  if (o->io_threads > kMaxIoThreads)
    return Status(Code::kInvalidArgument, "io_threads " + std::to_string(o->io_threads) + " is more than " +
                                              std::to_string(kMaxIoThreads) +
                                              ": each thread needs a core, and a lane's connection to every peer");
  // Frames of a partition arrive before their operation: the early-frame memory holds one at least.
  const uint64_t partition_bytes = ResolvePartitionBytes(o->partition_bytes, o->schedule);
  if (o->max_early_bytes < partition_bytes)
    return Status(Code::kInvalidArgument, "max_early_bytes (" + std::to_string(o->max_early_bytes) +
                                              ") must be at least partition_bytes (" +
                                              std::to_string(partition_bytes) + ")");
  return Status::OK();
}

std::string EngineOptionsJson(const EngineOptions& o) {
  std::string out = "{";
#define PROPHET_OPTION(TYPE, NAME, DEFAULT, ACCEPTS, USE, ENV, DOC) \
  out += (out.size() > 1 ? ", \"" : "\"") + std::string(#NAME) + "\": " + Json(o.NAME);
#include "ops/core/engine_options.def"
#undef PROPHET_OPTION
  return out + "}";
}

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
     << ", \"auto_lanes\": " << kAutoLanes << ", \"lane_slice_bytes\": " << kMinLaneSliceBytes
     << ", \"two_level_margin\": " << kTwoLevelMargin
     << ", \"options\": [";
  first = true;
#define PROPHET_OPTION(TYPE, NAME, DEFAULT, ACCEPTS, USE, ENV, DOC)                                 \
  os << (first ? "\n  " : ",\n  ") << OptionJson(#NAME, TypeName(&d.NAME), Json(d.NAME), ACCEPTS, USE, ENV, DOC); \
  first = false;
#include "ops/core/engine_options.def"
#undef PROPHET_OPTION
  os << "], \"schedule_traits\": " << ScheduleTraitsJson() << "}";
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
