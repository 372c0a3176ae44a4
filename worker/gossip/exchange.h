// The messages of the gossip protocol as plain structs (the core's view; the gRPC adapters
// map them to proto/gossip.proto field by field), and the transport interface the Gossiper
// sends them through.
//
// Thread safety: the structs are values. GossipTransport implementations must allow
// concurrent calls.
#ifndef GRADMESH_WORKER_GOSSIP_EXCHANGE_H_
#define GRADMESH_WORKER_GOSSIP_EXCHANGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradmesh {

// ExchangeKind of proto/gossip.proto.
enum class ExchangeKind { kPushSum, kAverage, kFinal };

// "push_sum", "average", "final" (for logs and messages).
const char* ExchangeKindName(ExchangeKind kind);

// ExchangeRequest without its payload.
struct ExchangeHeader {
  std::string job;
  int32_t from = 0;  // Sender rank.
  int32_t to = 0;    // Receiver rank.
  ExchangeKind kind = ExchangeKind::kPushSum;
  int64_t round = 0;         // Sender's gossip round (for logs).
  int64_t step = 0;          // Sender's local steps done.
  double weight = 0;         // kPushSum, kFinal: push-sum weight carried with the values.
  std::string codec;         // ValueCodec name of the payload ("", fp16, bf16).
  int64_t numel = 0;         // Elements of the flat parameter vector.
  uint64_t exchange_id = 0;  // kPushSum: the share's id (see proto/gossip.proto); 0 = none.
};

// ExchangeResponse.
struct ExchangeReply {
  int64_t step = 0;        // Receiver's local steps done.
  std::string codec;       // kAverage: codec of `payload` (the request's).
  int64_t numel = 0;       // kAverage: elements encoded in `payload`.
  std::string payload;     // kAverage: the receiver's values before averaging.
  bool duplicate = false;  // kFinal: already had this sender's final; kPushSum: this share.
};

// GossipStateResponse.
struct ReplicaState {
  int64_t step = 0;
  int64_t total_steps = 0;
  bool finished = false;
  double weight = 1;
  bool gathered = false;  // Root: every final is in (Gossiper::GatherFinal returned).
};

// Payload type URL on an error status whose request was never sent (the peer could not be
// connected to), so the receiver cannot have applied it; without it, a timeout or broken
// connection leaves that unknown.
inline constexpr char kGossipNotSentPayload[] = "type.gradmesh/gossip.not_sent";

// How a rank that is not the gather root refuses a final (FAILED_PRECONDITION, followed by the
// root's rank). A sender waiting for a fallback root to take over recognises it by this text:
// status payloads do not cross gRPC.
inline constexpr char kFinalsGoToRank[] = "finals go to rank ";

// How the Gossiper reaches peers. The gRPC implementation is NewGrpcGossipTransport
// (grpc_transport.h); tests use in-process ones.
class GossipTransport {
 public:
  virtual ~GossipTransport() = default;

  // Sends one exchange to rank `peer` and waits at most `timeout` for the reply. Returns the
  // receiver's status (see proto/gossip.proto), UNAVAILABLE when the peer cannot be reached
  // (with kGossipNotSentPayload when nothing was sent), DEADLINE_EXCEEDED after `timeout`.
  virtual absl::StatusOr<ExchangeReply> Exchange(int32_t peer, const ExchangeHeader& header,
                                                 absl::string_view payload,
                                                 absl::Duration timeout) = 0;

  // The state of (job, peer), waiting at most `timeout`; `from` is the caller's rank (the
  // peer records it as up: GossipReplica::Callers), or -1 for none.
  virtual absl::StatusOr<ReplicaState> GetState(int32_t peer, const std::string& job,
                                                absl::Duration timeout, int32_t from) = 0;

  // The peers' addresses changed (a rank moved to another node, or lost its node: ""): later
  // calls go to `peers[r]` (one per rank, as at creation; another count is ignored). A rank
  // without an address is unreachable (UNAVAILABLE, nothing sent). Any thread.
  virtual void SetPeers(const std::vector<std::string>& peers) {}
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_EXCHANGE_H_
