// The engine's side of fusion (fusion.h): declared tensors are held until every member of their
// bucket is submitted, then travel as one push_pull of the packed bucket, whose sums are copied
// back into each member's output (docs/design.md, "Fusion").
//
// Agreement: every worker declares the same tensors (the training program's gradients: names,
// bytes, dtype, priority, averaging, compression), so PlanFusion gives every worker the same
// buckets, members, order and byte offsets. A bucket's name carries a digest of its members'
// declarations, so workers whose declarations differ never add each other's bytes: their buckets
// have different names. A member submitted with another shape, dtype, averaging or compression
// than declared fails at once with an error naming it, and so does the rest of its bucket's round,
// on every worker (an error notice under the bucket's key). A bucket whose members do not all
// arrive within the operation timeout fails its held members, naming the missing ones.
//
// Runs on the engine thread only.
#ifndef PROPHET_OPS_CORE_FUSER_H_
#define PROPHET_OPS_CORE_FUSER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops/core/common.h"
#include "ops/core/engine.h"
#include "ops/core/fusion.h"

namespace prophet {

class Fuser {
 public:
  // A member's request that cannot go on, with the status it ends with.
  using Refusal = std::pair<OpRequest, Status>;

  // Replaces the plan of `group` (one optimizer step's gradients) and of every other group that
  // holds one of `tensors` (a model compiled again declares its gradients for a new optimizer:
  // the last declaration wins, the old group's other tensors travel alone). Fails if a member of
  // a replaced plan is held (declare between steps) or `tensors` names a tensor twice.
  Status Declare(const std::string& group, const std::vector<FusionDeclaration>& tensors, int world_size,
                 uint64_t bucket_bytes);
  // Whether `request` is a push_pull of a tensor that travels in a fused bucket.
  bool Fuses(const OpRequest& request) const;
  // Holds a member's request. Appends the bucket's request when this completes a round of its
  // bucket (its round comes from the engine: submit it like any request), and the requests that
  // must fail now (a member that differs from its declaration and the rest of its bucket's round:
  // `notice` then gets the bucket's name, whose next round must fail on every worker too).
  void Hold(OpRequest request, int64_t now_ns, std::vector<OpRequest>* ready, std::vector<Refusal>* refused,
            std::string* notice);
  // Held requests of buckets whose oldest member has waited `timeout_ns` or more fail.
  void Expire(int64_t now_ns, int64_t timeout_ns, std::vector<Refusal>* refused);
  // Every held request (the engine is stopping).
  void TakeAll(std::vector<OpRequest>* held);
  size_t held() const;

 private:
  struct Bucket {
    std::string group;
    uint64_t bucket_bytes = 0;  // the plan's bucket size: how the bucket is cut
    FusionBucket plan;
    std::string name;                           // plan.name + the members' digest
    std::vector<FusionDeclaration> members;     // in bucket order
    std::vector<std::deque<OpRequest>> queued;  // per member: submitted, not yet sent
    std::vector<std::deque<int64_t>> since_ns;  // when each was held
    // Per member: submissions still to come of rounds that failed (a member differed), refused
    // at once with the error of their round.
    std::vector<std::deque<Status>> refuse_next;
  };
  // The bucket's request for the front request of every member (popped).
  OpRequest Launch(Bucket& bucket);

  std::vector<Bucket> buckets_;
  std::unordered_map<std::string, std::pair<size_t, size_t>> member_of_;  // name -> (bucket, slot)
};

// "a, b and c" of the members' names, for error messages.
std::string MemberList(const std::vector<FusionDeclaration>& members);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUSER_H_
