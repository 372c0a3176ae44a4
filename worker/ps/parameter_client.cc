#include "worker/ps/parameter_client.h"

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <optional>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/mode.h"
#include "common/numeric.h"
#include "common/partitioner.h"
#include "common/rate_limiter.h"
#include "common/spin_wait.h"
#include "common/status.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "rpc/op_stream.h"
#include "rpc/shm_op_channel.h"
#include "rpc/tensor_wire.h"
#include "rpc/token_transport.h"
#include "worker/core/device_gradients.h"

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
  GrpcParameterClient(JobLayout layout, GrpcParameterClientOptions options, Partition partition,
                      std::unique_ptr<Compressor> push_codec,
                      std::unique_ptr<Compressor> pull_codec)
      : layout_(std::move(layout)),
        sync_(IsSync(layout_.consistency)),
        options_(std::move(options)),
        partition_(std::move(partition)),
        incarnation_(static_cast<uint64_t>(std::random_device{}()) << 32),
        push_codec_(std::move(push_codec)),
        pull_codec_(std::move(pull_codec)),
        send_link_(options_.rpc.link_bits_per_s / 8),
        receive_link_(options_.rpc.link_bits_per_s / 8),
        versions_(partition_.chunks().size(), 0),
        changes_(options_.pull_codec == "changes"),
        held_(partition_.chunks().size(), -1) {
    absl::MutexLock lock(&mu_);
    ResetFeedbackLocked();
    for (int32_t s = 0; s < static_cast<int32_t>(options_.servers.size()); ++s) {
      int64_t bytes = 0;
      for (int64_t idx : partition_.shard_chunks(s)) bytes += partition_.chunks()[idx].numel * 4;
      shard_bytes_.push_back(bytes);
      all_shards_.push_back(s);
    }
    for (const std::string& addr : options_.servers) {
      auto channel = MakeChannel(addr, options_.rpc);
      stubs_.push_back(ParameterService::NewStub(channel));
      generic_stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
      if (options_.transport == "stream" || options_.transport == "shm") {
        std::vector<std::pair<std::string, std::string>> md;
        if (!options_.job_token.empty())
          md.emplace_back("x-gradmesh-job-token", options_.job_token);
        streams_.push_back(std::make_unique<OpStream>(generic_stubs_.back().get(),
                                                      "/gradmesh.ParameterService/Stream", md));
        if (options_.transport == "shm") {
          const int32_t s = static_cast<int32_t>(shm_.size());
          ShmOpChannel::Options so;
          so.area_bytes = ShmAreaBytes(s);
          so.job = layout_.job;
          so.metadata = std::move(md);
          so.shard = absl::StrCat("shard ", s, " (", addr, ")");
          so.logger = options_.logger;
          // Only answers of small operations come within half of this: a training step's
          // exchange of hundreds of KB never spins this thread (the caller may, in WaitAll).
          so.spin = std::min(options_.spin_wait, absl::Microseconds(100));
          shm_.push_back(std::make_unique<ShmOpChannel>(stubs_.back().get(), std::move(so)));
        }
      }
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
      *r.mutable_durability() = layout_.durability;
      r.set_staleness_damping(layout_.staleness_damping);
      r.set_barrier_timeout_s(layout_.barrier_timeout_s);
      r.set_commit_steps(layout_.commit_steps);
      r.set_clip_grad_value(layout_.clip_grad_value);
      r.set_placement(layout_.placement);
      for (int64_t idx : partition_.shard_chunks(s)) {
        const ChunkInfo& c = partition_.chunks()[idx];
        FillChunk(c, initial[c.tensor].data(), r.add_initial());
      }
    }
    std::vector<InitJobResponse> resps(NumShards());
    return CallAll<InitJobRequest, InitJobResponse>(
        "InitJob", reqs, &resps,
        [this](int32_t shard, grpc::ClientContext* ctx, const InitJobRequest* req,
               InitJobResponse* resp, std::function<void(grpc::Status)> done) {
          stubs_[shard]->async()->InitJob(ctx, req, resp, std::move(done));
        });
  }

  void StopRetrying() override { stop_retrying_.store(true); }

  absl::Status SetPushCodec(const std::string& spec) override {
    std::unique_ptr<Compressor> codec;
    if (!spec.empty() && spec != "identity") {
      auto c = CompressorRegistry::WithBuiltins().Create(spec);
      if (!c.ok()) return Annotate(c.status(), "SetPushCodec");
      codec = std::move(c).value();
    }
    absl::MutexLock lock(&mu_);
    if (device_ != nullptr && (codec == nullptr || !DeviceCodecOf(*codec).has_value())) {
      return absl::FailedPreconditionError(
          absl::StrCat("SetPushCodec: \"", spec.empty() ? "identity" : spec,
                       "\" cannot run on the device, and this client reads its gradients there"));
    }
    push_codec_ = std::move(codec);
    ResetFeedbackLocked();
    return absl::OkStatus();
  }

  bool UseDeviceGradients(DeviceGradients* gradients) override {
    absl::MutexLock lock(&mu_);
    if (push_codec_ == nullptr || !DeviceCodecOf(*push_codec_).has_value()) return false;
    device_ = gradients;
    device_->ResetFeedback();
    return true;
  }

  absl::Status Push(int64_t step, const std::vector<absl::Span<const float>>& grads) override {
    return PushImpl(step, grads, nullptr);
  }

  absl::StatusOr<PreparedFigures> PushPrepared(int64_t step,
                                               const std::vector<absl::Span<const float>>& grads,
                                               bool nonfinite) override {
    std::vector<grpc::ByteBuffer> resps;
    RETURN_IF_ERROR(PushImpl(step, grads, nullptr, nonfinite, &resps, nullptr, nullptr,
                             /*prepared=*/true));
    PreparedFigures f;
    for (int32_t s = 0; s < NumShards(); ++s) {
      PushResponse r;
      const bool parsed = grpc::SerializationTraits<PushResponse>::Deserialize(&resps[s], &r).ok();
      if (parsed && r.duplicate() && !r.has_prepared()) {
        // Applied here, then the shard restarted (the step is in its log, its figures were in
        // memory): its commit will find the step applied, and the others decide without it.
        ++f.forgotten;
        continue;
      }
      if (!parsed || !r.has_prepared()) {
        return absl::InternalError(absl::StrCat(
            "Push: job ", layout_.job, " step ", step, ": shard ", s, " (", options_.servers[s],
            ") answered without the step's figures; does it hold the job with commit_steps?"));
      }
      f.grad_sq_norm += r.prepared().grad_sq_norm();
      f.nonfinite = f.nonfinite || r.prepared().nonfinite();
      f.value_clipped = f.value_clipped || r.prepared().value_clipped();
    }
    return f;
  }

  absl::StatusOr<bool> PullCommitted(const SyncCommit& commit,
                                     const std::vector<absl::Span<float>>& params) override {
    bool missing = false;
    RETURN_IF_ERROR(PullImpl(params, &commit, &missing));
    return !missing;
  }

  absl::Status PushFrom(int64_t step, const std::vector<absl::Span<const float>>& grads,
                        const std::vector<int64_t>& base_versions) override {
    RETURN_IF_ERROR(CheckBaseVersions(step, base_versions));
    return PushImpl(step, grads, &base_versions);
  }

  std::vector<int64_t> PulledVersions() const override {
    absl::MutexLock lock(&mu_);
    return versions_;
  }

  // `base` null: the versions of the last pull.
  // `nonfinite`: PushRequest.nonfinite; `responses` (may be null) receives each shard's answer.
  // `pulls` (may be null): each shard's encoded PullRequest, sent inside its push
  // (PushRequest.pull); the responses then carry the pulled values.
  // `prepared`: the first phase of a commit_steps step. Pushed again for the same step (a
  // shard restarted between the phases), it sends the step's first encodings: the shards that
  // hold the step keep those, and error feedback must count the step once.
  absl::Status PushImpl(int64_t step, const std::vector<absl::Span<const float>>& grads,
                        const std::vector<int64_t>* base, bool nonfinite = false,
                        std::vector<grpc::ByteBuffer>* responses = nullptr,
                        const std::vector<std::string>* pulls = nullptr,
                        const std::vector<int32_t>* only = nullptr, bool prepared = false) {
    RETURN_IF_ERROR(CheckSpans("Push", grads));
    const std::vector<int32_t>& shards = ShardsOr(only);
    // Shards reject non-finite gradients, but each only for its own chunks: with several
    // shards, checking here keeps a bad step from being applied on some shards and not
    // others; with a push codec it keeps NaNs out of the error-feedback residual. A single
    // shard with dense pushes checks the whole push before applying any of it, so there the
    // scan would only repeat the shard's (12% of the cycles of a 4 MiB push).
    bool scan = NumShards() > 1;
    DeviceGradients* device = nullptr;
    {
      absl::MutexLock lock(&mu_);
      scan = scan || push_codec_ != nullptr;
      // A non-finite step's placeholders (zeros) are on the host.
      if (!nonfinite) device = device_;
    }
    if (scan) RETURN_IF_ERROR(ScanHostGradients(step, shards, grads, device != nullptr));
    // Gradients (or their encodings) are referenced by the request buffers, not copied
    // (common/tensor_wire.h); they stay alive until every shard has answered.
    std::vector<grpc::ByteBuffer> reqs(NumShards());
    std::vector<std::string> encoded;
    int64_t raw = 0, wire = 0;
    {
      absl::MutexLock lock(&mu_);
      const Compressor* codec = push_codec_.get();
      if (codec != nullptr) encoded.resize(partition_.chunks().size());
      std::optional<DeviceCodec> device_codec;
      if (codec != nullptr && options_.warmup_steps > 0) {
        const double d = WarmupDensity(push_codec_->density(), {options_.warmup_steps, 4}, step);
        if (step_codec_ == nullptr || step_codec_->density() != d) {
          if (d == push_codec_->density()) {
            step_codec_.reset();
          } else {
            ASSIGN_OR_RETURN(step_codec_, push_codec_->WithDensity(d));
          }
        }
        if (step_codec_ != nullptr) codec = step_codec_.get();
      }
      if (device != nullptr && codec != nullptr) device_codec = DeviceCodecOf(*codec);
      const absl::Time t0 = absl::Now();
      const bool again = prepared && codec != nullptr && step == prepared_step_ &&
                         prepared_encoded_.size() == encoded.size();
      if (again) {
        encoded = prepared_encoded_;
      } else if (device_codec.has_value()) {
        RETURN_IF_ERROR(EncodeOnDeviceLocked(step, shards, *device_codec, device, &encoded));
      }
      for (int32_t s : shards) {
        std::vector<PushChunkRef> refs;
        for (int64_t idx : partition_.shard_chunks(s)) {
          const ChunkInfo& c = partition_.chunks()[idx];
          PushChunkRef ref{c.tensor, c.chunk, base != nullptr ? (*base)[idx] : versions_[idx],
                           grads[c.tensor].data() + c.offset, c.numel};
          raw += c.numel * static_cast<int64_t>(sizeof(float));
          // Buffers go dense: their deltas are small, and a sparsified or quantised delta
          // (with error feedback lagging behind) would make running statistics and counts
          // drift from what the forward passes did.
          if (codec != nullptr && !layout_.tensors[c.tensor].buffer()) {
            const absl::Span<const float> g(ref.data, c.numel);
            // Distinct per worker, step and chunk, reproducible for a given seed.
            const uint64_t seed = options_.seed ^ (static_cast<uint64_t>(options_.worker) << 48) ^
                                  (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^
                                  static_cast<uint64_t>(idx);
            // A non-finite step's zeros are discarded by every shard (the step is skipped):
            // going through error feedback they would spend the residual on nothing.
            absl::Status st;  // Chunks encoded on the device, or before, are done already.
            if (!device_codec.has_value() && !again) {
              st = feedback_.empty() || nonfinite
                       ? codec->Encode(g, seed, &encoded[idx])
                       : feedback_[idx]->Compress(*codec, g, seed, &encoded[idx]);
            }
            RETURN_IF_ERROR(
                Annotate(st, absl::StrCat("Push: encoding ", layout_.tensors[c.tensor].name(),
                                          " chunk ", c.chunk)));
            // The receiver decodes any density with the target-density codec.
            ref.codec = push_codec_->name();
            ref.encoded = encoded[idx];
            wire += static_cast<int64_t>(encoded[idx].size());
          } else {
            wire += c.numel * static_cast<int64_t>(sizeof(float));
          }
          refs.push_back(std::move(ref));
        }
        reqs[s] = EncodePushRequest(layout_.job, options_.worker, step,
                                    incarnation_ | next_request_++, refs, nonfinite,
                                    pulls != nullptr ? absl::string_view((*pulls)[s]) : "");
      }
      codec_seconds_ += absl::ToDoubleSeconds(absl::Now() - t0);
      if (prepared && codec != nullptr && !again) {
        prepared_step_ = step;
        prepared_encoded_ = encoded;
      }
    }
    send_link_.Acquire(wire);  // The modelled link, if any, carries the payload first.
    std::vector<grpc::ByteBuffer> resps(NumShards());
    RETURN_IF_ERROR((CallAll<grpc::ByteBuffer, grpc::ByteBuffer>(
        "Push", reqs, &resps,
        [this, fused = pulls != nullptr](int32_t shard, grpc::ClientContext* ctx,
                                         const grpc::ByteBuffer* req, grpc::ByteBuffer* resp,
                                         std::function<void(grpc::Status)> done) {
          // A fused push's answer carries the shard's values.
          const int64_t bytes = std::max(static_cast<int64_t>(req->Length()),
                                         fused ? shard_bytes_[shard] : int64_t{0});
          Send(StreamOp::kPush, shard, bytes, ctx, req, resp, std::move(done));
        },
        &shards)));
    bytes_pushed_ += wire;
    raw_bytes_pushed_ += raw;
    if (responses != nullptr) *responses = std::move(resps);
    return absl::OkStatus();
  }

  // INVALID_ARGUMENT naming the first non-finite element of `shards`' chunks of `grads` (only
  // the buffers' with device gradients: the parameters' are checked where they are).
  absl::Status ScanHostGradients(int64_t step, const std::vector<int32_t>& shards,
                                 const std::vector<absl::Span<const float>>& grads,
                                 bool buffers_only) const {
    for (int32_t s : shards) {
      for (int64_t idx : partition_.shard_chunks(s)) {
        const ChunkInfo& c = partition_.chunks()[idx];
        if (buffers_only && !layout_.tensors[c.tensor].buffer()) continue;
        const int64_t bad = FirstNonFinite(grads[c.tensor].data() + c.offset, c.numel);
        if (bad >= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("Push: job ", layout_.job, " step ", step, " gradient of ",
                           layout_.tensors[c.tensor].name(), " element ", c.offset + bad,
                           " is not finite; nothing was sent"));
        }
      }
    }
    return absl::OkStatus();
  }

  // The parameters' chunks of `shards`, encoded where the gradients are (UseDeviceGradients)
  // in one batch, into encoded[chunk index]; error feedback per chunk index.
  absl::Status EncodeOnDeviceLocked(int64_t step, const std::vector<int32_t>& shards,
                                    const DeviceCodec& codec, DeviceGradients* device,
                                    std::vector<std::string>* encoded)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<DeviceChunk> chunks;
    for (int32_t s : shards) {
      for (int64_t idx : partition_.shard_chunks(s)) {
        const ChunkInfo& c = partition_.chunks()[idx];
        if (layout_.tensors[c.tensor].buffer()) continue;
        chunks.push_back({static_cast<int>(c.tensor), c.offset, c.numel, idx});
      }
    }
    ErrorFeedbackOptions ef;
    ef.momentum = options_.ef_momentum;
    std::vector<std::string> out;
    absl::Status st = device->Encode(chunks, codec, feedback_.empty() ? nullptr : &ef, &out);
    if (!st.ok()) {
      return absl::Status(st.code(), absl::StrCat("Push: job ", layout_.job, " step ", step, " ",
                                                  st.message(), "; nothing was sent"));
    }
    for (size_t i = 0; i < chunks.size(); ++i) (*encoded)[chunks[i].slot] = std::move(out[i]);
    return absl::OkStatus();
  }

  absl::Status Pull(const std::vector<absl::Span<float>>& params) override {
    return PullImpl(params, nullptr, nullptr);
  }

  // `commit` (may be null): PullRequest.commit; then *missing says whether a shard answered
  // commit_missing (its chunks are not written).
  absl::Status PullImpl(const std::vector<absl::Span<float>>& params, const SyncCommit* commit,
                        bool* missing, const std::vector<int32_t>* only = nullptr) {
    std::vector<absl::Span<const float>> views(params.begin(), params.end());
    RETURN_IF_ERROR(CheckSpans("Pull", views));
    const std::vector<int32_t>& shards = ShardsOr(only);
    std::vector<grpc::ByteBuffer> reqs(NumShards());
    for (int32_t s : shards) {
      const std::string wire = PullWire(s, commit);
      grpc::Slice slice(wire.data(), wire.size());
      reqs[s] = grpc::ByteBuffer(&slice, 1);
    }
    std::vector<grpc::ByteBuffer> resps(NumShards());
    RETURN_IF_ERROR((CallAll<grpc::ByteBuffer, grpc::ByteBuffer>(
        "Pull", reqs, &resps,
        [this](int32_t shard, grpc::ClientContext* ctx, const grpc::ByteBuffer* req,
               grpc::ByteBuffer* resp, std::function<void(grpc::Status)> done) {
          Send(StreamOp::kPull, shard, shard_bytes_[shard], ctx, req, resp, std::move(done));
        },
        &shards)));
    return DecodePulled(resps, params, commit, missing, &shards);
  }

  absl::Status PushPull(int64_t step, const std::vector<absl::Span<const float>>& grads,
                        const std::vector<absl::Span<float>>& params,
                        const std::vector<int64_t>* base_versions) override {
    return PushPullImpl(step, grads, params, base_versions, all_shards_);
  }

  int32_t num_shards() const override { return NumShards(); }

  std::vector<std::vector<int32_t>> TensorShards() const override {
    std::vector<std::vector<int32_t>> out(layout_.tensors.size());
    for (const ChunkInfo& c : partition_.chunks()) out[c.tensor].push_back(c.shard);
    for (std::vector<int32_t>& v : out) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    }
    return out;
  }

  absl::Status PushPullShards(int64_t step, const std::vector<absl::Span<const float>>& grads,
                              const std::vector<absl::Span<float>>& params,
                              const std::vector<int32_t>& shards) override {
    for (size_t i = 0; i < shards.size(); ++i) {
      if (shards[i] < 0 || shards[i] >= NumShards() || (i > 0 && shards[i] <= shards[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("PushPullShards: job ", layout_.job, " step ", step, ": shards [",
                         absl::StrJoin(shards, ","), "] are not distinct, ascending and in [0, ",
                         NumShards(), ")"));
      }
    }
    if (shards.empty()) return absl::OkStatus();
    return PushPullImpl(step, grads, params, nullptr, shards);
  }

  absl::Status PushPullImpl(int64_t step, const std::vector<absl::Span<const float>>& grads,
                            const std::vector<absl::Span<float>>& params,
                            const std::vector<int64_t>* base_versions,
                            const std::vector<int32_t>& shards) {
    if (base_versions != nullptr) RETURN_IF_ERROR(CheckBaseVersions(step, *base_versions));
    std::vector<absl::Span<const float>> views(params.begin(), params.end());
    RETURN_IF_ERROR(CheckSpans("Pull", views));
    // sync: the shard that completes a step would run every worker's pull in turn on one
    // thread; two calls let the pulls run in parallel. And a shard that answered a fused push
    // without values (a binary older than PushRequest.pull) gets two calls from then on.
    if (sync_ || !fused_.load()) {
      RETURN_IF_ERROR(PushImpl(step, grads, base_versions, false, nullptr, nullptr, &shards));
      return PullImpl(params, nullptr, nullptr, &shards);
    }
    std::vector<std::string> pulls(NumShards());
    for (int32_t s : shards) pulls[s] = PullWire(s, nullptr);
    std::vector<grpc::ByteBuffer> resps;
    RETURN_IF_ERROR(PushImpl(step, grads, base_versions, false, &resps, &pulls, &shards));
    std::vector<grpc::ByteBuffer> pulled(NumShards());
    for (int32_t s : shards) {
      bool found = false;
      absl::Status st = FindMessageField(resps[s], 4, &pulled[s], &found);  // PushResponse.pulled
      if (st.ok() && !found) {
        // The push was applied (or was a duplicate); only the values are missing.
        fused_ = false;
        LogWarning(options_.logger, "fused_pull_unsupported",
                   {Kv("job", layout_.job), Kv("shard", s), Kv("server", options_.servers[s]),
                    Kv("then", "push_and_pull_calls")});
        return PullImpl(params, nullptr, nullptr, &shards);
      }
      if (!st.ok()) {
        return Annotate(st, absl::StrCat("Push: job ", layout_.job, " step ", step, ": shard ", s,
                                         " (", options_.servers[s], ")"));
      }
    }
    return DecodePulled(pulled, params, nullptr, nullptr, &shards);
  }

  // The encoded PullRequest for shard `s` (commit: may be null).
  std::string PullWire(int32_t s, const SyncCommit* commit) {
    PullRequest r;
    r.set_job(layout_.job);
    r.set_worker(options_.worker);
    r.set_codec(options_.pull_codec);
    if (commit != nullptr) *r.mutable_commit() = *commit;
    if (changes_) {
      // Name every owned chunk with the version held, so the shard can send only changes.
      absl::MutexLock lock(&mu_);
      for (int64_t idx : partition_.shard_chunks(s)) {
        ChunkData* c = r.add_chunks();
        c->set_tensor(partition_.chunks()[idx].tensor);
        c->set_chunk(partition_.chunks()[idx].chunk);
        c->set_version(held_[idx]);
      }
    }
    return r.SerializeAsString();
  }

  // Decodes each shard's encoded PullResponse (shard order) into `params`.
  absl::Status DecodePulled(const std::vector<grpc::ByteBuffer>& resps,
                            const std::vector<absl::Span<float>>& params, const SyncCommit* commit,
                            bool* missing, const std::vector<int32_t>* only = nullptr) {
    const std::vector<int32_t>& shards = ShardsOr(only);
    // Each shard answers with its owned chunks in partition order; values are copied from
    // gRPC's buffers straight into the caller's tensors.
    int64_t raw = 0, wire = 0;
    {
      absl::MutexLock lock(&mu_);
      for (int32_t s : shards) {
        const auto& owned = partition_.shard_chunks(s);
        size_t i = 0;
        // Encoded chunks land here first, then are decoded into the tensors.
        std::vector<std::pair<const ChunkInfo*, std::string>> encoded;
        bool shard_missing = false;
        absl::Status st = DecodePullResponse(
            resps[s],
            [&](int32_t tensor, int32_t chunk, int64_t version, int32_t dtype,
                absl::string_view codec, int64_t size) -> absl::StatusOr<char*> {
              if (i >= owned.size()) {
                return absl::InternalError(
                    absl::StrCat("more chunks than the ", owned.size(), " this shard owns"));
              }
              const ChunkInfo& c = partition_.chunks()[owned[i]];
              const int64_t dense = c.numel * static_cast<int64_t>(sizeof(float));
              // "changes" pulls answer each chunk dense or as changes; narrowed (fp16/bf16)
              // pulls answer buffers dense (the shards never round them).
              const bool codec_ok =
                  codec == options_.pull_codec ||
                  (codec.empty() && (changes_ || layout_.tensors[c.tensor].buffer()));
              if (tensor != c.tensor || chunk != c.chunk ||
                  (dtype != FLOAT32 && dtype != DTYPE_UNSPECIFIED) || !codec_ok ||
                  (codec.empty() && size != dense)) {
                return absl::InternalError(absl::StrCat(
                    "chunk ", i, " is (", tensor, ",", chunk, ") with ", size, " bytes of codec \"",
                    codec, "\", expected (", c.tensor, ",", c.chunk, ") with ", dense,
                    " bytes of codec \"", options_.pull_codec, "\""));
              }
              versions_[owned[i]] = version;
              if (changes_) held_[owned[i]] = version;
              ++i;
              raw += dense;
              wire += size;
              if (codec.empty()) return reinterpret_cast<char*>(params[c.tensor].data() + c.offset);
              encoded.emplace_back(&c, std::string(static_cast<size_t>(size), '\0'));
              return encoded.back().second.data();
            },
            &shard_missing);
        if (st.ok() && shard_missing) {
          if (commit == nullptr || i != 0) {
            st = absl::InternalError("answered commit_missing to a pull that committed nothing");
          } else {
            *missing = true;
            continue;
          }
        }
        if (st.ok() && i != owned.size()) {
          st =
              absl::InternalError(absl::StrCat("returned ", i, " chunks, expected ", owned.size()));
        }
        if (st.ok() && !encoded.empty()) {
          const absl::Time t0 = absl::Now();
          for (const auto& [c, payload] : encoded) {
            const absl::Span<float> dest = params[c->tensor].subspan(c->offset, c->numel);
            st = changes_ ? DecodeChanges(payload, dest) : pull_codec_->Decode(payload, dest);
            if (!st.ok()) break;
          }
          codec_seconds_ += absl::ToDoubleSeconds(absl::Now() - t0);
        }
        if (!st.ok()) {
          // Whatever arrived was not applied consistently: ask for everything dense next time.
          std::fill(held_.begin(), held_.end(), -1);
          return Annotate(st, absl::StrCat("Pull: shard ", s, " (", options_.servers[s],
                                           "); is it serving a different layout?"));
        }
      }
    }
    bytes_pulled_ += wire;
    raw_bytes_pulled_ += raw;
    receive_link_.Acquire(wire);  // Outside mu_: a concurrent Push need not wait for it.
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
        [this](int32_t shard, grpc::ClientContext* ctx, const FinishRequest* req,
               FinishResponse* resp, std::function<void(grpc::Status)> done) {
          stubs_[shard]->async()->Finish(ctx, req, resp, std::move(done));
        });
  }

  absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfo() override {
    return JobInfoFromShards(/*absent_ok=*/false);
  }
  absl::StatusOr<std::vector<JobInfoResponse>> GetJobInfoWhereHeld() override {
    return JobInfoFromShards(/*absent_ok=*/true);
  }

  int64_t bytes_pushed() const override { return bytes_pushed_.load(); }
  int64_t bytes_pulled() const override { return bytes_pulled_.load(); }
  int64_t raw_bytes_pushed() const override { return raw_bytes_pushed_.load(); }
  int64_t raw_bytes_pulled() const override { return raw_bytes_pulled_.load(); }
  double codec_seconds() const override {
    absl::MutexLock lock(&mu_);
    return codec_seconds_;
  }

 private:
  int32_t NumShards() const { return static_cast<int32_t>(stubs_.size()); }
  // The shards an operation goes to: `only`, or every shard when it is null.
  const std::vector<int32_t>& ShardsOr(const std::vector<int32_t>* only) const {
    return only != nullptr ? *only : all_shards_;
  }
  // Sends a push or pull (`op`) carrying `bytes` of tensor data to or from `shard` by its
  // shared-memory channel if it takes it, else its stream if the size allows, else a unary
  // call (with `ctx`).
  void Send(StreamOp op, int32_t shard, int64_t bytes, grpc::ClientContext* ctx,
            const grpc::ByteBuffer* req, grpc::ByteBuffer* resp,
            std::function<void(grpc::Status)> done) {
    if (!shm_.empty() && shm_[shard]->Call(op, *req, resp, &done)) return;
    if (Streamed(bytes)) {
      streams_[shard]->Call(op, *req, resp, std::move(done));
      return;
    }
    generic_stubs_[shard]->UnaryCall(ctx,
                                     op == StreamOp::kPush ? "/gradmesh.ParameterService/Push"
                                                           : "/gradmesh.ParameterService/Pull",
                                     grpc::StubOptions(), req, resp, std::move(done));
  }
  // The area a shared-memory channel to shard `s` asks for: its dense float32 values (the
  // largest push and the largest answer; twice that with "changes" pulls, whose payload can
  // outgrow the values) plus room for the framing of each chunk. A larger push takes the Stream;
  // a larger answer makes the channel reopen with twice the area (rpc/shm_op_channel.h).
  size_t ShmAreaBytes(int32_t s) const {
    return static_cast<size_t>(shard_bytes_[s]) * (changes_ ? 2 : 1) +
           64 * partition_.shard_chunks(s).size() + (size_t{64} << 10);
  }
  // Whether an operation carrying `bytes` of tensor data to or from a shard takes its stream.
  bool Streamed(int64_t bytes) const {
    return !streams_.empty() && bytes <= options_.stream_max_bytes;
  }

  // GetJobInfo of every shard; with `absent_ok` a shard's NOT_FOUND is an empty answer.
  absl::StatusOr<std::vector<JobInfoResponse>> JobInfoFromShards(bool absent_ok) {
    std::vector<JobInfoRequest> reqs(NumShards());
    for (auto& r : reqs) r.set_job(layout_.job);
    std::vector<JobInfoResponse> resps(NumShards());
    RETURN_IF_ERROR((CallAll<JobInfoRequest, JobInfoResponse>(
        "GetJobInfo", reqs, &resps,
        [this, absent_ok](int32_t shard, grpc::ClientContext* ctx, const JobInfoRequest* req,
                          JobInfoResponse* resp, std::function<void(grpc::Status)> done) {
          stubs_[shard]->async()->GetJobInfo(
              ctx, req, resp, [absent_ok, resp, done = std::move(done)](grpc::Status st) {
                if (absent_ok && st.error_code() == grpc::StatusCode::NOT_FOUND) {
                  resp->Clear();
                  st = grpc::Status::OK;
                }
                done(std::move(st));
              });
        })));
    return resps;
  }

  // InvalidArgument (nothing sent) unless `base` has one version per chunk.
  absl::Status CheckBaseVersions(int64_t step, const std::vector<int64_t>& base) const {
    if (base.size() == partition_.chunks().size()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("Push: job ", layout_.job, " step ", step, ": ",
                                                   base.size(), " base versions for ",
                                                   partition_.chunks().size(), " chunks"));
  }

  absl::Status CheckSpans(const char* what, const std::vector<absl::Span<const float>>& spans) {
    if (spans.size() != layout_.tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": job ", layout_.job, " has ",
                                                     layout_.tensors.size(), " tensors, got ",
                                                     spans.size()));
    }
    for (size_t t = 0; t < spans.size(); ++t) {
      if (static_cast<int64_t>(spans[t].size()) != partition_.tensor_numel(t)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": tensor ", layout_.tensors[t].name(),
                                                       " has ", partition_.tensor_numel(t),
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

  // Waits until `*left` (guarded by `mu`, as `finished`) is 0. Past `deadline` (plus a
  // second, so that a unary call's own deadline fires first), or as soon as a stop is
  // requested (StopRetrying), cuts short the calls still unanswered (pending[i] with
  // !finished[i]): cancels their contexts and breaks their shards' streams, which completes
  // their operations. Returns the indices cut short at the deadline (none after a stop).
  // While recent waits were short it first spins (common/spin_wait.h): a small operation's
  // answer then finds this thread running instead of asleep.
  std::vector<size_t> WaitAll(absl::Mutex* mu, const size_t* left,
                              const std::vector<bool>* finished, absl::Time deadline,
                              const std::vector<int32_t>& pending,
                              const std::vector<std::unique_ptr<grpc::ClientContext>>& contexts) {
    const absl::Time start = absl::Now();
    absl::MutexLock lock(mu);
    const absl::Time spin_until = start + spin_.SpinFor();
    while (*left != 0 && absl::Now() < spin_until) {
      mu->Unlock();
      SpinYield();
      mu->Lock();
    }
    const absl::Condition all_done(
        +[](const size_t* n) { return *n == 0; }, left);
    const absl::Time give_up = deadline + absl::Seconds(1);
    bool stopping = false;
    // Wakes every 50 ms to look at the stop flag.
    while (
        !mu->AwaitWithDeadline(all_done, std::min(give_up, absl::Now() + absl::Milliseconds(50)))) {
      stopping = Stopping();
      if (!stopping && absl::Now() < give_up) continue;
      std::vector<size_t> cut;
      for (size_t i = 0; i < pending.size(); ++i) {
        if (!(*finished)[i]) cut.push_back(i);
      }
      mu->Unlock();
      for (size_t i : cut) {
        contexts[i]->TryCancel();
        if (!streams_.empty()) streams_[pending[i]]->Abort();
        if (!shm_.empty()) shm_[pending[i]]->Abort();
      }
      mu->Lock();
      mu->Await(all_done);
      spin_.Record(absl::Now() - start);
      return stopping ? std::vector<size_t>() : cut;
    }
    spin_.Record(absl::Now() - start);
    return {};
  }

  // Sends reqs[s] to shard s for every shard, in parallel; retries retryable failures with
  // backoff. Fills resps. Returns the first non-retryable error, annotated with the shard.
  // Streamed pushes and pulls (whose `ctx` carries no deadline) past the deadline break their
  // shard's stream, which fails them UNAVAILABLE.
  // `only` (may be null: every shard): the shards to call.
  template <typename Req, typename Resp, typename Fn>
  absl::Status CallAll(const char* what, const std::vector<Req>& reqs, std::vector<Resp>* resps,
                       Fn call, const std::vector<int32_t>* only = nullptr) {
    std::vector<int32_t> pending = ShardsOr(only);
    absl::Duration backoff = options_.initial_backoff;
    // A sync push waits at the shard's barrier for up to the job's barrier timeout: an attempt
    // must outlast it, or the client would give up on a step the shard still completes.
    // An attempt that ran out of time doubles the next one's (kept for later calls, up to
    // kMaxRpcDeadline): a message that needs longer than rpc_deadline on a slow link then
    // gets through instead of timing out on every attempt.
    absl::Duration deadline = absl::Milliseconds(grown_deadline_ms_.load());
    if (sync_ && std::string(what) == "Push") {
      const double barrier = layout_.barrier_timeout_s > 0 ? layout_.barrier_timeout_s : 120;
      deadline = std::max(deadline, absl::Seconds(barrier) + absl::Seconds(30));
    }
    for (int32_t attempt = 1;; ++attempt) {
      std::vector<grpc::Status> results(pending.size());
      std::vector<std::unique_ptr<grpc::ClientContext>> contexts(pending.size());
      absl::Mutex done_mu;
      std::vector<bool> finished(pending.size(), false);
      size_t left = pending.size();
      const absl::Time attempt_deadline = absl::Now() + deadline;
      for (size_t i = 0; i < pending.size(); ++i) {
        const int32_t s = pending[i];
        contexts[i] = std::make_unique<grpc::ClientContext>();
        if (!options_.job_token.empty()) {
          contexts[i]->AddMetadata("x-gradmesh-job-token", options_.job_token);
        }
        contexts[i]->set_deadline(absl::ToChronoTime(absl::Now() + deadline));
        (*resps)[s].Clear();
        call(s, contexts[i].get(), &reqs[s], &(*resps)[s],
             [&results, &done_mu, &finished, &left, i](grpc::Status st) {
               absl::MutexLock lock(&done_mu);
               results[i] = std::move(st);
               finished[i] = true;
               --left;
             });
      }
      const std::vector<size_t> cut =
          WaitAll(&done_mu, &left, &finished, attempt_deadline, pending, contexts);
      const bool out_of_time = absl::Now() >= attempt_deadline;
      for (size_t i : cut) {
        if (results[i].ok()) continue;
        results[i] = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                  absl::StrCat("no answer within ", absl::FormatDuration(deadline),
                                               " (", results[i].error_message(), ")"));
      }
      std::vector<int32_t> retry;
      absl::Status last;
      for (size_t i = 0; i < pending.size(); ++i) {
        if (results[i].ok()) continue;
        const int32_t s = pending[i];
        absl::Status st =
            Annotate(FromGrpcStatus(results[i]),
                     absl::StrCat(what, " to shard ", s, " (", options_.servers[s], ")"));
        if (Stopping()) return StoppedRetrying(st, attempt);  // Cut short by the stop.
        if (!Retryable(st.code())) return st;
        retry.push_back(s);
        last = st;
      }
      if (retry.empty()) return absl::OkStatus();
      if (attempt >= options_.max_attempts) {
        return Annotate(last, absl::StrCat("gave up after ", attempt, " attempts"));
      }
      if (Stopping()) return StoppedRetrying(last, attempt);
      if (out_of_time && deadline < kMaxRpcDeadline) {
        deadline = std::min(deadline * 2, kMaxRpcDeadline);
        int64_t was = grown_deadline_ms_.load();
        const int64_t now_ms = absl::ToInt64Milliseconds(deadline);
        while (was < now_ms && !grown_deadline_ms_.compare_exchange_weak(was, now_ms)) {
        }
      }
      LogWarning(options_.logger, "rpc_retry",
                 {Kv("job", layout_.job), Kv("rpc", what), Kv("attempt", attempt),
                  Kv("backoff_ms", absl::ToInt64Milliseconds(backoff)),
                  Kv("deadline_s", absl::ToDoubleSeconds(deadline)), Kv("error", last.ToString())});
      if (!SleepUnlessStopped(backoff)) return StoppedRetrying(last, attempt);
      backoff = std::min(backoff * 2, options_.max_backoff);
      pending = std::move(retry);
    }
  }

  bool Stopping() const { return stop_retrying_.load(); }

  // Sleeps `d`, waking every 50 ms to look at the stop flag; false if it was set.
  bool SleepUnlessStopped(absl::Duration d) const {
    const absl::Time end = absl::Now() + d;
    for (absl::Time now = absl::Now(); now < end; now = absl::Now()) {
      if (Stopping()) return false;
      absl::SleepFor(std::min(end - now, absl::Milliseconds(50)));
    }
    return !Stopping();
  }

  static absl::Status StoppedRetrying(const absl::Status& last, int32_t attempts) {
    return absl::CancelledError(absl::StrCat("stop requested: not retrying after ", attempts,
                                             " attempt(s); last error: ", last.ToString()));
  }

  // The job's consistency (a mode string only as the shards' InitJob carries it) is sync.
  static bool IsSync(const std::string& consistency) {
    const absl::StatusOr<Mode> mode = ParseMode(consistency);
    return mode.ok() && *mode == Mode::kSync;
  }

  const JobLayout layout_;
  const bool sync_;
  const GrpcParameterClientOptions options_;
  const Partition partition_;
  const uint64_t incarnation_;  // High bits of request ids: distinct per client instance.
  AdaptiveSpin spin_{options_.spin_wait};   // WaitAll: spin first while answers come fast.
  std::atomic<bool> stop_retrying_{false};  // StopRetrying: CallAll retries no more.
  // Per-attempt deadline: options_.rpc_deadline, doubled by each attempt that ran out of time.
  static constexpr absl::Duration kMaxRpcDeadline = absl::Minutes(30);
  std::atomic<int64_t> grown_deadline_ms_{absl::ToInt64Milliseconds(options_.rpc_deadline)};
  std::vector<std::unique_ptr<ParameterService::Stub>> stubs_;
  // Push and Pull go through generic stubs to avoid copying tensor data.
  std::vector<std::unique_ptr<grpc::GenericStub>> generic_stubs_;
  std::vector<int64_t> shard_bytes_;  // Dense float32 bytes each shard owns (a full pull).
  std::vector<int32_t> all_shards_;   // 0, 1, ..., NumShards() - 1.
  // transport "stream": one per shard (after the stubs they use, so destroyed first).
  std::vector<std::unique_ptr<OpStream>> streams_;
  // transport "shm": one shared-memory channel per shard, tried before its stream.
  std::vector<std::unique_ptr<ShmOpChannel>> shm_;
  // Error feedback per chunk for a biased push codec (none otherwise), from zero.
  void ResetFeedbackLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    feedback_.clear();
    step_codec_.reset();
    if (device_ != nullptr) device_->ResetFeedback();
    if (push_codec_ == nullptr || !push_codec_->biased() || !options_.error_feedback) return;
    ErrorFeedbackOptions ef;
    ef.momentum = options_.ef_momentum;
    for (const ChunkInfo& c : partition_.chunks()) {
      feedback_.push_back(std::make_unique<ErrorFeedback>(c.numel, ef));
    }
  }

  std::unique_ptr<Compressor> push_codec_ ABSL_GUARDED_BY(mu_);  // Null: dense pushes.
  const std::unique_ptr<Compressor> pull_codec_;                 // Null: dense pulls.
  std::atomic<int64_t> bytes_pushed_{0};
  std::atomic<int64_t> bytes_pulled_{0};
  std::atomic<int64_t> raw_bytes_pushed_{0};
  std::atomic<int64_t> raw_bytes_pulled_{0};
  std::atomic<bool> fused_{true};  // Whether shards answer PushRequest.pull (false once not).
  RateLimiter send_link_;          // Unlimited unless options_.rpc.link_bits_per_s > 0.
  RateLimiter receive_link_;

  mutable absl::Mutex mu_;
  // Error feedback per partition chunk (biased push codecs), and the warm-up codec in use.
  std::vector<std::unique_ptr<ErrorFeedback>> feedback_ ABSL_GUARDED_BY(mu_);
  // The last prepared push's step and encodings (PushImpl's `prepared`), sent again as they
  // were if that step is pushed again.
  int64_t prepared_step_ ABSL_GUARDED_BY(mu_) = -1;
  std::vector<std::string> prepared_encoded_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Compressor> step_codec_ ABSL_GUARDED_BY(mu_);
  // Not null: the parameters' gradients are read and encoded through it (UseDeviceGradients).
  DeviceGradients* device_ ABSL_GUARDED_BY(mu_) = nullptr;
  double codec_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_request_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<int64_t> versions_ ABSL_GUARDED_BY(mu_);  // Last pulled, per chunk.
  // "changes" pulls: the version of each chunk whose values this client holds exactly as the
  // shard sent them (-1: unknown, so the shard sends it dense).
  const bool changes_;
  std::vector<int64_t> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void SetClientOptionsFromSpec(const JobSpec& spec, GrpcParameterClientOptions* options) {
  const CompressionSpec& cs = spec.compression();
  options->push_codec = cs.push() == "auto" ? "" : cs.push();
  options->pull_codec = cs.pull();
  options->error_feedback = !cs.has_error_feedback() || cs.error_feedback();
  options->ef_momentum = static_cast<float>(cs.momentum());
  options->warmup_steps = cs.warmup_steps();
  options->seed = spec.seed();
}

absl::StatusOr<std::unique_ptr<ParameterClient>> NewGrpcParameterClient(
    JobLayout layout, GrpcParameterClientOptions options) {
  if (options.servers.empty()) {
    return absl::InvalidArgumentError("parameter client: no servers given");
  }
  if (options.worker < 0 || options.worker >= layout.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("parameter client: worker ", options.worker,
                                                   " not in [0, ", layout.num_workers, ")"));
  }
  if (options.transport != "stream" && options.transport != "unary" && options.transport != "shm") {
    return absl::InvalidArgumentError(absl::StrCat("parameter client: transport \"",
                                                   options.transport,
                                                   "\" is not one of stream, unary, shm"));
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError("parameter client: max_attempts must be >= 1");
  }
  for (const std::string& server : options.servers) {
    RETURN_IF_ERROR(CheckTokenTransport(server, options.rpc.tls, options.job_token, "job token"));
  }
  if (layout.tensors.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter client: job ", layout.job, " has no tensors"));
  }
  std::vector<int64_t> numels;
  for (const TensorSpec& t : layout.tensors) numels.push_back(Numel(t));
  auto partition =
      Partition::Create(numels, layout.chunk_elems, static_cast<int32_t>(options.servers.size()),
                        static_cast<ChunkPlacement>(layout.placement));
  if (!partition.ok()) return Annotate(partition.status(), "parameter client");
  const CompressorRegistry codecs = CompressorRegistry::WithBuiltins();
  std::unique_ptr<Compressor> push_codec, pull_codec;
  if (!options.push_codec.empty() && options.push_codec != "identity") {
    auto c = codecs.Create(options.push_codec);
    if (!c.ok()) return Annotate(c.status(), "parameter client: push codec");
    push_codec = std::move(c).value();
  }
  if (!options.pull_codec.empty() && options.pull_codec != "changes") {
    if (options.pull_codec != "fp16" && options.pull_codec != "bf16") {
      return absl::InvalidArgumentError(absl::StrCat("parameter client: pull codec \"",
                                                     options.pull_codec,
                                                     "\" is not one of \"\", fp16, bf16, changes"));
    }
    pull_codec = std::move(codecs.Create(options.pull_codec)).value();
  }
  {
    ErrorFeedbackOptions ef;
    ef.momentum = options.ef_momentum;
    RETURN_IF_ERROR(Annotate(ValidateErrorFeedbackOptions(ef), "parameter client"));
  }
  return std::unique_ptr<ParameterClient>(
      new GrpcParameterClient(std::move(layout), std::move(options), std::move(partition).value(),
                              std::move(push_codec), std::move(pull_codec)));
}

}  // namespace gradmesh
