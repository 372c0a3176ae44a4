// Fuzz target: the gossip wire, what a worker does with a peer's GossipExchangeRequest
// (proto/gossip.proto): protobuf parse, HeaderFromProto (worker/gossip/wire.h), then
// GossipReplica::Handle (validation, ValueCodec decode, push-sum absorb or pairwise average).
//
// Input: byte 0 holds flags, the rest is a serialised GossipExchangeRequest. Flag bit 0 points
// the request at the replica (job, to_rank, numel), bits 1-2 set the values' codec ("", fp16,
// bf16), so mutations reach the decoder and the arithmetic. The receiver is a fresh replica
// (job "fz", rank 0 of 4, 8 parameters). Checked: refusals are INVALID_ARGUMENT,
// PERMISSION_DENIED, FAILED_PRECONDITION or ABORTED; after any request the replica's weight
// is finite and > 0 and its values are finite; a refused request changes nothing.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/gossip.pb.h"
#include "tests/fuzz/fuzz_util.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  FuzzInput in(data, size);
  const uint8_t flags = in.Byte();
  GossipExchangeRequest request;
  const absl::string_view bytes = in.Rest();
  if (!request.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return 0;
  constexpr int kNumel = 8;
  if (flags & 1) {
    request.set_job("fz");
    request.set_to_rank(0);
    request.mutable_values()->set_numel(kNumel);
  }
  if (flags & 6) {
    static const char* const kCodecs[] = {"", "fp16", "bf16", ""};
    request.mutable_values()->set_codec(kCodecs[(flags >> 1) & 3]);
  }
  const absl::StatusOr<ExchangeHeader> header = HeaderFromProto(request);
  if (!header.ok()) {
    FUZZ_CHECK(header.status().code() == absl::StatusCode::kInvalidArgument,
               header.status().ToString());
    return 0;
  }
  GossipReplica::Options options;
  options.job = "fz";
  options.rank = 0;
  options.num_workers = 4;
  std::vector<float> initial(kNumel);
  for (int i = 0; i < kNumel; ++i) initial[i] = 0.5f * static_cast<float>(i) - 1.0f;
  GossipReplica replica(options, initial);
  const ReplicaSnapshot before = replica.Snapshot();
  const absl::StatusOr<ExchangeReply> reply =
      replica.Handle(*header, request.values().data(), absl::InfiniteFuture());
  const ReplicaSnapshot after = replica.Snapshot();
  if (!reply.ok()) {
    const absl::StatusCode code = reply.status().code();
    FUZZ_CHECK(
        code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kPermissionDenied ||
            code == absl::StatusCode::kFailedPrecondition || code == absl::StatusCode::kAborted,
        reply.status().ToString());
    FUZZ_CHECK(
        after.weight == before.weight &&
            std::memcmp(after.values.data(), before.values.data(), kNumel * sizeof(float)) == 0,
        absl::StrCat("refused request changed the replica: ", reply.status().ToString()));
    return 0;
  }
  FUZZ_CHECK(std::isfinite(after.weight) && after.weight > 0,
             absl::StrCat("weight ", after.weight, " after ", request.ShortDebugString()));
  for (int i = 0; i < kNumel; ++i) {
    FUZZ_CHECK(std::isfinite(after.values[i]),
               absl::StrCat("value ", i, " = ", after.values[i], " after weight ", header->weight));
  }
  return 0;
}
