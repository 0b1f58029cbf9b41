// Chrome trace ("traceEvents" JSON, opens in Perfetto and chrome://tracing) of one worker.
//
// One process per worker (pid = rank, named "worker N") and one thread row per track ("ready",
// "queue", "block", "push", "sum", "pull", "apply", "step", ...), so that the traces of all
// workers, loaded together, show one band per worker with one row per track. Timestamps are
// CLOCK_MONOTONIC microseconds: every worker on one machine shares that clock, so their traces line
// up without any exchange.
//
// The file is valid JSON after every flush, not only after Close(): each flush writes the closing
// "]}" and the next one writes over it. A crash therefore loses at most the events since the last
// flush (every 256 KiB or 1 s of buffered events, and at Flush()/Close()).
//
// Thread-safe (one mutex around a buffered writer). When no file is open, each call costs one
// branch on an atomic flag; callers that build names or args with string formatting should check
// enabled() first so that the formatting is skipped too.
#ifndef PROPHET_OPS_CORE_TIMELINE_H_
#define PROPHET_OPS_CORE_TIMELINE_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>

namespace prophet {

class Timeline {
 public:
  Timeline() = default;
  ~Timeline() { Close(); }
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // Creates (truncates) `path`. False with *error set when it cannot be written or when a file is
  // already open. The worker's process is named "<process_label> <rank>" (a simulated run's trace
  // says "predicted worker 0", so that it is told apart from a real one drawn beside it).
  bool Open(const std::string& path, int rank, std::string* error,
            const std::string& process_label = "worker");
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // A span on `track` (phase "X"). `args_json` is a JSON object ("{\"bytes\":4096}") shown in the
  // viewer's details pane; anything else is stored as {"detail": "<text>"}.
  void Complete(const char* track, const std::string& name, int64_t start_ns, int64_t end_ns,
                const std::string& args_json = "") {
    if (enabled()) WriteComplete(track, name, start_ns, end_ns, args_json);
  }
  // A point event on `track` (phase "i").
  void Instant(const char* track, const std::string& name, int64_t ts_ns) {
    if (enabled()) WriteInstant(track, name, ts_ns);
  }
  // A sample of the counter `name` (phase "C"), e.g. bandwidth in MB/s. Non-finite values are
  // dropped (JSON has no NaN).
  void Counter(const char* name, int64_t ts_ns, double value) {
    if (enabled()) WriteCounter(name, ts_ns, value);
  }

  void Flush();
  // Writes what is buffered and the closing brackets; safe to call twice.
  void Close();

 private:
  void WriteComplete(const char* track, const std::string& name, int64_t start_ns, int64_t end_ns,
                     const std::string& args_json);
  void WriteInstant(const char* track, const std::string& name, int64_t ts_ns);
  void WriteCounter(const char* name, int64_t ts_ns, double value);
  // All below require mu_.
  int TrackIdLocked(const char* track);
  void AppendEventLocked(const std::string& event);
  void MaybeFlushLocked();  // every kFlushBytes of buffered events or kFlushIntervalNs
  void FlushLocked();

  std::atomic<bool> enabled_{false};
  std::mutex mu_;
  std::FILE* file_ = nullptr;
  int rank_ = 0;
  std::string buffer_;
  bool wrote_event_ = false;
  int64_t last_flush_ns_ = 0;
  std::map<std::string, int> track_ids_;
  int next_extra_track_id_ = 100;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_TIMELINE_H_
