#include "ops/core/link_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace prophet {

LinkModel::LinkModel(const LinkOptions& options) : options_(options) {
  options_.hosts = std::max(1, options_.hosts);
  if (!(options_.payload_efficiency > 0 && options_.payload_efficiency <= 1)) options_.payload_efficiency = 1;
  connections_.resize(static_cast<size_t>(options_.hosts) * options_.hosts);
  hosts_.resize(options_.hosts);
}

double LinkModel::wire_bytes(const LinkFrame& frame) const {
  return static_cast<double>(frame.payload_bytes + options_.frame_overhead_bytes);
}

void LinkModel::Progress(int connection, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (!c.frames.empty() && now_ns > c.updated_ns) {
    c.head_left = std::max(0.0, c.head_left - c.rate * static_cast<double>(now_ns - c.updated_ns));
  }
  c.updated_ns = now_ns;
}

void LinkModel::HeapPlace(size_t at, int connection) {
  finishes_[at] = connection;
  connections_[connection].heap_at = static_cast<int>(at);
}

void LinkModel::HeapSiftUp(size_t at) {
  const int c = finishes_[at];
  while (at > 0) {
    const size_t parent = (at - 1) / 2;
    if (!FinishesBefore(c, finishes_[parent])) break;
    HeapPlace(at, finishes_[parent]);
    at = parent;
  }
  HeapPlace(at, c);
}

void LinkModel::HeapSiftDown(size_t at) {
  const int c = finishes_[at];
  const size_t n = finishes_.size();
  while (true) {
    size_t child = 2 * at + 1;
    if (child >= n) break;
    if (child + 1 < n && FinishesBefore(finishes_[child + 1], finishes_[child])) ++child;
    if (!FinishesBefore(finishes_[child], c)) break;
    HeapPlace(at, finishes_[child]);
    at = child;
  }
  HeapPlace(at, c);
}

void LinkModel::HeapRemove(int connection) {
  Connection& c = connections_[connection];
  if (c.heap_at < 0) return;
  const size_t at = static_cast<size_t>(c.heap_at);
  c.heap_at = -1;
  const int last = finishes_.back();
  finishes_.pop_back();
  if (last == connection) return;
  HeapPlace(at, last);
  HeapSiftUp(at);
  HeapSiftDown(static_cast<size_t>(connections_[last].heap_at));
}

void LinkModel::ScheduleFinish(int connection, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (c.frames.empty() || c.rate <= 0) {
    HeapRemove(connection);
    return;
  }
  c.finish_ns = now_ns + static_cast<int64_t>(std::ceil(c.head_left / c.rate));
  if (c.heap_at < 0) {
    finishes_.push_back(connection);
    HeapSiftUp(finishes_.size() - 1);
    return;
  }
  const size_t at = static_cast<size_t>(c.heap_at);
  HeapSiftUp(at);
  HeapSiftDown(static_cast<size_t>(c.heap_at));
}

void LinkModel::Reschedule(int src, int dst, int64_t now_ns) {
  const int n = options_.hosts;
  const double egress = options_.egress_Bps * options_.payload_efficiency / 1e9;
  const double ingress = options_.ingress_Bps * options_.payload_efficiency / 1e9;
  auto update = [&](int s, int d) {
    Connection& c = connections_[Index(s, d)];
    if (c.frames.empty()) return;
    Progress(Index(s, d), now_ns);
    double rate = egress / std::max(1, hosts_[s].sending);
    if (options_.ingress_Bps > 0) rate = std::min(rate, ingress / std::max(1, hosts_[d].receiving));
    if (rate == c.rate) return;
    c.rate = rate;
    ScheduleFinish(Index(s, d), now_ns);
  };
  for (int d = 0; d < n; ++d) update(src, d);
  if (options_.ingress_Bps > 0) {
    // Senders into `dst` see a new ingress share; their egress siblings do not change (see the
    // header: unused shares are not redistributed).
    for (int s = 0; s < n; ++s) update(s, dst);
  }
}

void LinkModel::SetActive(int connection, bool active, int64_t now_ns) {
  const int src = connection / options_.hosts, dst = connection % options_.hosts;
  Host& out = hosts_[src];
  if (active) {
    if (out.sending++ == 0) out.busy_since_ns = now_ns;
    ++hosts_[dst].receiving;
    Connection& c = connections_[connection];
    c.rate = 0;  // forces a finish event in Reschedule
    c.updated_ns = now_ns;
  } else {
    if (--out.sending == 0) out.egress_busy_ns += now_ns - out.busy_since_ns;
    --hosts_[dst].receiving;
  }
  Reschedule(src, dst, now_ns);
}

void LinkModel::NoteWritten(int connection, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (c.frames.empty()) return;
  // Stream offsets from the head's first byte: the socket holds up to `window` bytes beyond what
  // has been sent.
  const double sent = wire_bytes(c.frames[0].frame) - c.head_left;
  const double limit = sent + static_cast<double>(options_.socket_window_bytes);
  double end = 0;
  for (Queued& q : c.frames) {
    end += q.wire_bytes;
    if (end > limit + 1e-6) break;
    if (!q.written) {
      q.written = true;
      pending_.push_back({LinkEvent::kWritten, now_ns, q.frame});
    }
  }
}

void LinkModel::Queue(int64_t now_ns, const LinkFrame& frame) {
  now_ns = std::max(now_ns, now_ns_);
  now_ns_ = now_ns;
  const int connection = Index(frame.src, frame.dst);
  Connection& c = connections_[connection];
  Progress(connection, now_ns);
  Queued queued{frame, wire_bytes(frame), false};
  // Frames whose first byte is already in the socket keep their place (the head always is).
  const double sent = c.frames.empty() ? 0.0 : c.frames[0].wire_bytes - c.head_left;
  const double window_end = sent + static_cast<double>(options_.socket_window_bytes);
  size_t pinned = 0;
  double start = 0;
  for (const Queued& q : c.frames) {
    if (pinned > 0 && start >= window_end) break;
    ++pinned;
    start += q.wire_bytes;
  }
  size_t at = c.frames.size();
  while (at > pinned && c.frames[at - 1].frame.priority < frame.priority) --at;
  const bool was_empty = c.frames.empty();
  c.frames.insert(c.frames.begin() + static_cast<std::ptrdiff_t>(at), queued);
  if (was_empty) {
    c.head_left = queued.wire_bytes;
    SetActive(connection, true, now_ns);
  }
  NoteWritten(connection, now_ns);
}

int64_t LinkModel::NextEventNs() const {
  if (!pending_.empty()) return now_ns_;
  return finishes_.empty() ? std::numeric_limits<int64_t>::max() : connections_[finishes_.front()].finish_ns;
}

void LinkModel::AdvanceTo(int64_t now_ns, std::vector<LinkEvent>* out) {
  for (const LinkEvent& e : pending_) out->push_back(e);
  pending_.clear();
  while (!finishes_.empty() && connections_[finishes_.front()].finish_ns <= now_ns) {
    const int connection = finishes_.front();
    Connection& c = connections_[connection];
    const int64_t time_ns = c.finish_ns;
    HeapRemove(connection);
    now_ns_ = std::max(now_ns_, time_ns);
    const Queued done = c.frames.front();
    c.frames.pop_front();
    const int src = connection / options_.hosts;
    hosts_[src].sent_wire_bytes += done.wire_bytes;
    c.updated_ns = time_ns;
    if (!done.written) out->push_back({LinkEvent::kWritten, time_ns, done.frame});
    out->push_back({LinkEvent::kSent, time_ns, done.frame});
    if (c.frames.empty()) {
      c.head_left = 0;
      SetActive(connection, false, time_ns);
    } else {
      // Same connection count, same rate: only this connection's next finish changes.
      c.head_left = c.frames.front().wire_bytes;
      ScheduleFinish(connection, time_ns);
      NoteWritten(connection, time_ns);
    }
    for (const LinkEvent& e : pending_) out->push_back(e);
    pending_.clear();
  }
  now_ns_ = std::max(now_ns_, now_ns);
}

}  // namespace prophet
