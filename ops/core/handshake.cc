#include "ops/core/handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>
#include <cstring>

#include "ops/core/wire.h"

namespace prophet {

namespace {

void AppendU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

}  // namespace

Status RandomNonce(uint8_t* out) {
  if (RAND_bytes(out, static_cast<int>(kNonceBytes)) != 1)
    return Status(Code::kInternal, "the system's random number generator failed (OpenSSL RAND_bytes)");
  return Status::OK();
}

void HandshakeMac(const std::string& token, HandshakeRole role, const HandshakeParams& params,
                  const uint8_t* nonce_c, const uint8_t* nonce_a, uint8_t* mac) {
  std::string transcript = role == HandshakeRole::kAcceptor ? "prophet_tf handshake: acceptor"
                                                            : "prophet_tf handshake: connector";
  transcript.push_back('\0');
  AppendU32(&transcript, kProtocolVersion);
  AppendU32(&transcript, static_cast<uint32_t>(params.world_size));
  AppendU32(&transcript, static_cast<uint32_t>(params.connector_rank));
  AppendU32(&transcript, static_cast<uint32_t>(params.acceptor_rank));
  transcript.append(reinterpret_cast<const char*>(nonce_c), kNonceBytes);
  transcript.append(reinterpret_cast<const char*>(nonce_a), kNonceBytes);
  unsigned int len = 0;
  // An empty key is valid HMAC input (a job whose user opted out of the token).
  static const unsigned char kNoKey = 0;
  HMAC(EVP_sha256(), token.empty() ? static_cast<const void*>(&kNoKey) : static_cast<const void*>(token.data()), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(transcript.data()), transcript.size(), mac, &len);
}

bool MacEqual(const uint8_t* a, const uint8_t* b) { return CRYPTO_memcmp(a, b, kMacBytes) == 0; }

Verdict MakeVerdict(VerdictStatus status, const std::string& reason) {
  Verdict v{};
  v.magic = kFrameMagic;
  v.version = kProtocolVersion;
  v.status = static_cast<uint16_t>(status);
  std::snprintf(v.reason, sizeof(v.reason), "%s", reason.c_str());
  return v;
}

}  // namespace prophet
