// BufferPool: warm buffers come back (best fit), the cap holds, and sizes follow the ones in use.
#include "ops/core/buffer_pool.h"

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

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
