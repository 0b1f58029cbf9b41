// Fuzzes the frame parser (wire.h) with well-formed frames and structure-aware mutations of them.
//
//   bazel run --config=asan //ops/core/fuzz:wire_fuzz_test -- --frames=1000000 --seed=1
//
// Every input is copied into a buffer of exactly its size, so the sanitizers see any read past it.
// Beyond "no crash, no sanitizer report", each decode is checked: a frame the parser accepts lies
// inside the buffer, re-encodes to the same bytes and is rejected as truncated when cut short; a
// frame it rejects gets a "malformed frame" or "truncated frame" message; the incremental API the
// engine uses (ValidateHeader + DecodeFrameMeta) agrees with DecodeFrame.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "ops/core/fuzz/flags.h"
#include "ops/core/fuzz/frames.h"
#include "ops/core/wire.h"

namespace prophet {
namespace fuzz {
namespace {

struct Stats {
  uint64_t frames = 0, mutated = 0, accepted = 0, malformed = 0, truncated = 0, violations = 0;
};

void Violation(Stats* stats, const std::string& what, const std::string& frame) {
  if (++stats->violations <= 10) {
    std::fprintf(stderr, "VIOLATION: %s (frame of %zu bytes:", what.c_str(), frame.size());
    for (size_t i = 0; i < frame.size() && i < 96; ++i) std::fprintf(stderr, " %02x", static_cast<unsigned char>(frame[i]));
    std::fprintf(stderr, ")\n");
  }
}

bool StartsWith(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// Decodes `frame` from an exactly sized heap copy and checks what the parser promises.
void Check(const std::string& frame, FrameMutator& mutator, Stats* stats) {
  const size_t len = frame.size();
  std::unique_ptr<char[]> buf(new char[len ? len : 1]);
  if (len) std::memcpy(buf.get(), frame.data(), len);
  FrameMeta meta;
  const char* payload = nullptr;
  const Status s = DecodeFrame(buf.get(), len, &meta, &payload);

  // The engine's incremental path must agree with the whole-frame decoder.
  if (len >= sizeof(FrameHeader)) {
    FrameHeader h;
    std::memcpy(&h, buf.get(), sizeof(h));
    const Status hs = ValidateHeader(h);
    if (!hs.ok() && (s.ok() || s.message() != hs.message()))
      Violation(stats, "ValidateHeader rejects (" + hs.message() + ") but DecodeFrame says: " + s.message(), frame);
    if (hs.ok() && len - sizeof(h) >= MetaTailBytes(h)) {
      FrameMeta incremental;
      const Status ms = DecodeFrameMeta(h, buf.get() + sizeof(h), MetaTailBytes(h), &incremental);
      if (ms.ok() != (s.ok() || StartsWith(s.message(), "truncated frame: payload")))
        Violation(stats, "DecodeFrameMeta (" + ms.message() + ") disagrees with DecodeFrame (" + s.message() + ")", frame);
    }
  }

  if (!s.ok()) {
    if (s.code() == Code::kFailedPrecondition && StartsWith(s.message(), "truncated frame")) {
      ++stats->truncated;
    } else if (s.code() == Code::kInvalidArgument && StartsWith(s.message(), "malformed frame")) {
      ++stats->malformed;
    } else {
      Violation(stats, "unexpected rejection: code " + std::to_string(static_cast<int>(s.code())) + " " + s.message(), frame);
    }
    return;
  }
  ++stats->accepted;
  const uint64_t head = sizeof(FrameHeader) + meta.name.size() + 8 * meta.shape.size();
  const bool nameless = IsNamelessFrame(meta.type);
  if ((meta.name.empty() && !nameless) || meta.name.size() > kMaxNameBytes ||
      meta.shape.size() > kMaxDims)
    Violation(stats, "accepted a name of " + std::to_string(meta.name.size()) + " bytes and " +
                         std::to_string(meta.shape.size()) + " dims", frame);
  if (payload != buf.get() + head || head + meta.payload_bytes > len)
    Violation(stats, "accepted a payload outside the buffer", frame);
  if (!IsControlFrame(meta.type)) {
    const uint64_t elem = DataTypeSize(meta.dtype);
    uint64_t total = elem;
    for (int64_t d : meta.shape) {
      if (d < 0) Violation(stats, "accepted a negative dimension", frame);
      total *= static_cast<uint64_t>(d);
    }
    // An encoded payload carries 2-byte codes of float32 elements.
    const bool encoded = meta.encoding != Encoding::kNone;
    const uint64_t code = encoded ? 2 : elem;
    const uint64_t carried = elem && code ? meta.payload_bytes / code * elem : 0;
    if (elem == 0 || meta.offset > total || carried > total - meta.offset || meta.offset % elem ||
        meta.payload_bytes % code || total > kMaxPayloadBytes || PayloadTensorBytes(meta) != carried)
      Violation(stats, "accepted a payload outside its tensor", frame);
    if (encoded && (meta.dtype != DataType::kFloat32 || meta.type == FrameType::kBroadcast ||
                    meta.scale_exp > kMaxScaleExponent || meta.scale_exp < -kMaxScaleExponent))
      Violation(stats, std::string("accepted a ") + EncodingName(meta.encoding) + " payload of dtype " +
                           DataTypeName(meta.dtype) + ", frame type " + std::to_string(static_cast<int>(meta.type)) +
                           ", scale exponent " + std::to_string(meta.scale_exp), frame);
  }
  if ((meta.encoding == Encoding::kNone || IsControlFrame(meta.type)) && meta.scale_exp != 0)
    Violation(stats, "accepted a scale exponent without an encoding", frame);
  std::string reencoded;
  EncodeFrameMeta(meta, &reencoded);
  if (reencoded.size() != head || std::memcmp(reencoded.data(), buf.get(), head) != 0)
    Violation(stats, "an accepted frame does not re-encode to the same bytes", frame);
  // Any strict prefix of a complete frame is incomplete, never something else.
  const uint64_t whole = head + meta.payload_bytes;
  if (whole > 0) {
    const uint64_t cut = mutator.Uniform(whole);
    FrameMeta partial;
    const char* p = nullptr;
    const Status ps = DecodeFrame(buf.get(), cut, &partial, &p);
    if (ps.ok() || !StartsWith(ps.message(), "truncated frame"))
      Violation(stats, "a prefix of " + std::to_string(cut) + " bytes decodes as: " + (ps.ok() ? "OK" : ps.message()), frame);
  }
}

int Main(int argc, char** argv) {
  const Flags flags(argc, argv, {{"frames", "1000000"}, {"seed", "1"}});
  const uint64_t frames = flags.U64("frames"), seed = flags.U64("seed");
  FrameMutator mutator(seed);
  Stats stats;
  uint64_t by_mutation[static_cast<int>(Mutation::kCount)] = {};
  const auto t0 = std::chrono::steady_clock::now();
  std::string previous = mutator.RandomValidFrame();
  for (uint64_t i = 0; i < frames; ++i) {
    const std::string valid = mutator.RandomValidFrame();
    std::string frame = valid;
    if (i % 8 != 0) {  // every 8th frame stays well-formed: the accepting paths are checked too
      const int rounds = 1 + static_cast<int>(mutator.Uniform(3));
      for (int r = 0; r < rounds; ++r) {
        const Mutation m = mutator.RandomMutation();
        ++by_mutation[static_cast<int>(m)];
        frame = mutator.Mutate(frame, m, previous);
      }
      ++stats.mutated;
    } else {
      FrameMeta meta;
      const char* payload = nullptr;
      const Status s = DecodeFrame(valid.data(), valid.size(), &meta, &payload);
      if (!s.ok()) Violation(&stats, "a generated well-formed frame is rejected: " + s.message(), valid);
    }
    ++stats.frames;
    Check(frame, mutator, &stats);
    previous = valid;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("mutations applied:");
  for (int m = 0; m < static_cast<int>(Mutation::kCount); ++m)
    std::printf(" %s %llu", MutationName(static_cast<Mutation>(m)), static_cast<unsigned long long>(by_mutation[m]));
  std::printf("\nwire_fuzz: seed %llu, %llu frames (%llu mutated), accepted %llu, rejected malformed %llu, "
              "truncated %llu; %llu violations; %.1f s\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(stats.frames),
              static_cast<unsigned long long>(stats.mutated), static_cast<unsigned long long>(stats.accepted),
              static_cast<unsigned long long>(stats.malformed), static_cast<unsigned long long>(stats.truncated),
              static_cast<unsigned long long>(stats.violations), seconds);
  return stats.violations == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fuzz
}  // namespace prophet

int main(int argc, char** argv) { return prophet::fuzz::Main(argc, argv); }
