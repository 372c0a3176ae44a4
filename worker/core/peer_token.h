// The job token on the workers' peer plane (GossipService, CollectiveService): what a peer
// service accepts, free of gRPC (the adapters read the metadata and call CheckPeerToken).
//
// Every gossip and collective RPC carries the job's token as gRPC metadata
// `x-gradmesh-job-token` (the same header the shards check, server/job_tokens.h). The
// service serving (job, rank) compares it in constant time with the token that rank runs
// with:
//   expected empty      open: every call is accepted (standalone runs without a token,
//                       loopback tests);
//   no token presented  UNAUTHENTICATED;
//   another token       PERMISSION_DENIED (a stranger's guess, or a rank of another job
//                       with its own valid token).
// The messages say which job and rank refused, never the expected token.
//
// Thread safety: pure function.
#ifndef GRADMESH_WORKER_CORE_PEER_TOKEN_H_
#define GRADMESH_WORKER_CORE_PEER_TOKEN_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

// The metadata key of the job token (lowercase, as gRPC requires).
inline constexpr char kJobTokenMetadata[] = "x-gradmesh-job-token";

// Constant-time comparison (the time depends on the lengths only).
inline bool PeerTokenEquals(absl::string_view a, absl::string_view b) {
  const absl::string_view other = a.size() == b.size() ? b : a;
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(other[i]);
  }
  return diff == 0;
}

// See above. `presented`: the metadata value, nullopt when the call had none. `where` names
// the service, job and rank for the message (e.g. "gossip job j rank 1").
inline absl::Status CheckPeerToken(absl::string_view expected,
                                   std::optional<absl::string_view> presented,
                                   absl::string_view where) {
  if (expected.empty()) return absl::OkStatus();
  if (!presented.has_value()) {
    return absl::UnauthenticatedError(std::string(where) +
                                      ": no job token (metadata x-gradmesh-job-token) on the call");
  }
  if (!PeerTokenEquals(expected, *presented)) {
    return absl::PermissionDeniedError(std::string(where) +
                                       ": wrong job token (metadata x-gradmesh-job-token)");
  }
  return absl::OkStatus();
}

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_PEER_TOKEN_H_
