// A fluid model of a cluster's network, for the step simulator (simulator.h).
//
// Every host has one NIC, full duplex: it sends at most `egress_Bps` and receives at most
// `ingress_Bps` (0: receiving is not limited, as in an emulated cluster that shapes only each
// host's egress). Every ordered pair of hosts has one connection, as the runtime has one TCP stream
// per peer; a connection carries its frames one after another, in queue order.
//
// Sharing: the connections that have a frame to send at a host share its egress equally, and
// those arriving at a host share its ingress equally; a connection moves at the smaller of its
// two shares (TCP flows through one bottleneck converge to equal shares). This is max-min
// fairness whenever the bottlenecks do not interact (egress-only links, two hosts, symmetric
// traffic) and a slight underestimate otherwise (a connection held back at the receiver does not
// hand its unused egress share to its siblings).
//
// Queue order is the runtime's (connection.cc, Connection::Queue): a frame is inserted behind every
// queued frame at least as urgent, and never in front of a frame whose first byte is already in
// the socket. The socket holds the next `socket_window_bytes` of a connection's stream beyond what
// has left the NIC; frames inside that window keep their order, and a frame whose last byte entered
// it counts as written (the runtime's on_sent, after which an owner's sum is done with).
//
// Bytes on the wire: payload + `frame_overhead_bytes` per frame, carried at `payload_efficiency`
// of the link rate (TCP/IP/Ethernet headers per packet).
#ifndef PROPHET_OPS_CORE_LINK_MODEL_H_
#define PROPHET_OPS_CORE_LINK_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace prophet {

struct LinkOptions {
  int hosts = 2;
  double egress_Bps = 125e6;       // bytes per second each NIC sends (1 Gbit/s = 125e6)
  double ingress_Bps = 125e6;      // bytes per second each NIC receives; 0 = unlimited
  double payload_efficiency = 1.0; // share of the link rate left for frame bytes (0, 1]
  uint64_t frame_overhead_bytes = 0;
  uint64_t socket_window_bytes = 0;
};

// What the simulator queues on a connection. `tag` is the caller's: the link model never looks
// at it.
struct LinkFrame {
  int src = 0;
  int dst = 0;
  uint64_t payload_bytes = 0;
  int64_t priority = 0;
  uint64_t tag = 0;
};

struct LinkEvent {
  enum Kind { kWritten, kSent };  // last byte entered the socket / left the NIC
  Kind kind = kSent;
  int64_t time_ns = 0;
  LinkFrame frame;
};

class LinkModel {
 public:
  explicit LinkModel(const LinkOptions& options);

  // Queues `frame` at `now_ns` (never earlier than the last AdvanceTo). Frames written at once
  // (inside the socket window) are reported by the next AdvanceTo.
  void Queue(int64_t now_ns, const LinkFrame& frame);
  // Time of the next event, or INT64_MAX when nothing is queued.
  int64_t NextEventNs() const;
  // Moves time forward to `now_ns` and appends every event up to and including it, in time order.
  void AdvanceTo(int64_t now_ns, std::vector<LinkEvent>* out);

  // Bytes (wire bytes, including overheads) that left host `host`'s NIC so far.
  double sent_wire_bytes(int host) const { return hosts_[host].sent_wire_bytes; }
  // Time host `host`'s egress was busy (at least one connection sending) until `now_ns`.
  int64_t egress_busy_ns(int host, int64_t now_ns) const {
    const Host& h = hosts_[host];
    return h.egress_busy_ns + (h.sending > 0 ? now_ns - h.busy_since_ns : 0);
  }
  double wire_bytes(const LinkFrame& frame) const;
  const LinkOptions& options() const { return options_; }

 private:
  struct Queued {
    LinkFrame frame;
    double wire_bytes = 0;
    bool written = false;
  };
  struct Connection {
    std::deque<Queued> frames;  // frames[0] is on the wire
    double head_left = 0;       // wire bytes of frames[0] still to send
    double rate = 0;            // wire bytes per ns
    int64_t updated_ns = 0;     // head_left is exact at this time
    int64_t finish_ns = 0;      // frames[0]'s last byte leaves at the current rate
    int heap_at = -1;           // index in finishes_, -1 when not sending
  };
  struct Host {
    int sending = 0;    // connections from this host with a frame
    int receiving = 0;  // connections into this host with a frame
    double sent_wire_bytes = 0;
    int64_t egress_busy_ns = 0;
    int64_t busy_since_ns = 0;
  };

  int Index(int src, int dst) const { return src * options_.hosts + dst; }
  void Progress(int connection, int64_t now_ns);
  // Rate and finish event of every active connection through `src`'s egress or `dst`'s ingress.
  void Reschedule(int src, int dst, int64_t now_ns);
  void ScheduleFinish(int connection, int64_t now_ns);
  // The finish heap: connections ordered by (finish_ns, index).
  bool FinishesBefore(int a, int b) const {
    const int64_t ta = connections_[a].finish_ns, tb = connections_[b].finish_ns;
    return ta != tb ? ta < tb : a < b;
  }
  void HeapPlace(size_t at, int connection);
  void HeapSiftUp(size_t at);
  void HeapSiftDown(size_t at);
  void HeapRemove(int connection);
  void SetActive(int connection, bool active, int64_t now_ns);
  // Marks frames whose last byte is inside the socket window as written.
  void NoteWritten(int connection, int64_t now_ns);

  LinkOptions options_;
  std::vector<Connection> connections_;
  std::vector<Host> hosts_;
  // A binary min-heap of the sending connections by finish time, one entry each, moved in place
  // when a rate changes (a change of sharing touches every connection of a host, so updates
  // outnumber finishes by the number of hosts).
  std::vector<int> finishes_;
  std::vector<LinkEvent> pending_;  // written at Queue time, reported by the next AdvanceTo
  int64_t now_ns_ = 0;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_LINK_MODEL_H_
