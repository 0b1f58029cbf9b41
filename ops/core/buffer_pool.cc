#include "ops/core/buffer_pool.h"

namespace prophet {

ByteBuffer BufferPool::Take(size_t bytes) {
  if (bytes == 0) return ByteBuffer();
  const auto best = free_.lower_bound(bytes);
  if (best == free_.end()) return ByteBuffer(bytes);
  ByteBuffer buffer = std::move(best->second);
  free_.erase(best);
  pooled_bytes_ -= buffer.capacity();
  buffer.size_ = bytes;
  return buffer;
}

void BufferPool::Give(ByteBuffer buffer) {
  const uint64_t capacity = buffer.capacity();
  if (capacity == 0 || capacity > max_pooled_bytes_) return;
  // Smaller buffers make room for a larger one: partitions of one tensor share a size, so the
  // pool follows the sizes in use.
  while (pooled_bytes_ + capacity > max_pooled_bytes_ && !free_.empty() && free_.begin()->first <= capacity) {
    pooled_bytes_ -= free_.begin()->first;
    free_.erase(free_.begin());
  }
  if (pooled_bytes_ + capacity > max_pooled_bytes_) return;
  pooled_bytes_ += capacity;
  free_.emplace(capacity, std::move(buffer));
}

}  // namespace prophet
