// Reading a job's parameters and buffers from its shards (see shard_export.h).
#include "cli/shard_export.h"

#include <grpcpp/client_context.h>

#include <chrono>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "google/protobuf/util/message_differencer.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "rpc/token_transport.h"

namespace gradmesh {
namespace cli {
namespace {

constexpr char kJobTokenKey[] = "x-gradmesh-job-token";

std::unique_ptr<grpc::ClientContext> Context(const ShardExportOptions& o) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(o.deadline));
  if (!o.job_token.empty()) ctx->AddMetadata(kJobTokenKey, o.job_token);
  return ctx;
}

std::string Where(const ShardExportOptions& o, size_t s) {
  return absl::StrCat("shard ", s, " (", o.shards[s], ")");
}

bool SameLayout(const JobInfoResponse& a, const JobInfoResponse& b) {
  if (a.chunk_elems() != b.chunk_elems() || a.num_shards() != b.num_shards() ||
      a.placement() != b.placement() || a.tensors_size() != b.tensors_size()) {
    return false;
  }
  for (int t = 0; t < a.tensors_size(); ++t) {
    if (!google::protobuf::util::MessageDifferencer::Equals(a.tensors(t), b.tensors(t))) {
      return false;
    }
  }
  return true;
}

// The rank with the fewest steps among those not finished (0 when all finished): a pull as
// that rank never waits in an ssp barrier.
int32_t SlowestRank(const JobInfoResponse& info) {
  int32_t rank = 0;
  int64_t lowest = INT64_MAX;
  for (const WorkerState& w : info.workers()) {
    if (!w.finished() && w.last_step() < lowest) {
      lowest = w.last_step();
      rank = w.worker();
    }
  }
  return rank;
}

}  // namespace

absl::StatusOr<std::vector<ExportedTensor>> FetchJobTensors(const ShardExportOptions& o) {
  if (o.shards.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("job ", o.job, " has no shard addresses"));
  }
  for (const std::string& shard : o.shards) {
    RETURN_IF_ERROR(CheckTokenTransport(shard, o.rpc.tls, o.job_token, "job token"));
  }
  std::vector<std::unique_ptr<ParameterService::Stub>> stubs;
  std::vector<JobInfoResponse> infos(o.shards.size());
  for (size_t s = 0; s < o.shards.size(); ++s) {
    stubs.push_back(ParameterService::NewStub(MakeChannel(o.shards[s], o.rpc)));
    JobInfoRequest req;
    req.set_job(o.job);
    absl::Status st = FromGrpcStatus(stubs[s]->GetJobInfo(Context(o).get(), req, &infos[s]));
    if (!st.ok()) return Annotate(st, absl::StrCat("GetJobInfo on ", Where(o, s)));
    const JobInfoResponse& info = infos[s];
    if (info.num_shards() != static_cast<int32_t>(o.shards.size()) ||
        info.shard_index() != static_cast<int32_t>(s)) {
      return absl::FailedPreconditionError(
          absl::StrCat(Where(o, s), " holds job ", o.job, " as shard ", info.shard_index(), " of ",
                       info.num_shards(), ", but the coordinator lists it as shard ", s, " of ",
                       o.shards.size()));
    }
    if (!SameLayout(infos[0], info)) {
      return absl::FailedPreconditionError(
          absl::StrCat(Where(o, s), " has another layout of job ", o.job, " than ", Where(o, 0)));
    }
  }
  const JobInfoResponse& layout = infos[0];
  std::vector<ExportedTensor> tensors(layout.tensors_size());
  std::vector<int64_t> numels;
  for (int t = 0; t < layout.tensors_size(); ++t) {
    ExportedTensor& out = tensors[t];
    out.name = layout.tensors(t).name();
    out.dtype =
        layout.tensors(t).dtype() == DTYPE_UNSPECIFIED ? FLOAT32 : layout.tensors(t).dtype();
    out.buffer = layout.tensors(t).buffer();
    int64_t n = 1;
    for (int64_t d : layout.tensors(t).shape()) {
      out.shape.push_back(d);
      n *= d;
    }
    numels.push_back(n);
    out.values.assign(static_cast<size_t>(n), 0.0f);
  }
  if (!Placement_IsValid(layout.placement())) {
    return absl::FailedPreconditionError(absl::StrCat(Where(o, 0), " reports job ", o.job,
                                                      " with placement ", layout.placement(),
                                                      ", unknown to this binary"));
  }
  ASSIGN_OR_RETURN(Partition partition,
                   Partition::Create(numels, layout.chunk_elems(), layout.num_shards(),
                                     static_cast<ChunkPlacement>(layout.placement())));

  for (size_t s = 0; s < o.shards.size(); ++s) {
    PullRequest req;
    req.set_job(o.job);
    req.set_worker(SlowestRank(infos[s]));
    PullResponse resp;
    absl::Status st = FromGrpcStatus(stubs[s]->Pull(Context(o).get(), req, &resp));
    if (!st.ok()) return Annotate(st, absl::StrCat("Pull from ", Where(o, s)));
    // An empty pull answers every owned chunk in partition order.
    const std::vector<int64_t>& owned = partition.shard_chunks(static_cast<int32_t>(s));
    if (resp.chunks_size() != static_cast<int>(owned.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("Pull from ", Where(o, s), " returned ", resp.chunks_size(),
                       " chunks of job ", o.job, ", the partition gives it ", owned.size()));
    }
    for (size_t i = 0; i < owned.size(); ++i) {
      const ChunkInfo& c = partition.chunks()[owned[i]];
      const ChunkData& d = resp.chunks(static_cast<int>(i));
      const size_t bytes = static_cast<size_t>(c.numel) * sizeof(float);
      if (d.tensor() != c.tensor || d.chunk() != c.chunk || d.dtype() != FLOAT32 ||
          !d.codec().empty() || d.data().size() != bytes) {
        return absl::FailedPreconditionError(absl::StrCat(
            "Pull from ", Where(o, s), ": chunk ", i, " is (", d.tensor(), ",", d.chunk(),
            ") dtype ", DType_Name(d.dtype()), " codec \"", d.codec(), "\" with ", d.data().size(),
            " bytes; expected (", c.tensor, ",", c.chunk, ") FLOAT32 dense with ", bytes));
      }
      std::memcpy(tensors[c.tensor].values.data() + c.offset, d.data().data(), bytes);
    }
  }
  return tensors;
}

}  // namespace cli
}  // namespace gradmesh
