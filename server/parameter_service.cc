#include "server/parameter_service.h"

#include <unistd.h>

#include <algorithm>
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
#include "rpc/shm_region.h"
#include "rpc/tensor_wire.h"
#include "server/shm_op_server.h"

namespace gradmesh {
namespace {

template <typename T>
grpc::Status Reply(absl::StatusOr<T> result, T* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = std::move(result).value();
  return grpc::Status::OK;
}

// The job token a call presented (metadata x-gradmesh-job-token; empty if none), valid for
// the call's lifetime.
absl::string_view PresentedToken(grpc::ServerContextBase* ctx) {
  const auto& md = ctx->client_metadata();
  auto it = md.find("x-gradmesh-job-token");
  return it == md.end() ? absl::string_view()
                        : absl::string_view(it->second.data(), it->second.size());
}

absl::Status CheckJobToken(const JobTokens* tokens, grpc::ServerContextBase* ctx,
                           const std::string& job) {
  if (tokens == nullptr) return absl::OkStatus();
  return tokens->Check(job, PresentedToken(ctx));
}

// Parses a request's bytes: a push with its raw chunk data decoded outside protobuf (copied
// once and scanned as it lands: rpc/tensor_wire.h; more than `max_chunks` chunks refused before
// they are decoded), a pull with protobuf.
absl::Status ParseRequest(const grpc::ByteBuffer& bytes, int64_t max_chunks, PushRequest* request,
                          DenseChunks* dense) {
  return DecodePushRequest(bytes, request, dense, max_chunks);
}
absl::Status ParseRequest(const grpc::ByteBuffer& bytes, int64_t /*max_chunks*/,
                          PullRequest* request, DenseChunks* /*dense*/) {
  grpc::ByteBuffer copy(bytes);  // Shares gRPC's slices: the parse reads a shared copy.
  const grpc::Status st =
      grpc::GenericDeserialize<grpc::ProtoBufferReader, PullRequest>(&copy, request);
  return st.ok() ? absl::OkStatus() : absl::DataLossError("PullRequest: malformed");
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
  bool Accept(const Shard& shard, const JobTokens* tokens, grpc::CallbackServerContext* ctx,
              const grpc::ByteBuffer& bytes, const char* rpc) {
    const int64_t max_chunks = shard.limits().max_chunks_per_job;
    absl::Status st = ParseRequest(bytes, max_chunks, &request, &dense);
    st = st.ok() ? CheckJobToken(tokens, ctx, request.job())
                 : UndecodableRequest(st, rpc, Request::descriptor()->name(), max_chunks);
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
// unary Push or Pull would (token check included), in message order, and writes each
// StreamResponse when its operation completes (completion order). It reads the next message
// only once every operation read so far has started, fewer than kMaxInFlight operations are in
// flight and fewer than kMaxInFlight answers wait to be written; gRPC's flow control then holds
// the client back. A message may be a batch of up to kMaxStreamBatch operations, so up to
// twice kMaxInFlight can be in flight. While the answers waiting to be written (or being
// written) hold kMaxHeldBytes or more, the stream's next operations wait to be started: a
// client that does not read its answers holds at most that much of the shard's memory, plus
// one answer, plus the answers of operations that were waiting at a barrier (those are bounded
// by --max_waiting_pushes).
// A cancelled stream withdraws its waiting operations, answers those not yet started
// CANCELLED, and starts nothing more; the call finishes once every operation has completed and
// every response is written (or the client is gone). Deletes itself when gRPC is done with it.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static constexpr size_t kMaxInFlight = 256;
  static constexpr int64_t kMaxHeldBytes = int64_t{64} << 20;

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
  // Starts the operations of pending_ in order while the answers held stay under
  // kMaxHeldBytes, one thread at a time (starting_); answers them CANCELLED instead once the
  // stream is gone. The caller then calls Proceed.
  void StartPending();
  // Starts `op` (in ops_) on the shard; its completion calls Complete.
  void Begin(std::shared_ptr<Op> op);
  // Queues the response of `op` with `status` and forgets the operation.
  void Complete(const std::shared_ptr<Op>& op, const absl::Status& status);
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
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;   // Of queued_ (elements' own lengths).
  int64_t writing_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // Of out_ while it is written.
  // Operations read (and in ops_) that have not started yet, in message order.
  std::deque<std::shared_ptr<Op>> pending_ ABSL_GUARDED_BY(mu_);
  // Every operation in flight, started or pending.
  absl::flat_hash_map<uint64_t, std::shared_ptr<Op>> ops_ ABSL_GUARDED_BY(mu_);
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;  // Messages read (for error messages).
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;  // No more reads: client half-closed or error.
  bool gone_ ABSL_GUARDED_BY(mu_) = false;        // Cancelled or a write failed: write no more.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool batch_responses_ ABSL_GUARDED_BY(mu_) = false;  // The client reads batches.
  // A thread is starting pending_ (a half-close may be read meanwhile, on another thread):
  // answers that complete meanwhile are written together once all have started (or the held
  // answers reach kMaxHeldBytes), and no other message is read until then.
  bool starting_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

void StreamReactor::OnReadDone(bool ok) {
  bool failed;
  {
    absl::MutexLock lock(&mu_);
    reading_ = false;
    if (!ok || gone_) {
      // Half-closed; or cancelled while this read completed, whose operations would come after
      // CancelAll's and never be withdrawn: nothing of it starts.
      reads_done_ = true;
    } else {
      ++received_;
      std::vector<std::shared_ptr<Op>> ops;
      error_ = DecodeLocked(&ops);
      if (!error_.ok()) reads_done_ = true;
      for (std::shared_ptr<Op>& op : ops) pending_.push_back(std::move(op));
    }
    in_.Clear();  // Everything needed was copied out: gRPC's buffers can go now.
    failed = !error_.ok();
  }
  StartPending();
  if (failed) CancelAll();
  Proceed();
}

void StreamReactor::StartPending() {
  {
    absl::MutexLock lock(&mu_);
    if (starting_) return;  // That thread takes what was added (it checks under mu_).
    starting_ = true;
  }
  while (true) {
    std::shared_ptr<Op> op;
    bool gone;
    {
      absl::MutexLock lock(&mu_);
      gone = gone_;
      if (pending_.empty() || (!gone && queued_bytes_ + writing_bytes_ >= kMaxHeldBytes)) {
        starting_ = false;
        return;
      }
      op = std::move(pending_.front());
      pending_.pop_front();
    }
    if (gone) {
      Complete(op, absl::CancelledError(absl::StrCat("Stream: call ", op->request.call(),
                                                     " cancelled before it started")));
    } else {
      Begin(std::move(op));
    }
  }
}

absl::Status StreamReactor::DecodeLocked(std::vector<std::shared_ptr<Op>>* ops) {
  std::vector<grpc::ByteBuffer> parts;
  bool batch = false;
  if (absl::Status st = SplitStreamBatch(in_, kMaxStreamBatch, &parts, &batch); !st.ok()) {
    return UndecodableRequest(st, absl::StrCat("Stream: message ", received_), "StreamRequest", 0);
  }
  if (!batch) parts.push_back(in_);  // Shares the slices.
  absl::flat_hash_set<uint64_t> calls;
  std::vector<std::shared_ptr<Op>> decoded;  // Handed out only if the whole message is good.
  const int64_t max_chunks = shard_->limits().max_chunks_per_job;
  int64_t chunks = 0;  // In the message's pushes so far.
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string where = batch ? absl::StrCat("message ", received_, " (batch element ", i + 1,
                                                   " of ", parts.size(), ")")
                                    : absl::StrCat("message ", received_);
    auto op = std::make_shared<Op>();
    // One budget for the whole message: a batch is decoded whole before any of it starts.
    if (absl::Status st =
            DecodeStreamRequest(parts[i], &op->request, &op->dense, max_chunks - chunks);
        !st.ok()) {
      return UndecodableRequest(st, absl::StrCat("Stream: ", where), "StreamRequest", max_chunks);
    }
    if (op->request.has_push()) chunks += op->request.push().chunks_size();
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
      queued_bytes_ += static_cast<int64_t>(encoded.Length());
      queued_.push_back(std::move(encoded));
    }
    finish = ProceedLocked();
    end = ToGrpcStatus(error_);
  }
  if (finish) Finish(end);
}

bool StreamReactor::ProceedLocked() {
  if (finished_) return false;
  if (!gone_ && !writing_ && !starting_ && !queued_.empty()) {
    out_ = TakeStreamMessages(&queued_, batch_responses_);
    writing_bytes_ = static_cast<int64_t>(out_.Length());
    // A batch's tags and lengths count in out_ too; what is left is recounted when empty.
    queued_bytes_ = queued_.empty() ? 0 : std::max<int64_t>(0, queued_bytes_ - writing_bytes_);
    writing_ = true;
    StartWrite(&out_);  // Never runs OnWriteDone inline.
  }
  // Not while operations are being started or wait to be: the next batch would keep the cork
  // on (starting_) for as long as the client keeps sending, and no answer would be written
  // meanwhile; and pending operations must start before any read later.
  if (!reading_ && !reads_done_ && !gone_ && !starting_ && pending_.empty() &&
      ops_.size() < kMaxInFlight && queued_.size() < kMaxInFlight) {
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
    writing_bytes_ = 0;
    out_.Clear();
    if (!ok) {
      gone_ = true;
      queued_.clear();
      queued_bytes_ = 0;
    }
  }
  StartPending();  // The answers held went down (or the stream is gone).
  Proceed();
}

void StreamReactor::OnCancel() {
  {
    absl::MutexLock lock(&mu_);
    gone_ = true;
    queued_.clear();
    queued_bytes_ = 0;
  }
  CancelAll();
  StartPending();
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

// One OpenShm call: its one request (checked: the area's bounds, the job's token) makes the
// channel (a ShmOpServer), whose location is the one answer; the channel then lives until the
// worker half-closes or cancels the call, or the server shuts down. A further message ends the
// call with INVALID_ARGUMENT. Every reaction takes mu_; the call finishes once the answer's
// write is done (a read is always outstanding until then, so OnCancel needs no override).
// Deletes itself when gRPC is done with it, and with it the channel: ~ShmOpServer withdraws a
// waiting operation at once and returns once one being applied has finished.
class ShmOpenReactor final : public grpc::ServerBidiReactor<ShmOpenRequest, ShmOpenResponse> {
 public:
  ShmOpenReactor(Shard* shard, const JobTokens* tokens, const ShmChannelOptions& options,
                 std::atomic<int32_t>* open, grpc::CallbackServerContext* ctx)
      : shard_(shard),
        tokens_(tokens),
        options_(options),
        open_(open),
        ctx_(ctx),
        peer_(ctx->peer()) {
    absl::MutexLock lock(&mu_);
    if (options_.max_channels <= 0 || !IsLocalPeer(peer_)) {
      FinishLocked(absl::FailedPreconditionError(
          options_.max_channels <= 0
              ? std::string("OpenShm: this shard takes no shared-memory channels "
                            "(--shm_channels=0); use the Stream")
              : absl::StrCat("OpenShm: ", peer_, " is not on this machine")));
      return;
    }
    StartRead(&in_);
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!ok || finishing_) {  // Half-closed or cancelled: the channel ends.
      FinishLocked(absl::OkStatus());
      return;
    }
    const absl::Status st =
        server_ == nullptr
            ? OpenLocked()
            : absl::InvalidArgumentError("OpenShm: one request opens a channel; nothing follows");
    if (!st.ok()) {
      FinishLocked(st);
      return;
    }
    StartRead(&in_);  // Ends when the call does.
  }

  void OnWriteDone(bool /*ok*/) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finishing_) FinishLocked(end_);
  }

  void OnDone() override {
    if (server_ != nullptr) {
      LogInfo(options_.logger, "shm_channel_closed",
              {{"peer", peer_}, {"operations", absl::StrCat(server_->served())}});
    }
    server_.reset();  // Closes the channel and joins its thread.
    if (counted_) open_->fetch_sub(1);
    delete this;
  }

 private:
  absl::Status OpenLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t area = in_.area_bytes();
    if (area < static_cast<int64_t>(kShmMinAreaBytes) || area > options_.max_area_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("OpenShm: an area of ", area,
                                                     " bytes is outside [", kShmMinAreaBytes, ", ",
                                                     options_.max_area_bytes, "]"));
    }
    RETURN_IF_ERROR(CheckJobToken(tokens_, ctx_, in_.job()));
    if (open_->fetch_add(1) >= options_.max_channels) {
      open_->fetch_sub(1);
      return absl::ResourceExhaustedError(
          absl::StrCat("OpenShm: this shard's ", options_.max_channels,
                       " shared-memory channels (--shm_channels) are all open; use the Stream"));
    }
    counted_ = true;
    ShmOpServer::Options o;
    o.area_bytes = static_cast<size_t>(area);
    o.token = std::string(PresentedToken(ctx_));
    o.tokens = tokens_;
    o.peer = peer_;
    o.logger = options_.logger;
    o.spin = options_.spin;
    absl::StatusOr<std::unique_ptr<ShmOpServer>> server = ShmOpServer::Start(shard_, o);
    if (!server.ok()) {
      // Refused (no memory for it): the slot is free again at once, not when the call ends.
      open_->fetch_sub(1);
      counted_ = false;
      return server.status();
    }
    server_ = std::move(server).value();
    out_.set_pid(static_cast<int32_t>(getpid()));
    out_.set_fd(server_->fd());
    out_.set_nonce(server_->region().nonce());
    out_.set_area_bytes(static_cast<int64_t>(server_->region().area_bytes()));
    out_.set_batches(true);
    LogInfo(options_.logger, "shm_channel_opened",
            {{"peer", peer_}, {"job", in_.job()}, {"area_bytes", absl::StrCat(out_.area_bytes())}});
    writing_ = true;
    StartWrite(&out_);
    return absl::OkStatus();
  }

  // Finishes once the answer's write is done.
  void FinishLocked(absl::Status st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finishing_ = true;
    end_ = std::move(st);
    if (writing_) return;
    finished_ = true;
    Finish(ToGrpcStatus(end_));
  }

  Shard* const shard_;
  const JobTokens* const tokens_;
  const ShmChannelOptions options_;
  std::atomic<int32_t>* const open_;
  grpc::CallbackServerContext* const ctx_;
  const std::string peer_;
  absl::Mutex mu_;
  ShmOpenRequest in_ ABSL_GUARDED_BY(mu_);
  ShmOpenResponse out_ ABSL_GUARDED_BY(mu_);
  // Set under mu_ by the one read; OnDone reads them after every reaction has run.
  std::unique_ptr<ShmOpServer> server_;
  bool counted_ = false;  // Holds one of max_channels.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerBidiReactor<ShmOpenRequest, ShmOpenResponse>* ParameterServiceImpl::OpenShm(
    grpc::CallbackServerContext* ctx) {
  return new ShmOpenReactor(shard_, tokens_, shm_, &shm_open_, ctx);
}

absl::Status ParameterServiceImpl::CheckToken(grpc::ServerContextBase* ctx,
                                              const std::string& job) const {
  return CheckJobToken(tokens_, ctx, job);
}

std::string ParameterServiceImpl::Incarnation(grpc::ServerContextBase* ctx) const {
  if (tokens_ == nullptr) return "";
  const absl::string_view token = PresentedToken(ctx);
  return token.empty() ? "" : HexOf(Sha256(token));
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
  if (!call->Accept(*shard_, tokens_, ctx, *request, "Push")) return call;
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
  if (!call->Accept(*shard_, tokens_, ctx, *request, "Pull")) return call;
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
