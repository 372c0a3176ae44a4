// Hashing of tokens. The coordinator keeps only the SHA-256 of each per-node token it issued
// (coordinator.h "# Node identity": in memory and in RocksDB), so its tables do not hold
// credentials, and compares a presented token's hash in constant time. Shards record the
// hash of the job token a job was created with (InitJobRequest.incarnation), never the token.
//
// SHA-256 is implemented here (FIPS 180-4) because the build has no crypto library; it is
// checked against the NIST test vectors. A token is 128 random bits, so an unsalted hash is
// enough: there is nothing to guess from a dictionary.
//
// Thread safety: pure functions.
#ifndef GRADMESH_COMMON_TOKEN_HASH_H_
#define GRADMESH_COMMON_TOKEN_HASH_H_

#include <string>

#include "absl/strings/string_view.h"

namespace gradmesh {

// The 32-byte SHA-256 digest of `data` (raw bytes).
std::string Sha256(absl::string_view data);

// Lower-case hex of `bytes`.
std::string HexOf(absl::string_view bytes);

// True if SHA-256(`token`) equals `hash` (a Sha256 result). Constant time in the hash bytes;
// false for an empty token or an empty hash.
bool TokenMatchesHash(absl::string_view token, absl::string_view hash);

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_TOKEN_HASH_H_
