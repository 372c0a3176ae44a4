#include "worker/parameter_client.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <random>

#include <grpcpp/client_context.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "proto/gradmesh.grpc.pb.h"

namespace gradmesh {
namespace {

bool Retryable(absl::StatusCode code) {
  return code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
         code == absl::StatusCode::kAborted;
}

int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

class GrpcParameterClient final : public ParameterClient {
 public:
  GrpcParameterClient(JobLayout layout, GrpcParameterClientOptions options, Partition partition)
      : layout_(std::move(layout)),
        options_(std::move(options)),
        partition_(std::move(partition)),
        incarnation_(static_cast<uint64_t>(std::random_device{}()) << 32),
        versions_(partition_.chunks().size(), 0) {
    for (const std::string& addr : options_.servers) {
      stubs_.push_back(ParameterService::NewStub(MakeChannel(addr, options_.rpc)));
    }
  }

  absl::Status InitJob(const std::vector<absl::Span<const float>>& initial) override {
    RETURN_IF_ERROR(CheckSpans("InitJob", initial));
    std::vector<InitJobRequest> reqs(NumShards());
    for (int32_t s = 0; s < NumShards(); ++s) {
      InitJobRequest& r = reqs[s];
      r.set_job(layout_.job);
      for (const TensorSpec& t : layout_.tensors) *r.add_tensors() = t;
      r.set_chunk_elems(layout_.chunk_elems);
      r.set_num_shards(NumShards());
      r.set_shard_index(s);
      *r.mutable_optimizer() = layout_.optimizer;
      r.set_consistency(layout_.consistency);
      r.set_num_workers(layout_.num_workers);
      for (int64_t idx : partition_.shard_chunks(s)) {
        const ChunkInfo& c = partition_.chunks()[idx];
        FillChunk(c, initial[c.tensor].data(), r.add_initial());
      }
    }
    std::vector<InitJobResponse> resps(NumShards());
    return CallAll<InitJobRequest, InitJobResponse>(
        "InitJob", reqs, &resps,
        [](ParameterService::Stub* stub, grpc::ClientContext* ctx, const InitJobRequest* req,
           InitJobResponse* resp, std::function<void(grpc::Status)> done) {
          stub->async()->InitJob(ctx, req, resp, std::move(done));
        });
  }

  absl::Status Push(int64_t step, const std::vector<absl::Span<const float>>& grads) override {
    RETURN_IF_ERROR(CheckSpans("Push", grads));
    std::vector<PushRequest> reqs(NumShards());
    int64_t bytes = 0;
    {
      absl::MutexLock lock(&mu_);
      for (int32_t s = 0; s < NumShards(); ++s) {
        PushRequest& r = reqs[s];
        r.set_job(layout_.job);
        r.set_worker(options_.worker);
        r.set_step(step);
        r.set_request_id(incarnation_ | next_request_++);
        for (int64_t idx : partition_.shard_chunks(s)) {
          const ChunkInfo& c = partition_.chunks()[idx];
          ChunkData* d = r.add_chunks();
          FillChunk(c, grads[c.tensor].data(), d);
          d->set_version(versions_[idx]);
          bytes += c.numel * static_cast<int64_t>(sizeof(float));
        }
      }
    }
    std::vector<PushResponse> resps(NumShards());
    RETURN_IF_ERROR((CallAll<PushRequest, PushResponse>(
        "Push", reqs, &resps,
        [](ParameterService::Stub* stub, grpc::ClientContext* ctx, const PushRequest* req,
           PushResponse* resp, std::function<void(grpc::Status)> done) {
          stub->async()->Push(ctx, req, resp, std::move(done));
        })));
    bytes_pushed_ += bytes;
    return absl::OkStatus();
  }

  absl::Status Pull(const std::vector<absl::Span<float>>& params) override {
    std::vector<absl::Span<const float>> views(params.begin(), params.end());
    RETURN_IF_ERROR(CheckSpans("Pull", views));
    std::vector<PullRequest> reqs(NumShards());
    for (int32_t s = 0; s < NumShards(); ++s) {
      reqs[s].set_job(layout_.job);
      reqs[s].set_worker(options_.worker);
    }
    std::vector<PullResponse> resps(NumShards());
    RETURN_IF_ERROR((CallAll<PullRequest, PullResponse>(
        "Pull", reqs, &resps,
        [](ParameterService::Stub* stub, grpc::ClientContext* ctx, const PullRequest* req,
           PullResponse* resp, std::function<void(grpc::Status)> done) {
          stub->async()->Pull(ctx, req, resp, std::move(done));
        })));
    int64_t bytes = 0;
    absl::MutexLock lock(&mu_);
    for (int32_t s = 0; s < NumShards(); ++s) {
      const auto& owned = partition_.shard_chunks(s);
      if (resps[s].chunks_size() != static_cast<int>(owned.size())) {
        return absl::InternalError(absl::StrCat("Pull: shard ", s, " (", options_.servers[s],
                                                ") returned ", resps[s].chunks_size(),
                                                " chunks, expected ", owned.size(),
                                                "; is it serving a different layout?"));
      }
      for (size_t i = 0; i < owned.size(); ++i) {
        const ChunkInfo& c = partition_.chunks()[owned[i]];
        const ChunkData& d = resps[s].chunks(static_cast<int>(i));
        const size_t want = static_cast<size_t>(c.numel) * sizeof(float);
        if (d.tensor() != c.tensor || d.chunk() != c.chunk || d.data().size() != want) {
          return absl::InternalError(absl::StrCat("Pull: shard ", s, " returned chunk (",
                                                  d.tensor(), ",", d.chunk(), ") of ",
                                                  d.data().size(), " bytes, expected (",
                                                  c.tensor, ",", c.chunk, ") of ", want));
        }
        std::memcpy(params[c.tensor].data() + c.offset, d.data().data(), want);
        versions_[owned[i]] = d.version();
        bytes += static_cast<int64_t>(want);
      }
    }
    bytes_pulled_ += bytes;
    return absl::OkStatus();
  }

  absl::Status Finish(int64_t step) override {
    std::vector<FinishRequest> reqs(NumShards());
    for (auto& r : reqs) {
      r.set_job(layout_.job);
      r.set_worker(options_.worker);
      r.set_step(step);
    }
    std::vector<FinishResponse> resps(NumShards());
    return CallAll<FinishRequest, FinishResponse>(
        "Finish", reqs, &resps,
        [](ParameterService::Stub* stub, grpc::ClientContext* ctx, const FinishRequest* req,
           FinishResponse* resp, std::function<void(grpc::Status)> done) {
          stub->async()->Finish(ctx, req, resp, std::move(done));
        });
  }

  absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfo() override {
    std::vector<JobInfoRequest> reqs(NumShards());
    for (auto& r : reqs) r.set_job(layout_.job);
    std::vector<JobInfoResponse> resps(NumShards());
    RETURN_IF_ERROR((CallAll<JobInfoRequest, JobInfoResponse>(
        "GetJobInfo", reqs, &resps,
        [](ParameterService::Stub* stub, grpc::ClientContext* ctx, const JobInfoRequest* req,
           JobInfoResponse* resp, std::function<void(grpc::Status)> done) {
          stub->async()->GetJobInfo(ctx, req, resp, std::move(done));
        })));
    return resps;
  }

  int64_t bytes_pushed() const override { return bytes_pushed_.load(); }
  int64_t bytes_pulled() const override { return bytes_pulled_.load(); }

 private:
  int32_t NumShards() const { return static_cast<int32_t>(stubs_.size()); }

  absl::Status CheckSpans(const char* what, const std::vector<absl::Span<const float>>& spans) {
    if (spans.size() != layout_.tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": job ", layout_.job, " has ",
                                                     layout_.tensors.size(), " tensors, got ",
                                                     spans.size()));
    }
    for (size_t t = 0; t < spans.size(); ++t) {
      if (static_cast<int64_t>(spans[t].size()) != partition_.tensor_numel(t)) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, ": tensor ", layout_.tensors[t].name(), " has ", partition_.tensor_numel(t),
            " elements, got ", spans[t].size()));
      }
    }
    return absl::OkStatus();
  }

  static void FillChunk(const ChunkInfo& c, const float* tensor, ChunkData* d) {
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(reinterpret_cast<const char*>(tensor + c.offset),
                static_cast<size_t>(c.numel) * sizeof(float));
  }


  // Sends reqs[s] to shard s for every shard, in parallel; retries retryable failures with
  // backoff. Fills resps. Returns the first non-retryable error, annotated with the shard.
  template <typename Req, typename Resp, typename Fn>
  absl::Status CallAll(const char* what, const std::vector<Req>& reqs, std::vector<Resp>* resps,
                       Fn call) {
    std::vector<int32_t> pending;
    for (int32_t s = 0; s < NumShards(); ++s) pending.push_back(s);
    absl::Duration backoff = options_.initial_backoff;
    for (int32_t attempt = 1;; ++attempt) {
      std::vector<grpc::Status> results(pending.size());
      std::vector<std::unique_ptr<grpc::ClientContext>> contexts(pending.size());
      absl::BlockingCounter done(static_cast<int>(pending.size()));
      for (size_t i = 0; i < pending.size(); ++i) {
        const int32_t s = pending[i];
        contexts[i] = std::make_unique<grpc::ClientContext>();
        contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_deadline));
        (*resps)[s].Clear();
        call(stubs_[s].get(), contexts[i].get(), &reqs[s], &(*resps)[s],
             [&results, &done, i](grpc::Status st) {
               results[i] = std::move(st);
               done.DecrementCount();
             });
      }
      done.Wait();
      std::vector<int32_t> retry;
      absl::Status last;
      for (size_t i = 0; i < pending.size(); ++i) {
        if (results[i].ok()) continue;
        const int32_t s = pending[i];
        absl::Status st = Annotate(FromGrpcStatus(results[i]),
                                   absl::StrCat(what, " to shard ", s, " (", options_.servers[s],
                                                ")"));
        if (!Retryable(st.code())) return st;
        retry.push_back(s);
        last = st;
      }
      if (retry.empty()) return absl::OkStatus();
      if (attempt >= options_.max_attempts) {
        return Annotate(last, absl::StrCat("gave up after ", attempt, " attempts"));
      }
      LogWarning(options_.logger, "rpc_retry",
                 {Kv("job", layout_.job), Kv("rpc", what), Kv("attempt", attempt),
                  Kv("backoff_ms", absl::ToInt64Milliseconds(backoff)),
                  Kv("error", last.ToString())});
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
      pending = std::move(retry);
    }
  }

  const JobLayout layout_;
  const GrpcParameterClientOptions options_;
  const Partition partition_;
  const uint64_t incarnation_;  // High bits of request ids: distinct per client instance.
  std::vector<std::unique_ptr<ParameterService::Stub>> stubs_;
  std::atomic<int64_t> bytes_pushed_{0};
  std::atomic<int64_t> bytes_pulled_{0};

  absl::Mutex mu_;
  uint64_t next_request_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<int64_t> versions_ ABSL_GUARDED_BY(mu_);  // Last pulled, per chunk.
};

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterClient>> NewGrpcParameterClient(
    JobLayout layout, GrpcParameterClientOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("parameter client: no servers given");
  }
  if (options.worker < 0 || options.worker >= layout.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("parameter client: worker ", options.worker,
                                                   " not in [0, ", layout.num_workers, ")"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("parameter client: max_attempts must be >= 1");
  }
  if (layout.tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter client: job ", layout.job, " has no tensors"));
  }
  std::vector<int64_t> numels;
  for (const TensorSpec& t : layout.tensors) numels.push_back(Numel(t));
  auto partition = Partition::Create(numels, layout.chunk_elems,
                                     static_cast<int32_t>(options.servers.size()));
  if (!partition.ok()) return Annotate(partition.status(), "parameter client");
  return std::unique_ptr<ParameterClient>(new GrpcParameterClient(
      std::move(layout), std::move(options), std::move(partition).value()));
}

}  // namespace gradmesh
