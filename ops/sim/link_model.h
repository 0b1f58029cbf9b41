// A fluid model of a cluster's network, for the step simulator (simulator.h).
//
// Workers live on hosts, `workers_per_host` each (worker w on host w / workers_per_host). Every
// host has one NIC, full duplex: it sends at most `egress_Bps` and receives at most `ingress_Bps`
// (0: receiving is not limited, as in an emulated cluster that shapes only each host's egress).
// Every ordered pair of workers has one connection, as the runtime has one TCP stream per peer; a
// connection carries its frames one after another, in queue order. A connection between two
// workers of one host never touches the NIC: it goes over the host's loopback (or shared
// memory), `loopback_Bps` shared by every such connection of the host.
//
// Sharing: the connections between hosts that have a frame to send at a host share its egress
// equally, and those arriving at a host share its ingress equally; a connection moves at the
// smaller of its two shares (TCP flows through one bottleneck converge to equal shares). This is
// max-min fairness whenever the bottlenecks do not interact (egress-only links, two hosts,
// symmetric traffic) and a slight underestimate otherwise (a connection held back at the receiver
// does not hand its unused egress share to its siblings). A host's connections over loopback
// share `loopback_Bps` equally.
//
// Queue order is the runtime's (connection.cc, Connection::Queue): a frame is inserted behind every
// queued frame at least as urgent, and never in front of a frame whose first byte is already in
// the socket. The socket holds the next `socket_window_bytes` of a connection's stream beyond what
// has left the NIC; frames inside that window keep their order, and a frame whose last byte entered
// it counts as written (the runtime's on_sent, after which an owner's sum is done with).
//
// Bytes on the wire: payload + `frame_overhead_bytes` per frame, carried at `payload_efficiency`
// of the link rate (TCP/IP/Ethernet headers per packet; loopback too, as it carries TCP).
//
// Cost: only connections with a frame are ever visited. A connection starting or ending changes
// the shares of the connections through its resources (the sender's egress, the receiver's
// ingress, or the host's loopback); connections starting at one instant are rescheduled together
// when time next moves, so an owner sending its sum to N-1 peers costs one pass, not N-1. The next
// frame to finish is found through each sending worker's earliest frame and a heap of workers.
#ifndef PROPHET_OPS_SIM_LINK_MODEL_H_
#define PROPHET_OPS_SIM_LINK_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace prophet {

struct LinkOptions {
  int workers = 2;
  int workers_per_host = 1;        // workers / workers_per_host hosts (the last may have fewer)
  double egress_Bps = 125e6;       // bytes per second each NIC sends (1 Gbit/s = 125e6)
  double ingress_Bps = 125e6;      // bytes per second each NIC receives; 0 = unlimited
  double loopback_Bps = 12.5e9;    // bytes per second between the workers of one host, shared
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
  // kWritten: the frame's last byte entered the socket; kSent: it left the NIC; kDrained: worker
  // frame.src's NIC sent drained_bytes (wire bytes, to other hosts) from drained_since_ns to
  // time_ns, all of it while one of its connections to another host was full (had a frame that
  // did not fit in its socket): the NIC's rate, what the engine's connections report to the
  // bandwidth monitor (bandwidth.h). The other fields of `frame` are the frame that just left.
  enum Kind { kWritten, kSent, kDrained };
  Kind kind = kSent;
  int64_t time_ns = 0;
  LinkFrame frame;
  double drained_bytes = 0;
  int64_t drained_since_ns = 0;
};

class LinkModel {
 public:
  explicit LinkModel(const LinkOptions& options);

  // Queues `frame` at `now_ns` (never earlier than the last AdvanceTo). Frames written at once
  // (inside the socket window) are reported by the next AdvanceTo.
  void Queue(int64_t now_ns, const LinkFrame& frame);
  // Time of the next event, or INT64_MAX when nothing is queued.
  int64_t NextEventNs();
  // Moves time forward to `now_ns` and appends every event up to and including it, in time order.
  void AdvanceTo(int64_t now_ns, std::vector<LinkEvent>* out);

  int host_of(int worker) const { return worker / options_.workers_per_host; }
  int hosts() const { return static_cast<int>(hosts_.size()); }
  // Bytes (wire bytes, including overheads) worker `worker` sent to other hosts so far.
  double sent_wire_bytes(int worker) const { return sent_wire_bytes_[worker]; }
  // Time host `host`'s egress was busy (at least one connection to another host sending) until
  // `now_ns`.
  int64_t egress_busy_ns(int host, int64_t now_ns) const {
    const Host& h = hosts_[host];
    return h.egress_busy_ns + (h.out.size() > 0 ? now_ns - h.busy_since_ns : 0);
  }
  double wire_bytes(const LinkFrame& frame) const;
  const LinkOptions& options() const { return options_; }

 private:
  struct Queued {
    LinkFrame frame;
    double wire_bytes = 0;
    bool written = false;
  };
  // The frames of a connection: frames[head] is on the wire. A vector with a moving head
  // allocates nothing until the connection carries a frame (there are workers^2 connections).
  struct FrameQueue {
    std::vector<Queued> items;
    size_t head = 0;
    bool empty() const { return head == items.size(); }
    size_t size() const { return items.size() - head; }
    Queued& front() { return items[head]; }
    Queued& operator[](size_t i) { return items[head + i]; }
    void pop_front() {
      if (++head == items.size()) {
        items.clear();
        head = 0;
      }
    }
    void insert(size_t at, const Queued& q) { items.insert(items.begin() + static_cast<std::ptrdiff_t>(head + at), q); }
  };
  enum Resource { kEgress, kIngress, kLoopback };
  struct Connection {
    FrameQueue frames;
    double head_left = 0;       // wire bytes of frames[0] still to send
    double rate = 0;            // wire bytes per ns
    int64_t updated_ns = 0;     // head_left is exact at this time
    int64_t finish_ns = 0;      // frames[0]'s last byte leaves at the current rate
    bool local = false;         // between two workers of one host
    // Positions in the active lists (-1: not there): the sender's egress or loopback list, the
    // receiver's ingress list, the sending worker's list.
    int at_first = -1;
    int at_ingress = -1;
    int at_worker = -1;
    bool full = false;          // a frame waits for room in the socket (not over loopback)
  };
  struct Host {
    std::vector<int> out;    // active connections to other hosts (egress)
    std::vector<int> in;     // active connections from other hosts (ingress)
    std::vector<int> local;  // active connections between its own workers
    // What each connection through the egress, ingress or loopback gets (wire bytes per ns).
    double egress_share = 0, ingress_share = 0, local_share = 0;
    int64_t egress_busy_ns = 0;
    int64_t busy_since_ns = 0;
    bool egress_dirty = false, ingress_dirty = false, local_dirty = false;  // shares changed, not yet applied
  };
  // Each sending worker's earliest finishing connection, in a heap of workers.
  struct Sender {
    std::vector<int> active;  // its connections with a frame
    int first = -1;           // the one finishing first (finish_ns, then index), -1: none
    int heap_at = -1;
    bool dirty = false;       // `first` must be found again
    // Kept for kDrained: wire bytes its connections to other hosts sent until sent_ns (and their
    // rates' sum, wire bytes per ns), its connections to other hosts that are full, and while
    // there are any, the time of the last report and `sent` then.
    double rate_sum = 0;
    double sent = 0;
    int64_t sent_ns = 0;
    int full_connections = 0;
    int64_t drained_mark_ns = 0;
    double drained_mark_sent = 0;
  };

  int Index(int src, int dst) const { return src * options_.workers + dst; }
  int Src(int connection) const { return connection / options_.workers; }
  int Dst(int connection) const { return connection % options_.workers; }
  bool FinishesBefore(int a, int b) const {
    const int64_t ta = connections_[a].finish_ns, tb = connections_[b].finish_ns;
    return ta != tb ? ta < tb : a < b;
  }
  void Progress(Connection& c, int64_t now_ns);
  double Rate(int connection) const;
  void UpdateShares(Host& host) const;
  // New shares for every connection through the dirty resources.
  void ApplyShares(int64_t now_ns);
  void Rerate(int connection, int64_t now_ns);
  // Whether a resource of `connection` has new shares not yet applied.
  bool SharesPending(int connection) const;
  void FinishChanged(int connection);
  void SetActive(int connection, bool active, int64_t now_ns);
  void FixSenders();
  void HeapPlace(size_t at, int sender);
  void HeapSiftUp(size_t at);
  void HeapSiftDown(size_t at);
  void HeapUpdate(int sender);
  // Marks frames whose last byte is inside the socket window as written, then whether a frame
  // still waits (NoteFull).
  void NoteWritten(int connection, int64_t now_ns);
  // Whether `connection` is full now, and what that changes for its sender's drain reports.
  void NoteFull(int connection, bool full, int64_t now_ns);
  // Senders' sent bytes: brings `sent` to now_ns, then a connection's rate changes to `rate`.
  void SetRate(int connection, double rate, int64_t now_ns);
  // A kDrained report of what `sender` sent since the last one, while saturated.
  void ReportDrained(int sender, int64_t now_ns);

  LinkOptions options_;
  std::vector<Connection> connections_;
  std::vector<Host> hosts_;
  std::vector<Sender> senders_;
  std::vector<double> sent_wire_bytes_;  // per worker, to other hosts
  std::vector<int> dirty_hosts_;
  std::vector<int> dirty_senders_;
  std::vector<int> heap_;  // senders with a connection sending, by their first finish
  std::vector<LinkEvent> pending_;  // written at Queue time, reported by the next AdvanceTo
  int64_t now_ns_ = 0;
};

}  // namespace prophet

#endif  // PROPHET_OPS_SIM_LINK_MODEL_H_
