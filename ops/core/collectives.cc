#include "ops/core/collectives.h"

#include "ops/core/allgather.h"
#include "ops/core/broadcast.h"
#include "ops/core/push_pull.h"
#include "ops/core/small_allreduce.h"
#include "ops/core/two_level.h"

namespace prophet {

std::unique_ptr<Collective> MakeCollective(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round) {
  switch (request.kind) {
    case OpKind::kPushPull:
      // A small control collective by recursive doubling, before the two-level path: log2(N)
      // hops instead of that path's four (ExchangesThis; every worker decides alike from the
      // same inputs).
      if (ExchangesThis(request, host->world_size(), host->options()))
        return std::unique_ptr<Collective>(new SmallAllreduce(host, id, std::move(request), round));
      if (const HostLayout* hosts = request.two_level ? host->two_level_hosts() : nullptr)
        return std::unique_ptr<Collective>(new TwoLevelPushPull(host, id, std::move(request), round, *hosts));
      return std::unique_ptr<Collective>(new PushPull(host, id, std::move(request), round));
    case OpKind::kBroadcast: return std::unique_ptr<Collective>(new Broadcast(host, id, std::move(request), round));
    case OpKind::kAllgather: return std::unique_ptr<Collective>(new Allgather(host, id, std::move(request), round));
  }
  return nullptr;
}

}  // namespace prophet
