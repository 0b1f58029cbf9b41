// OutputPool: a freed output comes back for the next output of (nearly) its size, what is kept
// never exceeds the peak in use, idle buffers go, and threads may take and give at once.
#include "ops/core/output_pool.h"

#include <cstring>
#include <thread>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(AFreedOutputServesTheNextOfItsSize) {
  OutputPool pool;
  void* a = pool.Take(64 * kMiB, 0);
  EXPECT_TRUE(a != nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % kOutputAlignment, uintptr_t{0});
  std::memset(a, 1, 64 * kMiB);
  pool.Give(a, 1);
  EXPECT_EQ(pool.kept_bytes(), uint64_t{64} * kMiB);
  void* b = pool.Take(64 * kMiB, 2);
  EXPECT_TRUE(b == a);
  EXPECT_EQ(pool.reused(), uint64_t{1});
  EXPECT_EQ(pool.kept_buffers(), size_t{0});
  pool.Give(b, 3);
  // Up to 1/8 larger serves; more would waste memory, smaller cannot.
  void* c = pool.Take(60 * kMiB, 4);
  EXPECT_TRUE(c == a);
  pool.Give(c, 5);
  void* d = pool.Take(32 * kMiB, 6);
  EXPECT_TRUE(d != a);
  void* e = pool.Take(65 * kMiB, 7);
  EXPECT_TRUE(e != a);
  EXPECT_EQ(pool.reused(), uint64_t{2});
  pool.Give(d, 8);
  pool.Give(e, 9);
}

TEST(KeepsNoMoreThanThePeakInUse) {
  OutputPool pool;
  void* a = pool.Take(8 * kMiB, 0);
  pool.Give(a, 1);
  void* b = pool.Take(16 * kMiB, 2);  // a does not fit: peak 16 MiB
  EXPECT_EQ(pool.peak_taken_bytes(), uint64_t{16} * kMiB);
  pool.Give(b, 3);  // 24 MiB kept > the peak: the oldest (a) goes
  EXPECT_EQ(pool.kept_bytes(), uint64_t{16} * kMiB);
  EXPECT_EQ(pool.kept_buffers(), size_t{1});
  // Two live at once raise the peak, and both are kept.
  void* c = pool.Take(16 * kMiB, 4);
  void* d = pool.Take(16 * kMiB, 5);
  pool.Give(c, 6);
  pool.Give(d, 7);
  EXPECT_EQ(pool.peak_taken_bytes(), uint64_t{32} * kMiB);
  EXPECT_EQ(pool.kept_bytes(), uint64_t{32} * kMiB);
}

TEST(IdleBuffersAreFreed) {
  OutputPool pool;
  void* a = pool.Take(4 * kMiB, 0);
  void* b = pool.Take(4 * kMiB, 0);
  pool.Give(a, 0);
  pool.Give(b, kRecycleIdleNs / 2);
  EXPECT_EQ(pool.kept_buffers(), size_t{2});
  // a idle past the limit, b not yet: the next call frees only a.
  void* c = pool.Take(2 * kMiB, kRecycleIdleNs + 1);
  EXPECT_EQ(pool.kept_buffers(), size_t{1});
  pool.Give(c, kRecycleIdleNs + 2);
  void* d = pool.Take(4 * kMiB, kRecycleIdleNs + 3);
  EXPECT_TRUE(d == b);
  pool.Give(d, kRecycleIdleNs + 4);
}

TEST(ThreadsTakeAndGiveAtOnce) {
  OutputPool pool;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&pool, t] {
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = (1 + (i + t) % 3) * kMiB;
        char* p = static_cast<char*>(pool.Take(bytes, i));
        p[0] = static_cast<char>(t);
        p[bytes - 1] = static_cast<char>(i);
        pool.Give(p, i + 1);
      }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(pool.reused() > 0);
  EXPECT_TRUE(pool.kept_bytes() <= pool.peak_taken_bytes());
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
