// The bookkeeping of "who is behind": answers, silence, and when a verdict is due.
#include "ops/core/straggler.h"

#include "ops/core/testing.h"

namespace prophet {
namespace {

TEST(VerdictIsDueWhenEveryoneAnsweredOrTimeIsUp) {
  StragglerProbe probe;
  probe.Begin("g#0", {0, 2, 3}, /*due_ns=*/1000);
  EXPECT_TRUE(probe.Asking("g#0") && !probe.Asking("g#1"));
  probe.OnReply("g#0", 2, /*submitted=*/true);
  probe.OnReply("g#0", 3, /*submitted=*/false);
  probe.OnReply("g#0", 5, /*submitted=*/false);  // not asked: ignored
  probe.OnReply("g#1", 0, /*submitted=*/false);  // another operation: ignored
  EXPECT_TRUE(probe.Due(999).empty());
  probe.OnReply("g#0", 0, /*submitted=*/false);
  probe.OnReply("g#0", 0, /*submitted=*/true);  // a second answer does not change the first
  EXPECT_EQ(probe.Due(999).size(), 1u);
  const StragglerProbe::Verdict v = probe.Take("g#0");
  EXPECT_TRUE(v.behind == std::vector<int>({0, 3}) && v.silent.empty());
  EXPECT_TRUE(!probe.Asking("g#0"));
}

TEST(SilentPeersAreNamedApart) {
  StragglerProbe probe;
  probe.Begin("g#0", {1, 2}, 1000);
  probe.OnReply("g#0", 2, true);
  EXPECT_TRUE(probe.Due(999).empty());
  EXPECT_EQ(probe.Due(1000).size(), 1u);
  const StragglerProbe::Verdict v = probe.Take("g#0");
  EXPECT_TRUE(v.behind.empty() && v.silent == std::vector<int>({1}));
  probe.Begin("h#0", {1}, 1000);
  probe.Forget("h#0");
  EXPECT_TRUE(probe.Due(5000).empty());
  EXPECT_EQ(RankList({1, 3}), std::string("1, 3"));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
