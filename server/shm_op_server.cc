#include "server/shm_op_server.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/gradmesh.pb.h"
#include "rpc/tensor_wire.h"

namespace gradmesh {
namespace {

// What the serving thread and an operation's completion share: the completion may run on
// another thread (a sync push released by another worker's push) and outlive the wait.
struct OpState {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  StreamResponse response;  // Filled by the shard before `done`.
};

// How often a thread waiting for a request or for an operation's completion looks at stop_.
constexpr absl::Duration kStopCheck = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::unique_ptr<ShmOpServer>> ShmOpServer::Start(Shard* shard, Options options) {
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Create(options.area_bytes);
  if (!region.ok()) return region.status();
  return std::unique_ptr<ShmOpServer>(
      new ShmOpServer(shard, std::move(options), std::move(region).value()));
}

ShmOpServer::ShmOpServer(Shard* shard, Options options, std::unique_ptr<ShmRegion> region)
    : shard_(shard),
      options_(std::move(options)),
      region_(std::move(region)),
      spin_(options_.spin),
      fd_(region_->fd()),
      request_copy_(new char[region_->area_bytes()]) {
  thread_ = std::thread([this] { Run(); });
}

ShmOpServer::~ShmOpServer() {
  stop_.store(true);
  ShmHeader* h = region_->header();
  h->closed.store(1);
  // The thread waits on request_seq: changing the word makes a wait that starts after stop_
  // was checked return at once (a wake-up alone could come before it).
  h->request_seq.fetch_add(1);
  ShmWake(&h->request_seq);
  {
    absl::MutexLock lock(&cancel_mu_);
    if (cancel_ != nullptr) cancel_->Cancel();  // A waiting operation completes now.
  }
  thread_.join();
  ShmWake(&h->response_seq);  // A worker still waiting sees `closed`.
}

void ShmOpServer::Run() {
  ShmHeader* h = region_->header();
  // The region is new: 0 is the number before the first request (reading the word here could
  // already see the first request if the worker was quick, which would then never be served).
  uint32_t seen = 0;
  const absl::Time attach_by = absl::Now() + kShmAttachWindow;
  absl::Time idle_since = absl::Now();
  absl::Time spin_until = idle_since + spin_.SpinFor();
  while (!stop_.load() && h->closed.load() == 0) {
    const uint32_t seq = h->request_seq.load(std::memory_order_acquire);
    if (seq == seen) {
      if (absl::Now() < spin_until) {
        SpinYield();
      } else {
        if (region_->fd() >= 0 && absl::Now() > attach_by) region_->CloseFd();
        ShmWait(&h->request_seq, seen, kStopCheck);
      }
      continue;
    }
    if (stop_.load()) break;
    seen = seq;
    region_->CloseFd();  // The worker has mapped the region: nobody else may open it now.
    spin_.Record(absl::Now() - idle_since);
    const uint64_t bytes = h->request_bytes.load(std::memory_order_relaxed);  // Read once.
    if (bytes > region_->area_bytes()) {
      LogWarning(options_.logger, "shm_channel_closed",
                 {{"peer", options_.peer},
                  {"reason", absl::StrCat("request of ", bytes, " bytes past the area of ",
                                          region_->area_bytes())}});
      break;
    }
    // The request is copied out before anything reads it: the worker may change the area
    // meanwhile, and the decoder reads its input more than once (chunk limit, then content).
    std::memcpy(request_copy_.get(), region_->request_area(), static_cast<size_t>(bytes));
    grpc::ByteBuffer answer = Serve(bytes, seq);
    // Closing: the operation may have been withdrawn (CANCELLED, nothing applied). Its worker
    // sees the channel close instead, UNAVAILABLE, and retries it as after a broken Stream.
    if (stop_.load()) break;
    const uint64_t length = CopyBufferTo(answer, region_->response_area(), region_->area_bytes())
                                ? answer.Length()
                                : kShmAnswerTooLarge;
    h->response_bytes.store(length, std::memory_order_relaxed);
    h->response_seq.store(seq, std::memory_order_release);
    ShmWake(&h->response_seq);
    served_.fetch_add(1);
    idle_since = absl::Now();
    spin_until = idle_since + spin_.SpinFor();
  }
  h->closed.store(1);
  ShmWake(&h->response_seq);
}

grpc::ByteBuffer ShmOpServer::Serve(uint64_t bytes, uint32_t seq) {
  grpc::Slice slice(request_copy_.get(), static_cast<size_t>(bytes), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer in(&slice, 1);
  StreamRequest request;
  DenseChunks dense;
  auto state = std::make_shared<OpState>();
  const int64_t max_chunks = shard_->limits().max_chunks_per_job;
  absl::Status st = DecodeStreamRequest(in, &request, &dense, max_chunks);
  const std::string where = absl::StrCat("OpenShm: request ", seq);
  if (!st.ok()) {
    st = absl::InvalidArgumentError(
        st.code() == absl::StatusCode::kInvalidArgument
            ? absl::StrCat(where, ": more than ", max_chunks,
                           " chunks, more than a job has (--max_chunks_per_job)")
            : absl::StrCat(where, ": the request is not a StreamRequest: ", st.message()));
  } else if (request.batch_size() > 0) {
    st = absl::InvalidArgumentError(
        absl::StrCat(where, ": a batch; a shared-memory channel carries one operation at a time"));
  } else if (request.op_case() == StreamRequest::OP_NOT_SET) {
    st = absl::InvalidArgumentError(
        absl::StrCat(where, " (call ", request.call(), ") carries neither a push nor a pull"));
  } else if (options_.tokens != nullptr) {
    st = options_.tokens->Check(request.has_push() ? request.push().job() : request.pull().job(),
                                options_.token);
  }
  if (st.ok()) {
    WaitCancel cancel;
    {
      absl::MutexLock lock(&cancel_mu_);
      cancel_ = &cancel;
      if (stop_.load()) cancel.Cancel();
    }
    if (request.has_push()) {
      shard_->PushAsync(
          request.push(),
          [state](absl::StatusOr<PushResponse> result) {
            absl::MutexLock lock(&state->mu);
            if (result.ok()) *state->response.mutable_push() = std::move(result).value();
            state->status = result.status();
            state->done = true;
          },
          &cancel, &dense);
    } else {
      shard_->PullAsync(
          request.pull(), state->response.mutable_pull(),
          [state](absl::Status result) {
            absl::MutexLock lock(&state->mu);
            state->status = std::move(result);
            state->done = true;
          },
          &cancel);
    }
    {
      absl::MutexLock lock(&state->mu);
      state->mu.Await(absl::Condition(&state->done));  // ~ShmOpServer cancels a wait.
      st = state->status;
    }
    absl::MutexLock lock(&cancel_mu_);
    cancel_ = nullptr;
  }
  StreamResponse& response = state->response;
  if (!st.ok()) {
    response.Clear();
    response.set_code(static_cast<int32_t>(st.code()));
    response.set_message(std::string(st.message()));
  } else if (request.has_push() && !response.has_push()) {
    response.mutable_push();  // The oneof says which operation this answers.
  }
  response.set_call(request.call());
  return EncodeStreamResponse(&response);
}

}  // namespace gradmesh
