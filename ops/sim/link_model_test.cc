// LinkModel: frames in the runtime's queue order (priority, never ahead of bytes already in the
// socket), the socket window (written vs sent), and fair sharing of egress and ingress.
#include "ops/sim/link_model.h"

#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;

LinkOptions Options(int workers, uint64_t window = 0) {
  LinkOptions o;
  o.workers = workers;
  o.egress_Bps = 1e6;  // 1,000 bytes per ms
  o.ingress_Bps = 1e6;
  o.socket_window_bytes = window;
  return o;
}

LinkFrame Frame(int src, int dst, uint64_t bytes, int64_t priority, uint64_t tag) {
  LinkFrame f;
  f.src = src;
  f.dst = dst;
  f.payload_bytes = bytes;
  f.priority = priority;
  f.tag = tag;
  return f;
}

// Runs the model to the end; returns the events.
std::vector<LinkEvent> Drain(LinkModel* link) {
  std::vector<LinkEvent> events;
  while (link->NextEventNs() != INT64_MAX) link->AdvanceTo(link->NextEventNs(), &events);
  return events;
}

int64_t SentAt(const std::vector<LinkEvent>& events, uint64_t tag) {
  for (const LinkEvent& e : events)
    if (e.kind == LinkEvent::kSent && e.frame.tag == tag) return e.time_ns;
  return -1;
}

int64_t WrittenAt(const std::vector<LinkEvent>& events, uint64_t tag) {
  for (const LinkEvent& e : events)
    if (e.kind == LinkEvent::kWritten && e.frame.tag == tag) return e.time_ns;
  return -1;
}

TEST(UrgentFramesGoFirstButNeverAheadOfTheFrameOnTheWire) {
  LinkModel link(Options(2));
  link.Queue(0, Frame(0, 1, 10'000, 1, 1));  // on the wire at once: 10 ms
  link.Queue(0, Frame(0, 1, 1'000, 1, 2));
  link.Queue(0, Frame(0, 1, 1'000, 5, 3));   // more urgent than 2, not than the frame sending
  const std::vector<LinkEvent> events = Drain(&link);
  EXPECT_EQ(SentAt(events, 1), 10 * kMs);
  EXPECT_EQ(SentAt(events, 3), 11 * kMs);
  EXPECT_EQ(SentAt(events, 2), 12 * kMs);
  // Without a socket window a frame is written when its last byte leaves.
  EXPECT_EQ(WrittenAt(events, 2), 12 * kMs);
}

TEST(SocketWindowPinsTheOrderAndWritesEarly) {
  LinkModel link(Options(2, /*window=*/5'000));
  link.Queue(0, Frame(0, 1, 3'000, 1, 1));
  link.Queue(0, Frame(0, 1, 1'000, 1, 2));   // starts at 3,000 < 5,000: in the socket, pinned
  link.Queue(0, Frame(0, 1, 4'000, 1, 3));   // starts at 4,000: pinned too, ends beyond it
  link.Queue(0, Frame(0, 1, 1'000, 9, 4));   // starts at 8,000: may not overtake 3
  const std::vector<LinkEvent> events = Drain(&link);
  EXPECT_EQ(WrittenAt(events, 1), 0);
  EXPECT_EQ(WrittenAt(events, 2), 0);
  EXPECT_EQ(SentAt(events, 3), 8 * kMs);
  EXPECT_EQ(SentAt(events, 4), 9 * kMs);
  // Frame 3 ends at 8,000: written once 3,000 bytes have left (checked when frame 1 is sent).
  EXPECT_EQ(WrittenAt(events, 3), 3 * kMs);
}

TEST(AFullSocketReportsWhatItTookAsDrains) {
  // A 2,500-byte socket and ten 1,000-byte frames at once: the socket is full until the last
  // frame fits in it (8 ms); the NIC's bytes meanwhile are reported, in reports that follow each
  // other, each at the link's rate.
  LinkModel link(Options(2, 2'500));
  for (uint64_t tag = 1; tag <= 10; ++tag) link.Queue(0, Frame(0, 1, 1'000, 1, tag));
  const std::vector<LinkEvent> events = Drain(&link);
  double drained = 0;
  int64_t previous = 0;
  int reports = 0;
  for (const LinkEvent& e : events) {
    if (e.kind != LinkEvent::kDrained) continue;
    ++reports;
    drained += e.drained_bytes;
    EXPECT_TRUE(e.drained_since_ns == previous && e.time_ns > e.drained_since_ns);
    EXPECT_NEAR(e.drained_bytes / static_cast<double>(e.time_ns - e.drained_since_ns), 1e-3, 1e-9);
    previous = e.time_ns;
  }
  EXPECT_EQ(reports, 8);
  EXPECT_NEAR(drained, 8'000, 1e-6);
  // A socket with room never fills: no drain; nor over loopback.
  LinkModel roomy(Options(2, 1'000'000));
  for (uint64_t tag = 1; tag <= 10; ++tag) roomy.Queue(0, Frame(0, 1, 1'000, 1, tag));
  LinkOptions one_host = Options(2, 2'500);
  one_host.workers_per_host = 2;
  LinkModel local(one_host);
  for (uint64_t tag = 1; tag <= 10; ++tag) local.Queue(0, Frame(0, 1, 1'000, 1, tag));
  for (LinkModel* model : {&roomy, &local}) {
    for (const LinkEvent& e : Drain(model)) EXPECT_TRUE(e.kind != LinkEvent::kDrained);
  }
}

TEST(ConnectionsShareEgressAndIngress) {
  {
    LinkModel link(Options(3));
    link.Queue(0, Frame(0, 1, 1'000, 0, 1));
    link.Queue(0, Frame(0, 2, 1'000, 0, 2));  // host 0's egress shared by two connections
    const std::vector<LinkEvent> events = Drain(&link);
    EXPECT_EQ(SentAt(events, 1), 2 * kMs);
    EXPECT_EQ(SentAt(events, 2), 2 * kMs);
    EXPECT_EQ(link.egress_busy_ns(0, 2 * kMs), 2 * kMs);
  }
  {
    LinkModel link(Options(3));
    link.Queue(0, Frame(1, 0, 1'000, 0, 1));
    link.Queue(0, Frame(2, 0, 1'000, 0, 2));  // host 0's ingress shared
    const std::vector<LinkEvent> events = Drain(&link);
    EXPECT_EQ(SentAt(events, 1), 2 * kMs);
    LinkOptions egress_only = Options(3);
    egress_only.ingress_Bps = 0;
    LinkModel unlimited(egress_only);
    unlimited.Queue(0, Frame(1, 0, 1'000, 0, 1));
    unlimited.Queue(0, Frame(2, 0, 1'000, 0, 2));
    EXPECT_EQ(SentAt(Drain(&unlimited), 2), 1 * kMs);
  }
  {
    // One connection finishes: the other speeds up for the rest of its frame.
    LinkModel link(Options(3));
    link.Queue(0, Frame(0, 1, 1'000, 0, 1));
    link.Queue(0, Frame(0, 2, 3'000, 0, 2));
    const std::vector<LinkEvent> events = Drain(&link);
    EXPECT_EQ(SentAt(events, 1), 2 * kMs);
    EXPECT_EQ(SentAt(events, 2), 4 * kMs);  // 1,000 bytes by 2 ms, then 2,000 at full rate
  }
}

TEST(OverheadAndEfficiencyCountOnTheWire) {
  LinkOptions o = Options(2);
  o.frame_overhead_bytes = 1'000;
  o.payload_efficiency = 0.5;
  LinkModel link(o);
  link.Queue(0, Frame(0, 1, 1'000, 0, 1));
  EXPECT_EQ(SentAt(Drain(&link), 1), 4 * kMs);
  EXPECT_NEAR(link.sent_wire_bytes(0), 2'000, 1e-9);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
