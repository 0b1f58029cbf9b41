// Goodput estimation: busy time only, overlaps merged, smoothing, sample stream.
#include "ops/core/bandwidth.h"

#include <cmath>

#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr uint64_t kMB = 1'000'000;

BandwidthOptions WindowOf(int64_t busy_ns, double alpha = 0.3) {
  BandwidthOptions options;
  options.min_sample_busy_ns = busy_ns;
  options.ewma_alpha = alpha;
  return options;
}

TEST(NoEstimateBeforeEnoughBusyTime) {
  BandwidthMonitor monitor(WindowOf(2 * kMs));
  EXPECT_TRUE(!monitor.has_estimate());
  EXPECT_EQ(monitor.estimate_Bps(), 0.0);
  monitor.OnTransfer(kMB, 0, kMs);
  monitor.OnTransfer(kMB, 10 * kMs, 11 * kMs);  // settles the first: 1 ms busy < 2 ms
  EXPECT_TRUE(!monitor.has_estimate());
  EXPECT_EQ(monitor.TakeSamples().size(), 0u);
}

TEST(IdleGapsAreNotCounted) {
  // 1 MB in 1 ms, 100 ms idle (forward pass), 1 MB in 1 ms: the link does 1 GB/s, not 2 MB/102 ms.
  BandwidthMonitor monitor(WindowOf(2 * kMs));
  monitor.OnTransfer(kMB, 0, kMs);
  monitor.OnTransfer(kMB, 101 * kMs, 102 * kMs);
  // The second transfer is measured once a transfer could no longer overlap it: one transfer
  // duration (1 ms) after the latest completion.
  EXPECT_TRUE(!monitor.has_estimate());
  monitor.OnTransfer(kMB, 201 * kMs, 202 * kMs);
  EXPECT_TRUE(monitor.has_estimate());
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 1u);
  if (samples.size() == 1) {
    EXPECT_EQ(samples[0].busy_ns, 2 * kMs);
    EXPECT_EQ(samples[0].bytes, 2 * kMB);
    EXPECT_EQ(samples[0].ts_ns, 102 * kMs);
  }
}

TEST(ARoundTripThatWaitedForThePeerDoesNotHoldTheEstimate) {
  // First step: one push waits 30 s for its owner (tracing) while the link is idle. Then 1 MB
  // every 10 ms, each taking 1 ms (1 GB/s). Taken whole, the 30 s round trip would hold every
  // window back by 30 s and then count 30 s of busy time for its 1 MB.
  BandwidthOptions options = WindowOf(2 * kMs, 1.0);
  options.max_transfer_ns = 100 * kMs;
  BandwidthMonitor monitor(options);
  const int64_t t0 = 30'000 * kMs;
  monitor.OnTransfer(kMB, 0, t0);
  for (int i = 0; i < 30; ++i) monitor.OnTransfer(kMB, t0 + i * 10 * kMs, t0 + i * 10 * kMs + kMs);
  EXPECT_TRUE(monitor.has_estimate());
  // The long round trip counts 100 ms (1/300 of its 1 MB): the first window's rate is low, and
  // the following ones are the link's.
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1e3);
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_TRUE(samples.size() >= 3u);
  // Windows follow the latest completion (t0 + 291 ms) closely, not 30 s behind.
  if (!samples.empty()) EXPECT_TRUE(samples.back().ts_ns >= t0 + 270 * kMs);
}

TEST(ASlowLinkKeepsItsRateWhenTransfersAreLong) {
  // 1 MB partitions that each take 400 ms back to back (2.5 MB/s): clipped to their last 100 ms
  // and a quarter of their bytes, the rate is the same.
  BandwidthOptions options = WindowOf(150 * kMs, 1.0);
  options.max_transfer_ns = 100 * kMs;
  BandwidthMonitor monitor(options);
  for (int i = 0; i < 6; ++i) monitor.OnTransfer(kMB, i * 400 * kMs, (i + 1) * 400 * kMs);
  EXPECT_TRUE(monitor.has_estimate());
  EXPECT_NEAR(monitor.estimate_Bps(), 2.5e6, 1e3);
}

TEST(OverlappingTransfersAreMerged) {
  // Two 1 MB transfers overlapping by 1 ms: busy 0..3 ms, 2 MB / 3 ms (summing durations: 4 ms).
  BandwidthMonitor monitor(WindowOf(3 * kMs));
  monitor.OnTransfer(kMB, 0, 2 * kMs);
  monitor.OnTransfer(kMB, kMs, 3 * kMs);
  monitor.OnTransfer(kMB, 10 * kMs, 12 * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 2e6 / 3e-3, 1.0);
}

TEST(ConcurrentSendsUnderACredit) {
  // The credit keeps 4 partitions in flight: each 1 MB partition takes 2 ms because it shares the
  // link with 3 others, so the link moves 2 GB/s. Completions arrive one by one.
  BandwidthMonitor monitor(WindowOf(4 * kMs, 1.0));
  for (int wave = 0; wave < 4; ++wave) {
    for (int i = 0; i < 4; ++i) monitor.OnTransfer(kMB, wave * 2 * kMs, (wave + 1) * 2 * kMs);
  }
  EXPECT_TRUE(monitor.has_estimate());
  EXPECT_NEAR(monitor.estimate_Bps(), 2e9, 1.0);
}

TEST(TransfersReportedOutOfStartOrder) {
  // Reported at completion: the short transfer inside the long one arrives first.
  BandwidthMonitor monitor(WindowOf(4 * kMs));
  monitor.OnTransfer(kMB, 1 * kMs, 2 * kMs);
  monitor.OnTransfer(3 * kMB, 0, 4 * kMs);
  monitor.OnTransfer(kMB, 10 * kMs, 11 * kMs);
  EXPECT_TRUE(monitor.has_estimate());
  EXPECT_NEAR(monitor.estimate_Bps(), 4e6 / 4e-3, 1.0);
}

TEST(StragglerCountsOnlyItsUnmeasuredPart) {
  BandwidthMonitor monitor(WindowOf(2 * kMs));
  monitor.OnTransfer(2 * kMB, 0, 2 * kMs);
  monitor.OnTransfer(kMB, 3 * kMs, 4 * kMs);  // horizon 2 ms: window 0..2 ms measured, 1 GB/s
  EXPECT_EQ(monitor.samples_taken(), 1u);
  // A transfer over 1..5 ms reported now: only 2..5 ms (3/4 of its 4 MB) is new.
  monitor.OnTransfer(4 * kMB, 1 * kMs, 5 * kMs);
  monitor.OnTransfer(kMB, 20 * kMs, 21 * kMs);  // horizon 17 ms
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 2u);
  if (samples.size() == 2) {
    EXPECT_EQ(samples[1].busy_ns, 3 * kMs);      // 2..5 ms
    EXPECT_EQ(samples[1].bytes, 4 * kMB);        // 3 MB of the straggler + the 1 MB at 3..4 ms
    EXPECT_NEAR(samples[1].sample_Bps, 4e6 / 3e-3, 1.0);
  }
  // Entirely inside measured time: ignored.
  monitor.OnTransfer(kMB, 0, kMs);
  EXPECT_EQ(monitor.TakeSamples().size(), 0u);
}

TEST(EwmaSmoothsSamples) {
  BandwidthMonitor monitor(WindowOf(kMs, 0.25));
  monitor.OnTransfer(kMB, 0, kMs);                  // 1 GB/s
  monitor.OnTransfer(2 * kMB, 10 * kMs, 11 * kMs);  // 2 GB/s
  monitor.OnTransfer(kMB, 20 * kMs, 21 * kMs);      // settles the second
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9 + 0.25 * 1e9, 1.0);
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 2u);
  if (samples.size() == 2) {
    EXPECT_NEAR(samples[0].estimate_Bps, 1e9, 1.0);
    EXPECT_NEAR(samples[1].sample_Bps, 2e9, 1.0);
    EXPECT_NEAR(samples[1].estimate_Bps, 1.25e9, 1.0);
  }
  EXPECT_EQ(monitor.samples_taken(), 2u);
  EXPECT_EQ(monitor.TakeSamples().size(), 0u);  // drained
}

TEST(ContinuousTrafficKeepsSampling) {
  // A link that never idles still yields one sample per window of busy time: 20 back-to-back 1 ms
  // transfers; the last 1 ms is not settled, so windows 0-5, 5-10, 10-15 ms are measured.
  BandwidthMonitor monitor(WindowOf(5 * kMs, 1.0));
  for (int i = 0; i < 20; ++i) monitor.OnTransfer(kMB, i * kMs, (i + 1) * kMs);
  EXPECT_EQ(monitor.samples_taken(), 3u);
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
}

TEST(SlowerLinkLowersTheEstimate) {
  BandwidthMonitor monitor(WindowOf(kMs, 1.0));
  monitor.OnTransfer(kMB, 0, kMs);
  monitor.OnTransfer(kMB, 5 * kMs, 9 * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  monitor.OnTransfer(kMB, 20 * kMs, 21 * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 2.5e8, 1.0);
}

TEST(PendingSamplesAreBounded) {
  BandwidthOptions options = WindowOf(kMs);
  options.max_pending_samples = 3;
  BandwidthMonitor monitor(options);
  for (int i = 0; i < 10; ++i) monitor.OnTransfer(kMB, 10 * i * kMs, (10 * i + 1) * kMs);
  EXPECT_EQ(monitor.samples_taken(), 9u);
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 3u);
  if (!samples.empty()) EXPECT_EQ(samples.back().ts_ns, 81 * kMs);  // the newest are kept
}

// ---- Drains: what a full socket took (the link's rate) ----

BandwidthOptions Drains(int64_t window_ns, int64_t time_constant_ns = 50 * kMs) {
  BandwidthOptions options;
  options.min_drain_busy_ns = window_ns;
  options.drain_time_constant_ns = time_constant_ns;
  return options;
}

TEST(DrainsMeasureTheLinkAndIgnoreTheRoundTrips) {
  // Round trips alone: a 4-byte exchange that waited 20 ms for its partner and 1 MB pushes whose
  // sums took 10 ms: a goodput far below the link.
  BandwidthMonitor monitor(Drains(5 * kMs));
  monitor.OnTransfer(4, 0, 20 * kMs);
  for (int i = 0; i < 5; ++i) monitor.OnTransfer(kMB, (30 + 10 * i) * kMs, (40 + 10 * i) * kMs);
  EXPECT_TRUE(monitor.has_estimate() && !monitor.drained());
  EXPECT_TRUE(monitor.estimate_Bps() < 2e8);
  // The socket was full from 100 ms on and took 1 MB per ms, reported at each write: 1 GB/s.
  for (int i = 0; i < 10; ++i) monitor.OnDrained(kMB, (100 + i) * kMs, (101 + i) * kMs);
  EXPECT_TRUE(monitor.drained());
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  // Round trips no longer move it.
  monitor.OnTransfer(4, 200 * kMs, 300 * kMs);
  for (int i = 0; i < 50; ++i) monitor.OnTransfer(kMB, (300 + 10 * i) * kMs, (310 + 10 * i) * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_TRUE(!samples.empty() && samples.back().drained);
  if (!samples.empty()) EXPECT_EQ(samples.back().busy_ns, 5 * kMs);
}

TEST(DrainsOfConnectionsFullAtOnceAddUp) {
  // Two connections share the link, each full and taking 0.5 MB per ms: the link does 1 GB/s;
  // their intervals overlap, so the time counts once. An idle gap between bursts is not counted.
  BandwidthMonitor monitor(Drains(10 * kMs));
  for (int burst = 0; burst < 2; ++burst) {
    const int64_t t0 = burst * 100 * kMs;
    for (int i = 0; i < 10; ++i) {
      monitor.OnDrained(kMB / 2, t0 + i * kMs, t0 + (i + 1) * kMs);
      monitor.OnDrained(kMB / 2, t0 + i * kMs + kMs / 2, t0 + (i + 1) * kMs + kMs / 2);
    }
  }
  EXPECT_TRUE(monitor.drained());
  // Each window: 10 ms of full time; a report that ends after the window closes counts in the
  // next one (at most one report of 0.5 MB per window off).
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 0.1e9);
  for (const BandwidthSample& s : monitor.TakeSamples()) EXPECT_NEAR(s.sample_Bps, 1e9, 0.1e9);
}

TEST(BytesTakenAtOnceJoinTheFullTimeAroundThem) {
  // A connection with room takes 1 MB at once while another one is full (its bytes share the
  // link then); at an instant with no full socket they say nothing.
  BandwidthMonitor monitor(Drains(10 * kMs));
  monitor.OnDrained(kMB, 0, 0);  // nothing full: ignored
  monitor.OnDrained(kMB, 0, 5 * kMs);
  monitor.OnDrained(kMB, 5 * kMs, 5 * kMs);  // inside the run
  monitor.OnDrained(2 * kMB, 5 * kMs, 10 * kMs);
  EXPECT_TRUE(monitor.drained());
  EXPECT_NEAR(monitor.estimate_Bps(), 4e6 / 10e-3, 1.0);
}

TEST(AShortWindowMovesTheEstimateLittle) {
  // Steady 1 GB/s, then one 5 ms window at half that: it moves the estimate by
  // 1 - exp(-5/50) of the way; a long stretch at the new rate moves it all the way.
  BandwidthMonitor monitor(Drains(5 * kMs));
  for (int i = 0; i < 20; ++i) monitor.OnDrained(kMB, i * kMs, (i + 1) * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  for (int i = 0; i < 5; ++i) monitor.OnDrained(kMB / 2, (100 + i) * kMs, (101 + i) * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9 - 0.5e9 * (1 - std::exp(-0.1)), 1e3);
  for (int i = 0; i < 400; ++i) monitor.OnDrained(kMB / 2, (200 + i) * kMs, (201 + i) * kMs);
  EXPECT_NEAR(monitor.estimate_Bps(), 0.5e9, 0.01e9);
}

TEST(SocketWritesWhileOneIsFullAreDrains) {
  // Socket A fills at 0 ms (its 1 MB taken at once is not a drain); while it stays full, A takes
  // 1 MB at 1 ms and socket B, with room, 1 MB at 2 ms (behind A on the link); A empties at 4 ms
  // taking 2 MB. 4 MB in 4 ms saturated. Then nothing is full: B's writes say nothing.
  BandwidthMonitor monitor(Drains(4 * kMs));
  monitor.OnSocketWrite(kMB, false, true, 0);
  EXPECT_TRUE(monitor.saturated());
  monitor.OnSocketWrite(kMB, true, true, kMs);
  monitor.OnSocketWrite(kMB, false, false, 2 * kMs);
  monitor.OnSocketWrite(2 * kMB, true, false, 4 * kMs);
  EXPECT_TRUE(!monitor.saturated());
  EXPECT_TRUE(monitor.drained());
  EXPECT_NEAR(monitor.estimate_Bps(), 1e9, 1.0);
  monitor.OnSocketWrite(10 * kMB, false, false, 5 * kMs);
  monitor.OnSocketWrite(kMB, false, true, 100 * kMs);  // saturated again from 100 ms
  monitor.OnSocketWrite(kMB, true, false, 102 * kMs);
  monitor.OnSocketWrite(kMB, false, true, 103 * kMs);
  monitor.OnSocketWrite(kMB, true, false, 105 * kMs);  // 2 MB in 4 ms saturated: 0.5 GB/s
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 2u);
  if (samples.size() == 2) EXPECT_NEAR(samples[1].sample_Bps, 0.5e9, 1.0);
}

TEST(ADrainReportedLateCountsOnlyItsUnmeasuredPart) {
  BandwidthMonitor monitor(Drains(4 * kMs));
  for (int i = 0; i < 4; ++i) monitor.OnDrained(kMB, i * kMs, (i + 1) * kMs);  // window 0..4 ms
  EXPECT_EQ(monitor.samples_taken(), 1u);
  // Another connection, full over 2..6 ms, reports at 6 ms: half of it is new.
  monitor.OnDrained(4 * kMB, 2 * kMs, 6 * kMs);
  monitor.OnDrained(2 * kMB, 6 * kMs, 8 * kMs);
  const std::vector<BandwidthSample> samples = monitor.TakeSamples();
  EXPECT_EQ(samples.size(), 2u);
  if (samples.size() == 2) {
    EXPECT_EQ(samples[1].busy_ns, 4 * kMs);
    EXPECT_EQ(samples[1].bytes, 4 * kMB);
  }
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
