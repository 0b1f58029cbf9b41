#include "ops/core/fuser.h"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "ops/core/codec.h"
#include "ops/core/scheduler.h"
#include "ops/core/wire.h"

namespace prophet {

std::string MemberList(const std::vector<FusionDeclaration>& members) {
  std::string out;
  for (size_t i = 0; i < members.size(); ++i) {
    if (i > 0) out += i + 1 == members.size() ? " and " : ", ";
    out += "'" + members[i].name + "'";
  }
  return out;
}

namespace {

std::string Describe(const FusionDeclaration& d) {
  return "shape " + ShapeString(d.shape) + " " + DataTypeName(d.dtype) + " (" + std::to_string(d.bytes) + " bytes)" +
         (d.average ? ", averaged" : ", summed") + ", compression " + EncodingName(d.compression);
}

// A digest of the members' declarations: workers that declared differently get different bucket
// names, so their bytes are never added together.
std::string Digest(const std::vector<FusionDeclaration>& members) {
  std::string text;
  for (const FusionDeclaration& d : members)
    text += d.name + "|" + Describe(d) + "|" + std::to_string(d.priority) + ";";
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(HashString(text)));
  return hex;
}

}  // namespace

Status Fuser::Declare(const std::string& group, const std::vector<FusionDeclaration>& tensors, int world_size,
                     uint64_t bucket_bytes) {
  // The plans this declaration replaces: its group's, and that of any group holding one of its
  // tensors. A model compiled again gets a new optimizer (a new group) for the same gradients;
  // the last declaration of a tensor wins, and the old group's other tensors travel alone.
  std::unordered_map<std::string, int> replaced{{group, 1}};
  for (const FusionDeclaration& d : tensors) {
    const auto other = member_of_.find(d.name);
    if (other != member_of_.end()) replaced.emplace(buckets_[other->second.first].group, 1);
  }
  for (const Bucket& b : buckets_) {
    if (!replaced.count(b.group)) continue;
    for (const auto& q : b.queued)
      if (!q.empty())
        return Status(Code::kFailedPrecondition,
                      "fusion declaration '" + group + "' came while '" + q.front().name + "' of the declaration '" +
                          b.group + "' waits for the rest of its bucket; declare between steps");
  }
  std::vector<FusionInput> inputs;
  std::unordered_map<std::string, int> seen;
  for (const FusionDeclaration& d : tensors) {
    if (!seen.emplace(d.name, 1).second)
      return Status(Code::kInvalidArgument, "fusion declaration '" + group + "' names tensor '" + d.name + "' twice");
    const size_t elem = DataTypeSize(d.dtype);
    int64_t elements = 1;
    for (const int64_t dim : d.shape) elements = dim < 0 ? -1 : elements * dim;
    if (elem == 0 || elements < 0 || d.bytes != static_cast<uint64_t>(elements) * elem)
      return Status(Code::kInvalidArgument, "fusion declaration of '" + d.name + "': " + std::to_string(d.bytes) +
                                                " bytes is not shape " + ShapeString(d.shape) + " of " +
                                                DataTypeName(d.dtype));
    FusionInput in;
    in.name = d.name;
    in.bytes = d.bytes;
    in.element_size = static_cast<uint32_t>(elem);
    in.priority = d.priority;
    // What must agree inside one payload: the dtype, averaging and the encoding.
    in.fuse_key = (static_cast<uint64_t>(d.dtype) << 16) | (static_cast<uint64_t>(d.compression) << 8) |
                  (d.average ? 1u : 0u);
    in.fusable = d.priority < kControlPriority;
    inputs.push_back(in);
  }
  buckets_.erase(
      std::remove_if(buckets_.begin(), buckets_.end(), [&](const Bucket& b) { return replaced.count(b.group) != 0; }),
      buckets_.end());
  for (FusionBucket& plan : PlanFusion(inputs, world_size, bucket_bytes)) {
    if (!plan.fused()) continue;  // travels alone, as without fusion
    Bucket b;
    b.group = group;
    b.bucket_bytes = bucket_bytes;
    for (const int m : plan.members) b.members.push_back(tensors[m]);
    b.name = plan.name + "~" + Digest(b.members);
    b.queued.resize(b.members.size());
    b.since_ns.resize(b.members.size());
    b.refuse_next.resize(b.members.size());
    b.plan = std::move(plan);
    buckets_.push_back(std::move(b));
  }
  member_of_.clear();
  for (size_t i = 0; i < buckets_.size(); ++i)
    for (size_t slot = 0; slot < buckets_[i].members.size(); ++slot) member_of_[buckets_[i].members[slot].name] = {i, slot};
  return Status::OK();
}

bool Fuser::Fuses(const OpRequest& request) const {
  return request.kind == OpKind::kPushPull && member_of_.count(request.name) != 0;
}

size_t Fuser::held() const {
  size_t n = 0;
  for (const Bucket& b : buckets_)
    for (const auto& q : b.queued) n += q.size();
  return n;
}

void Fuser::Hold(OpRequest request, int64_t now_ns, std::vector<OpRequest>* ready, std::vector<Refusal>* refused,
                 std::string* notice) {
  const auto [index, slot] = member_of_.at(request.name);
  Bucket& b = buckets_[index];
  const FusionDeclaration& d = b.members[slot];
  if (!b.refuse_next[slot].empty()) {  // its round failed already
    refused->emplace_back(std::move(request), b.refuse_next[slot].front());
    b.refuse_next[slot].pop_front();
    return;
  }
  if (request.dtype != d.dtype || request.shape != d.shape || request.bytes != d.bytes ||
      request.average != d.average || request.compression != d.compression) {
    FusionDeclaration got = d;
    got.dtype = request.dtype;
    got.shape = request.shape;
    got.bytes = request.bytes;
    got.average = request.average;
    got.compression = request.compression;
    const Status error(Code::kInvalidArgument,
                       "push_pull '" + d.name + "' was declared for fusion (bucket of " + MemberList(b.members) +
                           ") with " + Describe(d) + " but submitted with " + Describe(got) +
                           "; declare what every worker submits");
    refused->emplace_back(std::move(request), error);
    // The rest of this round of the bucket cannot travel either, here or anywhere: the members
    // held fail now, those still to come when they come.
    for (size_t m = 0; m < b.queued.size(); ++m) {
      if (m == slot) continue;
      if (b.queued[m].empty()) {
        b.refuse_next[m].push_back(error);
        continue;
      }
      refused->emplace_back(std::move(b.queued[m].front()), error);
      b.queued[m].pop_front();
      b.since_ns[m].pop_front();
    }
    *notice = b.name;
    return;
  }
  b.queued[slot].push_back(std::move(request));
  b.since_ns[slot].push_back(now_ns);
  for (const auto& q : b.queued)
    if (q.empty()) return;
  ready->push_back(Launch(b));
}

OpRequest Fuser::Launch(Bucket& b) {
  struct Run {
    std::vector<char> data;  // the packed bucket, summed in place
    std::vector<OpRequest> members;
  };
  auto run = std::make_shared<Run>();
  run->data.resize(b.plan.bytes);
  for (size_t m = 0; m < b.queued.size(); ++m) {
    OpRequest member = std::move(b.queued[m].front());
    b.queued[m].pop_front();
    b.since_ns[m].pop_front();
    if (member.bytes) std::memcpy(run->data.data() + b.plan.offsets[m], member.input, member.bytes);
    run->members.push_back(std::move(member));
  }
  const FusionDeclaration& first = b.members.front();
  OpRequest r;
  r.kind = OpKind::kPushPull;
  r.name = b.name;
  r.dtype = first.dtype;
  r.shape = {static_cast<int64_t>(b.plan.bytes / DataTypeSize(first.dtype))};
  r.input = run->data.data();
  r.output = run->data.data();
  r.bytes = b.plan.bytes;
  r.priority = b.plan.priority;
  r.average = first.average;
  r.compression = first.compression;
  r.fusion_bucket_bytes = b.bucket_bytes;
  const std::vector<uint64_t> offsets = b.plan.offsets;
  const std::string what = "fused bucket '" + b.name + "' of " + MemberList(b.members);
  r.done = [run, offsets, what](const Status& status, const GatherResult*) {
    for (size_t m = 0; m < run->members.size(); ++m) {
      OpRequest& member = run->members[m];
      if (status.ok()) {
        if (member.bytes) std::memcpy(member.output, run->data.data() + offsets[m], member.bytes);
        member.done(status, nullptr);
      } else {
        member.done(Status(status.code(), what + ": " + status.message()), nullptr);
      }
    }
  };
  return r;
}

void Fuser::Expire(int64_t now_ns, int64_t timeout_ns, std::vector<Refusal>* refused) {
  for (Bucket& b : buckets_) {
    bool late = false;
    for (const auto& since : b.since_ns) late = late || (!since.empty() && now_ns - since.front() >= timeout_ns);
    if (!late) continue;
    std::vector<FusionDeclaration> missing;
    for (size_t m = 0; m < b.queued.size(); ++m)
      if (b.queued[m].empty()) missing.push_back(b.members[m]);
    const Status error(Code::kDeadlineExceeded,
                       "fused bucket '" + b.name + "' of " + MemberList(b.members) + ": " + MemberList(missing) +
                           " not submitted on this worker within the operation timeout; every declared tensor "
                           "must be submitted each step");
    for (size_t m = 0; m < b.queued.size(); ++m) {
      while (!b.queued[m].empty()) {
        refused->emplace_back(std::move(b.queued[m].front()), error);
        b.queued[m].pop_front();
      }
      b.since_ns[m].clear();
    }
  }
}

void Fuser::TakeAll(std::vector<OpRequest>* held) {
  for (Bucket& b : buckets_) {
    for (size_t m = 0; m < b.queued.size(); ++m) {
      for (OpRequest& r : b.queued[m]) held->push_back(std::move(r));
      b.queued[m].clear();
      b.since_ns[m].clear();
    }
  }
}

}  // namespace prophet
