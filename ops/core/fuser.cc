#include "ops/core/fuser.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "ops/core/codec.h"
#include "ops/core/collective.h"
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

// What one tensor's push_pull is, whatever its priority.
bool SamePushPull(const FusionDeclaration& a, const FusionDeclaration& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.bytes == b.bytes && a.average == b.average &&
         a.compression == b.compression;
}

// Most urgent first, ties by name: PlanFusion's order.
bool MoreUrgent(const DeclaredTensor& a, const DeclaredTensor& b) {
  if (a.tensor.priority != b.tensor.priority) return a.tensor.priority > b.tensor.priority;
  return a.tensor.name < b.tensor.name;
}

// Every message of a disagreement starts so (a fused member's error then goes without its
// bucket's name: the message names the tensor).
constexpr const char* kDisagreementLead = "the gradients declared for fusion differ across workers: ";
constexpr const char* kDisagreementFix =
    "; every worker must build the same model (the same trainable variables, with the same shapes and dtypes) "
    "and pass the same ProphetStrategy options (fusion, compression)";

// A kQuery payload: "M ROUND NAME" per member of the bucket, then "D BUCKET_BYTES LINE" per
// declared tensor (LINE: FusionDeclarationLine).
std::string QueryPayload(const std::vector<std::pair<std::string, uint64_t>>& members, const std::string& declared) {
  std::string out;
  for (const auto& [name, round] : members) out += "M " + std::to_string(round) + " " + name + "\n";
  return out + declared;
}

std::string DeclaredPayload(const std::vector<DeclaredTensor>& declared) {
  std::string out;
  for (const DeclaredTensor& t : declared)
    out += "D " + std::to_string(t.bucket_bytes) + " " + FusionDeclarationLine(t.tensor) + "\n";
  return out;
}

// Parses a kQuery payload; false if it is malformed.
bool ParseQuery(const std::string& payload, std::vector<std::pair<std::string, uint64_t>>* members,
                std::vector<DeclaredTensor>* declared) {
  std::istringstream lines(payload);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.size() < 2 || line[1] != ' ') return false;
    const size_t space = line.find(' ', 2);
    if (space == std::string::npos) return false;
    char* end = nullptr;
    const unsigned long long number = std::strtoull(line.c_str() + 2, &end, 10);
    if (end != line.c_str() + space) return false;
    const std::string rest = line.substr(space + 1);
    if (line[0] == 'M') {
      members->emplace_back(rest, number);
    } else if (line[0] == 'D') {
      DeclaredTensor t;
      t.bucket_bytes = number;
      if (!ParseFusionDeclarationLine(rest, &t.tensor)) return false;
      declared->push_back(std::move(t));
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string FusionDeclarationLine(const FusionDeclaration& d) {
  std::string shape;
  for (size_t i = 0; i < d.shape.size(); ++i) shape += (i ? "," : "") + std::to_string(d.shape[i]);
  return std::string(DataTypeName(d.dtype)) + " " + (shape.empty() ? "-" : shape) + " " + std::to_string(d.bytes) +
         " " + std::to_string(d.priority) + " " + (d.average ? "1" : "0") + " " + EncodingName(d.compression) + " " +
         d.name;
}

bool ParseFusionDeclarationLine(const std::string& line, FusionDeclaration* d) {
  std::istringstream in(line);
  std::string dtype, shape, compression;
  int average = 0;
  *d = FusionDeclaration();
  bool ok = static_cast<bool>(in >> dtype >> shape >> d->bytes >> d->priority >> average >> compression);
  if (ok && shape != "-") {
    std::istringstream dims(shape);
    std::string dim;
    while (ok && std::getline(dims, dim, ',')) {
      char* end = nullptr;
      d->shape.push_back(std::strtoll(dim.c_str(), &end, 10));
      ok = !dim.empty() && end != nullptr && *end == '\0';
    }
  }
  if (ok) std::getline(in >> std::ws, d->name);
  d->average = average != 0;
  d->dtype = DataType::kInvalid;
  for (int code = 1; code <= 8; ++code)
    if (dtype == DataTypeName(static_cast<DataType>(code))) d->dtype = static_cast<DataType>(code);
  return ok && !d->name.empty() && d->dtype != DataType::kInvalid && ParseEncoding(compression, &d->compression);
}

std::string DescribeDisagreement(int rank_a, const std::vector<DeclaredTensor>& a, int rank_b,
                                 const std::vector<DeclaredTensor>& b, const std::string& fallback) {
  if (rank_b < rank_a) return DescribeDisagreement(rank_b, b, rank_a, a, fallback);
  std::unordered_map<std::string, const DeclaredTensor*> in_a, in_b;
  for (const DeclaredTensor& t : a) in_a[t.tensor.name] = &t;
  for (const DeclaredTensor& t : b) in_b[t.tensor.name] = &t;
  // The union in priority order (rank a's priority where both declare a tensor).
  std::vector<const DeclaredTensor*> all;
  for (const DeclaredTensor& t : a) all.push_back(&t);
  for (const DeclaredTensor& t : b)
    if (!in_a.count(t.tensor.name)) all.push_back(&t);
  std::sort(all.begin(), all.end(), [](const DeclaredTensor* x, const DeclaredTensor* y) { return MoreUrgent(*x, *y); });
  const std::string on_a = " on rank " + std::to_string(rank_a), on_b = " on rank " + std::to_string(rank_b);
  // A tensor one worker lacks, or declares otherwise, names the cause; a priority that differs is
  // mostly its consequence (priorities count the tensors).
  for (const DeclaredTensor* t : all) {
    const std::string& name = t->tensor.name;
    const auto x = in_a.find(name), y = in_b.find(name);
    if (x != in_a.end() && y != in_b.end() && SamePushPull(x->second->tensor, y->second->tensor)) continue;
    std::string what = "'" + name + "' ";
    if (y == in_b.end()) {
      what += "is declared" + on_a + " (" + Describe(x->second->tensor) + ") but not" + on_b;
    } else if (x == in_a.end()) {
      what += "is declared" + on_b + " (" + Describe(y->second->tensor) + ") but not" + on_a;
    } else {
      what += "has " + Describe(x->second->tensor) + on_a + " but " + Describe(y->second->tensor) + on_b;
    }
    return kDisagreementLead + what + kDisagreementFix;
  }
  for (const DeclaredTensor* t : all) {
    const int64_t priority_a = in_a.at(t->tensor.name)->tensor.priority, priority_b = in_b.at(t->tensor.name)->tensor.priority;
    if (priority_a != priority_b)
      return kDisagreementLead + std::string("'") + t->tensor.name + "' has priority " + std::to_string(priority_a) +
             on_a + " but " + std::to_string(priority_b) + on_b + kDisagreementFix;
  }
  for (const DeclaredTensor* t : all) {
    const uint64_t bytes_a = in_a.at(t->tensor.name)->bucket_bytes, bytes_b = in_b.at(t->tensor.name)->bucket_bytes;
    if (bytes_a != bytes_b)
      return kDisagreementLead + std::string("the same tensors, in buckets of ") + std::to_string(bytes_a) + " bytes" +
             on_a + " but " + std::to_string(bytes_b) + " bytes" + on_b + " (first '" + t->tensor.name +
             "'); pass the same ProphetStrategy(fusion=...) and $PROPHET_LINK_GBPS to every worker";
  }
  return kDisagreementLead + fallback + kDisagreementFix;
}

Status ValidateDeclaration(const std::string& group, const std::vector<FusionDeclaration>& tensors) {
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
  }
  return Status::OK();
}

FusionInput FusionInputOf(const FusionDeclaration& d) {
  FusionInput in;
  in.name = d.name;
  in.bytes = d.bytes;
  in.element_size = static_cast<uint32_t>(DataTypeSize(d.dtype));
  in.priority = d.priority;
  // What must agree inside one payload: the dtype, averaging and the encoding.
  in.fuse_key = (static_cast<uint64_t>(d.dtype) << 16) | (static_cast<uint64_t>(d.compression) << 8) |
                (d.average ? 1u : 0u);
  in.fusable = d.priority < kControlPriority;
  return in;
}

std::vector<std::vector<FusionDeclaration>> FusionByLane(const std::vector<FusionDeclaration>& tensors, int world_size,
                                                         uint64_t bucket_bytes, int lanes,
                                                         std::unordered_map<std::string, int>* fused_lane,
                                                         std::vector<std::vector<std::vector<int>>>* groups) {
  std::vector<FusionInput> inputs;
  for (const FusionDeclaration& d : tensors) inputs.push_back(FusionInputOf(d));
  const size_t n_lanes = static_cast<size_t>(std::max(lanes, 1));
  std::vector<std::vector<FusionDeclaration>> shares(n_lanes);
  groups->assign(n_lanes, {});
  fused_lane->clear();
  const std::vector<FusionBucket> plan = PlanFusion(inputs, world_size, bucket_bytes);
  const std::vector<int> lane_of = DealBucketsToLanes(plan, lanes);
  for (size_t b = 0; b < plan.size(); ++b) {
    if (lane_of[b] < 0) continue;
    const size_t lane = static_cast<size_t>(lane_of[b]);
    std::vector<int> group;
    for (const int m : plan[b].members) {
      group.push_back(static_cast<int>(shares[lane].size()));
      shares[lane].push_back(tensors[m]);
      (*fused_lane)[tensors[m].name] = lane_of[b];
    }
    (*groups)[lane].push_back(std::move(group));
  }
  return shares;
}

Status Fuser::Declare(const std::string& group, const std::vector<FusionDeclaration>& tensors, int world_size,
                     uint64_t bucket_bytes, const std::vector<std::vector<int>>* buckets) {
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
  const Status valid = ValidateDeclaration(group, tensors);
  if (!valid.ok()) return valid;
  if (buckets) {  // FusionByLane's groups: each tensor of the share in at most one bucket
    std::vector<bool> seen(tensors.size(), false);
    for (const std::vector<int>& members : *buckets)
      for (const int m : members) {
        if (m < 0 || static_cast<size_t>(m) >= tensors.size() || seen[static_cast<size_t>(m)])
          return Status(Code::kInvalidArgument, "fusion declaration '" + group + "': the buckets dealt to this lane "
                                                "name a tensor twice or one it was not given");
        seen[static_cast<size_t>(m)] = true;
      }
  }
  std::vector<FusionInput> inputs;
  for (const FusionDeclaration& d : tensors) inputs.push_back(FusionInputOf(d));
  buckets_.erase(
      std::remove_if(buckets_.begin(), buckets_.end(), [&](const Bucket& b) { return replaced.count(b.group) != 0; }),
      buckets_.end());
  for (auto it = declared_.begin(); it != declared_.end();)
    it = replaced.count(it->second.second) ? declared_.erase(it) : std::next(it);
  for (const FusionDeclaration& d : tensors) declared_[d.name] = {DeclaredTensor{d, bucket_bytes}, group};
  for (FusionBucket& plan : buckets ? PlanOfBuckets(inputs, *buckets) : PlanFusion(inputs, world_size, bucket_bytes)) {
    if (!plan.fused()) continue;  // travels alone, as without fusion
    Bucket b;
    b.group = group;
    b.bucket_bytes = bucket_bytes;
    for (const int m : plan.members) b.members.push_back(tensors[m]);
    b.name = plan.name + "~" + Digest(b.members);
    b.queued.resize(b.members.size());
    b.rounds.resize(b.members.size());
    b.since_ns.resize(b.members.size());
    b.refuse_next.resize(b.members.size());
    b.plan = std::move(plan);
    buckets_.push_back(std::move(b));
  }
  member_of_.clear();
  std::vector<std::string> names;
  uint64_t fused_bytes = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    names.push_back(buckets_[i].name);
    if (buckets_[i].members.size() > 1) fused_bytes += buckets_[i].plan.bytes;  // a bucket of one packs nothing
    for (size_t slot = 0; slot < buckets_[i].members.size(); ++slot) member_of_[buckets_[i].members[slot].name] = {i, slot};
  }
  // Bucket names carry their members' declarations: equal sets of names, equal buckets.
  std::sort(names.begin(), names.end());
  std::string text;
  for (const std::string& name : names) text += name + "\n";
  digest_ = names.empty() ? 0 : HashString(text) | 1;
  buffers_ = std::make_shared<BufferPool>(fused_bytes);
  ++epoch_;
  disagreement_ = Status::OK();  // the new declarations may agree; the check tells
  disagreed_.clear();
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

void Fuser::Hold(OpRequest request, uint64_t round, int64_t now_ns, std::vector<OpRequest>* ready,
                 std::vector<Refusal>* refused, std::string* notice) {
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
      b.rounds[m].pop_front();
      b.since_ns[m].pop_front();
    }
    *notice = b.name;
    return;
  }
  b.queued[slot].push_back(std::move(request));
  b.rounds[slot].push_back(round);
  b.since_ns[slot].push_back(now_ns);
  for (const auto& q : b.queued)
    if (q.empty()) return;
  ready->push_back(Launch(b));
}

OpRequest Fuser::Launch(Bucket& b) {
  struct Run {
    ByteBuffer data;  // the packed bucket, summed in place (every byte is a member's)
    std::shared_ptr<BufferPool> pool;
    std::vector<OpRequest> members;
  };
  auto run = std::make_shared<Run>();
  run->pool = buffers_;
  // A bucket of one travels in its member's own buffers: nothing to pack.
  const bool alone = b.queued.size() == 1;
  if (!alone) run->data = buffers_->Take(b.plan.bytes);
  b.launching.clear();
  for (size_t m = 0; m < b.queued.size(); ++m) {
    OpRequest member = std::move(b.queued[m].front());
    b.queued[m].pop_front();
    b.launching.push_back(b.rounds[m].front());
    b.rounds[m].pop_front();
    b.since_ns[m].pop_front();
    if (!alone && member.bytes) std::memcpy(run->data.data() + b.plan.offsets[m], member.input, member.bytes);
    run->members.push_back(std::move(member));
  }
  const FusionDeclaration& first = b.members.front();
  OpRequest r;
  r.kind = OpKind::kPushPull;
  r.name = b.name;
  r.dtype = first.dtype;
  r.shape = {static_cast<int64_t>(b.plan.bytes / DataTypeSize(first.dtype))};
  r.input = alone ? run->members.front().input : run->data.data();
  r.output = alone ? run->members.front().output : run->data.data();
  r.bytes = b.plan.bytes;
  r.priority = b.plan.priority;
  r.average = first.average;
  r.compression = first.compression;
  r.fusion_bucket_bytes = b.bucket_bytes;
  r.two_level = run->members.front().two_level;
  const std::vector<uint64_t> offsets = b.plan.offsets;
  const std::string what = "fused bucket '" + b.name + "' of " + MemberList(b.members);
  r.done = [run, offsets, what, alone](const Status& status, const GatherResult*) {
    for (size_t m = 0; m < run->members.size(); ++m) {
      OpRequest& member = run->members[m];
      if (status.ok()) {
        if (!alone && member.bytes) std::memcpy(member.output, run->data.data() + offsets[m], member.bytes);
        member.done(status, nullptr);
      } else if (status.message().rfind(kDisagreementLead, 0) == 0) {
        member.done(status, nullptr);  // names the tensor that differs, not this bucket
      } else {
        member.done(Status(status.code(), what + ": " + status.message()), nullptr);
      }
    }
    if (!alone) run->pool->Give(std::move(run->data));  // the operation is over: no frame uses it any more
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
      b.rounds[m].clear();
      b.since_ns[m].clear();
    }
  }
}

void Fuser::TakeAll(std::vector<OpRequest>* held) {
  for (Bucket& b : buckets_) {
    for (size_t m = 0; m < b.queued.size(); ++m) {
      for (OpRequest& r : b.queued[m]) held->push_back(std::move(r));
      b.queued[m].clear();
      b.rounds[m].clear();
      b.since_ns[m].clear();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// The check of agreement across workers

void Fuser::Routed(const std::string& name, uint64_t round) {
  Routes& r = routes_[name];
  r.next_round = round + 1;
  if (r.epoch == epoch_) return;  // no declaration since its last route
  r.epoch = epoch_;
  const auto it = member_of_.find(name);
  const std::string route = it == member_of_.end() ? "" : buckets_[it->second.first].name;
  if (!r.from.empty() && r.from.back().second == route) return;
  r.from.emplace_back(round, route);
  if (r.from.size() > 4) r.from.erase(r.from.begin());  // a peer asks about rounds in flight, not old ones
}

void Fuser::TellDigest(int rank, int world_size, std::vector<CheckFrame>* out) {
  if (digest_ == told_digest_) return;
  told_digest_ = digest_;
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == rank) continue;
    CheckFrame f;
    f.peer = peer;
    f.kind = FusionCheckKind::kDigest;
    f.name = "fusion";
    f.digest = digest_;
    out->push_back(std::move(f));
  }
}

void Fuser::Started(const std::string& bucket_name, uint64_t round, int64_t now_ns) {
  for (Bucket& b : buckets_) {
    if (b.name != bucket_name) continue;
    InFlight f;
    f.name = bucket_name;
    f.round = round;
    for (size_t m = 0; m < b.members.size() && m < b.launching.size(); ++m)
      f.members.emplace_back(b.members[m].name, b.launching[m]);
    f.next_check_ns = now_ns + kFusionCheckAfterNs;
    f.interval_ns = 2 * kFusionCheckAfterNs;
    in_flight_[OperationKey(bucket_name, round)] = std::move(f);
    return;
  }
}

void Fuser::Check(int64_t now_ns, int rank, int world_size,
                  const std::function<bool(const std::string& name, uint64_t round)>& running,
                  std::vector<CheckFrame>* out) {
  std::string declared;  // this worker's declarations, written once for every question
  for (auto it = in_flight_.begin(); it != in_flight_.end();) {
    InFlight& f = it->second;
    if (!running(f.name, f.round)) {
      it = in_flight_.erase(it);
      continue;
    }
    if (now_ns >= f.next_check_ns && disagreement_.ok()) {
      for (int peer = 0; peer < world_size; ++peer) {
        const uint64_t theirs = static_cast<size_t>(peer) < peer_digests_.size() ? peer_digests_[peer] : 0;
        if (peer == rank || theirs == digest_) continue;
        if (declared.empty()) declared = DeclaredPayload(Declared());
        CheckFrame q;
        q.peer = peer;
        q.kind = FusionCheckKind::kQuery;
        q.name = f.name;
        q.round = f.round;
        q.digest = digest_;
        q.payload = QueryPayload(f.members, declared);
        // A declaration too large for one frame stays home: the answer then names the member.
        if (q.payload.size() > kMaxFusionCheckBytes) q.payload = QueryPayload(f.members, "");
        if (q.payload.size() > kMaxFusionCheckBytes) continue;
        out->push_back(std::move(q));
      }
      f.next_check_ns = now_ns + f.interval_ns;
      f.interval_ns = std::min(2 * f.interval_ns, kFusionCheckMaxIntervalNs);
    }
    ++it;
  }
}

Status Fuser::OnCheck(int rank, int peer, FusionCheckKind kind, const std::string& name, uint64_t round,
                      uint64_t digest, const std::string& payload, std::vector<CheckFrame>* out,
                      std::vector<Refusal>* refused) {
  if (kind == FusionCheckKind::kDigest) {
    if (peer_digests_.size() <= static_cast<size_t>(peer)) peer_digests_.resize(peer + 1, 0);
    peer_digests_[peer] = digest;
    return Status::OK();
  }
  std::vector<std::pair<std::string, uint64_t>> members;
  std::vector<DeclaredTensor> theirs;
  if (kind == FusionCheckKind::kDisagree) {  // the message's line, then the peer's declaration
    const size_t end = payload.find('\n');
    if (end != std::string::npos && ParseQuery(payload.substr(end + 1), &members, &theirs)) {
      const Status error(Code::kInvalidArgument, payload.substr(0, end));
      Disagree(error, theirs, refused);
      return error;
    }
  }
  if (kind != FusionCheckKind::kQuery || !ParseQuery(payload, &members, &theirs)) {
    PROPHET_INFO("ignored a malformed fusion check from rank %d", peer);
    return Status::OK();
  }
  // Only a member already routed here, at the asker's round, proves anything: one not routed yet
  // may still come with the asker's declaration (this worker may not have declared it yet).
  std::string fallback;
  for (const auto& [member, member_round] : members) {
    const auto r = routes_.find(member);
    if (r == routes_.end() || r->second.next_round <= member_round) continue;
    const std::string* route = nullptr;
    for (auto f = r->second.from.rbegin(); f != r->second.from.rend() && !route; ++f)
      if (f->first <= member_round) route = &f->second;
    if (!route || *route == name) continue;
    fallback = "'" + member + "' travels in bucket '" + name + "' on rank " + std::to_string(peer) + " but " +
               (route->empty() ? std::string("alone") : "in bucket '" + *route + "'") + " on rank " +
               std::to_string(rank);
    break;
  }
  if (fallback.empty()) return Status::OK();
  // No declaration came (too large to send; an asker with a bucket declared something).
  const Status error(Code::kInvalidArgument,
                     theirs.empty() ? kDisagreementLead + fallback + kDisagreementFix
                                    : DescribeDisagreement(peer, theirs, rank, Declared(), fallback));
  CheckFrame answer;
  answer.peer = peer;
  answer.kind = FusionCheckKind::kDisagree;
  answer.name = name;
  answer.round = round;
  answer.payload = error.message() + "\n" + DeclaredPayload(Declared());
  if (answer.payload.size() > kMaxFusionCheckBytes) answer.payload = error.message() + "\n";
  out->push_back(std::move(answer));
  Disagree(error, theirs, refused);
  return error;
}

bool Fuser::Refuses(const OpRequest& request, Status* error) const {
  if (disagreement_.ok() || request.kind != OpKind::kPushPull || !disagreed_.count(request.name)) return false;
  *error = disagreement_;
  return true;
}

void Fuser::Disagree(const Status& error, const std::vector<DeclaredTensor>& theirs, std::vector<Refusal>* refused) {
  disagreement_ = error;
  disagreed_.clear();
  for (const auto& [name, entry] : declared_) disagreed_.emplace(name, 1);
  for (const DeclaredTensor& t : theirs) disagreed_.emplace(t.tensor.name, 1);
  for (Bucket& b : buckets_) {
    for (size_t m = 0; m < b.queued.size(); ++m) {
      for (OpRequest& r : b.queued[m]) refused->emplace_back(std::move(r), error);
      b.queued[m].clear();
      b.rounds[m].clear();
      b.since_ns[m].clear();
    }
  }
}

std::vector<DeclaredTensor> Fuser::Declared() const {
  std::vector<DeclaredTensor> out;
  for (const auto& [name, entry] : declared_) out.push_back(entry.first);
  std::sort(out.begin(), out.end(), MoreUrgent);
  return out;
}

}  // namespace prophet
