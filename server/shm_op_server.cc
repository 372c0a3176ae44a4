#include "server/shm_op_server.h"

#include <cstring>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "proto/gradmesh.pb.h"
#include "rpc/tensor_wire.h"

namespace gradmesh {

// One operation of a request: what the serving thread and its completion share. The
// completion may run on another thread (a sync push released by another worker's push); it
// fills `response` and `status`, then counts itself done in the request's Tally, after which
// it touches neither.
struct ShmOpServer::Op {
  StreamRequest request;
  DenseChunks dense;  // Its push's raw chunk data (rpc/tensor_wire.h DecodeStreamRequest).
  StreamResponse response;
  absl::Status status;
  WaitCancel cancel;
};

// Shared with the completions: the last one may still be unlocking `mu` when the serving
// thread goes on.
struct ShmOpServer::Tally {
  absl::Mutex mu;
  size_t left ABSL_GUARDED_BY(mu) = 0;
  size_t held ABSL_GUARDED_BY(mu) = 0;  // Bytes of the answers of those completed.
};

namespace {

// How often a thread waiting for a request looks at stop_.
constexpr absl::Duration kStopCheck = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::unique_ptr<ShmOpServer>> ShmOpServer::Start(Shard* shard, Options options) {
  // The region (a header page and two page-rounded areas) and the shard's copy of a request
  // count against --max_memory_bytes while the channel is open: a worker cannot grow the
  // shard past it by opening channels.
  const int64_t page = static_cast<int64_t>(kShmHeaderBytes);
  const int64_t area = (static_cast<int64_t>(options.area_bytes) + page - 1) / page * page;
  const int64_t bytes = page + 3 * area + static_cast<int64_t>(kShmAlignment);
  absl::StatusOr<MemoryReservation> memory = shard->ReserveBytes(
      bytes,
      absl::StrCat("OpenShm: a shared-memory channel with two ", FormatBytes(area), " areas"));
  if (!memory.ok()) return memory.status();
  absl::StatusOr<std::unique_ptr<ShmRegion>> region = ShmRegion::Create(options.area_bytes);
  if (!region.ok()) return region.status();
  return std::unique_ptr<ShmOpServer>(new ShmOpServer(
      shard, std::move(options), std::move(region).value(), std::move(memory).value()));
}

ShmOpServer::ShmOpServer(Shard* shard, Options options, std::unique_ptr<ShmRegion> region,
                         MemoryReservation memory)
    : shard_(shard),
      options_(std::move(options)),
      memory_(std::move(memory)),
      region_(std::move(region)),
      spin_(options_.spin),
      fd_(region_->fd()),
      request_copy_(new char[region_->area_bytes() + kShmAlignment]),
      // 64-byte aligned, as the worker aligns a push's data from the request's start.
      request_at_(
          request_copy_.get() +
          (kShmAlignment - reinterpret_cast<uintptr_t>(request_copy_.get()) % kShmAlignment) %
              kShmAlignment) {
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
    stopping_ = true;
    for (WaitCancel* c : cancels_) c->Cancel();  // Waiting operations complete now.
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
    // The copy is scanned for NaN/Inf on the way, so that a push's data is not read again.
    CopyAndScan(region_->request_area(), request_at_, static_cast<size_t>(bytes), &scanned_);
    int64_t operations = 0;
    grpc::ByteBuffer answer = Serve(bytes, seq, &operations);
    // Closing: operations may have been withdrawn (CANCELLED, nothing applied). Its worker
    // sees the channel close instead, UNAVAILABLE, and retries it as after a broken Stream.
    if (stop_.load()) break;
    const uint64_t length = CopyBufferTo(answer, region_->response_area(), region_->area_bytes())
                                ? answer.Length()
                                : kShmAnswerTooLarge;
    h->response_bytes.store(length, std::memory_order_relaxed);
    h->response_seq.store(seq, std::memory_order_release);
    ShmWake(&h->response_seq);
    served_.fetch_add(operations);
    idle_since = absl::Now();
    spin_until = idle_since + spin_.SpinFor();
  }
  h->closed.store(1);
  ShmWake(&h->response_seq);
}

void ShmOpServer::Completed(Op* op, const std::shared_ptr<Tally>& tally, absl::Status status) {
  const size_t bytes = status.ok() ? op->response.ByteSizeLong() : 0;
  absl::MutexLock lock(&tally->mu);
  op->status = std::move(status);
  tally->held += bytes;
  --tally->left;
}

grpc::ByteBuffer ShmOpServer::AnswerOf(Op* op) {
  StreamResponse& response = op->response;
  if (!op->status.ok()) {
    response.Clear();
    response.set_code(static_cast<int32_t>(op->status.code()));
    response.set_message(std::string(op->status.message()));
  } else if (op->request.has_push() && !response.has_push()) {
    response.mutable_push();  // The oneof says which operation this answers.
  }
  response.set_call(op->request.call());
  return EncodeStreamResponse(&response);
}

grpc::ByteBuffer ShmOpServer::Serve(uint64_t bytes, uint32_t seq, int64_t* operations) {
  grpc::Slice slice(request_at_, static_cast<size_t>(bytes), grpc::Slice::STATIC_SLICE);
  const grpc::ByteBuffer in(&slice, 1);
  std::vector<std::unique_ptr<Op>> ops;
  bool batch = false;
  if (absl::Status st = Decode(in, absl::StrCat("OpenShm: request ", seq), &ops, &batch);
      !st.ok()) {
    *operations = 1;
    StreamResponse refused;  // Call 0: it answers the request, whatever its calls were.
    refused.set_code(static_cast<int32_t>(st.code()));
    refused.set_message(std::string(st.message()));
    return EncodeStreamResponse(&refused);
  }
  RunAll(ops);
  *operations = static_cast<int64_t>(ops.size());
  if (!batch) return AnswerOf(ops[0].get());
  std::vector<grpc::Slice> slices;
  for (const std::unique_ptr<Op>& op : ops) AppendStreamBatchElement(AnswerOf(op.get()), &slices);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status ShmOpServer::Decode(const grpc::ByteBuffer& in, const std::string& where,
                                 std::vector<std::unique_ptr<Op>>* ops, bool* batch) const {
  std::vector<grpc::ByteBuffer> parts;
  if (absl::Status st = SplitStreamBatch(in, kMaxStreamBatch, &parts, batch); !st.ok()) {
    return UndecodableRequest(st, where, "StreamRequest", 0);
  }
  if (!*batch) parts.push_back(in);
  const int64_t max_chunks = shard_->limits().max_chunks_per_job;
  int64_t chunks = 0;  // One budget for the whole request, as on the Stream.
  absl::flat_hash_set<uint64_t> calls;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string at =
        *batch ? absl::StrCat(where, " (batch element ", i + 1, " of ", parts.size(), ")") : where;
    auto op = std::make_unique<Op>();
    // The copy stays unchanged until every operation of the request has completed: aligned
    // raw data in it is referenced rather than copied again.
    if (absl::Status st =
            DecodeStreamRequest(parts[i], &op->request, &op->dense, max_chunks - chunks, &scanned_);
        !st.ok()) {
      return UndecodableRequest(st, at, "StreamRequest", max_chunks);
    }
    const StreamRequest& r = op->request;
    if (r.has_push()) chunks += r.push().chunks_size();
    if (r.batch_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, " sets batch (field ", kStreamBatchField,
          ") beside other fields, or inside a batch: a batch message carries nothing else"));
    }
    if (r.op_case() == StreamRequest::OP_NOT_SET) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, " (call ", r.call(), ") carries neither a push nor a pull"));
    }
    if (!calls.insert(r.call()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, " reuses call id ", r.call(), " of the same batch"));
    }
    ops->push_back(std::move(op));
  }
  return absl::OkStatus();
}

void ShmOpServer::RunAll(const std::vector<std::unique_ptr<Op>>& ops) {
  auto tally = std::make_shared<Tally>();
  {
    absl::MutexLock lock(&tally->mu);
    tally->left = ops.size();
  }
  {
    absl::MutexLock lock(&cancel_mu_);
    for (const std::unique_ptr<Op>& op : ops) {
      cancels_.push_back(&op->cancel);
      if (stopping_) op->cancel.Cancel();
    }
  }
  for (const std::unique_ptr<Op>& owned : ops) {
    Op* op = owned.get();
    const StreamRequest& r = op->request;
    {
      // The answers must fit the response area together: once those held pass it, the rest
      // are not started (a batch of many pulls would otherwise hold many copies of a job).
      absl::ReleasableMutexLock lock(&tally->mu);
      if (tally->held > region_->area_bytes()) {
        lock.Release();
        Completed(op, tally,
                  absl::ResourceExhaustedError(absl::StrCat(
                      "OpenShm: call ", r.call(), " not started: the answers before it already ",
                      "pass the response area of ", region_->area_bytes(), " bytes")));
        continue;
      }
    }
    if (options_.tokens != nullptr) {
      absl::Status st =
          options_.tokens->Check(r.has_push() ? r.push().job() : r.pull().job(), options_.token);
      if (!st.ok()) {
        Completed(op, tally, std::move(st));
        continue;
      }
    }
    if (r.has_push()) {
      shard_->PushAsync(
          r.push(),
          [op, tally](absl::StatusOr<PushResponse> result) {
            if (result.ok()) *op->response.mutable_push() = std::move(result).value();
            Completed(op, tally, result.status());
          },
          &op->cancel, &op->dense);
    } else {
      shard_->PullAsync(
          r.pull(), op->response.mutable_pull(),
          [op, tally](absl::Status st) { Completed(op, tally, std::move(st)); }, &op->cancel);
    }
  }
  {
    absl::MutexLock lock(&tally->mu);
    tally->mu.Await(absl::Condition(
        +[](size_t* left) { return *left == 0; }, &tally->left));  // ~ShmOpServer cancels waits.
  }
  absl::MutexLock lock(&cancel_mu_);
  cancels_.clear();
}

}  // namespace gradmesh
