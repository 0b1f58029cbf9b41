// Payload bytes held in memory (frames that arrive before their operation, allgather pieces),
// and the pool that recycles them.
//
// Why not std::vector<char>: making a vector of n bytes writes n zeros, and a freshly allocated
// large buffer costs a page fault (and the kernel's zeroing) per 4 KiB on first touch. A frame's
// payload is received over every byte anyway, so a ByteBuffer is left uninitialised, and the
// pool hands back warm buffers: a push_pull whose peer runs ahead (its PUSHes arrive before this
// worker submits) then costs the receive and the later sum, not a fresh allocation per partition.
#ifndef PROPHET_OPS_CORE_BUFFER_POOL_H_
#define PROPHET_OPS_CORE_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

namespace prophet {

class ByteBuffer {
 public:
  ByteBuffer() = default;
  explicit ByteBuffer(size_t bytes) : data_(bytes ? new char[bytes] : nullptr), size_(bytes), capacity_(bytes) {}
  ByteBuffer(ByteBuffer&& other) noexcept { *this = std::move(other); }
  ByteBuffer& operator=(ByteBuffer&& other) noexcept {
    data_ = std::move(other.data_);
    size_ = other.size_;
    capacity_ = other.capacity_;
    other.size_ = other.capacity_ = 0;
    return *this;
  }

  char* data() { return data_.get(); }
  const char* data() const { return data_.get(); }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  bool empty() const { return size_ == 0; }

 private:
  friend class BufferPool;
  std::unique_ptr<char[]> data_;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// Keeps returned buffers, up to `max_pooled_bytes` of capacity in total, for reuse. Not
// thread-safe: the engine's I/O thread owns it. Take and Give cost O(log n) in the buffers
// pooled: with small partitions a worker that submits late replays thousands of early frames in
// one turn of the I/O thread, each returning its buffer here.
class BufferPool {
 public:
  explicit BufferPool(uint64_t max_pooled_bytes) : max_pooled_bytes_(max_pooled_bytes) {}

  // `bytes` of uninitialised memory: the smallest pooled buffer that is large enough, else a
  // new one.
  ByteBuffer Take(size_t bytes);
  // Keeps `buffer` if it fits under the cap (making room by dropping smaller pooled buffers),
  // else frees it.
  void Give(ByteBuffer buffer);

  uint64_t pooled_bytes() const { return pooled_bytes_; }
  size_t pooled_buffers() const { return free_.size(); }

 private:
  const uint64_t max_pooled_bytes_;
  uint64_t pooled_bytes_ = 0;
  std::multimap<size_t, ByteBuffer> free_;  // by capacity
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_BUFFER_POOL_H_
