#include "ops/core/buffer_pool.h"

#include <algorithm>

namespace prophet {

ByteBuffer BufferPool::Take(size_t bytes) {
  if (bytes == 0) return ByteBuffer();
  size_t best = free_.size();
  for (size_t i = 0; i < free_.size(); ++i)
    if (free_[i].capacity() >= bytes && (best == free_.size() || free_[i].capacity() < free_[best].capacity()))
      best = i;
  if (best == free_.size()) return ByteBuffer(bytes);
  ByteBuffer buffer = std::move(free_[best]);
  free_[best] = std::move(free_.back());
  free_.pop_back();
  pooled_bytes_ -= buffer.capacity();
  buffer.size_ = bytes;
  return buffer;
}

void BufferPool::Give(ByteBuffer buffer) {
  const uint64_t capacity = buffer.capacity();
  if (capacity == 0 || capacity > max_pooled_bytes_) return;
  // Smaller buffers make room for a larger one: partitions of one tensor share a size, so the
  // pool follows the sizes in use.
  std::sort(free_.begin(), free_.end(),
            [](const ByteBuffer& a, const ByteBuffer& b) { return a.capacity() > b.capacity(); });
  while (pooled_bytes_ + capacity > max_pooled_bytes_ && !free_.empty() && free_.back().capacity() <= capacity) {
    pooled_bytes_ -= free_.back().capacity();
    free_.pop_back();
  }
  if (pooled_bytes_ + capacity > max_pooled_bytes_) return;
  pooled_bytes_ += capacity;
  free_.push_back(std::move(buffer));
}

}  // namespace prophet
