#include "rpc/op_stream.h"

#include <grpcpp/client_context.h>
#include <grpcpp/support/client_callback.h>

#include <algorithm>
#include <deque>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace gradmesh {

// One open call. Owns itself until gRPC is done with it (OnDone); OpStream holds a reference
// to the current one and to replaced ones until their OnDone has run. A read is always
// outstanding; writes go one at a time from a queue.
// Writes are started from callers' threads, so the call holds a hold (AddHold) until it
// closes (a read or write failed): after that no write is started.
class OpStream::Conn final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  static std::shared_ptr<Conn> Open(grpc::GenericStub* stub, const std::string& method,
                                    const std::vector<std::pair<std::string, std::string>>& md) {
    std::shared_ptr<Conn> conn(new Conn());
    for (const auto& [key, value] : md) conn->ctx_.AddMetadata(key, value);
    conn->ctx_.AddMetadata(kStreamBatchMetadata, "1");  // This side reads batched responses.
    conn->self_ = conn;
    stub->PrepareBidiStreamingCall(&conn->ctx_, method, grpc::StubOptions(), conn.get());
    conn->AddHold();
    conn->StartRead(&conn->in_);
    conn->StartCall();
    return conn;
  }

  // Queues one framed operation. False (nothing taken from `done`) if the call has closed.
  bool Send(uint64_t call, grpc::ByteBuffer framed, grpc::ByteBuffer* response, Done* done,
            bool more) {
    absl::MutexLock lock(&mu_);
    if (closing_) return false;
    pending_.emplace(call, Pending{response, std::move(*done)});
    queued_.push_back(std::move(framed));
    // A burst is held back until its last operation, even if a write ends meanwhile.
    holding_ = more && batch_requests_;
    if (!writing_ && !holding_) {
      writing_ = true;
      out_ = TakeStreamMessages(&queued_, batch_requests_);
      ++writes_;
      StartWrite(&out_);  // The client API never runs OnWriteDone inline.
    }
    return true;
  }

  // Messages written so far (a batch counts once), and whether the shard reads batches.
  int64_t writes() const {
    absl::MutexLock lock(&mu_);
    return writes_;
  }
  bool batching() const {
    absl::MutexLock lock(&mu_);
    return batch_requests_;
  }

  bool closing() const {
    absl::MutexLock lock(&mu_);
    return closing_;
  }
  void Cancel() { ctx_.TryCancel(); }
  // Whether OnDone has run (and dropped the call's own reference).
  bool ended() const { return ended_->HasBeenNotified(); }
  void WaitDone() { ended_->WaitForNotification(); }

  void OnWriteDone(bool ok) override {
    bool close = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        queued_.clear();  // Their operations fail in OnDone.
        close = CloseLocked();
      } else if (!queued_.empty() && !holding_) {
        // What queued while the last write was out goes as one batch, if the shard reads them.
        out_ = TakeStreamMessages(&queued_, batch_requests_);
        ++writes_;
        writing_ = true;
        StartWrite(&out_);
      }
    }
    if (close) RemoveHold();
  }

  void OnReadInitialMetadataDone(bool ok) override {
    if (!ok) return;
    const auto& md = ctx_.GetServerInitialMetadata();
    const auto it = md.find(kStreamBatchMetadata);
    absl::MutexLock lock(&mu_);
    batch_requests_ = it != md.end() && it->second == "1";
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      bool close;
      {
        absl::MutexLock lock(&mu_);
        close = CloseLocked();
      }
      if (close) RemoveHold();
      return;
    }
    // One response, or a batch of them.
    struct Answer {
      Pending op;
      grpc::ByteBuffer body;
      grpc::Status status;
    };
    std::vector<Answer> answered;
    bool close = false;
    {
      absl::MutexLock lock(&mu_);
      std::vector<grpc::ByteBuffer> parts;
      bool batch = false;
      absl::Status st = SplitStreamBatch(in_, std::numeric_limits<size_t>::max(), &parts, &batch);
      if (!batch) parts.push_back(in_);
      // Every good answer is delivered, even after a bad one (which then ends the call).
      for (size_t i = 0; i < parts.size(); ++i) {
        StreamResponseHead head;
        grpc::ByteBuffer body;
        absl::Status part = SplitStreamResponse(parts[i], &head, &body);
        auto it = part.ok() ? pending_.find(head.call) : pending_.end();
        if (part.ok() && it == pending_.end()) {
          part = absl::DataLossError(
              absl::StrCat("response to call ", head.call, ", which is not in flight"));
        }
        if (!part.ok()) {
          if (st.ok()) st = part;
          continue;
        }
        answered.push_back({std::move(it->second), std::move(body),
                            grpc::Status(static_cast<grpc::StatusCode>(head.code), head.message)});
        pending_.erase(it);
      }
      if (st.ok()) {
        StartRead(&in_);  // The bodies hold their own references to the slices read.
      } else {
        error_ = std::string(st.message());
        ctx_.TryCancel();  // No more reads; OnDone fails the operations in flight.
        close = CloseLocked();
      }
    }
    for (Answer& a : answered) {
      *a.op.response = std::move(a.body);
      a.op.done(a.status);
    }
    if (close) RemoveHold();
  }

  void OnDone(const grpc::Status& status) override {
    absl::flat_hash_map<uint64_t, Pending> pending;
    std::string why;
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
      pending.swap(pending_);
      why = error_.empty() ? status.error_message() : error_;
    }
    // A stream that ended (cancelled, server gone, or ended OK with operations unanswered)
    // loses its operations: retryable. An error the server gave the stream itself (e.g.
    // INVALID_ARGUMENT for a message it could not parse) is passed on.
    grpc::StatusCode code = status.error_code();
    if (code == grpc::StatusCode::OK || code == grpc::StatusCode::CANCELLED) {
      code = grpc::StatusCode::UNAVAILABLE;
    }
    const grpc::Status lost(code, absl::StrCat("stream ended before the answer came: ", why));
    for (auto& [call, op] : pending) {
      *op.response = grpc::ByteBuffer();
      op.done(lost);
    }
    // Drop the call's own reference *before* telling ~OpStream that it is done: the waiter's
    // reference is then the last one and ~Conn (whose ctx_ releases a reference to the
    // channel) runs on the waiter's thread, while the stub still holds the channel. If ~Conn
    // ran here after the client had released its stubs, this thread (one of gRPC 1.51's
    // "nexting" threads of the process-wide callback completion queue) would destroy the last
    // grpc::Channel: ~Channel shuts that queue down, cannot join this very thread, frees the
    // queue, and this thread then polls freed memory ("assertion failed: prior > 0" in
    // grpc_cq_internal_unref).
    const std::shared_ptr<absl::Notification> ended = ended_;
    {
      std::shared_ptr<Conn> keep = std::move(self_);
    }  // May have destroyed *this: no member is touched below.
    ended->Notify();
  }

 private:
  struct Pending {
    grpc::ByteBuffer* response = nullptr;
    Done done;
  };

  Conn() = default;

  // Marks the call closed; true the first time (the caller then removes the hold).
  bool CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closing_) return false;
    closing_ = true;
    return true;
  }

  grpc::ClientContext ctx_;
  std::shared_ptr<Conn> self_;  // Until OnDone.
  // Shared with OnDone, which notifies it after dropping `self_` (possibly destroying *this).
  const std::shared_ptr<absl::Notification> ended_ = std::make_shared<absl::Notification>();
  mutable absl::Mutex mu_;
  grpc::ByteBuffer in_ ABSL_GUARDED_BY(mu_);
  grpc::ByteBuffer out_ ABSL_GUARDED_BY(mu_);
  std::deque<grpc::ByteBuffer> queued_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool batch_requests_ ABSL_GUARDED_BY(mu_) = false;  // The shard reads batches.
  bool holding_ ABSL_GUARDED_BY(mu_) = false;         // A burst's last operation is still to come.
  int64_t writes_ ABSL_GUARDED_BY(mu_) = 0;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::string error_ ABSL_GUARDED_BY(mu_);  // Why the client ended the call, if it did.
};

OpStream::OpStream(grpc::GenericStub* stub, std::string method,
                   std::vector<std::pair<std::string, std::string>> metadata)
    : stub_(stub), method_(std::move(method)), metadata_(std::move(metadata)) {}

OpStream::~OpStream() {
  std::vector<std::shared_ptr<Conn>> conns;
  {
    absl::MutexLock lock(&mu_);
    conns.swap(retired_);
    if (conn_ != nullptr) conns.push_back(std::move(conn_));
  }
  for (const std::shared_ptr<Conn>& conn : conns) conn->Cancel();
  for (const std::shared_ptr<Conn>& conn : conns) conn->WaitDone();
  // OnDone drops each call's own reference before it notifies, so `conns` holds the last ones:
  // the calls (and their ClientContexts) are destroyed here, before the owner releases the
  // stub and the channel.
}

void OpStream::Call(StreamOp op, const grpc::ByteBuffer& body, grpc::ByteBuffer* response,
                    Done done, bool more) {
  // Twice at most: a call found closed is replaced once.
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::shared_ptr<Conn> conn;
    std::vector<std::shared_ptr<Conn>> ended;  // Released after the lock, on this thread.
    uint64_t id;
    {
      absl::MutexLock lock(&mu_);
      if (conn_ == nullptr || conn_->closing()) {
        for (std::shared_ptr<Conn>& old : retired_) {
          if (old->ended()) ended.push_back(std::move(old));
        }
        retired_.erase(std::remove(retired_.begin(), retired_.end(), nullptr), retired_.end());
        if (conn_ != nullptr) retired_.push_back(std::move(conn_));
        conn_ = Conn::Open(stub_, method_, metadata_);
        ++opened_;
      }
      conn = conn_;
      id = next_call_++;
    }
    if (conn->Send(id, FrameStreamRequest(id, op, body), response, &done, more)) return;
  }
  *response = grpc::ByteBuffer();
  done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "stream closed as it was opened"));
}

void OpStream::Abort() {
  std::shared_ptr<Conn> conn;
  {
    absl::MutexLock lock(&mu_);
    conn = conn_;
  }
  if (conn != nullptr) conn->Cancel();
}

int64_t OpStream::opened() const {
  absl::MutexLock lock(&mu_);
  return opened_;
}

int64_t OpStream::writes() const {
  absl::MutexLock lock(&mu_);
  return conn_ != nullptr ? conn_->writes() : 0;
}

bool OpStream::batching() const {
  absl::MutexLock lock(&mu_);
  return conn_ != nullptr && conn_->batching();
}

}  // namespace gradmesh
