#include "server/parameter_service.h"

#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "common/token_hash.h"
#include "rpc/grpc_status.h"
#include "rpc/tensor_wire.h"

namespace gradmesh {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

absl::Status CheckJobToken(const JobTokens* tokens, grpc::ServerContextBase* ctx,
                           const std::string& job) {
  if (tokens == nullptr) return absl::OkStatus();
  absl::string_view presented;
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  if (it != md.end()) presented = absl::string_view(it->second.data(), it->second.size());
  return tokens->Check(job, presented);
}

// Parses a request's bytes: a push with its raw chunk data decoded outside protobuf (copied
// once and scanned as it lands: rpc/tensor_wire.h), a pull with protobuf.
bool ParseRequest(const grpc::ByteBuffer& bytes, PushRequest* request, DenseChunks* dense) {
  return DecodePushRequest(bytes, request, dense).ok();
}
bool ParseRequest(const grpc::ByteBuffer& bytes, PullRequest* request, DenseChunks* /*dense*/) {
  grpc::ByteBuffer copy(bytes);  // Shares gRPC's slices: the parse reads a shared copy.
  return grpc::GenericDeserialize<grpc::ProtoBufferReader, PullRequest>(&copy, request).ok();
}

// One Push or Pull in the callback API, on raw bytes: the parsed request and the response
// live with the call. It finishes when the shard completes the call; if gRPC cancels the call
// first (client cancellation, deadline, server shutdown), the shard withdraws its wait and
// completes it then. Deletes itself when gRPC is done with it.
template <typename Request, typename Response>
class RawUnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  Request request;
  DenseChunks dense;  // A push's raw chunk data (ParseRequest).
  Response response;

  // Parses the request bytes (which stay gRPC's) for `rpc` and checks its job's token. False
  // if either fails: the call is then completed with the error.
  bool Accept(const JobTokens* tokens, grpc::CallbackServerContext* ctx,
              const grpc::ByteBuffer& bytes, const char* rpc) {
    absl::Status st = ParseRequest(bytes, &request, &dense)
                          ? CheckJobToken(tokens, ctx, request.job())
                          : absl::InvalidArgumentError(absl::StrCat(rpc, ": the request is not a ",
                                                                    Request::descriptor()->name()));
    if (!st.ok()) Complete(st);
    return st.ok();
  }

  WaitCancel* cancel() { return &cancel_; }
  // Finishes the call; the reactor may be gone when this returns.
  void Complete(const absl::Status& status) { Finish(ToGrpcStatus(status)); }

  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  WaitCancel cancel_;
};

// One ParameterService.Stream call: reads StreamRequests, starts each on the shard as the
// unary Push or Pull would (token check included), and writes each StreamResponse when its
// operation completes (completion order). It reads the next message only when fewer than
// kMaxInFlight operations are in flight and fewer than kMaxInFlight answers wait to be
// written (a client that does not read its answers is held back too), and no batch is still
// being started; gRPC's flow control then holds the client back. A message may be a batch of
// up to kMaxStreamBatch operations, so up to twice kMaxInFlight can be in flight.
// A cancelled stream withdraws its waiting operations; the call finishes once every operation
// has completed and every response is written (or the client is gone). Deletes itself when
// gRPC is done with it.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static constexpr size_t kMaxInFlight = 256;

  StreamReactor(Shard* shard, const JobTokens* tokens, grpc::CallbackServerContext* ctx)
      : shard_(shard), tokens_(tokens), ctx_(ctx) {
    // Batches (rpc/tensor_wire.h): read from any client, written to one that reads them.
    ctx->AddInitialMetadata(kStreamBatchMetadata, "1");
    const auto announced = ctx->client_metadata().find(kStreamBatchMetadata);
    absl::MutexLock lock(&mu_);
    batch_responses_ = announced != ctx->client_metadata().end() && announced->second == "1";
    reading_ = true;
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override { delete this; }

 private:
  struct Op {
    StreamRequest request;
    DenseChunks dense;  // Its push's raw chunk data (rpc/tensor_wire.h DecodeStreamRequest).
    StreamResponse response;
    WaitCancel cancel;
  };

  // Decodes the message read (one operation or a batch of them) into `ops` and registers them
  // in ops_; on an error none is registered.
  absl::Status DecodeLocked(std::vector<std::shared_ptr<Op>>* ops)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts `op` (in ops_) on the shard; its completion calls Complete.
  void Begin(std::shared_ptr<Op> op);
  // Queues the response of `op` with `status` and forgets the operation.
  void Complete(const std::shared_ptr<Op>& op, const absl::Status& status);
  // Ends the stream with `status` (malformed input): no more reads, waiting operations
  // withdrawn.
  void Fail(const absl::Status& status);
  void CancelAll();
  // Starts the next read or write if one is due; true if the call should finish now.
  bool ProceedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Proceed() {
    bool finish;
    grpc::Status status;
    {
      absl::MutexLock lock(&mu_);
      finish = ProceedLocked();
      status = ToGrpcStatus(error_);
    }
    if (finish) Finish(status);  // May run OnDone inline: nothing touches `this` after it.
  }

  Shard* const shard_;
  const JobTokens* const tokens_;
  grpc::CallbackServerContext* const ctx_;
  absl::Mutex mu_;
  grpc::ByteBuffer in_ ABSL_GUARDED_BY(mu_);   // The read in progress.
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);  // The write in progress.
  std::deque<grpc::ByteBuffer> queued_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, std::shared_ptr<Op>> ops_ ABSL_GUARDED_BY(mu_);
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;  // Messages read (for error messages).
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;  // No more reads: client half-closed or error.
  bool gone_ ABSL_GUARDED_BY(mu_) = false;        // Cancelled or a write failed: write no more.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool batch_responses_ ABSL_GUARDED_BY(mu_) = false;  // The client reads batches.
  // Batches whose operations are being started (a half-close may be read meanwhile, on
  // another thread): answers that complete meanwhile are written together once all have
  // started, and no other message is read until then.
  int starting_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

void StreamReactor::OnReadDone(bool ok) {
  std::vector<std::shared_ptr<Op>> ops;
  bool failed;
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ok) {
      reads_done_ = true;
    } else {
      ++received_;
      error_ = DecodeLocked(&ops);
      in_.Clear();  // Everything needed was copied out: gRPC's buffers can go now.
      if (!error_.ok()) reads_done_ = true;
    }
    failed = !error_.ok();
    if (ops.size() > 1) ++starting_;
  }
  // In message order: a batch's operations start as consecutive messages' would. The answers
  // of those that complete meanwhile are written together after the last has started.
  for (std::shared_ptr<Op>& op : ops) Begin(std::move(op));
  if (ops.size() > 1) {
    absl::MutexLock lock(&mu_);
    --starting_;
  }
  if (failed) CancelAll();
  Proceed();
}

absl::Status StreamReactor::DecodeLocked(std::vector<std::shared_ptr<Op>>* ops) {
  std::vector<grpc::ByteBuffer> parts;
  bool batch = false;
  if (absl::Status st = SplitStreamBatch(in_, kMaxStreamBatch, &parts, &batch); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Stream: message ", received_, " is not a StreamRequest: ", st.message()));
  }
  if (!batch) parts.push_back(in_);  // Shares the slices.
  absl::flat_hash_set<uint64_t> calls;
  std::vector<std::shared_ptr<Op>> decoded;  // Handed out only if the whole message is good.
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string where = batch ? absl::StrCat("message ", received_, " (batch element ", i + 1,
                                                   " of ", parts.size(), ")")
                                    : absl::StrCat("message ", received_);
    auto op = std::make_shared<Op>();
    if (!DecodeStreamRequest(parts[i], &op->request, &op->dense).ok()) {
      return absl::InvalidArgumentError(absl::StrCat("Stream: ", where, " is not a StreamRequest"));
    }
    const uint64_t call = op->request.call();
    if (op->request.batch_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Stream: ", where, " sets batch (field ", kStreamBatchField,
          ") beside other fields, or inside a batch: a batch message carries nothing else"));
    }
    if (ops_.contains(call) || !calls.insert(call).second) {
      return absl::InvalidArgumentError(absl::StrCat("Stream: ", where, " reuses call id ", call,
                                                     " of an operation still in flight"));
    }
    decoded.push_back(std::move(op));
  }
  for (const std::shared_ptr<Op>& op : decoded) ops_[op->request.call()] = op;
  *ops = std::move(decoded);
  return absl::OkStatus();
}

void StreamReactor::Begin(std::shared_ptr<Op> op) {
  const StreamRequest& r = op->request;
  if (r.op_case() == StreamRequest::OP_NOT_SET) {
    Complete(op, absl::InvalidArgumentError(absl::StrCat("Stream: call ", r.call(),
                                                         " carries neither a push nor a pull")));
    return;
  }
  const std::string& job = r.has_push() ? r.push().job() : r.pull().job();
  if (absl::Status st = CheckJobToken(tokens_, ctx_, job); !st.ok()) {
    Complete(op, st);
    return;
  }
  if (r.has_push()) {
    shard_->PushAsync(
        r.push(),
        [this, op](absl::StatusOr<PushResponse> result) {
          if (result.ok()) *op->response.mutable_push() = std::move(result).value();
          Complete(op, result.status());
        },
        &op->cancel, &op->dense);
  } else {
    PullResponse* response = op->response.mutable_pull();
    shard_->PullAsync(
        r.pull(), response, [this, op](absl::Status st) { Complete(op, st); }, &op->cancel);
  }
}

void StreamReactor::Complete(const std::shared_ptr<Op>& op, const absl::Status& status) {
  StreamResponse& response = op->response;
  response.set_call(op->request.call());
  if (!status.ok()) {
    response.Clear();
    response.set_call(op->request.call());
    response.set_code(static_cast<int32_t>(status.code()));
    response.set_message(std::string(status.message()));
  } else if (op->request.has_push() && !response.has_push()) {
    response.mutable_push();  // The oneof says which operation this answers.
  }
  // The pulled values move into the encoded buffer's slices rather than being copied again.
  grpc::ByteBuffer encoded = EncodeStreamResponse(&response);
  bool finish;
  grpc::Status end;
  {
    // Forgetting the operation and deciding whether to finish happen under one lock: once the
    // last operation is gone, another thread may finish the call (and delete this).
    absl::MutexLock lock(&mu_);
    ops_.erase(op->request.call());
    if (!gone_) {
      queued_.push_back(std::move(encoded));
    }
    finish = ProceedLocked();
    end = ToGrpcStatus(error_);
  }
  if (finish) Finish(end);
}

bool StreamReactor::ProceedLocked() {
  if (finished_) return false;
  if (!gone_ && !writing_ && starting_ == 0 && !queued_.empty()) {
    out_ = TakeStreamMessages(&queued_, batch_responses_);
    writing_ = true;
    StartWrite(&out_);  // Never runs OnWriteDone inline.
  }
  // Not while a batch is being started: the next batch would keep the cork on (starting_)
  // for as long as the client keeps sending, and no answer would be written meanwhile.
  if (!reading_ && !reads_done_ && !gone_ && starting_ == 0 && ops_.size() < kMaxInFlight &&
      queued_.size() < kMaxInFlight) {
    reading_ = true;
    StartRead(&in_);
  }
  const bool ended = reads_done_ || gone_;
  if (ended && ops_.empty() && !writing_ && (queued_.empty() || gone_)) {
    finished_ = true;
    return true;
  }
  return false;
}

void StreamReactor::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      gone_ = true;
      queued_.clear();
    }
  }
  Proceed();
}

void StreamReactor::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    gone_ = true;
    queued_.clear();
  }
  CancelAll();
  Proceed();
}

void StreamReactor::CancelAll() {
  std::vector<std::shared_ptr<Op>> ops;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [call, op] : ops_) ops.push_back(op);
  }
  // Outside mu_: a cancelled wait completes (Complete takes mu_) on this thread.
  for (const auto& op : ops) op->cancel.Cancel();
}

}  // namespace

absl::Status ParameterServiceImpl::CheckToken(grpc::ServerContextBase* ctx,
                                              const std::string& job) const {
  return CheckJobToken(tokens_, ctx, job);
}

std::string ParameterServiceImpl::Incarnation(grpc::ServerContextBase* ctx) const {
  if (tokens_ == nullptr) return "";
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  if (it == md.end() || it->second.empty()) return "";
  return HexOf(Sha256(absl::string_view(it->second.data(), it->second.size())));
}

grpc::Status ParameterServiceImpl::InitJob(grpc::ServerContext* ctx, const InitJobRequest* request,
                                           InitJobResponse* response) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  // Which submission of the job this is: the hash of the token it presented (never the token).
  return Reply(shard_->InitJob(*request, Incarnation(ctx)), response);
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Push(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  auto* call = new RawUnaryReactor<PushRequest, PushResponse>();
  if (!call->Accept(tokens_, ctx, *request, "Push")) return call;
  shard_->PushAsync(
      call->request,
      [call, response](absl::StatusOr<PushResponse> result) {
        if (result.ok()) {
          call->response = std::move(result).value();
          *response = EncodePushResponse(&call->response);
        }
        call->Complete(result.status());
      },
      call->cancel(), &call->dense);
  return call;
}

grpc::ServerUnaryReactor* ParameterServiceImpl::Pull(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* request,
                                                     grpc::ByteBuffer* response) {
  auto* call = new RawUnaryReactor<PullRequest, PullResponse>();
  if (!call->Accept(tokens_, ctx, *request, "Pull")) return call;
  // The call's request and response live until it finishes.
  shard_->PullAsync(
      call->request, &call->response,
      [call, response](absl::Status st) {
        if (st.ok()) *response = EncodePullResponse(&call->response);
        call->Complete(st);
      },
      call->cancel());
  return call;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ParameterServiceImpl::Stream(
    grpc::CallbackServerContext* ctx) {
  return new StreamReactor(shard_, tokens_, ctx);
}

grpc::Status ParameterServiceImpl::Finish(grpc::ServerContext* ctx, const FinishRequest* request,
                                          FinishResponse*) {
  if (absl::Status st = CheckToken(ctx, request->job()); !st.ok()) return ToGrpcStatus(st);
  return ToGrpcStatus(shard_->Finish(*request));
}

// GetJobInfo is open: layout, progress and statistics, no tensor values (monitoring tools and
// tests read it without the job's token).
grpc::Status ParameterServiceImpl::GetJobInfo(grpc::ServerContext*, const JobInfoRequest* request,
                                              JobInfoResponse* response) {
  return Reply(shard_->GetJobInfo(*request), response);
}

}  // namespace gradmesh
