#include "ops/core/scheduler.h"

#include <algorithm>

namespace prophet {

void PriorityTaskQueue::Push(const SendTask& task) {
  heap_.push_back(task);
  std::push_heap(heap_.begin(), heap_.end(), LessUrgent);
}

SendTask PriorityTaskQueue::Pop() {
  std::pop_heap(heap_.begin(), heap_.end(), LessUrgent);
  SendTask task = std::move(heap_.back());
  heap_.pop_back();
  return task;
}

void PriorityTaskQueue::MoveAllTo(PriorityTaskQueue* other) {
  for (const SendTask& task : heap_) other->Push(task);
  heap_.clear();
}

SendTask FifoTaskQueue::Pop() {
  SendTask task = std::move(queue_.front());
  queue_.pop_front();
  return task;
}

void FifoPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  CreditWindow(credit_bytes).Release(&queue_, out);
}

void PriorityPolicy::Dequeue(uint64_t credit_bytes, int64_t /*now_ns*/, std::vector<SendTask>* out) {
  CreditWindow(credit_bytes).Release(&queue_, out);
}

}  // namespace prophet
