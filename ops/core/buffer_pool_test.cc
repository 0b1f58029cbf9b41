// BufferPool: warm buffers come back (best fit), the cap holds, and sizes follow the ones in use.
#include "ops/core/buffer_pool.h"

#include <random>
#include <set>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

TEST(ReusesTheSmallestBufferThatFits) {
  BufferPool pool(10 << 20);
  ByteBuffer a = pool.Take(4 << 20), b = pool.Take(1 << 20);
  const char* a_data = a.data();
  const char* b_data = b.data();
  pool.Give(std::move(a));
  pool.Give(std::move(b));
  EXPECT_EQ(pool.pooled_bytes(), uint64_t{5} << 20);
  ByteBuffer c = pool.Take(512 << 10);  // the 1 MiB one
  EXPECT_TRUE(c.data() == b_data);
  EXPECT_EQ(c.size(), size_t{512} << 10);
  ByteBuffer d = pool.Take(3 << 20);  // the 4 MiB one
  EXPECT_TRUE(d.data() == a_data);
  EXPECT_EQ(pool.pooled_buffers(), 0u);
  ByteBuffer e = pool.Take(8 << 20);  // nothing fits: a new one
  EXPECT_EQ(e.size(), size_t{8} << 20);
  EXPECT_TRUE(pool.Take(0).empty());
}

TEST(KeepsAtMostTheCapAndFollowsTheSizesInUse) {
  BufferPool pool(4 << 20);
  for (int i = 0; i < 4; ++i) pool.Give(ByteBuffer(1 << 20));
  pool.Give(ByteBuffer(1 << 20));  // over the cap: freed
  EXPECT_EQ(pool.pooled_buffers(), 4u);
  EXPECT_EQ(pool.pooled_bytes(), uint64_t{4} << 20);
  pool.Give(ByteBuffer(2 << 20));  // larger: two small ones make room
  EXPECT_EQ(pool.pooled_bytes(), uint64_t{4} << 20);
  EXPECT_EQ(pool.pooled_buffers(), 3u);
  pool.Give(ByteBuffer(8 << 20));  // larger than the whole cap: never kept
  EXPECT_EQ(pool.pooled_bytes(), uint64_t{4} << 20);
}

TEST(ThousandsOfSmallBuffersFollowTheRulesOfBestFitAndCap) {
  // A late worker with small partitions replays thousands of early frames in one turn of the I/O
  // thread; the pool is kept ordered by capacity for that. Checked against a plain model of the rules: Take returns the smallest capacity
  // that fits; Give drops the smallest pooled buffers (none larger than the one given) to make
  // room under the cap, or frees the one given.
  const uint64_t cap = 1 << 20;
  BufferPool pool(cap);
  std::multiset<size_t> model;
  uint64_t model_bytes = 0;
  std::mt19937_64 rng(7);
  std::vector<ByteBuffer> out;
  for (int step = 0; step < 20000; ++step) {
    if (rng() % 2 == 0) {
      const size_t bytes = 1 + rng() % 2048;
      ByteBuffer b = pool.Take(bytes);
      const auto fit = model.lower_bound(bytes);
      const size_t expected = fit == model.end() ? bytes : *fit;
      if (fit != model.end()) {
        model_bytes -= *fit;
        model.erase(fit);
      }
      EXPECT_EQ(b.capacity(), expected);
      EXPECT_EQ(b.size(), bytes);
      out.push_back(std::move(b));
    } else if (!out.empty()) {
      const size_t at = rng() % out.size();
      const size_t capacity = out[at].capacity();
      pool.Give(std::move(out[at]));
      out[at] = std::move(out.back());
      out.pop_back();
      while (model_bytes + capacity > cap && !model.empty() && *model.begin() <= capacity) {
        model_bytes -= *model.begin();
        model.erase(model.begin());
      }
      if (model_bytes + capacity <= cap) {
        model_bytes += capacity;
        model.insert(capacity);
      }
    }
    EXPECT_EQ(pool.pooled_bytes(), model_bytes);
    EXPECT_EQ(pool.pooled_buffers(), model.size());
    if (pool.pooled_bytes() != model_bytes) break;
  }
  EXPECT_TRUE(model.size() > 100);  // the pool did hold many buffers
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
