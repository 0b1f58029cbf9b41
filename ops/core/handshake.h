// The authenticated start-up handshake between two workers of one job, and the notices they
// exchange until the whole job has formed.
//
// The higher rank (connector, C) connects to the lower rank (acceptor, A):
//   C -> A  ClientHello  magic, version, C's rank, world size, the rank C expects A to be, its
//                        lane (one connection per pair and lane: BootstrapOptions::lanes), nonce_c
//   A -> C  Verdict      kChallenge (or kRejected with the reason), then Challenge: nonce_a and
//                        mac_a = HMAC-SHA256(token, "acceptor" | transcript)
//   C -> A  ClientProof  mac_c = HMAC-SHA256(token, "connector" | transcript)
//   A -> C  Verdict      kAccepted, or kRejected with the reason
// transcript = version, world size, both ranks, nonce_c, nonce_a. Each side proves that it holds
// the job token for this pair of fresh nonces, so a recorded handshake is worthless against the
// next one, and the direction label keeps one side's MAC from being reflected as the other's.
// The token itself never travels. (The handshake authenticates who joins the job; the data that
// follows is neither encrypted nor signed.)
//
// Once a worker holds every connection (every lane of every peer) it sends kReady to each peer on
// lane 0, and it leaves start-up when every peer's kReady has arrived. A worker whose start-up
// fails sends kAbort with the reason to the peers it is connected to, so the whole job fails at
// once and everyone says why: on lane 0, and until it has sent kReady on every other lane held
// too, where a peer that does not hold lane 0 yet reads it (after kReady a peer's engine may be
// reading lanes 1 and up, and lane 0 is held).
//
// Verdict has the layout of protocol version 1's reply and the hello starts like version 1's, so
// workers of different versions tell each other why they cannot work together.
#ifndef PROPHET_OPS_CORE_HANDSHAKE_H_
#define PROPHET_OPS_CORE_HANDSHAKE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "ops/core/common.h"

namespace prophet {

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;  // HMAC-SHA256
constexpr uint32_t kStartupNoticeMagic = 0x53465450;  // "PTFS" little-endian
constexpr size_t kMaxNoticeReasonBytes = 2048;

#pragma pack(push, 1)
// The first bytes of every version's hello: enough to tell a stranger or another version apart.
struct HelloPrefix {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
};
struct ClientHello {
  HelloPrefix prefix;
  int32_t rank;           // the connecting worker's rank
  int32_t world_size;
  int32_t acceptor_rank;  // the rank the connecting worker believes it is talking to
  uint32_t heartbeat_ms;  // its heartbeat_s: the workers of a job must agree on it
  uint16_t lane;          // which of the pair's connections this is
  uint16_t lanes;         // connections per pair: the workers of a job must agree on it
  uint8_t nonce[kNonceBytes];
};
// kAborted: the acceptor's own start-up failed meanwhile (the reason says why).
enum class VerdictStatus : uint16_t { kRejected = 0, kAccepted = 1, kChallenge = 2, kAborted = 3 };
struct Verdict {
  uint32_t magic;
  uint16_t version;
  uint16_t status;  // VerdictStatus
  char reason[256];  // NUL-terminated when rejected
};
struct Challenge {
  uint8_t nonce[kNonceBytes];
  uint8_t mac[kMacBytes];
};
struct ClientProof {
  uint8_t mac[kMacBytes];
};
enum class NoticeKind : uint8_t { kReady = 1, kAbort = 2 };
struct StartupNotice {
  uint32_t magic;       // kStartupNoticeMagic
  uint8_t kind;         // NoticeKind
  uint8_t code;         // kAbort: the Code of the failure
  uint16_t reason_len;  // kAbort: bytes of reason that follow (at most kMaxNoticeReasonBytes)
};
#pragma pack(pop)
static_assert(sizeof(ClientHello) == 60, "the hello layout is part of the protocol");
static_assert(sizeof(Verdict) == 264, "the verdict layout is part of the protocol (same as version 1)");
static_assert(sizeof(StartupNotice) == 8, "the notice layout is part of the protocol");

enum class HandshakeRole { kAcceptor, kConnector };

// What both sides must agree on; bound into every MAC.
struct HandshakeParams {
  int world_size = 0;
  int connector_rank = 0;
  int acceptor_rank = 0;
};

// Fills `out` with kNonceBytes from the operating system's CSPRNG (through OpenSSL).
Status RandomNonce(uint8_t* out);

// mac = HMAC-SHA256(token, label(role) | version | params | nonce_c | nonce_a).
void HandshakeMac(const std::string& token, HandshakeRole role, const HandshakeParams& params,
                  const uint8_t* nonce_c, const uint8_t* nonce_a, uint8_t* mac);

// Compares two MACs in constant time.
bool MacEqual(const uint8_t* a, const uint8_t* b);

Verdict MakeVerdict(VerdictStatus status, const std::string& reason = "");

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_HANDSHAKE_H_
