#include "ops/core/timeline.h"

#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstring>

#include "ops/core/common.h"

namespace prophet {

namespace {

constexpr char kHeader[] = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
constexpr char kFooter[] = "\n]}\n";
constexpr size_t kFlushBytes = 256 << 10;
constexpr int64_t kFlushIntervalNs = 1'000'000'000;

// Tracks in the order the viewer should show them (the thread sort index); others follow.
constexpr const char* kKnownTracks[] = {"step", "forward", "backward", "ready", "queue",
                                        "block", "push", "sum", "pull", "apply"};

int64_t MonotonicNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Nanoseconds as microseconds with three decimals, exactly (no double rounding).
void AppendMicros(int64_t ns, std::string* out) {
  char buffer[40];
  const char* sign = ns < 0 ? "-" : "";
  const uint64_t magnitude = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  std::snprintf(buffer, sizeof(buffer), "%s%" PRIu64 ".%03" PRIu64, sign, magnitude / 1000,
                magnitude % 1000);
  out->append(buffer);
}

bool LooksLikeJsonObject(const std::string& text) {
  size_t first = text.find_first_not_of(" \t\n\r");
  size_t last = text.find_last_not_of(" \t\n\r");
  return first != std::string::npos && text[first] == '{' && text[last] == '}';
}

}  // namespace

bool Timeline::Open(const std::string& path, int rank, std::string* error,
                    const std::string& process_label) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ != nullptr) {
    *error = "timeline already open";
    return false;
  }
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) {
    *error = "cannot write timeline '" + path + "': " + std::strerror(errno);
    return false;
  }
  file_ = file;
  rank_ = rank;
  buffer_.assign(kHeader);
  wrote_event_ = false;
  track_ids_.clear();
  next_extra_track_id_ = 100;

  std::string event = "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
                      ",\"args\":{\"name\":";
  AppendJsonString(process_label + " " + std::to_string(rank), &event);
  event += "}}";
  AppendEventLocked(event);
  event = "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
          ",\"args\":{\"sort_index\":" + std::to_string(rank) + "}}";
  AppendEventLocked(event);
  FlushLocked();
  enabled_.store(true, std::memory_order_relaxed);
  return true;
}

int Timeline::TrackIdLocked(const char* track) {
  const std::string key = track != nullptr ? track : "";
  auto it = track_ids_.find(key);
  if (it != track_ids_.end()) return it->second;

  int id = -1;
  for (size_t i = 0; i < sizeof(kKnownTracks) / sizeof(kKnownTracks[0]); ++i) {
    if (key == kKnownTracks[i]) id = static_cast<int>(i) + 1;
  }
  if (id < 0) id = next_extra_track_id_++;
  track_ids_[key] = id;

  // Name the row and fix its position, once per track.
  std::string event = "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
                      ",\"tid\":" + std::to_string(id) + ",\"args\":{\"name\":";
  AppendJsonString(key, &event);
  event += "}}";
  AppendEventLocked(event);
  event = "{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
          ",\"tid\":" + std::to_string(id) + ",\"args\":{\"sort_index\":" + std::to_string(id) +
          "}}";
  AppendEventLocked(event);
  return id;
}

void Timeline::AppendEventLocked(const std::string& event) {
  buffer_.append(wrote_event_ ? ",\n" : "\n");
  buffer_.append(event);
  wrote_event_ = true;
}

void Timeline::WriteComplete(const char* track, const std::string& name, int64_t start_ns,
                             int64_t end_ns, const std::string& args_json) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;  // closed since the enabled() check
  const int tid = TrackIdLocked(track);
  std::string event = "{\"name\":";
  AppendJsonString(name, &event);
  event += ",\"cat\":";
  AppendJsonString(track != nullptr ? track : "", &event);
  event += ",\"ph\":\"X\",\"ts\":";
  AppendMicros(start_ns, &event);
  event += ",\"dur\":";
  AppendMicros(end_ns > start_ns ? end_ns - start_ns : 0, &event);
  event += ",\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(tid);
  if (!args_json.empty()) {
    event += ",\"args\":";
    if (LooksLikeJsonObject(args_json)) {
      event += args_json;
    } else {
      event += "{\"detail\":";
      AppendJsonString(args_json, &event);
      event += "}";
    }
  }
  event += "}";
  AppendEventLocked(event);
  MaybeFlushLocked();
}

void Timeline::WriteInstant(const char* track, const std::string& name, int64_t ts_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  const int tid = TrackIdLocked(track);
  std::string event = "{\"name\":";
  AppendJsonString(name, &event);
  event += ",\"ph\":\"i\",\"s\":\"t\",\"ts\":";
  AppendMicros(ts_ns, &event);
  event += ",\"pid\":" + std::to_string(rank_) + ",\"tid\":" + std::to_string(tid) + "}";
  AppendEventLocked(event);
  MaybeFlushLocked();
}

void Timeline::WriteCounter(const char* name, int64_t ts_ns, double value) {
  if (!std::isfinite(value)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  std::string event = "{\"name\":";
  AppendJsonString(name != nullptr ? name : "", &event);
  event += ",\"ph\":\"C\",\"ts\":";
  AppendMicros(ts_ns, &event);
  char value_text[40];
  std::snprintf(value_text, sizeof(value_text), "%.17g", value);
  event += ",\"pid\":" + std::to_string(rank_) + ",\"args\":{\"value\":" + value_text + "}}";
  AppendEventLocked(event);
  MaybeFlushLocked();
}

void Timeline::MaybeFlushLocked() {
  if (buffer_.size() >= kFlushBytes || MonotonicNs() - last_flush_ns_ >= kFlushIntervalNs) {
    FlushLocked();
  }
}

void Timeline::FlushLocked() {
  if (file_ == nullptr) return;
  // Write the pending events, then the footer, then step back over the footer: the file is valid
  // JSON now, and the next flush continues where the footer starts.
  buffer_.append(kFooter);
  std::fwrite(buffer_.data(), 1, buffer_.size(), file_);
  std::fflush(file_);
  std::fseek(file_, -static_cast<long>(sizeof(kFooter) - 1), SEEK_CUR);
  buffer_.clear();
  last_flush_ns_ = MonotonicNs();
}

void Timeline::Flush() {
  std::lock_guard<std::mutex> lock(mu_);
  FlushLocked();
}

void Timeline::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  enabled_.store(false, std::memory_order_relaxed);
  FlushLocked();
  std::fclose(file_);  // the footer is the last thing written, so the file ends with it
  file_ = nullptr;
}

}  // namespace prophet
