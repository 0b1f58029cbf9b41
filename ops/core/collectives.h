// The collectives by kind. Kept apart from the base class (collective.h) so that the base knows
// none of its subclasses; the engine, which creates them, includes this.
#ifndef PROPHET_OPS_CORE_COLLECTIVES_H_
#define PROPHET_OPS_CORE_COLLECTIVES_H_

#include <cstdint>
#include <memory>

#include "ops/core/collective.h"

namespace prophet {

// A new collective of request.kind.
std::unique_ptr<Collective> MakeCollective(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_COLLECTIVES_H_
