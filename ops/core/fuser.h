// The engine's side of fusion (fusion.h): declared tensors are held until every member of their
// bucket is submitted, then travel as one push_pull of the packed bucket, whose sums are copied
// back into each member's output (a bucket of one travels in its member's own buffers)
// (docs/design.md, "Fusion").
//
// Agreement: every worker declares the same tensors (the training program's gradients: names,
// bytes, dtype, priority, averaging, compression), so PlanFusion (and, with lanes, the dealt
// buckets: FusionByLane) gives every worker the same buckets, members, order and byte offsets. A bucket's name carries a digest of its members'
// declarations, so workers whose declarations differ never add each other's bytes: their buckets
// have different names. A member submitted with another shape, dtype, averaging or compression
// than declared fails at once with an error naming it, and so does the rest of its bucket's round,
// on every worker (an error notice under the bucket's key). A bucket whose members do not all
// arrive within the operation timeout fails its held members, naming the missing ones.
//
// Declarations that differ across workers (a model built differently on one worker) are found
// in seconds, not after the operation timeout, by the check (FrameType::kFusionCheck):
// - every worker tells its peers the digest of its buckets when a declaration changes them
//   (kDigest; a declaration that changes nothing, e.g. one worker compiling again, sends nothing);
// - a bucket that has waited kFusionCheckAfterNs asks every peer whose digest differs what it
//   did with the bucket's members at their rounds (kQuery, with this worker's declaration); it
//   asks again, less and less often, while it waits. The digests alone cannot decide: a peer may
//   not have traced its step (declared) yet;
// - the peer answers only when it proves a difference: a member it has already routed, at that
//   round, into another bucket or alone. It then names the first tensor the two declarations
//   disagree on (DescribeDisagreement), fails its fused operations and the push_pulls of tensors
//   either declared, and tells the asker (kDisagree: the message and its declaration), which
//   does the same. Failed operations tell every worker (error notices), and until the next
//   declaration those push_pulls fail at once, everywhere.
// While the digests agree, the check sends nothing.
//
// Runs on the engine thread only.
#ifndef PROPHET_OPS_CORE_FUSER_H_
#define PROPHET_OPS_CORE_FUSER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops/core/buffer_pool.h"
#include "ops/core/common.h"
#include "ops/core/engine.h"
#include "ops/core/fusion.h"

namespace prophet {

// The kinds of FrameType::kFusionCheck frames (their `partition`).
enum class FusionCheckKind : uint32_t {
  kDigest = 0,    // offset: the sender's bucket digest (Fuser::digest)
  kQuery = 1,     // name#round: a bucket waiting at the sender; payload: its members, the declaration
  kDisagree = 2,  // payload: the message that fails the operations, a line; the sender's declaration
};
// A bucket waits this long before its worker asks peers with other digests about it.
constexpr int64_t kFusionCheckAfterNs = 1000000000;
// ... and asks again after twice as long each time, up to this interval.
constexpr int64_t kFusionCheckMaxIntervalNs = 8000000000;

// A declaration as one line of text, "DTYPE SHAPE BYTES PRIORITY AVERAGE COMPRESSION NAME" (DTYPE
// as DataTypeName, SHAPE its dimensions joined by ',' or '-' for a scalar, AVERAGE 0/1,
// COMPRESSION as EncodingName; NAME to the end of the line): how Python declares (c_api.cc) and
// how the check sends declarations.
std::string FusionDeclarationLine(const FusionDeclaration& d);
// False if `line` is not such a line.
bool ParseFusionDeclarationLine(const std::string& line, FusionDeclaration* d);

// One tensor of a worker's declarations as the check compares them: as declared, with the bucket
// size of its declaration.
struct DeclaredTensor {
  FusionDeclaration tensor;
  uint64_t bucket_bytes = 0;
};

// The first difference between two workers' declarations (each in any order): the first tensor
// in priority order that one declares and the other does not, or declares otherwise, named with
// both declarations and the fix; else the bucket sizes; else `fallback`. The same sentence
// whichever worker writes it.
std::string DescribeDisagreement(int rank_a, const std::vector<DeclaredTensor>& a, int rank_b,
                                 const std::vector<DeclaredTensor>& b, const std::string& fallback);

// A declaration that names a tensor twice, or whose bytes are not its shape, fails with the reason.
Status ValidateDeclaration(const std::string& group, const std::vector<FusionDeclaration>& tensors);
// How a declared tensor enters the plan (PlanFusion).
FusionInput FusionInputOf(const FusionDeclaration& declaration);
// For the engine's lanes (engine.h): what each of `lanes` lanes declares. The plan's buckets
// are dealt by DealBucketsToLanes (fusion.h: about the same bytes on every lane, buckets of
// every urgency); a lane's share is its buckets' members, and `groups` gets, per lane, those
// buckets as indices into its share, which its fuser takes as they are (Fuser::Declare).
// `fused_lane` gets, for every member of a bucket, its lane (the rest travel alone).
std::vector<std::vector<FusionDeclaration>> FusionByLane(const std::vector<FusionDeclaration>& tensors, int world_size,
                                                         uint64_t bucket_bytes, int lanes,
                                                         std::unordered_map<std::string, int>* fused_lane,
                                                         std::vector<std::vector<std::vector<int>>>* groups);

class Fuser {
 public:
  // A member's request that cannot go on, with the status it ends with.
  using Refusal = std::pair<OpRequest, Status>;

  // Replaces the plan of `group` (one optimizer step's gradients) and of every other group that
  // holds one of `tensors` (a model compiled again declares its gradients for a new optimizer:
  // the last declaration wins, the old group's other tensors travel alone). Fails if a member of
  // a replaced plan is held (declare between steps) or `tensors` names a tensor twice. With
  // `buckets` (a lane's share: FusionByLane's groups), those are the buckets; else PlanFusion's.
  Status Declare(const std::string& group, const std::vector<FusionDeclaration>& tensors, int world_size,
                 uint64_t bucket_bytes, const std::vector<std::vector<int>>* buckets = nullptr);
  // Whether `request` is a push_pull of a tensor that travels in a fused bucket.
  bool Fuses(const OpRequest& request) const;
  // Holds a member's request. Appends the bucket's request when this completes a round of its
  // bucket (its round comes from the engine: submit it like any request), and the requests that
  // must fail now (a member that differs from its declaration and the rest of its bucket's round:
  // `notice` then gets the bucket's name, whose next round must fail on every worker too).
  // `round`: the request's round (Engine::Submit).
  void Hold(OpRequest request, uint64_t round, int64_t now_ns, std::vector<OpRequest>* ready,
            std::vector<Refusal>* refused, std::string* notice);
  // Held requests of buckets whose oldest member has waited `timeout_ns` or more fail.
  void Expire(int64_t now_ns, int64_t timeout_ns, std::vector<Refusal>* refused);
  // Every held request (the engine is stopping).
  void TakeAll(std::vector<OpRequest>* held);
  size_t held() const;

  // --- The check of agreement across workers (see the top of this file) ------------------------
  // A frame for a peer (the engine sends it as FrameType::kFusionCheck).
  struct CheckFrame {
    int peer = 0;
    FusionCheckKind kind = FusionCheckKind::kDigest;
    std::string name;
    uint64_t round = 0;
    uint64_t digest = 0;
    std::string payload;
  };
  // How round `round` of push_pull `name` travels from now on (in its bucket, or alone): a peer's
  // question about it is answered from this. Called for every push_pull as it is routed.
  void Routed(const std::string& name, uint64_t round);
  // The digest of this worker's buckets: equal on workers that make the same buckets; 0 for none.
  uint64_t digest() const { return digest_; }
  // After Declare: a kDigest frame for each peer in `out` if the digest changed since the peers
  // were last told.
  void TellDigest(int rank, int world_size, std::vector<CheckFrame>* out);
  // The request Hold returned for `bucket_name` started as that name's round `round`.
  void Started(const std::string& bucket_name, uint64_t round, int64_t now_ns);
  // Questions (kQuery) for peers whose digest differs about started buckets that have waited long
  // enough; `running(name, round)` tells whether a started bucket still runs.
  void Check(int64_t now_ns, int rank, int world_size,
             const std::function<bool(const std::string& name, uint64_t round)>& running, std::vector<CheckFrame>* out);
  // A check frame from `peer` (`out` gets the answer, if any). Returns the error when it proves
  // the declarations differ; this worker then refuses as Refuses says, the held members now
  // (`refused`), and the engine fails what runs: fused buckets and what Refuses names. Else OK.
  Status OnCheck(int rank, int peer, FusionCheckKind kind, const std::string& name, uint64_t round, uint64_t digest,
                 const std::string& payload, std::vector<CheckFrame>* out, std::vector<Refusal>* refused);
  // While the declarations are known to differ (until the next declaration): whether push_pull
  // `request` fails at once (a tensor either worker declared), and with what error.
  bool Refuses(const OpRequest& request, Status* error) const;
  // This worker's declarations, in priority order (most urgent first, ties by name).
  std::vector<DeclaredTensor> Declared() const;

 private:
  struct Bucket {
    std::string group;
    uint64_t bucket_bytes = 0;  // the plan's bucket size: how the bucket is cut
    FusionBucket plan;
    std::string name;                           // plan.name + the members' digest
    std::vector<FusionDeclaration> members;     // in bucket order
    std::vector<std::deque<OpRequest>> queued;  // per member: submitted, not yet sent
    std::vector<std::deque<int64_t>> since_ns;  // when each was held
    std::vector<std::deque<uint64_t>> rounds;   // of each queued request
    // Per member: submissions still to come of rounds that failed (a member differed), refused
    // at once with the error of their round.
    std::vector<std::deque<Status>> refuse_next;
    std::vector<uint64_t> launching;  // the member rounds of the request Launch returned last
  };
  // A push_pull's routes: from which of its rounds it travelled in which bucket ("" alone).
  struct Routes {
    uint64_t next_round = 0;  // rounds routed so far
    uint64_t epoch = 0;       // the declaration epoch_ its last route was read in
    std::vector<std::pair<uint64_t, std::string>> from;  // (first round, bucket), the last few
  };
  // A started bucket, for the check.
  struct InFlight {
    std::string name;
    uint64_t round = 0;
    std::vector<std::pair<std::string, uint64_t>> members;  // name, round
    int64_t next_check_ns = 0;
    int64_t interval_ns = 0;
  };
  // The bucket's request for the front request of every member (popped).
  OpRequest Launch(Bucket& bucket);

  std::vector<Bucket> buckets_;
  std::unordered_map<std::string, std::pair<size_t, size_t>> member_of_;  // name -> (bucket, slot)
  // Every declared tensor (fused or not) and its group, for the check's messages.
  std::unordered_map<std::string, std::pair<DeclaredTensor, std::string>> declared_;
  uint64_t epoch_ = 1;  // counts the declarations
  uint64_t digest_ = 0, told_digest_ = 0;
  std::unordered_map<std::string, Routes> routes_;  // by push_pull name
  std::unordered_map<std::string, InFlight> in_flight_;  // by bucket key (name#round)
  std::vector<uint64_t> peer_digests_;              // by rank, as last told (0 before)
  // Every worker's operations fail while the declarations are known to differ (Disagree): the
  // error, and the tensors this worker or the peer declared.
  void Disagree(const Status& error, const std::vector<DeclaredTensor>& theirs, std::vector<Refusal>* refused);
  Status disagreement_;
  std::unordered_map<std::string, int> disagreed_;
  // The packed buckets' memory, reused step after step (a new buffer would be zeroed and, when
  // large, page-faulted in on every launch); holds one of each bucket. Shared with the runs in
  // flight, which give their buffer back when their sums are copied out.
  std::shared_ptr<BufferPool> buffers_ = std::make_shared<BufferPool>(0);
};

// "a, b and c" of the members' names, for error messages.
std::string MemberList(const std::vector<FusionDeclaration>& members);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUSER_H_
