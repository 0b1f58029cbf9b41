#include "ops/core/output_pool.h"

#include <cstdlib>

namespace prophet {

OutputPool::~OutputPool() {
  for (const Kept& k : kept_) std::free(k.data);
}

void* OutputPool::Take(size_t bytes, int64_t now_ns) {
  if (bytes == 0) bytes = 1;
  std::lock_guard<std::mutex> lock(mu_);
  Trim(now_ns);
  size_t best = kept_.size();
  for (size_t i = 0; i < kept_.size(); ++i) {
    const size_t c = kept_[i].capacity;
    if (c >= bytes && c - bytes <= bytes / 8 && (best == kept_.size() || c < kept_[best].capacity)) best = i;
  }
  void* data = nullptr;
  size_t capacity = bytes;
  if (best < kept_.size()) {
    data = kept_[best].data;
    capacity = kept_[best].capacity;
    kept_bytes_ -= capacity;
    kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
    ++reused_;
  } else if (::posix_memalign(&data, kOutputAlignment, bytes) != 0) {
    return nullptr;
  }
  taken_[data] = capacity;
  taken_bytes_ += capacity;
  if (taken_bytes_ > peak_taken_bytes_) peak_taken_bytes_ = taken_bytes_;
  return data;
}

void OutputPool::Give(void* data, int64_t now_ns) {
  if (data == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = taken_.find(data);
  if (it == taken_.end()) {  // not ours: a caller's mistake, but freeing is what it wanted
    std::free(data);
    return;
  }
  const size_t capacity = it->second;
  taken_.erase(it);
  taken_bytes_ -= capacity;
  kept_.push_back({data, capacity, now_ns});
  kept_bytes_ += capacity;
  Trim(now_ns);
}

void OutputPool::Trim(int64_t now_ns) {
  size_t drop = 0;  // kept_ is oldest first: the idle ones, then the oldest beyond the peak
  uint64_t kept = kept_bytes_;
  while (drop < kept_.size() && (now_ns - kept_[drop].since_ns > kRecycleIdleNs || kept > peak_taken_bytes_)) {
    kept -= kept_[drop].capacity;
    ++drop;
  }
  for (size_t i = 0; i < drop; ++i) std::free(kept_[i].data);
  kept_.erase(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(drop));
  kept_bytes_ = kept;
}

uint64_t OutputPool::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_bytes_;
}

size_t OutputPool::kept_buffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return kept_.size();
}

uint64_t OutputPool::peak_taken_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_taken_bytes_;
}

uint64_t OutputPool::reused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reused_;
}

OutputPool& GlobalOutputPool() {
  static OutputPool* pool = new OutputPool();  // leaked on purpose (see the header)
  return *pool;
}

}  // namespace prophet
