// CollectiveServiceImpl: inboxes fed by Ring streams (see collective_service.h).
//
// Reactor life cycle. Every RingReader state change happens under the service mutex:
// `reading` is true while a read is outstanding, `finishing` once Finish is due. Whoever
// flips one of them under the lock owns the matching gRPC call (StartRead or Finish), made
// after unlocking. Finish is only called with no read outstanding, so OnDone (which deletes
// the reader) cannot run while another thread is about to start a read on it.
#include "worker/allreduce/collective_service.h"

#include <deque>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_name.h"
#include "common/status.h"
#include "rpc/grpc_status.h"
#include "worker/core/peer_token.h"

namespace gradmesh {
namespace {

constexpr size_t kMaxJobName = 256;

// Reads protobuf wire format across the slices of a received message without copying it.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>* slices) : slices_(slices) { Skip0(); }

  size_t position() const { return pos_; }
  bool AtEnd() const { return index_ >= slices_->size(); }

  bool ReadByte(uint8_t* b) {
    if (AtEnd()) return false;
    *b = (*slices_)[index_].begin()[offset_];
    Advance(1);
    return true;
  }

  bool ReadVarint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // The next `n` bytes as pieces (no copy); false if fewer remain.
  bool Take(uint64_t n, std::vector<absl::Span<const char>>* pieces) {
    while (n > 0) {
      if (AtEnd()) return false;
      const grpc::Slice& s = (*slices_)[index_];
      const size_t take = std::min<uint64_t>(n, s.size() - offset_);
      if (pieces != nullptr) {
        pieces->emplace_back(reinterpret_cast<const char*>(s.begin()) + offset_, take);
      }
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    Skip0();
  }
  // Moves past exhausted (or empty) slices.
  void Skip0() {
    while (index_ < slices_->size() && offset_ >= (*slices_)[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>* slices_;
  size_t index_ = 0, offset_ = 0, pos_ = 0;
};

// Splits a serialized RingChunk into its header fields and its `data` bytes, in place.
absl::Status ParseRingChunk(const grpc::ByteBuffer& buffer, RingChunk* header,
                            RingMessage* payload) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  if (grpc::Status st = buffer.Dump(slices.get()); !st.ok()) {
    return absl::InvalidArgumentError("ring chunk: unreadable message");
  }
  SliceCursor in(slices.get());
  payload->pieces.clear();
  while (!in.AtEnd()) {
    uint64_t tag;
    if (!in.ReadVarint(&tag)) return absl::InvalidArgumentError("ring chunk: truncated tag");
    const uint64_t field = tag >> 3;
    const uint64_t wire = tag & 7;
    uint64_t v = 0;
    if (wire == 0) {
      if (!in.ReadVarint(&v)) return absl::InvalidArgumentError("ring chunk: truncated varint");
      switch (field) {
        case 2:
          header->set_from_rank(static_cast<int32_t>(v));
          break;
        case 3:
          header->set_to_rank(static_cast<int32_t>(v));
          break;
        case 4:
          header->set_world_size(static_cast<int32_t>(v));
          break;
        case 5:
          header->set_seq(v);
          break;
        default:
          break;  // Unknown varint field: ignored.
      }
    } else if (wire == 2) {
      uint64_t len;
      if (!in.ReadVarint(&len)) return absl::InvalidArgumentError("ring chunk: truncated length");
      if (field == 1) {
        if (len > kMaxJobName) return absl::InvalidArgumentError("ring chunk: job name too long");
        std::vector<absl::Span<const char>> pieces;
        if (!in.Take(len, &pieces)) return absl::InvalidArgumentError("ring chunk: truncated job");
        std::string job;
        for (auto p : pieces) job.append(p.data(), p.size());
        header->set_job(std::move(job));
      } else if (field == 15) {
        payload->pieces.clear();  // The last occurrence wins, as in protobuf.
        if (!in.Take(len, &payload->pieces)) {
          return absl::InvalidArgumentError("ring chunk: truncated data");
        }
      } else if (!in.Take(len, nullptr)) {
        return absl::InvalidArgumentError("ring chunk: truncated field");
      }
    } else if (wire == 1 || wire == 5) {
      if (!in.Take(wire == 1 ? 8 : 4, nullptr)) {
        return absl::InvalidArgumentError("ring chunk: truncated field");
      }
    } else {
      return absl::InvalidArgumentError(absl::StrCat("ring chunk: bad wire type ", wire));
    }
  }
  payload->owner = std::move(slices);
  return absl::OkStatus();
}

// The ring's job: a job name (common/job_name.h), optionally followed by "/<sub-ring>" (the
// hierarchical backend's "/host:<host>" and "/leaders").
absl::Status CheckRingJob(const std::string& job) {
  const absl::string_view name = absl::string_view(job).substr(0, job.find('/'));
  return CheckName("ring chunk: job", name);
}

std::string StreamName(const RingChunk& h) {
  return absl::StrCat("stream from rank ", h.from_rank(), " to rank ", h.to_rank(), " of job ",
                      h.job(), " (world size ", h.world_size(), ")");
}

}  // namespace

// Fields other than the constants are guarded by the service's mu_.
class CollectiveServiceImpl::Inbox {
 public:
  Inbox(std::string job, int rank, int world_size, std::string prev_name, std::string token,
        std::string prev_hash)
      : job(std::move(job)),
        rank(rank),
        world_size(world_size),
        prev_name(std::move(prev_name)),
        token(std::move(token)),
        prev_hash(std::move(prev_hash)) {}

  const std::string job;
  const int rank;
  const int world_size;
  const std::string prev_name;
  const std::string token;      // The job token a stream must present; empty: any.
  const std::string prev_hash;  // Hash of the previous rank's token; empty: not checked.

  std::deque<RingMessage> queue;
  int64_t queued_bytes = 0;
  uint64_t next_seq = 0;
  RingReader* stream = nullptr;  // The attached stream while it lives.
  bool connected = false;        // A stream was ever attached.
  bool stream_ended = false;
  std::string end_detail;
  RingReader* paused = nullptr;  // The attached stream, when not read for lack of space.
  absl::Status failure;          // FailInbox or a protocol error of the attached stream.
  bool closed = false;
  std::string rejected;  // Why the last other stream was turned away.
  absl::CondVar cv;      // Signalled on every change above.
};

class CollectiveServiceImpl::RingReader final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  RingReader(CollectiveServiceImpl* service, grpc::CallbackServerContext* context,
             grpc::ByteBuffer* response)
      : service_(service), context_(context), response_(response) {
    const auto& md = context->client_metadata();
    if (auto it = md.find(kJobTokenMetadata); it != md.end()) {
      token = std::string(it->second.data(), it->second.size());
    }
    if (auto it = md.find(kRankTokenMetadata); it != md.end()) {
      rank_token = std::string(it->second.data(), it->second.size());
    }
    reading = true;  // No other thread knows this reader yet.
    StartRead(&buffer);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      service_->StreamEnded(this, /*read_done=*/true);
      return;
    }
    RingChunk header;
    RingMessage payload;
    absl::Status parsed = ParseRingChunk(buffer, &header, &payload);
    buffer.Clear();
    Next next;
    if (!parsed.ok()) {
      absl::MutexLock lock(&service_->mu_);
      reading = false;
      finishing = true;
      finish_status = ToGrpcStatus(parsed);
      if (inbox != nullptr && inbox->stream == this) {
        inbox->failure = absl::UnavailableError(absl::StrCat(
            "ring link from ", inbox->prev_name, " broke the protocol: ", parsed.message()));
        inbox->cv.SignalAll();
      }
      next = Next::kFinish;
    } else {
      next = service_->Deliver(this, std::move(header), std::move(payload));
    }
    Continue(next);
  }

  void OnCancel() override { service_->StreamEnded(this, /*read_done=*/false); }

  void OnDone() override {
    service_->StreamDone(this);
    delete this;
  }

  // Makes the gRPC call that `next` stands for (never under the service lock).
  void Continue(Next next) {
    if (next == Next::kRead) StartRead(&buffer);
    if (next == Next::kFinish) {
      if (finish_status.ok()) {
        RingAck ack;
        ack.set_chunks(chunks);
        ack.set_bytes(bytes);
        const std::string s = ack.SerializeAsString();
        grpc::Slice slice(s);
        *response_ = grpc::ByteBuffer(&slice, 1);
      }
      Finish(finish_status);
    }
  }

  bool cancelled() const { return context_->IsCancelled(); }

  // Guarded by the service's mu_ (except `buffer`, which only the read path touches).
  bool reading = false;
  bool finishing = false;
  grpc::Status finish_status;
  bool has_first = false;
  RingChunk first;               // Identity of the stream (no data).
  std::shared_ptr<Inbox> inbox;  // Once attached.
  bool held = false;
  RingChunk held_header;     // The first chunk while held.
  RingMessage held_payload;  // Its size() is counted in held_bytes_ while held.
  uint64_t chunks = 0, bytes = 0;
  grpc::ByteBuffer buffer;
  std::optional<std::string> token;       // The call's job token metadata; constant after creation.
  std::optional<std::string> rank_token;  // Its rank token metadata; constant after creation.

 private:
  CollectiveServiceImpl* const service_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
};

CollectiveServiceImpl::CollectiveServiceImpl() : CollectiveServiceImpl(Options()) {}
CollectiveServiceImpl::CollectiveServiceImpl(Options options) : options_(options) {}
CollectiveServiceImpl::~CollectiveServiceImpl() = default;

grpc::ServerReadReactor<grpc::ByteBuffer>* CollectiveServiceImpl::Ring(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return new RingReader(this, context, response);
}

CollectiveServiceImpl::Next CollectiveServiceImpl::Deliver(RingReader* reader, RingChunk header,
                                                           RingMessage payload) {
  absl::MutexLock lock(&mu_);
  reader->reading = false;
  auto finish = [&](const absl::Status& st) {
    reader->finishing = true;
    reader->finish_status = ToGrpcStatus(st);
    return Next::kFinish;
  };
  if (reader->finishing) return Next::kWait;  // Cancelled meanwhile: OnCancel finished it.
  if (!reader->has_first) {
    const int ws = header.world_size();
    if (absl::Status st = CheckRingJob(header.job()); !st.ok()) return finish(st);
    if (header.job().empty() || ws <= 0 || header.from_rank() < 0 || header.from_rank() >= ws ||
        header.to_rank() < 0 || header.to_rank() >= ws) {
      return finish(absl::InvalidArgumentError(
          absl::StrCat("ring chunk: bad identity: ", StreamName(header),
                       " (needs a job name, world_size > 0, from_rank and to_rank in "
                       "[0, world_size))")));
    }
    if (header.to_rank() != (header.from_rank() + 1) % ws) {
      // A rank claiming to feed a rank it does not precede in the ring.
      return finish(absl::PermissionDeniedError(
          absl::StrCat("ring: ", StreamName(header), " refused: only rank ",
                       (int64_t{header.to_rank()} + ws - 1) % ws,
                       " (its predecessor in the ring) feeds rank ", header.to_rank())));
    }
    reader->has_first = true;
    reader->first = header;
    const auto key = std::make_pair(header.job(), header.to_rank());
    auto it = inboxes_.find(key);
    if (it == inboxes_.end()) {
      if (static_cast<int>(held_.size()) >= options_.max_held_streams) {
        return finish(absl::ResourceExhaustedError(absl::StrCat(
            "ring: ", held_.size(), " streams already wait for ranks not served here; ",
            StreamName(header), " refused")));
      }
      const int64_t bytes = static_cast<int64_t>(payload.size());
      if (!held_.empty() && held_bytes_ + bytes > options_.max_held_bytes) {
        return finish(absl::ResourceExhaustedError(absl::StrCat(
            "ring: ", held_bytes_, " bytes of streams already wait for ranks not served here; ",
            StreamName(header), " refused")));
      }
      reader->held = true;
      reader->held_header = std::move(header);
      reader->held_payload = std::move(payload);
      held_bytes_ += bytes;
      held_.emplace(key, reader);
      return Next::kWait;
    }
    return AttachLocked(reader, it->second, std::move(header), std::move(payload));
  }
  const RingChunk& f = reader->first;
  Inbox* inbox = reader->inbox.get();
  if (header.job() != f.job() || header.from_rank() != f.from_rank() ||
      header.to_rank() != f.to_rank() || header.world_size() != f.world_size()) {
    absl::Status st = absl::InvalidArgumentError(
        absl::StrCat("ring chunk: ", StreamName(header), " on the ", StreamName(f)));
    if (inbox != nullptr) {
      inbox->failure = absl::UnavailableError(
          absl::StrCat("ring link from ", inbox->prev_name, " broke the protocol: ", st.message()));
      inbox->cv.SignalAll();
    }
    return finish(st);
  }
  if (inbox == nullptr) {
    // Only the first chunk is read before the inbox opens.
    return finish(absl::InternalError("ring: chunk read on a held stream"));
  }
  if (inbox->closed) {
    return finish(absl::FailedPreconditionError(
        absl::StrCat("ring: rank ", inbox->rank, " of job ", inbox->job, " has closed its inbox")));
  }
  if (header.seq() != inbox->next_seq) {
    absl::Status st = absl::InvalidArgumentError(
        absl::StrCat("ring chunk: seq ", header.seq(), " where ", inbox->next_seq,
                     " was expected on the ", StreamName(f)));
    inbox->failure = absl::UnavailableError(
        absl::StrCat("ring link from ", inbox->prev_name, " broke the protocol: ", st.message()));
    inbox->cv.SignalAll();
    return finish(st);
  }
  ++inbox->next_seq;
  return EnqueueLocked(reader, inbox, std::move(payload));
}

CollectiveServiceImpl::Next CollectiveServiceImpl::AttachLocked(RingReader* reader,
                                                                const std::shared_ptr<Inbox>& inbox,
                                                                RingChunk header,
                                                                RingMessage payload) {
  auto finish = [&](const absl::Status& st) {
    reader->finishing = true;
    reader->finish_status = ToGrpcStatus(st);
    inbox->rejected = std::string(st.message());
    return Next::kFinish;
  };
  if (inbox->closed) {
    return finish(absl::FailedPreconditionError(
        absl::StrCat("ring: rank ", inbox->rank, " of job ", inbox->job, " has closed its inbox")));
  }
  std::optional<absl::string_view> presented;
  if (reader->token.has_value()) presented = *reader->token;
  const std::string where =
      absl::StrCat("ring: ", StreamName(header), " refused by rank ", inbox->rank);
  if (absl::Status st = CheckPeerToken(inbox->token, presented, where); !st.ok()) {
    return finish(st);
  }
  std::optional<absl::string_view> rank_token;
  if (reader->rank_token.has_value()) rank_token = *reader->rank_token;
  const int prev = (inbox->rank + inbox->world_size - 1) % inbox->world_size;
  if (absl::Status st = CheckRankTokenHash(inbox->prev_hash, prev, rank_token, where); !st.ok()) {
    return finish(st);
  }
  if (inbox->connected) {
    return finish(absl::FailedPreconditionError(
        absl::StrCat("ring: ", StreamName(header), " refused: rank ", inbox->rank, " of job ",
                     inbox->job, " already has its ring link")));
  }
  if (header.world_size() != inbox->world_size) {
    return finish(absl::InvalidArgumentError(
        absl::StrCat("ring: ", StreamName(header), " refused: rank ", inbox->rank, " of job ",
                     inbox->job, " is in a ring of ", inbox->world_size)));
  }
  inbox->stream = reader;
  inbox->connected = true;
  reader->inbox = inbox;
  reader->has_first = true;
  reader->first = header;
  reader->first.clear_seq();
  // Deliver() takes it from here, with the lock already held: inline the common path.
  reader->reading = false;
  if (header.seq() != 0) {
    inbox->failure = absl::UnavailableError(absl::StrCat(
        "ring link from ", inbox->prev_name, " started at seq ", header.seq(), ", not 0"));
    inbox->cv.SignalAll();
    reader->finishing = true;
    reader->finish_status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                         "ring chunk: the first seq of a stream must be 0");
    return Next::kFinish;
  }
  inbox->next_seq = 1;
  return EnqueueLocked(reader, inbox.get(), std::move(payload));
}

CollectiveServiceImpl::Next CollectiveServiceImpl::EnqueueLocked(RingReader* reader, Inbox* inbox,
                                                                 RingMessage payload) {
  const size_t size = payload.size();
  ++reader->chunks;
  reader->bytes += size;
  inbox->queued_bytes += static_cast<int64_t>(size);
  inbox->queue.push_back(std::move(payload));
  inbox->cv.Signal();
  if (inbox->queued_bytes >= options_.inbox_bytes) {
    inbox->paused = reader;  // Backpressure: the stream is read again once Receive drains.
    return Next::kWait;
  }
  reader->reading = true;
  return Next::kRead;
}

void CollectiveServiceImpl::StreamEnded(RingReader* reader, bool read_done) {
  bool finish = false;
  {
    absl::MutexLock lock(&mu_);
    if (read_done) reader->reading = false;
    UnholdLocked(reader);
    Inbox* inbox = reader->inbox.get();
    if (inbox != nullptr && inbox->stream == reader && !inbox->stream_ended) {
      inbox->stream_ended = true;
      inbox->end_detail =
          reader->cancelled() ? "its stream was cancelled (process gone?)" : "it closed its stream";
      if (inbox->paused == reader) inbox->paused = nullptr;
      inbox->cv.SignalAll();
    }
    if (!reader->reading && !reader->finishing) {
      reader->finishing = true;
      reader->finish_status = grpc::Status::OK;
      finish = true;
    }
  }
  if (finish) reader->Continue(Next::kFinish);
}

void CollectiveServiceImpl::UnholdLocked(RingReader* reader) {
  if (!reader->held) return;
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->second == reader) {
      held_.erase(it);
      break;
    }
  }
  held_bytes_ -= static_cast<int64_t>(reader->held_payload.size());
  reader->held = false;
  reader->held_payload = RingMessage();
}

void CollectiveServiceImpl::StreamDone(RingReader* reader) {
  absl::MutexLock lock(&mu_);
  UnholdLocked(reader);
  Inbox* inbox = reader->inbox.get();
  if (inbox != nullptr) {
    if (inbox->stream == reader) {
      inbox->stream = nullptr;
      if (!inbox->stream_ended) {
        inbox->stream_ended = true;
        inbox->end_detail = "its stream ended";
        inbox->cv.SignalAll();
      }
    }
    if (inbox->paused == reader) inbox->paused = nullptr;
  }
}

absl::StatusOr<std::shared_ptr<CollectiveServiceImpl::Inbox>> CollectiveServiceImpl::OpenInbox(
    const std::string& job, int rank, int world_size, const std::string& prev_name,
    const std::string& job_token, const std::string& prev_rank_hash) {
  std::vector<std::pair<RingReader*, Next>> actions;
  std::shared_ptr<Inbox> inbox;
  {
    absl::MutexLock lock(&mu_);
    const auto key = std::make_pair(job, rank);
    if (inboxes_.count(key) > 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("ring: rank ", rank, " of job ", job, " already has an open inbox here"));
    }
    inbox = std::make_shared<Inbox>(job, rank, world_size, prev_name, job_token, prev_rank_hash);
    inboxes_[key] = inbox;
    auto range = held_.equal_range(key);
    std::vector<RingReader*> waiting;
    for (auto it = range.first; it != range.second; ++it) waiting.push_back(it->second);
    held_.erase(range.first, range.second);
    for (RingReader* reader : waiting) {
      reader->held = false;
      held_bytes_ -= static_cast<int64_t>(reader->held_payload.size());
      RingChunk header = std::move(reader->held_header);
      RingMessage payload = std::move(reader->held_payload);
      actions.emplace_back(reader,
                           AttachLocked(reader, inbox, std::move(header), std::move(payload)));
    }
  }
  for (auto& [reader, next] : actions) reader->Continue(next);
  return inbox;
}

void CollectiveServiceImpl::CloseInbox(const std::shared_ptr<Inbox>& inbox) {
  RingReader* finish = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = inboxes_.find(std::make_pair(inbox->job, inbox->rank));
    if (it != inboxes_.end() && it->second == inbox) inboxes_.erase(it);
    inbox->closed = true;
    inbox->queue.clear();
    inbox->queued_bytes = 0;
    if (inbox->paused != nullptr) {
      RingReader* r = inbox->paused;
      inbox->paused = nullptr;
      if (!r->reading && !r->finishing) {
        r->finishing = true;
        r->finish_status = grpc::Status(
            grpc::StatusCode::FAILED_PRECONDITION,
            absl::StrCat("ring: rank ", inbox->rank, " of job ", inbox->job, " closed its inbox"));
        finish = r;
      }
    }
    inbox->cv.SignalAll();
  }
  if (finish != nullptr) finish->Continue(Next::kFinish);
}

void CollectiveServiceImpl::FailInbox(const std::shared_ptr<Inbox>& inbox,
                                      const absl::Status& error) {
  absl::MutexLock lock(&mu_);
  if (inbox->failure.ok()) inbox->failure = error;
  inbox->cv.SignalAll();
}

absl::StatusOr<RingMessage> CollectiveServiceImpl::Receive(const std::shared_ptr<Inbox>& inbox,
                                                           absl::Time deadline,
                                                           const RingAbort* abort) {
  RingReader* resume = nullptr;
  RingMessage msg;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time start = absl::Now();
    while (inbox->queue.empty() && inbox->failure.ok() && !inbox->closed && !inbox->stream_ended) {
      if (RingAborted(abort)) {
        return RingAbortedError(
            absl::StrCat("ring: inbox of rank ", inbox->rank, " of job ", inbox->job));
      }
      if (inbox->cv.WaitWithDeadline(&mu_, RingAbortSlice(deadline, abort)) &&
          absl::Now() >= deadline) {
        break;
      }
    }
    if (!inbox->failure.ok()) return inbox->failure;
    if (inbox->closed) {
      return absl::CancelledError(
          absl::StrCat("ring: inbox of rank ", inbox->rank, " of job ", inbox->job, " is closed"));
    }
    if (inbox->queue.empty()) {
      if (inbox->stream_ended) {
        return absl::UnavailableError(
            absl::StrCat("ring link from ", inbox->prev_name, " ended: ", inbox->end_detail));
      }
      return absl::DeadlineExceededError(absl::StrCat(
          "nothing from ", inbox->prev_name, " within ", absl::FormatDuration(absl::Now() - start),
          inbox->connected ? "" : " (it never connected)",
          inbox->rejected.empty() ? ""
                                  : absl::StrCat("; a stream was refused: ", inbox->rejected)));
    }
    msg = std::move(inbox->queue.front());
    inbox->queue.pop_front();
    inbox->queued_bytes -= static_cast<int64_t>(msg.size());
    if (inbox->paused != nullptr && inbox->queued_bytes < options_.inbox_bytes) {
      resume = inbox->paused;
      inbox->paused = nullptr;
      resume->reading = true;
    }
  }
  if (resume != nullptr) resume->Continue(Next::kRead);
  return msg;
}

}  // namespace gradmesh
