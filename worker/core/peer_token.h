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
// Rank identity. The job token proves membership of the job, not which rank a caller is: any
// rank could claim to be another. Jobs placed by the coordinator therefore give each rank its
// own rank token (Task.rank_token: random per job, derived by the coordinator from a secret
// only it holds) and every rank the SHA-256 of all ranks' tokens (Task.rank_token_hashes). A
// call then also carries the sender's rank token as metadata `x-gradmesh-rank-token`, and
// CheckRankToken verifies it against the hash of the rank the call claims to come from:
//   no hashes           rank not checked (standalone runs: the job token is the only secret);
//   no rank token       UNAUTHENTICATED;
//   claimed rank out of range, or the token is not that rank's: PERMISSION_DENIED.
//
// Thread safety: pure function.
#ifndef GRADMESH_WORKER_CORE_PEER_TOKEN_H_
#define GRADMESH_WORKER_CORE_PEER_TOKEN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/token_hash.h"

namespace gradmesh {

// The metadata key of the job token (lowercase, as gRPC requires).
inline constexpr char kJobTokenMetadata[] = "x-gradmesh-job-token";

// The metadata key of the sender's rank token.
inline constexpr char kRankTokenMetadata[] = "x-gradmesh-rank-token";

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

// See "Rank identity" above: the call must come from `rank`, whose token hashes to `hash`
// (raw SHA-256; empty: not checked).
inline absl::Status CheckRankTokenHash(absl::string_view hash, int64_t rank,
                                       std::optional<absl::string_view> presented,
                                       absl::string_view where) {
  if (hash.empty()) return absl::OkStatus();
  if (!presented.has_value()) {
    return absl::UnauthenticatedError(
        absl::StrCat(where, ": no rank token (metadata x-gradmesh-rank-token) on the call"));
  }
  if (!TokenMatchesHash(*presented, hash)) {
    return absl::PermissionDeniedError(absl::StrCat(
        where, ": the rank token (metadata x-gradmesh-rank-token) is not rank ", rank, "'s"));
  }
  return absl::OkStatus();
}

// The same for a call claiming to come from `claimed_rank`; `hashes`: SHA-256 (raw) of each
// rank's token, by rank (empty: not checked).
inline absl::Status CheckRankToken(const std::vector<std::string>& hashes, int64_t claimed_rank,
                                   std::optional<absl::string_view> presented,
                                   absl::string_view where) {
  if (hashes.empty()) return absl::OkStatus();
  if (claimed_rank < 0 || claimed_rank >= static_cast<int64_t>(hashes.size())) {
    if (!presented.has_value()) return CheckRankTokenHash("-", claimed_rank, presented, where);
    return absl::PermissionDeniedError(
        absl::StrCat(where, ": the rank token (metadata x-gradmesh-rank-token) is not rank ",
                     claimed_rank, "'s"));
  }
  return CheckRankTokenHash(hashes[claimed_rank], claimed_rank, presented, where);
}

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_CORE_PEER_TOKEN_H_
