#include "ops/sim/link_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace prophet {

LinkModel::LinkModel(const LinkOptions& options) : options_(options) {
  options_.workers = std::max(1, options_.workers);
  options_.workers_per_host = std::max(1, std::min(options_.workers_per_host, options_.workers));
  if (!(options_.payload_efficiency > 0 && options_.payload_efficiency <= 1)) options_.payload_efficiency = 1;
  connections_.resize(static_cast<size_t>(options_.workers) * options_.workers);
  hosts_.resize((options_.workers + options_.workers_per_host - 1) / options_.workers_per_host);
  senders_.resize(options_.workers);
  sent_wire_bytes_.assign(options_.workers, 0.0);
  for (Host& host : hosts_) UpdateShares(host);
  for (int s = 0; s < options_.workers; ++s) {
    for (int d = 0; d < options_.workers; ++d) connections_[Index(s, d)].local = host_of(s) == host_of(d);
  }
}

double LinkModel::wire_bytes(const LinkFrame& frame) const {
  return static_cast<double>(frame.payload_bytes + options_.frame_overhead_bytes);
}

void LinkModel::Progress(Connection& c, int64_t now_ns) {
  if (!c.frames.empty() && now_ns > c.updated_ns) {
    c.head_left = std::max(0.0, c.head_left - c.rate * static_cast<double>(now_ns - c.updated_ns));
  }
  c.updated_ns = now_ns;
}

double LinkModel::Rate(int connection) const {
  const Connection& c = connections_[connection];
  if (c.local) return hosts_[host_of(Src(connection))].local_share;
  const double rate = hosts_[host_of(Src(connection))].egress_share;
  return options_.ingress_Bps > 0 ? std::min(rate, hosts_[host_of(Dst(connection))].ingress_share) : rate;
}

void LinkModel::UpdateShares(Host& host) const {
  // One division per host, the same expression per connection before.
  const double egress = options_.egress_Bps * options_.payload_efficiency / 1e9;
  const double ingress = options_.ingress_Bps * options_.payload_efficiency / 1e9;
  const double loopback = options_.loopback_Bps * options_.payload_efficiency / 1e9;
  host.egress_share = egress / static_cast<double>(std::max<size_t>(1, host.out.size()));
  host.ingress_share = ingress / static_cast<double>(std::max<size_t>(1, host.in.size()));
  host.local_share = loopback / static_cast<double>(std::max<size_t>(1, host.local.size()));
}

void LinkModel::Rerate(int connection, int64_t now_ns) {
  Connection& c = connections_[connection];
  Progress(c, now_ns);
  const double rate = Rate(connection);
  if (rate == c.rate) return;
  SetRate(connection, rate, now_ns);
  c.finish_ns = now_ns + static_cast<int64_t>(std::ceil(c.head_left / c.rate));
  FinishChanged(connection);
}

void LinkModel::FinishChanged(int connection) {
  const int s = Src(connection);
  Sender& sender = senders_[s];
  if (sender.dirty) return;
  if (sender.first == connection) {
    // It may now finish later than a sibling: find the first again.
    sender.dirty = true;
    dirty_senders_.push_back(s);
    return;
  }
  if (sender.first < 0 || FinishesBefore(connection, sender.first)) {
    sender.first = connection;
    HeapUpdate(s);
  }
}

void LinkModel::ApplyShares(int64_t now_ns) {
  for (int h : dirty_hosts_) UpdateShares(hosts_[h]);
  for (int h : dirty_hosts_) {
    Host& host = hosts_[h];
    // Rerate never changes the lists, so iterating them directly is safe.
    if (host.egress_dirty) {
      for (int c : host.out) Rerate(c, now_ns);
    }
    if (host.ingress_dirty && options_.ingress_Bps > 0) {
      for (int c : host.in) Rerate(c, now_ns);
    }
    if (host.local_dirty) {
      for (int c : host.local) Rerate(c, now_ns);
    }
    host.egress_dirty = host.ingress_dirty = host.local_dirty = false;
  }
  dirty_hosts_.clear();
  FixSenders();
}

void LinkModel::FixSenders() {
  for (int s : dirty_senders_) {
    Sender& sender = senders_[s];
    sender.dirty = false;
    sender.first = -1;
    for (int c : sender.active) {
      if (sender.first < 0 || FinishesBefore(c, sender.first)) sender.first = c;
    }
    HeapUpdate(s);
  }
  dirty_senders_.clear();
}

void LinkModel::HeapPlace(size_t at, int sender) {
  heap_[at] = sender;
  senders_[sender].heap_at = static_cast<int>(at);
}

void LinkModel::HeapSiftUp(size_t at) {
  const int s = heap_[at];
  while (at > 0) {
    const size_t parent = (at - 1) / 2;
    if (!FinishesBefore(senders_[s].first, senders_[heap_[parent]].first)) break;
    HeapPlace(at, heap_[parent]);
    at = parent;
  }
  HeapPlace(at, s);
}

void LinkModel::HeapSiftDown(size_t at) {
  const int s = heap_[at];
  const size_t n = heap_.size();
  while (true) {
    size_t child = 2 * at + 1;
    if (child >= n) break;
    if (child + 1 < n && FinishesBefore(senders_[heap_[child + 1]].first, senders_[heap_[child]].first)) ++child;
    if (!FinishesBefore(senders_[heap_[child]].first, senders_[s].first)) break;
    HeapPlace(at, heap_[child]);
    at = child;
  }
  HeapPlace(at, s);
}

void LinkModel::HeapUpdate(int s) {
  Sender& sender = senders_[s];
  if (sender.first < 0) {
    if (sender.heap_at < 0) return;
    const size_t at = static_cast<size_t>(sender.heap_at);
    sender.heap_at = -1;
    const int last = heap_.back();
    heap_.pop_back();
    if (last == s) return;
    HeapPlace(at, last);
    HeapSiftUp(at);
    HeapSiftDown(static_cast<size_t>(senders_[last].heap_at));
    return;
  }
  if (sender.heap_at < 0) {
    heap_.push_back(s);
    HeapSiftUp(heap_.size() - 1);
    return;
  }
  HeapSiftUp(static_cast<size_t>(sender.heap_at));
  HeapSiftDown(static_cast<size_t>(sender.heap_at));
}

namespace {

// Removes the entry at `*at` of `list` by moving the last entry there; `position` gives where
// an entry's own index is kept, so that the moved one learns its new place.
template <typename PositionOf>
void SwapRemove(std::vector<int>* list, int* at, PositionOf position) {
  const int last = list->back();
  (*list)[static_cast<size_t>(*at)] = last;
  *position(last) = *at;
  list->pop_back();
  *at = -1;
}

}  // namespace

void LinkModel::SetActive(int connection, bool active, int64_t now_ns) {
  Connection& c = connections_[connection];
  const int s = Src(connection), d = Dst(connection);
  Host& from = hosts_[host_of(s)];
  Host& to = hosts_[host_of(d)];
  Sender& sender = senders_[s];
  std::vector<int>& first_list = c.local ? from.local : from.out;
  if (active) {
    if (!c.local && from.out.empty()) from.busy_since_ns = now_ns;
    c.at_first = static_cast<int>(first_list.size());
    first_list.push_back(connection);
    if (!c.local) {
      c.at_ingress = static_cast<int>(to.in.size());
      to.in.push_back(connection);
    }
    c.at_worker = static_cast<int>(sender.active.size());
    sender.active.push_back(connection);
    SetRate(connection, 0, now_ns);  // forces a finish time when the shares are applied
    c.updated_ns = now_ns;
  } else {
    SwapRemove(&first_list, &c.at_first, [this](int other) { return &connections_[other].at_first; });
    if (!c.local) {
      SwapRemove(&to.in, &c.at_ingress, [this](int other) { return &connections_[other].at_ingress; });
      if (from.out.empty()) from.egress_busy_ns += now_ns - from.busy_since_ns;
    }
    SwapRemove(&sender.active, &c.at_worker, [this](int other) { return &connections_[other].at_worker; });
    SetRate(connection, 0, now_ns);  // sends no more
    if (sender.first == connection && !sender.dirty) {
      sender.dirty = true;
      dirty_senders_.push_back(s);
    }
  }
  auto mark = [this](int h, bool Host::*flag) {
    Host& host = hosts_[h];
    if (!host.egress_dirty && !host.ingress_dirty && !host.local_dirty) dirty_hosts_.push_back(h);
    host.*flag = true;
  };
  if (c.local) {
    mark(host_of(s), &Host::local_dirty);
  } else {
    mark(host_of(s), &Host::egress_dirty);
    if (options_.ingress_Bps > 0) mark(host_of(d), &Host::ingress_dirty);
  }
}

void LinkModel::NoteWritten(int connection, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (c.frames.empty()) return NoteFull(connection, false, now_ns);
  // Stream offsets from the head's first byte: the socket holds up to `window` bytes beyond what
  // has been sent.
  const double sent = wire_bytes(c.frames.front().frame) - c.head_left;
  const double limit = sent + static_cast<double>(options_.socket_window_bytes);
  double end = 0;
  bool waiting = false;
  for (size_t i = 0; i < c.frames.size(); ++i) {
    Queued& q = c.frames[i];
    end += q.wire_bytes;
    if (end > limit + 1e-6) {
      waiting = true;
      break;
    }
    if (!q.written) {
      q.written = true;
      pending_.push_back({LinkEvent::kWritten, now_ns, q.frame});
    }
  }
  NoteFull(connection, waiting, now_ns);
}

void LinkModel::SetRate(int connection, double rate, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (!c.local) {
    Sender& sender = senders_[Src(connection)];
    if (now_ns > sender.sent_ns) {
      sender.sent += sender.rate_sum * static_cast<double>(now_ns - sender.sent_ns);
      sender.sent_ns = now_ns;
    }
    sender.rate_sum += rate - c.rate;
  }
  c.rate = rate;
}

void LinkModel::ReportDrained(int s, int64_t now_ns) {
  Sender& sender = senders_[s];
  if (sender.full_connections == 0 || now_ns <= sender.drained_mark_ns) return;
  const double sent = sender.sent + sender.rate_sum * static_cast<double>(now_ns - sender.sent_ns);
  LinkEvent drained;
  drained.kind = LinkEvent::kDrained;
  drained.time_ns = now_ns;
  drained.frame.src = s;
  drained.drained_bytes = sent - sender.drained_mark_sent;
  drained.drained_since_ns = sender.drained_mark_ns;
  pending_.push_back(drained);
  sender.drained_mark_ns = now_ns;
  sender.drained_mark_sent = sent;
}

void LinkModel::NoteFull(int connection, bool full, int64_t now_ns) {
  Connection& c = connections_[connection];
  if (c.local || c.full == full) return;  // loopback is not the link
  c.full = full;
  const int s = Src(connection);
  Sender& sender = senders_[s];
  if (!full) ReportDrained(s, now_ns);  // what it sent until now, if this ends the saturation
  sender.full_connections += full ? 1 : -1;
  if (full && sender.full_connections == 1) {
    // Saturated from now: its NIC sends as fast as it can while a connection waits for room.
    sender.drained_mark_ns = now_ns;
    sender.drained_mark_sent = sender.sent + sender.rate_sum * static_cast<double>(now_ns - sender.sent_ns);
  }
}

void LinkModel::Queue(int64_t now_ns, const LinkFrame& frame) {
  now_ns = std::max(now_ns, now_ns_);
  if (now_ns > now_ns_ && !dirty_hosts_.empty()) ApplyShares(now_ns_);  // connections that started earlier
  now_ns_ = now_ns;
  const int connection = Index(frame.src, frame.dst);
  Connection& c = connections_[connection];
  Progress(c, now_ns);
  Queued queued{frame, wire_bytes(frame), false};
  // Frames whose first byte is already in the socket keep their place (the head always is).
  const double sent = c.frames.empty() ? 0.0 : c.frames.front().wire_bytes - c.head_left;
  const double window_end = sent + static_cast<double>(options_.socket_window_bytes);
  size_t pinned = 0;
  double start = 0;
  for (; pinned < c.frames.size(); ) {
    if (pinned > 0 && start >= window_end) break;
    start += c.frames[pinned].wire_bytes;
    ++pinned;
  }
  size_t at = c.frames.size();
  while (at > pinned && c.frames[at - 1].frame.priority < frame.priority) --at;
  const bool was_empty = c.frames.empty();
  c.frames.insert(at, queued);
  if (was_empty) {
    c.head_left = queued.wire_bytes;
    SetActive(connection, true, now_ns);  // its shares are applied when time next moves
  }
  NoteWritten(connection, now_ns);
}

int64_t LinkModel::NextEventNs() {
  if (!dirty_hosts_.empty()) ApplyShares(now_ns_);
  if (!pending_.empty()) return now_ns_;
  return heap_.empty() ? std::numeric_limits<int64_t>::max() : connections_[senders_[heap_.front()].first].finish_ns;
}

bool LinkModel::SharesPending(int connection) const {
  const Connection& c = connections_[connection];
  const Host& from = hosts_[host_of(Src(connection))];
  if (c.local) return from.local_dirty;
  return from.egress_dirty || (options_.ingress_Bps > 0 && hosts_[host_of(Dst(connection))].ingress_dirty);
}

void LinkModel::AdvanceTo(int64_t now_ns, std::vector<LinkEvent>* out) {
  if (!dirty_hosts_.empty()) ApplyShares(now_ns_);
  for (const LinkEvent& e : pending_) out->push_back(e);
  pending_.clear();
  // Connections that end at one instant change their siblings' shares once, not once each: the
  // shares are applied when time moves on, and before that only to a connection about to finish
  // at this instant (what applying them at once would give it: its rate, and a finish pushed
  // past this instant when bytes are left). Ends only raise shares, so each sibling's last
  // new rate, and its finish, are what one pass gives.
  int64_t ended_at = -1;
  while (!heap_.empty()) {
    const int connection = senders_[heap_.front()].first;
    Connection& c = connections_[connection];
    const int64_t time_ns = c.finish_ns;
    if (ended_at >= 0 && time_ns > ended_at) {
      ApplyShares(ended_at);
      ended_at = -1;
      continue;
    }
    if (time_ns > now_ns) break;
    if (ended_at >= 0 && SharesPending(connection)) {
      Rerate(connection, time_ns);
      FixSenders();
      if (senders_[heap_.front()].first != connection || c.finish_ns != time_ns) continue;
    }
    now_ns_ = std::max(now_ns_, time_ns);
    const Queued done = c.frames.front();
    c.frames.pop_front();
    if (!c.local) sent_wire_bytes_[Src(connection)] += done.wire_bytes;
    c.updated_ns = time_ns;
    if (!done.written) out->push_back({LinkEvent::kWritten, time_ns, done.frame});
    out->push_back({LinkEvent::kSent, time_ns, done.frame});
    if (c.frames.empty()) {
      c.head_left = 0;
      SetActive(connection, false, time_ns);
      ended_at = time_ns;
      FixSenders();
    } else {
      // Same shares: only this connection's next finish changes.
      c.head_left = c.frames.front().wire_bytes;
      c.finish_ns = time_ns + static_cast<int64_t>(std::ceil(c.head_left / c.rate));
      FinishChanged(connection);
      FixSenders();
    }
    NoteWritten(connection, time_ns);
    ReportDrained(Src(connection), time_ns);
    for (const LinkEvent& e : pending_) out->push_back(e);
    pending_.clear();
  }
  if (ended_at >= 0) ApplyShares(ended_at);
  now_ns_ = std::max(now_ns_, now_ns);
}

}  // namespace prophet
