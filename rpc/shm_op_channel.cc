#include "rpc/shm_op_channel.h"

#include <grpc/slice.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/client_callback.h>

#include <atomic>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "rpc/grpc_status.h"
#include "rpc/shm_region.h"

namespace gradmesh {
namespace {

// How often the answering thread looks at the channel's state while it waits.
constexpr absl::Duration kStateCheck = absl::Milliseconds(50);

}  // namespace

// The OpenShm call: writes the one request, reads the shard's answer, then keeps a read
// outstanding, whose end says the call (and so the channel) is gone. Every Start* is issued
// before StartCall or from a reaction, never after OnDone. OnDone only notifies `ended_`
// (shared): the object is destroyed on the channel's thread, never on gRPC's (see OpStream's
// Conn for why).
class ShmOpChannel::Control final
    : public grpc::ClientBidiReactor<ShmOpenRequest, ShmOpenResponse> {
 public:
  Control(ParameterService::Stub* stub, const Options& options, size_t area_bytes) {
    for (const auto& [key, value] : options.metadata) ctx_.AddMetadata(key, value);
    request_.set_area_bytes(static_cast<int64_t>(area_bytes));
    request_.set_job(options.job);
    stub->async()->OpenShm(&ctx_, this);
    StartWrite(&request_);
    StartRead(&answer_);
    StartCall();
  }

  // The shard's answer, once it came (false: the call ended or `timeout` passed first; *why
  // says which, with the shard's status).
  bool WaitAnswer(absl::Duration timeout, ShmOpenResponse* answer, grpc::Status* why) {
    if (!answered_.WaitForNotificationWithTimeout(timeout)) {
      *why =
          grpc::Status(grpc::StatusCode::UNAVAILABLE,
                       absl::StrCat("no answer to OpenShm within ", absl::FormatDuration(timeout)));
      return false;
    }
    {
      absl::MutexLock lock(&mu_);
      if (answer_ok_) {
        *answer = answer_;
        return true;
      }
    }
    ended_->WaitForNotification();  // The call's status says why.
    absl::MutexLock lock(&mu_);
    *why = status_;
    return false;
  }

  bool gone() const { return gone_.load(); }
  // Ends the call (a wait for the answer returns); Close also waits for gRPC to be done.
  void Cancel() { ctx_.TryCancel(); }
  void Close() {
    ctx_.TryCancel();
    ended_->WaitForNotification();
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (!answered_.HasBeenNotified()) {
      answer_ok_ = ok;
      answered_.Notify();
      if (ok) {
        StartRead(&rest_);  // Ends when the call does.
        return;
      }
    }
    gone_.store(true);
  }

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      status_ = status;
      gone_.store(true);
      if (!answered_.HasBeenNotified()) answered_.Notify();
    }
    const std::shared_ptr<absl::Notification> ended = ended_;
    ended->Notify();  // *this may be destroyed from here on.
  }

 private:
  grpc::ClientContext ctx_;
  ShmOpenRequest request_;
  ShmOpenResponse rest_;
  absl::Notification answered_;
  const std::shared_ptr<absl::Notification> ended_ = std::make_shared<absl::Notification>();
  std::atomic<bool> gone_{false};
  mutable absl::Mutex mu_;
  ShmOpenResponse answer_ ABSL_GUARDED_BY(mu_);
  bool answer_ok_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// One open channel: the OpenShm call and the mapped region.
struct ShmOpChannel::Conn {
  std::unique_ptr<Control> control;
  std::unique_ptr<ShmRegion> region;
  uint32_t seq = 0;                 // Of the last request sent (under the channel's mu_).
  std::atomic<bool> broken{false};  // Abort, or a bad answer: close it.
  std::atomic<bool> closed{false};  // Close has run.
  // The last answer is still read in place (its slice is alive): no request until it is not,
  // since the next answer would overwrite it.
  std::atomic<bool> lent{false};
  bool batches = false;  // The shard takes batches (ShmOpenResponse.batches).

  bool Usable() const {
    return !broken.load() && !control->gone() && region->header()->closed.load() == 0;
  }
  void Close() {
    if (closed.exchange(true)) return;
    region->header()->closed.store(1);
    ShmWake(&region->header()->request_seq);
    control->Close();
  }
};

ShmOpChannel::ShmOpChannel(ParameterService::Stub* stub, Options options)
    : stub_(stub),
      options_(std::move(options)),
      area_bytes_(options_.area_bytes),
      spin_(options_.spin) {
  absl::MutexLock lock(&mu_);
  want_open_ = true;  // Opened ahead of the first Call, which would otherwise take the Stream.
  thread_ = std::thread([this] { Run(); });
}

ShmOpChannel::~ShmOpChannel() {
  std::shared_ptr<Conn> conn;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    conn = conn_;
    if (in_flight_.has_value()) in_flight_->conn->broken.store(true);
    if (opening_ != nullptr) opening_->control->Cancel();  // An open in progress ends now.
  }
  if (conn != nullptr) ShmWake(&conn->region->header()->response_seq);
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  if (conn_ != nullptr) conn_->Close();
  conn_.reset();
}

absl::StatusOr<std::shared_ptr<ShmOpChannel::Conn>> ShmOpChannel::Open(size_t area_bytes) {
  auto conn = std::make_shared<Conn>();
  conn->control = std::make_unique<Control>(stub_, options_, area_bytes);
  {
    absl::MutexLock lock(&mu_);
    opening_ = stop_ ? nullptr : conn;
    if (stop_) conn->control->Cancel();
  }
  ShmOpenResponse answer;
  grpc::Status why;
  const bool answered = conn->control->WaitAnswer(options_.open_timeout, &answer, &why);
  {
    absl::MutexLock lock(&mu_);
    opening_ = nullptr;
  }
  if (!answered) {
    conn->control->Close();
    return FromGrpcStatus(why);
  }
  absl::StatusOr<std::unique_ptr<ShmRegion>> region =
      answer.area_bytes() < static_cast<int64_t>(area_bytes)
          ? absl::FailedPreconditionError(absl::StrCat("shared memory: the shard granted areas of ",
                                                       answer.area_bytes(), " bytes, under the ",
                                                       area_bytes, " asked"))
          : ShmRegion::Attach(answer.pid(), answer.fd(), answer.nonce(),
                              static_cast<size_t>(answer.area_bytes()));
  if (!region.ok()) {
    conn->control->Close();
    return region.status();
  }
  conn->region = std::move(region).value();
  conn->batches = answer.batches();
  conn->seq = conn->region->header()->request_seq.load();
  LogInfo(options_.logger, "shm_channel_opened",
          {{"shard", options_.shard}, {"area_bytes", absl::StrCat(answer.area_bytes())}});
  return conn;
}

void ShmOpChannel::DisableLocked(const absl::Status& why) {
  if (disabled_) return;
  disabled_ = true;
  LogInfo(options_.logger, "shm_unavailable",
          {{"shard", options_.shard}, {"reason", why.ToString()}, {"using", "stream"}});
}

bool ShmOpChannel::Call(StreamOp op, const grpc::ByteBuffer& body, grpc::ByteBuffer* response,
                        Done* done) {
  std::vector<Item> one(1);
  one[0] = Item{op, &body, response, std::move(*done)};
  if (CallBatch(&one)) return true;
  *done = std::move(one[0].done);
  return false;
}

bool ShmOpChannel::CallBatch(std::vector<Item>* items) {
  if (items->empty() || items->size() > kMaxStreamBatch) return false;
  absl::MutexLock lock(&mu_);
  if (disabled_ || stop_ || in_flight_.has_value()) return false;
  if (conn_ != nullptr && conn_->lent.load()) return false;
  if (conn_ == nullptr || !conn_->Usable()) {
    want_open_ = true;  // The thread closes a broken channel and opens a new one when due.
    return false;
  }
  if (items->size() > 1 && !conn_->batches) return false;  // A shard from before batches.
  Pending p{conn_, 0, items->size() > 1, {}};
  std::vector<grpc::ByteBuffer> messages;
  for (const Item& item : *items) {
    p.calls.push_back(Outstanding{next_call_++, item.response, nullptr});
    messages.push_back(FrameStreamRequest(p.calls.back().call, item.op, *item.body));
  }
  // Each push's data float-aligned in the area: the shard reads it in place.
  const grpc::ByteBuffer framed = JoinAlignedStreamRequests(messages);
  if (!CopyBufferTo(framed, conn_->region->request_area(), conn_->region->area_bytes())) {
    return false;  // Too large for the area: the caller sends it over the Stream.
  }
  ShmHeader* h = conn_->region->header();
  h->request_bytes.store(framed.Length(), std::memory_order_relaxed);
  p.seq = ++conn_->seq;
  h->request_seq.store(p.seq, std::memory_order_release);
  ShmWake(&h->request_seq);
  for (size_t i = 0; i < items->size(); ++i) p.calls[i].done = std::move((*items)[i].done);
  in_flight_ = std::move(p);
  return true;
}

size_t ShmOpChannel::area_bytes() const {
  absl::MutexLock lock(&mu_);
  return conn_ != nullptr && conn_->Usable() ? conn_->region->area_bytes() : 0;
}

void ShmOpChannel::Abort() {
  absl::MutexLock lock(&mu_);
  if (!in_flight_.has_value()) return;
  in_flight_->conn->broken.store(true);
  ShmWake(&in_flight_->conn->region->header()->response_seq);
}

int64_t ShmOpChannel::opened() const {
  absl::MutexLock lock(&mu_);
  return opened_;
}

bool ShmOpChannel::disabled() const {
  absl::MutexLock lock(&mu_);
  return disabled_;
}

void ShmOpChannel::Run() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ShmOpChannel* c) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return c->stop_ || c->in_flight_.has_value() || (c->want_open_ && !c->disabled_);
          },
          this));
      if (!in_flight_.has_value() && stop_) return;
      if (!in_flight_.has_value()) {
        mu_.Unlock();
        Reopen();
        mu_.Lock();
        continue;
      }
    }
    Answer();
  }
}

void ShmOpChannel::Reopen() {
  std::shared_ptr<Conn> old;
  size_t area;
  absl::Time due;
  {
    absl::MutexLock lock(&mu_);
    if (conn_ != nullptr && !conn_->Usable()) old = std::move(conn_);
    area = area_bytes_;
    due = next_open_;
  }
  if (old != nullptr) old->Close();
  {
    // At most one try a second; Stop ends the wait.
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithDeadline(absl::Condition(&stop_), due);
    if (stop_ || conn_ != nullptr) {
      want_open_ = false;
      return;
    }
  }
  absl::StatusOr<std::shared_ptr<Conn>> conn = Open(area);
  absl::MutexLock lock(&mu_);
  want_open_ = false;
  if (conn.ok()) {
    conn_ = std::move(conn).value();
    ++opened_;
    return;
  }
  next_open_ = absl::Now() + absl::Seconds(1);
  const absl::StatusCode code = conn.status().code();
  // Refusals that another try would meet again turn the channel off.
  if (code == absl::StatusCode::kFailedPrecondition || code == absl::StatusCode::kUnimplemented ||
      code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kPermissionDenied ||
      code == absl::StatusCode::kUnauthenticated) {
    DisableLocked(conn.status());
  }
}

void ShmOpChannel::Answer() {
  std::shared_ptr<Conn> conn;
  uint32_t seq;
  {
    absl::MutexLock lock(&mu_);
    conn = in_flight_->conn;
    seq = in_flight_->seq;
  }
  ShmHeader* h = conn->region->header();
  bool answered = false;
  const absl::Time start = absl::Now();
  const absl::Time spin_until = start + spin_.SpinFor();
  while (true) {
    const uint32_t seen = h->response_seq.load(std::memory_order_acquire);
    if (seen == seq) {
      answered = true;
      break;
    }
    if (!conn->Usable()) break;
    if (absl::Now() < spin_until) {
      SpinYield();
    } else {
      ShmWait(&h->response_seq, seen, kStateCheck);
    }
  }
  spin_.Record(absl::Now() - start);
  Pending p;
  {
    // in_flight_ keeps its channel until reset: the destructor and Abort break it through it.
    absl::MutexLock lock(&mu_);
    p.conn = in_flight_->conn;
    p.seq = in_flight_->seq;
    p.batch = in_flight_->batch;
    p.calls = std::move(in_flight_->calls);
  }
  const std::vector<grpc::Status> statuses = Complete(&p, answered);
  std::shared_ptr<Conn> closing;
  {
    absl::MutexLock lock(&mu_);
    in_flight_.reset();
    if (!p.conn->Usable() && conn_ == p.conn) closing = std::move(conn_);
  }
  if (closing != nullptr) closing->Close();  // Off the lock: it waits for the call's end.
  for (size_t i = 0; i < p.calls.size(); ++i) p.calls[i].done(statuses[i]);
}

std::vector<grpc::Status> ShmOpChannel::Complete(Pending* p, bool answered) {
  const std::string where = absl::StrCat("shared-memory channel to ", options_.shard);
  const size_t n = p->calls.size();
  for (Outstanding& c : p->calls) *c.response = grpc::ByteBuffer();
  if (!answered) {
    p->conn->broken.store(true);
    return std::vector<grpc::Status>(
        n, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(where, " closed before the answer came")));
  }
  const ShmHeader* h = p->conn->region->header();
  const uint64_t bytes = h->response_bytes.load(std::memory_order_relaxed);
  if (bytes == kShmAnswerTooLarge) {
    p->conn->broken.store(true);
    absl::MutexLock lock(&mu_);
    area_bytes_ = std::min(2 * p->conn->region->area_bytes(), kShmMaxAreaBytes);
    return std::vector<grpc::Status>(
        n, grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat(where, ": the answer did not fit the area of ",
                                     p->conn->region->area_bytes(), " bytes; reopening with ",
                                     area_bytes_)));
  }
  absl::Status st;
  std::vector<grpc::Status> statuses;
  if (bytes > p->conn->region->area_bytes()) {
    st = absl::DataLossError(absl::StrCat("an answer of ", bytes, " bytes, past the area"));
  } else {
    // The answer is read where it lies: the slice keeps the region mapped and the area lent
    // until the caller drops the last reference to it (no request is sent meanwhile).
    p->conn->lent.store(true);
    grpc::Slice in_place(grpc_slice_new_with_user_data(
                             p->conn->region->response_area(), static_cast<size_t>(bytes),
                             +[](void* keep) {
                               auto* conn = static_cast<std::shared_ptr<Conn>*>(keep);
                               (*conn)->lent.store(false);
                               delete conn;
                             },
                             new std::shared_ptr<Conn>(p->conn)),
                         grpc::Slice::STEAL_REF);
    st = ReadAnswers(grpc::ByteBuffer(&in_place, 1), p, &statuses);
  }
  if (!st.ok()) {
    p->conn->broken.store(true);
    return std::vector<grpc::Status>(
        n, grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat(where, ": ", st.message())));
  }
  return statuses;
}

absl::Status ShmOpChannel::ReadAnswers(const grpc::ByteBuffer& whole, Pending* p,
                                       std::vector<grpc::Status>* statuses) {
  std::vector<grpc::ByteBuffer> parts;
  bool batch = false;
  if (absl::Status st = SplitStreamBatch(whole, kMaxStreamBatch, &parts, &batch); !st.ok()) {
    return st;
  }
  if (!batch) parts.push_back(whole);
  std::vector<StreamResponseHead> heads(parts.size());
  std::vector<grpc::ByteBuffer> bodies(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    if (absl::Status st = SplitStreamResponse(parts[i], &heads[i], &bodies[i]); !st.ok()) {
      return st;
    }
  }
  const size_t n = p->calls.size();
  // A request the shard refused whole (it could not decode it) has one error answer, call 0.
  if (!batch && heads[0].call == 0 && heads[0].code != 0) {
    statuses->assign(n,
                     grpc::Status(static_cast<grpc::StatusCode>(heads[0].code), heads[0].message));
    return absl::OkStatus();
  }
  // Answers come in the request's order (one request at a time): the call ids must agree.
  if (parts.size() != n || batch != p->batch) {
    return absl::DataLossError(absl::StrCat(parts.size(), " answers to ", n, " calls"));
  }
  for (size_t i = 0; i < n; ++i) {
    if (heads[i].call != p->calls[i].call) {
      return absl::DataLossError(
          absl::StrCat("the answer to call ", heads[i].call, " for call ", p->calls[i].call));
    }
  }
  statuses->clear();
  for (size_t i = 0; i < n; ++i) {
    *p->calls[i].response = std::move(bodies[i]);
    statuses->emplace_back(static_cast<grpc::StatusCode>(heads[i].code), heads[i].message);
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
