// Frames for fuzzing: well-formed frames of the real protocol and structure-aware mutations of them.
//
// The mutations are the ways a broken or hostile peer can deviate from the protocol: flipped bits,
// a header field set to an extreme value, length fields that claim gigabytes (with a shape that
// makes the claim self-consistent, so that it passes the frame's own checks), bad dimensions,
// truncation, insertions and deletions, spliced frames, random bytes.
#ifndef PROPHET_OPS_CORE_FUZZ_FRAMES_H_
#define PROPHET_OPS_CORE_FUZZ_FRAMES_H_

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ops/core/wire.h"

namespace prophet {
namespace fuzz {

// Header + name + dims + payload. `meta.payload_bytes` is written as given (it may differ from
// payload.size() on purpose).
std::string EncodeFrame(const FrameMeta& meta, const std::string& payload);

enum class Mutation {
  kBitFlips,      // 1-8 random bits anywhere in the frame
  kFieldValue,    // one header field set to an extreme or off-by-one value
  kHugeLength,    // a payload of up to 2^38 bytes declared with a shape that allows it
  kBadDims,       // negative, overflowing or zero dimensions
  kTruncate,      // the frame cut at a random point
  kInsertDelete,  // bytes inserted into or deleted from the middle
  kSplice,        // the header of one frame with the rest of another
  kRandomBytes,   // no frame at all
  kCount,
};
const char* MutationName(Mutation m);

class FrameMutator {
 public:
  explicit FrameMutator(uint64_t seed) : rng_(seed) {}

  uint64_t Uniform(uint64_t n) { return n == 0 ? 0 : rng_() % n; }  // [0, n)
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  std::string RandomBytes(size_t n);
  std::mt19937_64& rng() { return rng_; }

  // A random well-formed frame of any type (what the wire fuzzer starts from).
  std::string RandomValidFrame();
  Mutation RandomMutation() { return static_cast<Mutation>(Uniform(static_cast<uint64_t>(Mutation::kCount))); }
  // `frame` must be well-formed; `other` is any second frame (used by kSplice).
  std::string Mutate(const std::string& frame, Mutation m, const std::string& other);

 private:
  uint64_t InterestingValue(int bytes);
  std::mt19937_64 rng_;
};

}  // namespace fuzz
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUZZ_FRAMES_H_
