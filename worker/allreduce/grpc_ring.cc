// The gRPC ring transport (see grpc_ring.h): an outgoing client stream (OutLink) and an inbox
// in the local CollectiveServiceImpl.
#include "worker/allreduce/grpc_ring.h"

#include <google/protobuf/io/coded_stream.h>
#include <grpc/slice.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/status.h"
#include "rpc/grpc_status.h"
#include "worker/core/peer_token.h"

namespace gradmesh {
namespace {

// The method name must outlive every call (gRPC keeps a pointer to it).
const std::string& RingMethod() {
  static const std::string* const kMethod = new std::string("/gradmesh.CollectiveService/Ring");
  return *kMethod;
}

using google::protobuf::io::CodedOutputStream;

size_t VarintSize(uint64_t v) { return CodedOutputStream::VarintSize64(v); }

char* PutVarint(uint64_t v, char* p) {
  return reinterpret_cast<char*>(
      CodedOutputStream::WriteVarint64ToArray(v, reinterpret_cast<uint8_t*>(p)));
}

// Slices that point into a caller's memory (SendNoCopy) own nothing. gRPC may drop its
// last reference after the memory is gone, but it never reads it after the write completed
// (see OutLink::WaitWritten).
void KeepNothing(void*) {}

// The client stream to the next rank. Owned by GrpcRingTransport; deleted after OnDone.
class OutLink final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  OutLink(std::shared_ptr<grpc::Channel> channel, std::string peer_name,
          const std::string& job_token, const std::string& rank_token,
          std::function<void(const absl::Status&)> on_failure)
      : channel_(std::move(channel)),
        stub_(channel_),
        peer_name_(std::move(peer_name)),
        on_failure_(std::move(on_failure)) {
    context_.set_wait_for_ready(true);
    if (!job_token.empty()) context_.AddMetadata(kJobTokenMetadata, job_token);
    if (!rank_token.empty()) context_.AddMetadata(kRankTokenMetadata, rank_token);
    stub_.PrepareBidiStreamingCall(&context_, RingMethod(), grpc::StubOptions(), this);
    StartRead(&ack_);
    StartCall();
  }

  // Queues one serialized chunk; starts writing if idle.
  absl::Status Send(grpc::ByteBuffer chunk) {
    const grpc::ByteBuffer* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (!error_.ok()) return error_;
      if (done_)
        return absl::UnavailableError(absl::StrCat("ring link to ", peer_name_, " is closed"));
      queue_.push_back(std::move(chunk));
      if (!writing_) {
        writing_ = true;
        start = &queue_.front();
      }
    }
    if (start != nullptr) StartWrite(start, WriteThrough());
    return absl::OkStatus();
  }

  // Waits until every queued chunk has been written to the socket (so memory sent in place
  // is no longer read), the link failed (its error), or `deadline` (DEADLINE_EXCEEDED).
  absl::Status WaitWritten(absl::Time deadline, const RingAbort* abort) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !writing_ || !error_.ok() || done_;
    };
    while (!mu_.AwaitWithDeadline(absl::Condition(&idle), RingAbortSlice(deadline, abort))) {
      if (RingAborted(abort)) return RingAbortedError(absl::StrCat("ring link to ", peer_name_));
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(peer_name_, " did not take the last ring messages in time"));
      }
    }
    if (!error_.ok()) return error_;
    if (writing_)
      return absl::UnavailableError(absl::StrCat("ring link to ", peer_name_, " ended"));
    return absl::OkStatus();
  }

  // Half-closes after the queued chunks and waits for the receiver's answer until
  // `deadline`, then cancels. Returns the stream's final status.
  absl::Status Close(absl::Time deadline) {
    bool writes_done = false;
    {
      absl::MutexLock lock(&mu_);
      closing_ = true;
      if (!writing_ && !done_ && !writes_done_started_) {
        writes_done_started_ = true;
        writes_done = true;
      }
    }
    if (writes_done) StartWritesDone();
    if (!done_notification_.WaitForNotificationWithDeadline(deadline)) {
      context_.TryCancel();
      done_notification_.WaitForNotification();
    }
    absl::MutexLock lock(&mu_);
    return error_;
  }

  // OK while the stream is healthy; its failure otherwise.
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return error_;
  }

  void OnWriteDone(bool ok) override {
    const grpc::ByteBuffer* next = nullptr;
    bool writes_done = false;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      if (!ok) {
        // The stream is broken; OnDone brings the status. Drop what is queued.
        queue_.clear();
        writing_ = false;
        Fail(absl::UnavailableError(
            absl::StrCat("ring link to ", peer_name_, " broke while sending")));
      } else if (!queue_.empty()) {
        next = &queue_.front();
      } else {
        writing_ = false;
        if (closing_ && !writes_done_started_) {
          writes_done_started_ = true;
          writes_done = true;
        }
      }
    }
    if (next != nullptr) StartWrite(next, WriteThrough());
    if (writes_done) StartWritesDone();
  }

  void OnReadDone(bool) override {}

  // Completion only once the bytes are written to the socket, not when gRPC has merely
  // framed them: in-place memory must not be read after Flush.
  static grpc::WriteOptions WriteThrough() {
    return grpc::WriteOptions().set_write_through();
  }  // The RingAck (or nothing); the status says the rest.

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok()) {
        Fail(Annotate(FromGrpcStatus(status), absl::StrCat("ring link to ", peer_name_)));
      } else if (!closing_) {
        Fail(absl::UnavailableError(
            absl::StrCat("ring link to ", peer_name_, " was ended by the receiver")));
      }
      done_ = true;
    }
    // Last: the owner may delete this link as soon as it sees the notification (the
    // Notification's destructor waits for Notify to return).
    done_notification_.Notify();
  }

 private:
  // Records the first failure and reports it (the callback only takes the service lock).
  void Fail(absl::Status st) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!error_.ok()) return;
    // A link error means the peer is unreachable or gone: UNAVAILABLE unless it timed out
    // or refused this rank's job token (a configuration error, kept as such).
    if (st.code() != absl::StatusCode::kDeadlineExceeded &&
        st.code() != absl::StatusCode::kUnavailable &&
        st.code() != absl::StatusCode::kUnauthenticated &&
        st.code() != absl::StatusCode::kPermissionDenied) {
      st = absl::UnavailableError(st.message());
    }
    error_ = st;
    if (!closing_) on_failure_(st);
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
  grpc::ClientContext context_;
  const std::string peer_name_;
  const std::function<void(const absl::Status&)> on_failure_;
  grpc::ByteBuffer ack_;

  mutable absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);  // Front: being written.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_started_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  // Declared last, destroyed first.
  absl::Notification done_notification_;
};

class GrpcRingTransport final : public RingTransport {
 public:
  GrpcRingTransport(const GrpcRingOptions& options,
                    std::shared_ptr<CollectiveServiceImpl::Inbox> inbox)
      : options_(options), n_(static_cast<int>(options.peers.size())), inbox_(std::move(inbox)) {
    RingChunk header;
    header.set_job(options_.job);
    header.set_from_rank(options_.rank);
    header.set_to_rank((options_.rank + 1) % n_);
    header.set_world_size(n_);
    header_prefix_ = header.SerializeAsString();
    if (n_ > 1) {
      const int next = (options_.rank + 1) % n_;
      CollectiveServiceImpl* local = options_.local;
      std::shared_ptr<CollectiveServiceImpl::Inbox> in = inbox_;
      link_ = std::make_unique<OutLink>(
          MakeChannel(options_.peers[next], options_.rpc), PeerName(next), options_.job_token,
          options_.rank_token, [local, in](const absl::Status& st) { local->FailInbox(in, st); });
    }
  }

  ~GrpcRingTransport() override {
    if (link_ != nullptr) {
      // After a failure the ring is out of step: do not wait for the peer's answer.
      (void)link_->Close(failed_ || RingAborted(options_.abort)
                             ? absl::Now()
                             : absl::Now() + options_.close_timeout);
    }
    options_.local->CloseInbox(inbox_);
  }

  int rank() const override { return options_.rank; }
  int size() const override { return n_; }

  absl::Status Send(absl::Span<const char> data) override { return SendChunk(data, true); }

  absl::Status SendNoCopy(absl::Span<const char> data) override { return SendChunk(data, false); }

  absl::Status Flush(absl::Time deadline) override {
    if (link_ == nullptr) return absl::OkStatus();
    absl::Status st = link_->WaitWritten(deadline, options_.abort);
    if (!st.ok()) failed_ = true;
    return st;
  }

  absl::StatusOr<RingMessage> Recv(absl::Time deadline) override {
    absl::StatusOr<RingMessage> msg = options_.local->Receive(inbox_, deadline, options_.abort);
    if (!msg.ok()) failed_ = true;
    return msg;
  }

  std::string PeerName(int rank) const override {
    return absl::StrCat("rank ", rank, " (", options_.peers[rank], ")");
  }

  std::string kind() const override { return "grpc"; }

 private:
  // One RingChunk: header_prefix_ | seq (field 5) | data (field 15). The header is its own
  // small slice; the data is copied behind it (`copy`) or referenced in place.
  absl::Status SendChunk(absl::Span<const char> data, bool copy) {
    if (link_ == nullptr) {
      return absl::FailedPreconditionError("ring: a ring of one rank sends nothing");
    }
    const uint64_t seq = seq_++;
    const size_t data_tag = (15 << 3) | 2;
    const size_t header_size = header_prefix_.size() + 1 + VarintSize(seq) + VarintSize(data_tag) +
                               VarintSize(data.size());
    grpc_slice head = grpc_slice_malloc(header_size + (copy ? data.size() : 0));
    char* p = reinterpret_cast<char*>(GRPC_SLICE_START_PTR(head));
    std::memcpy(p, header_prefix_.data(), header_prefix_.size());
    p += header_prefix_.size();
    *p++ = static_cast<char>((5 << 3) | 0);
    p = PutVarint(seq, p);
    p = PutVarint(data_tag, p);
    p = PutVarint(data.size(), p);
    // Fill `head` before wrapping it: a small slice is inlined, i.e. its bytes live in the
    // grpc_slice struct itself, which grpc::Slice copies.
    if (copy && !data.empty()) std::memcpy(p, data.data(), data.size());
    grpc::Slice slices[2] = {grpc::Slice(head, grpc::Slice::STEAL_REF), grpc::Slice()};
    size_t count = 1;
    if (!copy && !data.empty()) {
      grpc_slice body = grpc_slice_new_with_user_data(const_cast<char*>(data.data()), data.size(),
                                                      &KeepNothing, nullptr);
      slices[1] = grpc::Slice(body, grpc::Slice::STEAL_REF);
      count = 2;
    }
    absl::Status st = link_->Send(grpc::ByteBuffer(slices, count));
    if (!st.ok()) failed_ = true;
    return st;
  }

  const GrpcRingOptions options_;
  const int n_;
  const std::shared_ptr<CollectiveServiceImpl::Inbox> inbox_;
  std::string header_prefix_;
  uint64_t seq_ = 0;
  bool failed_ = false;  // A Send or Recv failed: close without waiting.
  std::unique_ptr<OutLink> link_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RingTransport>> NewGrpcRingTransport(
    const GrpcRingOptions& options) {
  const int n = static_cast<int>(options.peers.size());
  if (options.job.empty()) return absl::InvalidArgumentError("ring: empty job name");
  if (n == 0) return absl::InvalidArgumentError("ring: no peers");
  if (options.rank < 0 || options.rank >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring: rank ", options.rank, " not in [0, ", n, ")"));
  }
  if (options.local == nullptr) {
    return absl::InvalidArgumentError("ring: no local CollectiveService");
  }
  if (!options.rank_token_hashes.empty() &&
      static_cast<int64_t>(options.rank_token_hashes.size()) != static_cast<int64_t>(n)) {
    return absl::InvalidArgumentError(absl::StrCat("ring: ", options.rank_token_hashes.size(),
                                                   " rank token hashes for ", n, " ranks"));
  }
  const int prev = (options.rank + n - 1) % n;
  ASSIGN_OR_RETURN(
      std::shared_ptr<CollectiveServiceImpl::Inbox> inbox,
      options.local->OpenInbox(
          options.job, options.rank, n, absl::StrCat("rank ", prev, " (", options.peers[prev], ")"),
          options.job_token,
          options.rank_token_hashes.empty() ? std::string() : options.rank_token_hashes[prev]));
  return std::unique_ptr<RingTransport>(new GrpcRingTransport(options, std::move(inbox)));
}

}  // namespace gradmesh
