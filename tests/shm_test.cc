// ParameterService.OpenShm over real gRPC on 127.0.0.1, driven raw: what a worker that does
// not follow the protocol (or writes garbage into the region) can and cannot do to a shard.
// A request that does not decode is answered INVALID_ARGUMENT and the channel goes on; a length
// past the area closes the channel; an answer larger than the area is flagged, not written; a
// worker that goes away withdraws its waiting push; bad area sizes and a full shard are
// refused, and the worker's client then keeps to the Stream. The shard keeps serving through
// all of it and changes only through valid operations.
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "rpc/shm_op_channel.h"
#include "rpc/shm_region.h"
#include "rpc/tensor_wire.h"
#include "tests/testing/loopback.h"

namespace gradmesh {
namespace {

using namespace loopback;  // NOLINT: test helpers.

JobLayout Layout(const std::string& job, int32_t num_workers = 1,
                 const std::string& consistency = "async") {
  JobLayout l;
  l.job = job;
  l.tensors = {Tensor("a", {10}), Tensor("c", {3001})};
  l.chunk_elems = 1000;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(0.5);
  l.num_workers = num_workers;
  l.consistency = consistency;
  l.barrier_timeout_s = 60;
  return l;
}

// A channel opened by hand: the OpenShm call and the mapped region.
struct RawChannel {
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<ShmOpenRequest, ShmOpenResponse>> call;
  std::unique_ptr<ShmRegion> region;
  ShmOpenResponse answer;
  uint32_t seq = 0;

  // Writes `bytes` as the next request and waits (up to 10 s) for its answer: the answer's
  // bytes, or nullopt-like "" with *closed set if the shard closed the channel instead.
  std::string Exchange(const std::string& bytes, bool* closed, uint64_t length_override = 0) {
    ShmHeader* h = region->header();
    std::memcpy(region->request_area(), bytes.data(), bytes.size());
    h->request_bytes.store(length_override != 0 ? length_override : bytes.size());
    h->request_seq.store(++seq);
    ShmWake(&h->request_seq);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (h->response_seq.load() != seq && h->closed.load() == 0 && absl::Now() < give_up) {
      ShmWait(&h->response_seq, h->response_seq.load(), absl::Milliseconds(20));
    }
    *closed = h->response_seq.load() != seq;
    if (*closed) return "";
    const uint64_t n = h->response_bytes.load();
    if (n == kShmAnswerTooLarge) return "too large";
    return std::string(region->response_area(), n);
  }

  void Close() {
    if (call == nullptr) return;
    call->WritesDone();
    (void)call->Finish();
    call.reset();
  }
};

// Opens a channel for `job` with areas of `area_bytes` (and the job token, if any); the status
// of the call if the shard refused it.
absl::StatusOr<RawChannel> OpenRaw(Stub* stub, int64_t area_bytes, const std::string& job = "raw",
                                   const std::string& token = "") {
  RawChannel c;
  c.ctx = std::make_unique<grpc::ClientContext>();
  if (!token.empty()) c.ctx->AddMetadata("x-gradmesh-job-token", token);
  c.call = stub->OpenShm(c.ctx.get());
  ShmOpenRequest request;
  request.set_area_bytes(area_bytes);
  request.set_job(job);
  if (!c.call->Write(request) || !c.call->Read(&c.answer)) {
    c.call->WritesDone();
    const grpc::Status st = c.call->Finish();
    return absl::Status(static_cast<absl::StatusCode>(st.error_code()), st.error_message());
  }
  ASSIGN_OR_RETURN(c.region, ShmRegion::Attach(c.answer.pid(), c.answer.fd(), c.answer.nonce(),
                                               static_cast<size_t>(c.answer.area_bytes())));
  return c;
}

std::string PullRequestBytes(const std::string& job, uint64_t call) {
  StreamRequest r;
  r.set_call(call);
  r.mutable_pull()->set_job(job);
  return r.SerializeAsString();
}

// The chunks of `g` (values of every tensor of `l`) as one shard's push.
std::vector<PushChunkRef> Refs(const JobLayout& l, const Values& g) {
  std::vector<PushChunkRef> refs;
  const Partition p = MakePartition(l, 1);
  for (const ChunkInfo& c : p.chunks()) {
    PushChunkRef r;
    r.tensor = c.tensor;
    r.chunk = c.chunk;
    r.data = g[c.tensor].data() + c.offset;
    r.numel = c.numel;
    refs.push_back(r);
  }
  return refs;
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return bytes;
}

// A framed StreamRequest `call` carrying worker 0's push of `g` at `step` (request id `id`).
std::string PushBytes(const JobLayout& l, const Values& g, int64_t step, uint64_t id,
                      uint64_t call) {
  return Flatten(
      FrameStreamRequest(call, StreamOp::kPush, EncodePushRequest(l.job, 0, step, id, Refs(l, g))));
}

// A batch StreamRequest of `elements` (each an encoded StreamRequest).
std::string BatchBytes(const std::vector<std::string>& elements) {
  StreamRequest b;
  for (const std::string& e : elements) EXPECT_TRUE(b.add_batch()->ParseFromString(e));
  return b.SerializeAsString();
}

::testing::AssertionResult HasCodeAndText(const absl::Status& st, absl::StatusCode code,
                                          const std::string& text) {
  if (st.code() == code && st.message().find(text) != std::string::npos) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << st << " is not " << code << " with \"" << text << "\"";
}

StreamResponse Parse(const std::string& bytes) {
  StreamResponse r;
  EXPECT_TRUE(r.ParseFromString(bytes));
  return r;
}

class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer();
    ASSERT_NE(server_, nullptr);
    stub_ = ParameterService::NewStub(MakeChannel(server_->addr, RpcOptions()));
    auto c = NewGrpcParameterClient(layout_, ClientOptions({server_->addr}));
    ASSERT_OK(c.status());
    client_ = std::move(c).value();
    ASSERT_OK(client_->InitJob(ConstSpans(OddInit(layout_))));
  }

  const JobLayout layout_ = Layout("raw");
  std::unique_ptr<TestServer> server_;
  std::unique_ptr<Stub> stub_;
  std::unique_ptr<ParameterClient> client_;
};

// Garbage is answered INVALID_ARGUMENT, as is an empty operation; the channel then still serves
// a good pull, whose answer is the unary Pull's.
TEST_F(ShmTest, GarbageIsAnsweredInvalidArgumentAndTheChannelGoesOn) {
  const std::string before = Snapshot(stub_.get(), "raw");
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub_.get(), 1 << 20));
  EXPECT_EQ(server_->service->shm_channels(), 1);
  StreamRequest empty;
  empty.set_call(9);
  for (const std::string& bad :
       {std::string("\xff\xff\xff\xff\x0f garbage", 14), empty.SerializeAsString()}) {
    bool closed = false;
    const StreamResponse r = Parse(ch.Exchange(bad, &closed));
    ASSERT_FALSE(closed);
    EXPECT_EQ(r.code(), static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT)) << r.message();
    EXPECT_NE(r.message().find("OpenShm: request"), std::string::npos) << r.message();
  }
  // Once a request came, the shard's descriptor is closed: nobody else can open the region.
  EXPECT_FALSE(ShmRegion::Attach(ch.answer.pid(), ch.answer.fd(), ch.answer.nonce(),
                                 static_cast<size_t>(ch.answer.area_bytes()))
                   .ok());
  bool closed = false;
  const StreamResponse pulled = Parse(ch.Exchange(PullRequestBytes("raw", 42), &closed));
  ASSERT_FALSE(closed);
  EXPECT_EQ(pulled.code(), 0) << pulled.message();
  EXPECT_EQ(pulled.call(), 42u);
  PullRequest req;
  req.set_job("raw");
  PullResponse unary;
  ASSERT_TRUE(RawPull(stub_.get(), req, &unary).ok());
  EXPECT_EQ(pulled.pull().SerializeAsString(), unary.SerializeAsString());
  EXPECT_EQ(Snapshot(stub_.get(), "raw"), before);
  ch.Close();
}

// A length past the area closes the channel (nothing is read past it); an answer larger than
// the area is flagged instead of written; the shard serves other callers throughout.
TEST_F(ShmTest, ALengthPastTheAreaClosesTheChannelAndALargeAnswerIsFlagged) {
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub_.get(), 4096));
  bool closed = false;
  // The job's values are 3011 floats (12 KB): the pull's answer cannot fit 4 KiB.
  EXPECT_EQ(ch.Exchange(PullRequestBytes("raw", 1), &closed), "too large");
  EXPECT_FALSE(closed);
  EXPECT_EQ(ch.Exchange(PullRequestBytes("raw", 2), &closed, /*length_override=*/1 << 30), "");
  EXPECT_TRUE(closed);
  EXPECT_EQ(ch.region->header()->closed.load(), 1u);
  Values v = Zeros(layout_);
  EXPECT_OK(client_->Pull(Spans(v)));
  ch.Close();
}

// A batch's operations are answered together, one answer per element in the request's order;
// the pushes are applied exactly as the same pushes sent one by one over the Stream.
TEST_F(ShmTest, ABatchIsAnsweredTogetherInItsOrder) {
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub_.get(), 1 << 20));
  const Values g = OddInit(layout_);
  bool closed = false;
  const StreamResponse r =
      Parse(ch.Exchange(BatchBytes({PushBytes(layout_, g, 0, 101, 1), PullRequestBytes("raw", 2),
                                    PushBytes(layout_, g, 1, 102, 3)}),
                        &closed));
  ASSERT_FALSE(closed);
  ASSERT_EQ(r.batch_size(), 3) << r.DebugString();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(r.batch(i).call(), static_cast<uint64_t>(i + 1));
    EXPECT_EQ(r.batch(i).code(), 0) << r.batch(i).message();
  }
  EXPECT_TRUE(r.batch(0).has_push());
  EXPECT_TRUE(r.batch(1).has_pull());
  EXPECT_TRUE(r.batch(2).has_push());
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 2);
  // The same two pushes to another job, over the Stream: bit-identical values.
  const JobLayout ref_layout = Layout("ref");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> ref,
                       NewGrpcParameterClient(ref_layout, ClientOptions({server_->addr})));
  ASSERT_OK(ref->InitJob(ConstSpans(OddInit(ref_layout))));
  ASSERT_OK(ref->Push(0, ConstSpans(g)));
  ASSERT_OK(ref->Push(1, ConstSpans(g)));
  Values mine = Zeros(layout_), theirs = Zeros(ref_layout);
  ASSERT_OK(client_->Pull(Spans(mine)));
  ASSERT_OK(ref->Pull(Spans(theirs)));
  EXPECT_EQ(mine, theirs);
  // A batch of one push already applied (same request id): answered, not applied again.
  const StreamResponse again = Parse(ch.Exchange(
      BatchBytes({PushBytes(layout_, g, 1, 102, 4), PullRequestBytes("raw", 5)}), &closed));
  ASSERT_EQ(again.batch_size(), 2);
  EXPECT_EQ(again.batch(0).code(), 0) << again.batch(0).message();
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 2);
  ch.Close();
}

// A batch with one bad element is refused whole, INVALID_ARGUMENT naming the element, with
// nothing of it applied; the channel goes on.
TEST_F(ShmTest, ABatchWithABadElementIsRefusedWhole) {
  const std::string before = Snapshot(stub_.get(), "raw");
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub_.get(), 1 << 20));
  const Values g = OddInit(layout_);
  const std::string push = PushBytes(layout_, g, 0, 301, 1);
  StreamRequest empty;
  empty.set_call(2);
  const std::string nested = BatchBytes({PullRequestBytes("raw", 2)});
  const std::vector<std::pair<std::string, std::string>> bad = {
      {BatchBytes({push, PushBytes(layout_, g, 1, 302, 1)}), "reuses call id 1"},
      {BatchBytes({push, empty.SerializeAsString()}), "carries neither a push nor a pull"},
      {BatchBytes({push, nested}), "inside a batch"},
  };
  for (const auto& [bytes, text] : bad) {
    bool closed = false;
    const StreamResponse r = Parse(ch.Exchange(bytes, &closed));
    ASSERT_FALSE(closed);
    EXPECT_EQ(r.batch_size(), 0);
    EXPECT_EQ(r.call(), 0u);
    EXPECT_EQ(r.code(), static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT)) << r.message();
    EXPECT_NE(r.message().find("(batch element 2 of 2)"), std::string::npos) << r.message();
    EXPECT_NE(r.message().find(text), std::string::npos) << r.message();
  }
  EXPECT_EQ(Snapshot(stub_.get(), "raw"), before);
  bool closed = false;
  EXPECT_EQ(Parse(ch.Exchange(BatchBytes({push}), &closed)).batch(0).code(), 0);
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 1);
  ch.Close();
}

// A shard whose --max_chunks_per_job is `max_chunks`, serving a job initialised with
// OddInit; a stub and a client for it.
struct LimitedShard {
  LimitedShard(int64_t max_chunks, const std::string& job) : layout(Layout(job)) {
    options.limits.max_chunks_per_job = max_chunks;
  }
  // False (with a test failure) if the shard or the job could not be made.
  bool Start() {
    server = StartShardServer(options, RpcOptions(), 0, nullptr);
    if (server == nullptr) return false;
    stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
    absl::StatusOr<std::unique_ptr<ParameterClient>> made =
        NewGrpcParameterClient(layout, ClientOptions({server->addr}));
    EXPECT_OK(made.status());
    if (!made.ok()) return false;
    client = std::move(made).value();
    const absl::Status st = client->InitJob(ConstSpans(OddInit(layout)));
    EXPECT_OK(st);
    return st.ok();
  }

  ShardOptions options;
  const JobLayout layout;
  std::unique_ptr<TestServer> server;
  std::unique_ptr<Stub> stub;
  std::unique_ptr<ParameterClient> client;
};

// A worker that rewrites its request area while the shard reads it (another process writing
// two requests of one length by turns: a push of one chunk, and a push of more chunks than the
// shard allows) cannot crash the shard or pass its limits: every request is answered, OK or
// refused, and the channel and the shard go on. (Decoding straight from the area failed this
// at once: protobuf's reader CHECKs that a byte it reads twice is the same.)
TEST(ShmHostileTest, ARequestRewrittenWhileTheShardReadsItIsAnsweredSafely) {
  LimitedShard shard(/*max_chunks_per_job=*/10, "race");
  ASSERT_TRUE(shard.Start());
  Stub* stub = shard.stub.get();
  const JobLayout& l = shard.layout;
  ParameterClient* c = shard.client.get();
  StreamRequest many;
  many.set_call(1);
  many.mutable_push()->set_job("race");
  for (int i = 0; i < 8000; ++i) many.mutable_push()->add_chunks();  // 16 KB.
  const std::string b = many.SerializeAsString();
  const Values g = OddInit(l);
  const std::string push = PushBytes(l, g, 0, 1, 1);
  ASSERT_LT(push.size() + 4, b.size());
  std::string a;  // The push, padded with an unknown field (100) to b's length.
  for (size_t pad = 0; pad < b.size() && a.size() != b.size(); ++pad) {
    a = push + std::string("\xa2\x06", 2);  // Tag of field 100, length-delimited.
    size_t v = pad;
    while (v >= 0x80) {
      a += static_cast<char>((v & 0x7f) | 0x80);
      v >>= 7;
    }
    a += static_cast<char>(v);
    a += std::string(pad, 'p');
  }
  ASSERT_EQ(a.size(), b.size());
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub, 1 << 16, "race"));
  bool closed = false;
  EXPECT_EQ(Parse(ch.Exchange(a, &closed)).code(), 0);  // Each alone: applied, refused.
  EXPECT_EQ(Parse(ch.Exchange(b, &closed)).code(),
            static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT));
  ASSERT_EQ(RawInfo(stub, "race").pushes_applied(), 1);
  char* area = ch.region->request_area();
  const size_t len = a.size();
  auto* stop = static_cast<std::atomic<int>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(static_cast<void*>(stop), MAP_FAILED);
  stop->store(0);
  const pid_t writer = fork();
  ASSERT_GE(writer, 0);
  // However the test ends, the writer stops and is reaped.
  absl::Cleanup stop_writer = [&] {
    stop->store(1);
    int status = 0;
    waitpid(writer, &status, 0);
    munmap(static_cast<void*>(stop), 4096);
  };
  if (writer == 0) {  // Rewrites the area by turns, a byte range at a time.
    for (uint64_t i = 0; stop->load() == 0; ++i) {
      const std::string& next = (i & 1) != 0 ? a : b;
      const size_t at = (i * 7) % len, n = std::min(len - at, size_t{1} + (i % 97));
      std::memcpy(area + at, next.data() + at, n);
      if (i % 5 == 0) std::memcpy(area, next.data(), len);
    }
    _exit(0);
  }
  ShmHeader* h = ch.region->header();
  int answered = 0, applied = 0;
  const absl::Time end = absl::Now() + absl::Milliseconds(500);
  while (absl::Now() < end) {
    h->request_bytes.store(len);
    h->request_seq.store(++ch.seq);
    ShmWake(&h->request_seq);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (h->response_seq.load() != ch.seq && h->closed.load() == 0 && absl::Now() < give_up) {
      ShmWait(&h->response_seq, h->response_seq.load(), absl::Milliseconds(20));
    }
    ASSERT_EQ(h->response_seq.load(), ch.seq) << "no answer; closed=" << h->closed.load();
    StreamResponse r;
    ASSERT_TRUE(
        r.ParseFromArray(ch.region->response_area(), static_cast<int>(h->response_bytes.load())));
    ++answered;
    if (r.code() == 0) ++applied;
  }
  std::move(stop_writer).Invoke();
  EXPECT_GT(answered, 50);
  // Push request id 1 again each time it decoded: applied once (exactly-once), never more.
  EXPECT_EQ(RawInfo(stub, "race").pushes_applied(), 1) << applied << " answered OK";
  Values v = Zeros(l);
  EXPECT_OK(c->Pull(Spans(v)));
  ch.Close();
}

// A batch whose answers pass the response area: once the answers held do, the shard starts
// none of the rest (a push after them is not applied), and the answer is flagged too large.
TEST_F(ShmTest, ABatchStopsOnceItsAnswersPassTheArea) {
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub_.get(), 1 << 16));
  std::vector<std::string> elements;
  for (int i = 0; i < 8; ++i) elements.push_back(PullRequestBytes("raw", 1 + i));  // 12 KB each.
  elements.push_back(PushBytes(layout_, OddInit(layout_), 0, 501, 9));
  bool closed = false;
  EXPECT_EQ(ch.Exchange(BatchBytes(elements), &closed), "too large");
  EXPECT_FALSE(closed);
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 0);
  const StreamResponse one = Parse(ch.Exchange(PullRequestBytes("raw", 10), &closed));
  EXPECT_EQ(one.code(), 0) << one.message();
  ch.Close();
}

// One batch's pushes share the shard's chunk budget (--max_chunks_per_job), as on the Stream:
// two pushes within it alone but over it together are refused whole.
TEST(ShmBatchLimitsTest, ABatchSharesOneChunkBudget) {
  LimitedShard shard(/*max_chunks_per_job=*/5, "budget");  // The job has 1 + 4 = 5 chunks.
  ASSERT_TRUE(shard.Start());
  Stub* stub = shard.stub.get();
  const JobLayout& l = shard.layout;
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub, 1 << 20, "budget"));
  const Values g = OddInit(l);
  bool closed = false;
  const StreamResponse r =
      Parse(ch.Exchange(BatchBytes({PushBytes(l, g, 0, 1, 1), PushBytes(l, g, 1, 2, 2)}), &closed));
  ASSERT_FALSE(closed);
  EXPECT_EQ(r.code(), static_cast<int32_t>(grpc::StatusCode::INVALID_ARGUMENT)) << r.message();
  EXPECT_NE(r.message().find("more than 5 chunks"), std::string::npos) << r.message();
  EXPECT_EQ(RawInfo(stub, "budget").pushes_applied(), 0);
  const StreamResponse one = Parse(ch.Exchange(PushBytes(l, g, 0, 1, 3), &closed));
  EXPECT_EQ(one.code(), 0) << one.message();
  EXPECT_EQ(RawInfo(stub, "budget").pushes_applied(), 1);
  ch.Close();
}

// The worker's channel carries a batch (CallBatch): each call completes in order with the
// Stream's answer; the answers are lent until released, and meanwhile the channel takes
// nothing; a batch the shard refuses whole fails every call with its status.
TEST_F(ShmTest, TheClientsBatchCompletesEachCallAndLendsTheAnswers) {
  ShmOpChannel::Options o;
  o.area_bytes = 1 << 20;
  o.job = "raw";
  o.shard = "shard 0";
  ShmOpChannel channel(stub_.get(), o);
  for (int i = 0; i < 500 && channel.area_bytes() == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_GE(channel.area_bytes(), size_t{1} << 20);
  const Values g = OddInit(layout_);
  PullRequest pull;
  pull.set_job("raw");
  const std::string pull_bytes = pull.SerializeAsString();
  grpc::Slice pull_slice(pull_bytes.data(), pull_bytes.size());
  const grpc::ByteBuffer pull_body(&pull_slice, 1);
  const grpc::ByteBuffer push_body = EncodePushRequest("raw", 0, 0, 401, Refs(layout_, g));
  const grpc::ByteBuffer garbage = [] {
    grpc::Slice s(std::string("\xff\xff\xff\xff\x0f", 5));
    return grpc::ByteBuffer(&s, 1);
  }();
  // Runs one batch of `bodies` and waits for every call; false if the channel refused it.
  absl::Mutex mu;
  std::vector<grpc::Status> statuses;
  std::vector<grpc::ByteBuffer> responses;
  const auto run = [&](const std::vector<std::pair<StreamOp, const grpc::ByteBuffer*>>& bodies) {
    statuses.assign(bodies.size(), grpc::Status(grpc::StatusCode::UNKNOWN, "not completed"));
    responses.assign(bodies.size(), grpc::ByteBuffer());
    std::vector<ShmOpChannel::Item> items;
    auto left = std::make_shared<size_t>(bodies.size());
    for (size_t i = 0; i < bodies.size(); ++i) {
      items.push_back(
          {bodies[i].first, bodies[i].second, &responses[i], [&, i, left](grpc::Status st) {
             absl::MutexLock lock(&mu);
             EXPECT_EQ(*left, bodies.size() - i);  // In order.
             statuses[i] = st;
             --*left;
           }});
    }
    if (!channel.CallBatch(&items)) return false;
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](size_t* n) { return *n == 0; }, left.get()));
    return true;
  };
  ASSERT_TRUE(run({{StreamOp::kPush, &push_body}, {StreamOp::kPull, &pull_body}}));
  ASSERT_TRUE(statuses[0].ok()) << statuses[0].error_message();
  ASSERT_TRUE(statuses[1].ok()) << statuses[1].error_message();
  PushResponse pushed;
  EXPECT_TRUE(pushed.ParseFromString(Flatten(responses[0])));
  PullResponse pulled, unary;
  EXPECT_TRUE(pulled.ParseFromString(Flatten(responses[1])));
  ASSERT_TRUE(RawPull(stub_.get(), pull, &unary).ok());
  EXPECT_EQ(pulled.SerializeAsString(), unary.SerializeAsString());
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 1);
  // The answers still refer to the region: nothing more goes until they are released.
  std::vector<ShmOpChannel::Item> one(1);
  grpc::ByteBuffer unused;
  one[0] = {StreamOp::kPull, &pull_body, &unused, [](grpc::Status) {}};
  EXPECT_FALSE(channel.CallBatch(&one));
  ASSERT_NE(one[0].done, nullptr);  // Untouched.
  responses.clear();
  // More than a batch holds is refused, nothing sent.
  std::vector<ShmOpChannel::Item> many(kMaxStreamBatch + 1);
  for (auto& item : many) item = {StreamOp::kPull, &pull_body, &unused, [](grpc::Status) {}};
  EXPECT_FALSE(channel.CallBatch(&many));
  // A batch the shard refuses whole: every call fails INVALID_ARGUMENT, nothing applied.
  const std::string before = Snapshot(stub_.get(), "raw");
  const grpc::ByteBuffer push2 = EncodePushRequest("raw", 0, 1, 402, Refs(layout_, g));
  ASSERT_TRUE(run({{StreamOp::kPush, &push2}, {StreamOp::kPush, &garbage}}));
  for (const grpc::Status& st : statuses) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("batch element 2 of 2"), std::string::npos)
        << st.error_message();
  }
  EXPECT_EQ(Snapshot(stub_.get(), "raw"), before);
  responses.clear();
  ASSERT_TRUE(run({{StreamOp::kPush, &push2}}));
  EXPECT_TRUE(statuses[0].ok()) << statuses[0].error_message();
  EXPECT_EQ(RawInfo(stub_.get(), "raw").pushes_applied(), 2);
}

// Areas under a page or over the shard's bound are INVALID_ARGUMENT; with max_channels open
// the shard answers RESOURCE_EXHAUSTED, and a worker's shm client keeps to the Stream (its
// results are the same) until a channel is free; a wrong job token is refused at open.
TEST(ShmLimitsTest, BadAreasAndAFullShardAreRefusedAndTheClientKeepsTheStream) {
  ShmChannelOptions shm;
  shm.max_channels = 1;
  shm.max_area_bytes = 1 << 20;
  auto server = StartShardServer(ShardOptions(), RpcOptions(), 0, nullptr, shm);
  ASSERT_NE(server, nullptr);
  const ParameterServiceImpl& service = *server->service;
  const std::string addr = server->addr;
  auto stub = ParameterService::NewStub(MakeChannel(addr, RpcOptions()));
  for (int64_t area : {int64_t{0}, int64_t{100}, int64_t{2} << 20}) {
    EXPECT_TRUE(HasCodeAndText(OpenRaw(stub.get(), area).status(),
                               absl::StatusCode::kInvalidArgument, "outside"))
        << area;
  }
  ASSERT_OK_AND_ASSIGN(RawChannel first, OpenRaw(stub.get(), 1 << 16));
  EXPECT_TRUE(HasCodeAndText(OpenRaw(stub.get(), 1 << 16).status(),
                             absl::StatusCode::kResourceExhausted,
                             "shared-memory channels (--shm_channels) are all open"));
  const JobLayout l = Layout("full");
  GrpcParameterClientOptions o = ClientOptions({addr});
  o.transport = "shm";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> c, NewGrpcParameterClient(l, o));
  ASSERT_OK(c->InitJob(ConstSpans(OddInit(l))));
  Values v = Zeros(l);
  for (int step = 0; step < 3; ++step) {
    ASSERT_OK(c->Pull(Spans(v)));
    ASSERT_OK(c->Push(step, ConstSpans(OddInit(l))));
  }
  EXPECT_EQ(RawInfo(stub.get(), "full").pushes_applied(), 3);
  EXPECT_EQ(service.shm_channels(), 1);  // Still only the raw one.
  first.Close();
  for (int i = 0; i < 200 && service.shm_channels() != 0; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(service.shm_channels(), 0);
  // A slot is free: the client opens its channel (at most a second after its last try).
  for (int i = 0; i < 300 && service.shm_channels() != 1; ++i) {
    ASSERT_OK(c->Pull(Spans(v)));
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(service.shm_channels(), 1);
  c.reset();
}

// A channel's region and the shard's copy of a request count against --max_memory_bytes while
// it is open: a worker cannot grow the shard past its budget by opening channels. A refused
// channel reserves nothing; a closed one gives its bytes back.
TEST(ShmLimitsTest, AChannelsMemoryCountsAgainstTheShardsBudget) {
  ShardOptions options;
  options.limits.max_memory_bytes = 5 << 20;  // Room for one channel of 1 MiB areas.
  ShmChannelOptions shm;
  shm.max_area_bytes = 1 << 20;
  auto server = StartShardServer(options, RpcOptions(), 0, nullptr, shm);
  ASSERT_NE(server, nullptr);
  const ParameterServiceImpl& service = *server->service;
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  const int64_t before = server->shard->memory_reserved();
  absl::StatusOr<RawChannel> first = OpenRaw(stub.get(), 1 << 20);
  ASSERT_OK(first.status());
  const int64_t channel = server->shard->memory_reserved() - before;
  // What is mapped (the header page and the region's two areas, as the worker sees them) and
  // the shard's 64-byte-aligned copy of a request.
  const int64_t area = static_cast<int64_t>(first->region->area_bytes());
  EXPECT_EQ(area, 1 << 20);
  EXPECT_EQ(channel, 4096 + 2 * area + (area + 64));
  EXPECT_TRUE(HasCodeAndText(OpenRaw(stub.get(), 1 << 20).status(),
                             absl::StatusCode::kResourceExhausted, "--max_memory_bytes"));
  EXPECT_EQ(server->shard->memory_reserved() - before, channel);
  // The refused call stops counting once it is done.
  for (int i = 0; i < 200 && service.shm_channels() != 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(service.shm_channels(), 1);
  first->Close();
  for (int i = 0; i < 200 && server->shard->memory_reserved() != before; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server->shard->memory_reserved(), before);
  ASSERT_OK(OpenRaw(stub.get(), 1 << 20).status());  // The bytes came back.
}

// With per-job tokens, a channel opens only for a job the presented token may act on.
TEST(ShmLimitsTest, AChannelOpensOnlyWithTheJobsToken) {
  JobTokens tokens(/*required=*/true);
  tokens.Set("secret", "good-token");
  auto server = StartShardServer(ShardOptions(), RpcOptions(), 0, &tokens);
  ASSERT_NE(server, nullptr);
  const ParameterServiceImpl& service = *server->service;
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  for (const std::string token : {"bad-token", ""}) {
    const absl::StatusCode code = OpenRaw(stub.get(), 1 << 16, "secret", token).status().code();
    EXPECT_TRUE(code == absl::StatusCode::kPermissionDenied ||
                code == absl::StatusCode::kUnauthenticated)
        << "token '" << token << "': " << code;
  }
  EXPECT_EQ(service.shm_channels(), 0);
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub.get(), 1 << 16, "secret", "good-token"));
  EXPECT_EQ(service.shm_channels(), 1);
  ch.Close();
}

// A worker whose OpenShm call ends while its sync push waits at the barrier: the push is
// withdrawn (nothing applied, the step still open for the others) and the channel closed.
TEST(ShmLifetimeTest, AWorkerThatGoesAwayWithdrawsItsWaitingPush) {
  auto server = StartServer();
  ASSERT_NE(server, nullptr);
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  const JobLayout l = Layout("gone", /*num_workers=*/2, "sync");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> init,
                       NewGrpcParameterClient(l, ClientOptions({server->addr})));
  ASSERT_OK(init->InitJob(ConstSpans(OddInit(l))));
  ASSERT_OK_AND_ASSIGN(RawChannel ch, OpenRaw(stub.get(), 1 << 20, "gone"));
  // A sync push of step 0 by worker 0, written raw: it waits for worker 1.
  const std::string bytes = PushBytes(l, OddInit(l), 0, 99, 7);
  ShmHeader* h = ch.region->header();
  std::memcpy(ch.region->request_area(), bytes.data(), bytes.size());
  h->request_bytes.store(bytes.size());
  h->request_seq.store(1);
  ShmWake(&h->request_seq);
  for (int i = 0; i < 1000 && server->shard->waiting() != 1; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(server->shard->waiting(), 1);
  ch.ctx->TryCancel();
  ch.Close();
  for (int i = 0; i < 1000 && server->shard->waiting() != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server->shard->waiting(), 0);
  for (int i = 0; i < 1000 && server->service->shm_channels() != 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(server->service->shm_channels(), 0);
  EXPECT_EQ(h->closed.load(), 1u);
  const JobInfoResponse info = RawInfo(stub.get(), "gone");
  EXPECT_EQ(info.pushes_applied(), 0);
  EXPECT_EQ(info.updates_applied(), 0);
}

}  // namespace
}  // namespace gradmesh
