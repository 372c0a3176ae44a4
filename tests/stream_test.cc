// ParameterService.Stream over real gRPC on 127.0.0.1: the streamed transport of the worker's
// client gives exactly the unary results; operations on one stream complete out of order (a
// push waiting at a barrier holds up nothing else); a stream broken mid-push is retried and
// the push applied once; a retried push on a new stream is acknowledged, not reapplied; the
// per-job token check applies to every streamed operation; malformed messages are refused
// without harm.
#include <grpcpp/generic/generic_stub.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "rpc/op_stream.h"
#include "rpc/tensor_wire.h"
#include "server/job_tokens.h"
#include "tests/testing/loopback.h"

namespace gradmesh {
namespace {

using namespace loopback;  // NOLINT: test helpers.

constexpr char kStream[] = "/gradmesh.ParameterService/Stream";

JobLayout Layout(const std::string& job, int32_t num_workers = 1,
                 const std::string& consistency = "async") {
  JobLayout l;
  l.job = job;
  l.tensors = {Tensor("a", {10}), Tensor("b", {1}), Tensor("c", {3001}), Tensor("d", {3, 7})};
  l.chunk_elems = 1000;
  l.optimizer.set_name("adam");
  l.optimizer.set_lr(0.01);
  l.num_workers = num_workers;
  l.consistency = consistency;
  l.barrier_timeout_s = 60;
  return l;
}

// Gradient of step `step`: distinct, non-trivial values per element.
Values Grad(const JobLayout& l, int64_t step, float scale = 1) {
  Values g = Zeros(l);
  for (size_t t = 0; t < g.size(); ++t) {
    for (size_t i = 0; i < g[t].size(); ++i) {
      g[t][i] = scale * (static_cast<float>((i * 7 + t * 3 + step * 11) % 17) - 8.0f) / 16.0f;
    }
  }
  return g;
}

GrpcParameterClientOptions Options(std::vector<std::string> servers, const std::string& transport,
                                   int32_t worker = 0) {
  GrpcParameterClientOptions o = ClientOptions(std::move(servers), worker);
  o.transport = transport;
  return o;
}

std::unique_ptr<ParameterClient> Client(const JobLayout& l, GrpcParameterClientOptions o) {
  auto c = NewGrpcParameterClient(l, std::move(o));
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

// A unary client of `l` on the shard at `addr` alone, with the job registered there (OddInit
// values); null (and a test failure) if either fails.
std::unique_ptr<ParameterClient> InitJobOn(const std::string& addr, const JobLayout& l) {
  auto c = Client(l, Options({addr}, "unary"));
  if (c == nullptr) return nullptr;
  const absl::Status st = c->InitJob(ConstSpans(OddInit(l)));
  EXPECT_TRUE(st.ok()) << st;
  return st.ok() ? std::move(c) : nullptr;
}

// Pushes and pulls on a raw OpStream; waits for the answer.
grpc::Status StreamCall(OpStream* stream, StreamOp op, const grpc::ByteBuffer& body,
                        grpc::ByteBuffer* response) {
  absl::Notification done;
  grpc::Status result;
  stream->Call(op, body, response, [&](grpc::Status st) {
    result = std::move(st);
    done.Notify();
  });
  done.WaitForNotification();
  return result;
}

grpc::ByteBuffer Encode(const google::protobuf::MessageLite& m) {
  const std::string wire = m.SerializeAsString();
  grpc::Slice slice(wire.data(), wire.size());
  return grpc::ByteBuffer(&slice, 1);
}

using StreamTest = TwoShardFixture;

// The default (stream) and unary transports, a mix (one shard's messages over its stream,
// the other's too large for it) and shared memory produce bit-identical values, versions and
// shard state.
TEST_F(StreamTest, StreamAndUnaryGiveExactlyTheSameResults) {
  std::vector<std::unique_ptr<ParameterClient>> clients;
  std::vector<Values> pulled;
  int64_t shard_bytes[2] = {0, 0};
  const Partition p = MakePartition(Layout("x"), 2);
  for (const ChunkInfo& c : p.chunks()) shard_bytes[c.shard] += c.numel * 4;
  ASSERT_GT(std::abs(shard_bytes[0] - shard_bytes[1]), 200);
  const std::vector<std::string> transports = {"stream", "unary", "mixed", "shm"};
  for (const std::string& transport : transports) {
    const JobLayout l = Layout("same-" + transport);
    GrpcParameterClientOptions o = Options(Addrs(), transport == "mixed" ? "stream" : transport);
    if (transport == "mixed") o.stream_max_bytes = std::min(shard_bytes[0], shard_bytes[1]) + 100;
    clients.push_back(Client(l, o));
    ASSERT_NE(clients.back(), nullptr);
    ParameterClient& c = *clients.back();
    ASSERT_OK(c.InitJob(ConstSpans(OddInit(l))));
    Values v = Zeros(l);
    for (int64_t step = 0; step < 5; ++step) {
      ASSERT_OK(c.Pull(Spans(v)));
      ASSERT_OK(c.Push(step, ConstSpans(Grad(l, step))));
    }
    ASSERT_OK(c.Pull(Spans(v)));
    pulled.push_back(v);
  }
  for (size_t i = 1; i < transports.size(); ++i) {
    SCOPED_TRACE(transports[i]);
    EXPECT_TRUE(SameBits(pulled[0], pulled[i]));
    EXPECT_EQ(clients[0]->PulledVersions(), clients[i]->PulledVersions());
    EXPECT_EQ(clients[0]->bytes_pushed(), clients[i]->bytes_pushed());
    EXPECT_EQ(clients[0]->bytes_pulled(), clients[i]->bytes_pulled());
  }
  for (auto& stub : stubs_) {
    EXPECT_EQ(Snapshot(stub.get(), "same-stream"), Snapshot(stub.get(), "same-unary"));
    EXPECT_EQ(Snapshot(stub.get(), "same-stream"), Snapshot(stub.get(), "same-mixed"));
    EXPECT_EQ(Snapshot(stub.get(), "same-stream"), Snapshot(stub.get(), "same-shm"));
  }
  // The shm client went through its channels (one per shard, open while it lives).
  for (const auto& server : servers_) EXPECT_EQ(server->service->shm_channels(), 1);
}

// Many threads share one client (one stream per shard): a pushing thread (as a pipelined
// worker's) and pulling threads, all at once; every push is applied once, and the values are
// those of the same pushes made one by one over unary calls.
// The same over shared memory: an operation that finds the channel busy takes the stream.
TEST_F(StreamTest, ManyConcurrentOperationsShareOneStream) {
  constexpr int kPullers = 7, kSteps = 40;
  const char* const transports[3] = {"stream", "shm", "unary"};
  Values result[3];
  for (int t = 0; t < 3; ++t) {
    const JobLayout l = Layout(absl::StrCat("many-", transports[t]));
    auto client = Client(l, Options(Addrs(), transports[t]));
    ASSERT_NE(client, nullptr);
    ASSERT_OK(client->InitJob(ConstSpans(OddInit(l))));
    std::atomic<int> failures{0};
    std::atomic<bool> pushing{true};
    std::vector<std::thread> threads;
    threads.emplace_back([&] {
      for (int step = 0; step < kSteps; ++step) {
        if (!client->Push(step, ConstSpans(Grad(l, step))).ok()) ++failures;
      }
      pushing = false;
    });
    for (int p = 0; p < (t < 2 ? kPullers : 0); ++p) {
      threads.emplace_back([&] {
        Values v = Zeros(l);
        while (pushing.load()) {
          if (!client->Pull(Spans(v)).ok()) ++failures;
        }
      });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(failures.load(), 0);
    result[t] = Zeros(l);
    ASSERT_OK(client->Pull(Spans(result[t])));
    for (auto& stub : stubs_) {
      const JobInfoResponse info = RawInfo(stub.get(), l.job);
      EXPECT_EQ(info.pushes_applied(), kSteps);
      EXPECT_EQ(info.duplicates_dropped(), 0);
    }
  }
  EXPECT_TRUE(SameBits(result[0], result[2]));
  EXPECT_TRUE(SameBits(result[1], result[2]));
}

// On one stream, a sync push waits at the barrier while later pulls are answered; the push is
// answered when the other worker arrives. Responses come by call id, out of order.
TEST_F(StreamTest, AWaitingPushHoldsUpNothingElseOnItsStream) {
  const JobLayout l = Layout("order", /*num_workers=*/2, "sync");
  auto c0 = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c0, nullptr);
  auto ctx = Ctx();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stubs_[0]->Stream(ctx.get());
  const Partition p = MakePartition(l, 1);
  PushRequest push;
  push.set_job("order");
  push.set_worker(0);
  push.set_request_id(99);
  const Values g = Grad(l, 0);
  for (const ChunkInfo& c : p.chunks()) {
    ChunkData* d = push.add_chunks();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(g[c.tensor].data() + c.offset, c.numel));
  }
  StreamRequest req;
  req.set_call(1);
  *req.mutable_push() = push;
  ASSERT_TRUE(stream->Write(req));
  for (uint64_t call = 2; call <= 4; ++call) {
    StreamRequest pull;
    pull.set_call(call);
    pull.mutable_pull()->set_job("order");
    pull.mutable_pull()->set_worker(1);
    ASSERT_TRUE(stream->Write(pull));
  }
  StreamRequest empty;  // Neither push nor pull: refused, the stream goes on.
  empty.set_call(5);
  ASSERT_TRUE(stream->Write(empty));
  std::vector<uint64_t> order;
  for (int i = 0; i < 4; ++i) {
    StreamResponse resp;
    ASSERT_TRUE(stream->Read(&resp));
    order.push_back(resp.call());
    if (resp.call() == 5) {
      EXPECT_EQ(resp.code(), grpc::StatusCode::INVALID_ARGUMENT) << resp.message();
    } else {
      EXPECT_EQ(resp.code(), 0) << resp.message();
      EXPECT_EQ(resp.pull().chunks_size(), static_cast<int>(p.chunks().size()));
    }
  }
  EXPECT_EQ(servers_[0]->shard->waiting(), 1);  // The push, still at the barrier.
  // Worker 1 completes the step; only then is call 1 answered.
  PushRequest other = push;
  other.set_worker(1);
  other.set_request_id(100);
  ASSERT_TRUE(RawPush(stubs_[0].get(), other).ok());
  StreamResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  EXPECT_EQ(resp.call(), 1u);
  EXPECT_EQ(resp.code(), 0) << resp.message();
  EXPECT_TRUE(resp.has_push());
  EXPECT_EQ(std::count(order.begin(), order.end(), 1u), 0);
  ASSERT_TRUE(stream->WritesDone());
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(RawInfo(stubs_[0].get(), "order").updates_applied(), 1);
}

// A retried push on a new stream (same request id) is acknowledged and not applied again.
TEST_F(StreamTest, APushRetriedOnANewStreamIsAppliedOnce) {
  const JobLayout l = Layout("dedupe");
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  const Partition p = MakePartition(l, 1);
  const Values g = Grad(l, 3);
  std::vector<PushChunkRef> refs;
  for (const ChunkInfo& ci : p.chunks()) {
    refs.push_back({ci.tensor, ci.chunk, 0, g[ci.tensor].data() + ci.offset, ci.numel});
  }
  const grpc::ByteBuffer body = EncodePushRequest("dedupe", 0, 0, 0x1234567, refs);
  grpc::GenericStub generic(MakeChannel(servers_[0]->addr, RpcOptions()));
  for (int attempt = 0; attempt < 2; ++attempt) {
    OpStream stream(&generic, kStream, {});  // A new stream each time.
    grpc::ByteBuffer resp;
    grpc::Status st = StreamCall(&stream, StreamOp::kPush, body, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  const JobInfoResponse info = RawInfo(stubs_[0].get(), "dedupe");
  EXPECT_EQ(info.pushes_applied(), 1);
  EXPECT_EQ(info.duplicates_dropped(), 1);
}

// A sync push waiting at the barrier when its server restarts (same shard state, as a durable
// shard would recover it) is withdrawn, retried by the client over a new stream with the same
// request id, and applied exactly once when the other worker arrives.
class StreamRestartTest : public ::testing::TestWithParam<const char*> {};

// The same over a shared-memory channel: the restart closes it; the retry opens a new one.
INSTANTIATE_TEST_SUITE_P(Transports, StreamRestartTest, ::testing::Values("stream", "shm"));

TEST_P(StreamRestartTest, AStreamBrokenMidPushIsRetriedAndThePushAppliedOnce) {
  const std::string transport = GetParam();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Shard> shard, Shard::Create(ShardOptions()));
  auto serve = [&](int port, int* bound) {
    auto service = std::make_unique<ParameterServiceImpl>(shard.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                             bound);
    builder.RegisterService(service.get());
    auto server = builder.BuildAndStart();
    return std::make_pair(std::move(service), std::move(server));
  };
  int port = 0;
  auto [service, server] = serve(0, &port);
  ASSERT_NE(server, nullptr);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  const JobLayout l = Layout("restart", /*num_workers=*/2, "sync");
  // Both clients ride over the restart: c1 may have tried its channel (shm opens at once)
  // while the server was down, and gRPC then refuses its first calls until it reconnects.
  const auto patient = [&](int32_t worker) {
    GrpcParameterClientOptions o = Options({addr}, transport, worker);
    o.max_attempts = 20;
    o.initial_backoff = absl::Milliseconds(20);
    o.max_backoff = absl::Milliseconds(100);
    return o;
  };
  auto c0 = Client(l, patient(0));
  auto c1 = Client(l, patient(1));
  ASSERT_NE(c0, nullptr);
  ASSERT_NE(c1, nullptr);
  ASSERT_OK(c0->InitJob(ConstSpans(OddInit(l))));
  absl::Status pushed0;
  std::thread t0([&] { pushed0 = c0->Push(0, ConstSpans(Grad(l, 0))); });
  grpc::Server* first = server.get();
  grpc::Server* second = nullptr;  // The restarted server, once it runs.
  // A failed ASSERT returns early: t0's push must not be left retrying or parked at the
  // barrier. c0 stops retrying, the servers end its calls, and t0 is joined; then the clients
  // go, so that no server's destructor waits for their open calls.
  absl::Cleanup end_early = [&] {
    if (!t0.joinable()) return;
    c0->StopRetrying();
    c1->StopRetrying();
    const auto soon = std::chrono::system_clock::now() + std::chrono::milliseconds(100);
    first->Shutdown(soon);
    if (second != nullptr) second->Shutdown(soon);
    t0.join();
    c0.reset();
    c1.reset();
  };
  auto wait_for = [&](int64_t n) {
    for (int i = 0; i < 1000 && shard->waiting() != n; ++i) absl::SleepFor(absl::Milliseconds(5));
    return shard->waiting();
  };
  ASSERT_EQ(wait_for(1), 1);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  server->Wait();
  EXPECT_EQ(shard->waiting(), 0);  // Withdrawn with its stream.
  int again = 0;
  auto [service2, server2] = serve(port, &again);
  ASSERT_NE(server2, nullptr);
  second = server2.get();
  // Runs before server2's destructor (declared after it): the clients' calls end first.
  absl::Cleanup end_clients = [&] {
    if (c0 == nullptr) return;
    c0->StopRetrying();
    c1->StopRetrying();
    second->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    if (t0.joinable()) t0.join();
    c0.reset();
    c1.reset();
  };
  ASSERT_EQ(again, port);
  ASSERT_EQ(wait_for(1), 1);  // The retry, waiting again.
  ASSERT_OK(c1->Push(0, ConstSpans(Grad(l, 0, 2))));
  t0.join();
  ASSERT_OK(pushed0);
  if (transport == "shm") {
    // Each client has its channel to the new server: c1's from its push, and c0's reopened by
    // its first call once a second has passed since the try that found the server down.
    absl::SleepFor(absl::Milliseconds(1100));
    Values v = Zeros(l);
    ASSERT_OK(c0->Pull(Spans(v)));
    EXPECT_EQ(service2->shm_channels(), 2);
  }
  auto stub = ParameterService::NewStub(MakeChannel(addr, RpcOptions()));
  const JobInfoResponse info = RawInfo(stub.get(), "restart");
  EXPECT_EQ(info.pushes_applied(), 2);
  EXPECT_EQ(info.updates_applied(), 1);

  // The same step without a restart, unary, on a fresh job: the same values.
  const JobLayout r = Layout("reference", 2, "sync");
  auto r0 = Client(r, Options({addr}, "unary", 0));
  auto r1 = Client(r, Options({addr}, "unary", 1));
  ASSERT_OK(r0->InitJob(ConstSpans(OddInit(r))));
  absl::Status ref0;
  std::thread u0([&] { ref0 = r0->Push(0, ConstSpans(Grad(r, 0))); });
  absl::Cleanup end_u0 = [&] {  // As for t0: never left running past a failed ASSERT.
    if (!u0.joinable()) return;
    r0->StopRetrying();
    second->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    u0.join();
  };
  ASSERT_EQ(wait_for(1), 1);
  ASSERT_OK(r1->Push(0, ConstSpans(Grad(r, 0, 2))));
  u0.join();
  ASSERT_OK(ref0);
  Values got = Zeros(l), want = Zeros(r);
  ASSERT_OK(c0->Pull(Spans(got)));
  ASSERT_OK(r0->Pull(Spans(want)));
  EXPECT_TRUE(SameBits(got, want));
  c0.reset();
  c1.reset();
  r0.reset();
  r1.reset();
  server2->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

// With per-job tokens, a streamed push or pull (or one through shared memory) with a wrong or
// missing token fails with the code the unary call gives, and changes nothing.
TEST(StreamTokenTest, AnUnauthorisedJobIsRefusedAsUnaryRefusesIt) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Shard> shard, Shard::Create(ShardOptions()));
  JobTokens tokens(/*required=*/true);
  tokens.Set("secret", "good-token");
  ParameterServiceImpl service(shard.get(), &tokens);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  const JobLayout l = Layout("secret");
  GrpcParameterClientOptions good = Options({addr}, "stream");
  good.job_token = "good-token";
  auto owner = Client(l, good);
  ASSERT_NE(owner, nullptr);
  ASSERT_OK(owner->InitJob(ConstSpans(OddInit(l))));
  auto stub = ParameterService::NewStub(MakeChannel(addr, RpcOptions()));
  auto snapshot = [&] {
    PullRequest req;
    req.set_job("secret");
    PullResponse resp;
    auto ctx = Ctx();
    ctx->AddMetadata("x-gradmesh-job-token", "good-token");
    EXPECT_TRUE(stub->Pull(ctx.get(), req, &resp).ok());
    return resp.SerializeAsString();
  };
  const std::string before = snapshot();
  for (const std::string token : {"bad-token", ""}) {
    absl::StatusCode codes[3][2];
    const char* const transports[3] = {"stream", "shm", "unary"};
    for (int t = 0; t < 3; ++t) {
      GrpcParameterClientOptions o = Options({addr}, transports[t]);
      o.job_token = token;
      o.max_attempts = 1;
      auto c = Client(l, o);
      ASSERT_NE(c, nullptr);
      Values v = Zeros(l);
      codes[t][0] = c->Push(0, ConstSpans(Grad(l, 0))).code();
      codes[t][1] = c->Pull(Spans(v)).code();
    }
    for (int op = 0; op < 2; ++op) {
      EXPECT_TRUE(codes[0][op] == absl::StatusCode::kPermissionDenied ||
                  codes[0][op] == absl::StatusCode::kUnauthenticated)
          << "token '" << token << "' op " << op << ": " << codes[0][op];
      EXPECT_EQ(codes[0][op], codes[2][op]) << "token '" << token << "' op " << op;
      EXPECT_EQ(codes[1][op], codes[2][op]) << "shm, token '" << token << "' op " << op;
    }
  }
  EXPECT_EQ(snapshot(), before);
  JobInfoRequest info;
  info.set_job("secret");
  ASSERT_OK_AND_ASSIGN(JobInfoResponse state, shard->GetJobInfo(info));
  EXPECT_EQ(state.pushes_applied(), 0);
  owner.reset();
  server->Shutdown();
}

// Bytes that are not a StreamRequest end the stream with INVALID_ARGUMENT; the server keeps
// serving (a new stream works).
TEST_F(StreamTest, AMalformedMessageEndsItsStreamWithInvalidArgument) {
  const JobLayout l = Layout("malformed");
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  const std::string before = Snapshot(stubs_[0].get(), "malformed");
  grpc::GenericStub generic(MakeChannel(servers_[0]->addr, RpcOptions()));
  OpStream stream(&generic, kStream, {});
  for (const std::string garbage : {std::string("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11),
                                    std::string("\x0a\x40ab", 4), std::string("\x0f", 1)}) {
    grpc::Slice slice(garbage.data(), garbage.size());
    grpc::ByteBuffer resp;
    grpc::Status st = StreamCall(&stream, StreamOp::kPush, grpc::ByteBuffer(&slice, 1), &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    PullRequest pull;  // The next operation opens a new stream and succeeds.
    pull.set_job("malformed");
    st = StreamCall(&stream, StreamOp::kPull, Encode(pull), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  }
  EXPECT_EQ(stream.opened(), 4);
  EXPECT_EQ(Snapshot(stubs_[0].get(), "malformed"), before);
}

// The push of step `step` of `job` (every chunk of shard 0 of a one-shard layout), encoded.
grpc::ByteBuffer PushBody(const JobLayout& l, const Values& g, int64_t step) {
  const Partition p = MakePartition(l, 1);
  std::vector<PushChunkRef> refs;
  for (const ChunkInfo& ci : p.chunks()) {
    refs.push_back({ci.tensor, ci.chunk, 0, g[ci.tensor].data() + ci.offset, ci.numel});
  }
  return EncodePushRequest(l.job, 0, step, 1000 + static_cast<uint64_t>(step), refs);
}

// A burst of operations (OpStream::Call with `more`) goes to the shard in one message, a batch,
// and each operation is answered as it would be alone: the same statuses, pulled bytes and
// final state as the same operations sent one message at a time.
TEST_F(StreamTest, ABurstGoesInOneMessageAndIsAnsweredAsOneByOne) {
  constexpr int kOps = 30;
  std::vector<Values> grads;
  for (int i = 0; i < kOps; ++i) grads.push_back(Grad(Layout("x"), i));
  grpc::GenericStub generic(MakeChannel(servers_[0]->addr, RpcOptions()));
  std::vector<std::string> answers[2];
  for (int mode = 0; mode < 2; ++mode) {  // 0: one burst; 1: one message per operation.
    const JobLayout l = Layout(mode == 0 ? "burst" : "one-by-one");
    auto c = InitJobOn(servers_[0]->addr, l);
    ASSERT_NE(c, nullptr);
    PullRequest pull;
    pull.set_job(l.job);
    OpStream stream(&generic, kStream, {});
    grpc::ByteBuffer first;
    ASSERT_TRUE(StreamCall(&stream, StreamOp::kPull, Encode(pull), &first).ok());
    // The shard announced batches in its initial metadata, read with its first answer.
    for (int i = 0; i < 1000 && !stream.batching(); ++i) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_TRUE(stream.batching());
    const int64_t writes = stream.writes();
    std::vector<grpc::ByteBuffer> bodies(kOps), resps(kOps);
    std::vector<grpc::Status> statuses(kOps);
    absl::Mutex mu;
    int left = kOps;
    for (int i = 0; i < kOps; ++i) {
      const bool is_pull = i % 3 == 2;
      bodies[i] = is_pull ? Encode(pull) : PushBody(l, grads[i], i);
      auto done = [&, i](grpc::Status st) {
        absl::MutexLock lock(&mu);
        statuses[i] = std::move(st);
        --left;
      };
      const StreamOp op = is_pull ? StreamOp::kPull : StreamOp::kPush;
      if (mode == 0) {
        stream.Call(op, bodies[i], &resps[i], done, /*more=*/i + 1 < kOps);
      } else {
        done(StreamCall(&stream, op, bodies[i], &resps[i]));
      }
    }
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &left));
    }
    EXPECT_EQ(stream.writes() - writes, mode == 0 ? 1 : kOps);
    for (int i = 0; i < kOps; ++i) {
      ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
      std::vector<grpc::Slice> slices;
      std::string bytes;
      if (resps[i].Length() > 0) ASSERT_TRUE(resps[i].Dump(&slices).ok());
      for (const grpc::Slice& sl : slices)
        bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
      answers[mode].push_back(std::move(bytes));
    }
    EXPECT_EQ(RawInfo(stubs_[0].get(), l.job).pushes_applied(), kOps - kOps / 3);
  }
  EXPECT_EQ(answers[0], answers[1]);
  EXPECT_EQ(Snapshot(stubs_[0].get(), "burst"), Snapshot(stubs_[0].get(), "one-by-one"));
}

// The shard answers a batch's operations together, in one batch, to a client that announced it
// reads batches, and one message per answer to a client that did not (one from before
// batches); it announces that it reads batches either way.
TEST_F(StreamTest, AnswersComeBatchedOnlyToAClientThatReadsBatches) {
  const JobLayout l = Layout("answers");
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  for (const bool announce : {false, true}) {
    auto ctx = Ctx();
    if (announce) ctx->AddMetadata(kStreamBatchMetadata, "1");
    auto stream = stubs_[0]->Stream(ctx.get());
    StreamRequest batch;
    for (uint64_t call = 1; call <= 5; ++call) {
      StreamRequest* op = batch.add_batch();
      op->set_call(call);
      op->mutable_pull()->set_job("answers");
    }
    ASSERT_TRUE(stream->Write(batch));
    ASSERT_TRUE(stream->WritesDone());
    std::vector<StreamResponse> messages;
    for (StreamResponse r; stream->Read(&r);) messages.push_back(r);
    ASSERT_TRUE(stream->Finish().ok());
    const auto& md = ctx->GetServerInitialMetadata();
    ASSERT_NE(md.find(kStreamBatchMetadata), md.end());
    EXPECT_EQ(md.find(kStreamBatchMetadata)->second, "1");
    std::vector<StreamResponse> answers;
    for (const StreamResponse& m : messages) {
      if (m.batch_size() == 0) answers.push_back(m);
      for (const StreamResponse& e : m.batch()) answers.push_back(e);
    }
    EXPECT_EQ(messages.size(), announce ? 1u : 5u);
    ASSERT_EQ(answers.size(), 5u);
    for (size_t i = 0; i < answers.size(); ++i) {
      EXPECT_EQ(answers[i].call(), i + 1);  // Started, and here completed, in batch order.
      EXPECT_EQ(answers[i].code(), 0) << answers[i].message();
      EXPECT_EQ(answers[i].pull().chunks_size(),
                static_cast<int>(MakePartition(l, 1).chunks().size()));
    }
  }
}

// A malformed batch ends its stream with INVALID_ARGUMENT saying what was wrong, and none of
// its operations is applied, not even the well-formed ones before the fault.
TEST_F(StreamTest, AMalformedBatchEndsItsStreamAndAppliesNothing) {
  const JobLayout l = Layout("badbatch");
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  const std::string before = Snapshot(stubs_[0].get(), "badbatch");
  const Partition p = MakePartition(l, 1);
  const Values g = Grad(l, 0);
  StreamRequest push;
  push.set_call(1);
  push.mutable_push()->set_job("badbatch");
  push.mutable_push()->set_request_id(5);
  for (const ChunkInfo& ci : p.chunks()) {
    ChunkData* d = push.mutable_push()->add_chunks();
    d->set_tensor(ci.tensor);
    d->set_chunk(ci.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(g[ci.tensor].data() + ci.offset, ci.numel));
  }
  StreamRequest pull;
  pull.mutable_pull()->set_job("badbatch");
  std::vector<std::pair<StreamRequest, std::string>> cases;
  StreamRequest m;
  *m.add_batch() = push;
  *m.add_batch() = pull;
  m.mutable_batch(1)->set_call(1);
  cases.push_back({m, "(batch element 2 of 2) reuses call id 1"});
  m.mutable_batch(1)->set_call(2);
  *m.mutable_batch(1)->add_batch() = pull;
  cases.push_back({m, "(batch element 2 of 2) sets batch"});
  m.Clear();
  m.set_call(3);  // Written first: read as one operation, which then carries a batch.
  *m.add_batch() = push;
  cases.push_back({m, "message 1 sets batch"});
  m.Clear();
  *m.add_batch() = push;
  for (uint64_t call = 2; call <= kMaxStreamBatch + 1; ++call) {
    *m.add_batch() = pull;
    m.mutable_batch(m.batch_size() - 1)->set_call(call);
  }
  cases.push_back({m, "a batch of more than 256 elements"});
  for (const auto& [message, why] : cases) {
    auto ctx = Ctx();
    auto stream = stubs_[0]->Stream(ctx.get());
    stream->Write(message);  // The shard may end the stream before this returns.
    stream->WritesDone();
    StreamResponse r;
    EXPECT_FALSE(stream->Read(&r));
    const grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(why), std::string::npos) << st.error_message();
  }
  EXPECT_EQ(Snapshot(stubs_[0].get(), "badbatch"), before);
  EXPECT_EQ(RawInfo(stubs_[0].get(), "badbatch").pushes_applied(), 0);
  // The same push in a well-formed batch is applied: the refusals above were the batches'.
  m.Clear();
  *m.add_batch() = push;
  *m.add_batch() = pull;
  m.mutable_batch(1)->set_call(2);
  auto ctx = Ctx();
  auto stream = stubs_[0]->Stream(ctx.get());
  ASSERT_TRUE(stream->Write(m));
  ASSERT_TRUE(stream->WritesDone());
  for (StreamResponse r; stream->Read(&r);) EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(RawInfo(stubs_[0].get(), "badbatch").pushes_applied(), 1);
  EXPECT_NE(Snapshot(stubs_[0].get(), "badbatch"), before);
}

// The unary Push and Pull take raw bytes (so that pulled values are not copied twice): bytes
// that do not parse are INVALID_ARGUMENT naming the message, and change nothing; a push that
// carries its pull (PushRequest.pull) answers with the values after it, over the typed stub
// as over the stream.
TEST_F(StreamTest, UnaryCallsRefuseUnparsableBytesAndAnswerFusedPushes) {
  const JobLayout l = Layout("raw");
  auto c = Client(l, Options({servers_[0]->addr, servers_[1]->addr}, "unary"));
  ASSERT_NE(c, nullptr);
  ASSERT_OK(c->InitJob(ConstSpans(OddInit(l))));
  const std::string before = Snapshot(stubs_[0].get(), "raw");
  grpc::GenericStub generic(MakeChannel(servers_[0]->addr, RpcOptions()));
  for (const std::string method : {"Push", "Pull"}) {
    const std::string garbage("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 11);
    grpc::Slice slice(garbage.data(), garbage.size());
    const grpc::ByteBuffer req(&slice, 1);
    grpc::ByteBuffer resp;
    grpc::ClientContext ctx;
    absl::Notification done;
    grpc::Status st;
    generic.UnaryCall(&ctx, "/gradmesh.ParameterService/" + method, grpc::StubOptions(), &req,
                      &resp, [&](grpc::Status s) {
                        st = std::move(s);
                        done.Notify();
                      });
    done.WaitForNotification();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_EQ(st.error_message(), method + ": the request is not a " + method +
                                      "Request: " + method + "Request: malformed");
  }
  EXPECT_EQ(Snapshot(stubs_[0].get(), "raw"), before);

  // A fused push over the typed stub: its pulled chunks are exactly a Pull's after it.
  const Partition p = MakePartition(l, 2);
  PushRequest push;
  push.set_job("raw");
  push.set_step(1);
  push.set_request_id(77);
  for (int64_t idx : p.shard_chunks(0)) {
    const ChunkInfo& ci = p.chunks()[idx];
    ChunkData* d = push.add_chunks();
    d->set_tensor(ci.tensor);
    d->set_chunk(ci.chunk);
    d->set_dtype(FLOAT32);
    const std::vector<float> g(static_cast<size_t>(ci.numel), 0.5f);
    d->set_data(std::string(reinterpret_cast<const char*>(g.data()), g.size() * sizeof(float)));
  }
  push.mutable_pull()->set_job("raw");
  PushResponse fused;
  ASSERT_TRUE(RawPush(stubs_[0].get(), push, &fused).ok());
  PullRequest pull;
  pull.set_job("raw");
  PullResponse after;
  ASSERT_TRUE(RawPull(stubs_[0].get(), pull, &after).ok());
  EXPECT_EQ(fused.pulled().SerializeAsString(), after.SerializeAsString());
  EXPECT_NE(Snapshot(stubs_[0].get(), "raw"), before);
  ASSERT_GT(after.chunks_size(), 0);
  EXPECT_EQ(after.chunks(0).version(), 1);
}

// The push of `step` on job "unread" (worker 0): 16 floats into tensor 0 and, in the same call,
// a pull of everything the shard holds (PushRequest.pull with no chunks listed).
StreamRequest FusedSmallPush(uint64_t call, int64_t step) {
  StreamRequest op;
  op.set_call(call);
  PushRequest* push = op.mutable_push();
  push->set_job("unread");
  push->set_step(step);
  push->set_request_id(1000 + static_cast<uint64_t>(step));
  ChunkData* d = push->add_chunks();
  d->set_tensor(0);
  d->set_chunk(0);
  d->set_dtype(FLOAT32);
  d->set_data(Bytes(std::vector<float>(16, 0.25f)));
  push->mutable_pull()->set_job("unread");
  return op;
}

JobLayout UnreadLayout() {
  JobLayout l;
  l.job = "unread";
  l.tensors = {Tensor("a", {16}), Tensor("big", {1 << 19})};  // 2 MiB of values.
  l.chunk_elems = 1 << 16;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(0.01);
  l.num_workers = 1;
  return l;
}

// A client that sends many operations and does not read their answers holds a bounded share
// of the shard's memory: 256 fused pushes in one batch, each answered with the shard's 2 MiB of
// values, would be 512 MiB of answers at once; the stream starts its operations only while the
// answers waiting to be written stay under 64 MiB, and starts the rest, in order, as the
// client reads.
TEST_F(StreamTest, AClientThatDoesNotReadItsAnswersHoldsBoundedMemory) {
  const JobLayout l = UnreadLayout();
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  constexpr int kOps = 256;
  StreamRequest m;
  for (int i = 1; i <= kOps; ++i) *m.add_batch() = FusedSmallPush(i, i);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stubs_[0]->Stream(&ctx);
  ASSERT_TRUE(stream->Write(m));
  // Time for every operation to run if nothing held them back (each takes well under 1 ms).
  absl::SleepFor(absl::Seconds(1));
  const int64_t started = RawInfo(stubs_[0].get(), "unread").pushes_applied();
  EXPECT_GE(started, 1);
  // 64 MiB of answers is 32; gRPC's windows and the socket take a few more off the shard.
  EXPECT_LE(started, 48);
  ASSERT_TRUE(stream->WritesDone());
  int answers = 0;
  for (StreamResponse r; stream->Read(&r);) {
    ++answers;
    EXPECT_EQ(r.code(), 0) << r.message();
    EXPECT_EQ(r.call(), static_cast<uint64_t>(answers));  // Started, and so answered, in order.
    EXPECT_EQ(r.push().pulled().chunks_size(), 9);
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(answers, kOps);
  const JobInfoResponse info = RawInfo(stubs_[0].get(), "unread");
  EXPECT_EQ(info.pushes_applied(), kOps);
  EXPECT_EQ(info.duplicates_dropped(), 0);
}

// Operations sent as separate messages start in message order, also while answers are being
// written on other threads: pushes of increasing steps from one worker are all applied (a push
// started after a later step of its worker would be dropped as a duplicate).
TEST_F(StreamTest, OperationsOfSeparateMessagesStartInMessageOrder) {
  const JobLayout l = UnreadLayout();
  auto c = InitJobOn(servers_[0]->addr, l);
  ASSERT_NE(c, nullptr);
  constexpr int kOps = 300;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stubs_[0]->Stream(&ctx);
  std::thread reader([&] {
    for (StreamResponse r; stream->Read(&r);) EXPECT_EQ(r.code(), 0) << r.message();
  });
  for (int i = 1; i <= kOps; ++i) ASSERT_TRUE(stream->Write(FusedSmallPush(i, i)));
  stream->WritesDone();
  reader.join();
  EXPECT_TRUE(stream->Finish().ok());
  const JobInfoResponse info = RawInfo(stubs_[0].get(), "unread");
  EXPECT_EQ(info.pushes_applied(), kOps);
  EXPECT_EQ(info.duplicates_dropped(), 0);
}

// A push of more chunks than a job may have (--max_chunks_per_job) is refused before its
// chunks are decoded (an empty chunk is 2 bytes on the wire and about a hundred decoded),
// over the unary call and the stream, naming the limit, and changes nothing.
TEST(StreamLimitsTest, APushOfMoreChunksThanAJobMayHaveIsRefusedUndecoded) {
  ShardOptions options;
  options.limits.max_chunks_per_job = 64;
  auto server = StartShardServer(std::move(options));
  ASSERT_NE(server, nullptr);
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  const JobLayout l = Layout("chunks");
  auto c = InitJobOn(server->addr, l);
  ASSERT_NE(c, nullptr);
  const std::string before = Snapshot(stub.get(), "chunks");
  PushRequest push;
  push.set_job("chunks");
  push.set_step(1);
  push.set_request_id(9);
  for (int i = 0; i < 65; ++i) push.add_chunks();  // Empty chunks: 2 bytes each.
  PushResponse resp;
  grpc::Status st = RawPush(stub.get(), push, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(),
            "Push: more than 64 chunks, more than a job has (--max_chunks_per_job)");
  StreamRequest m;
  m.set_call(1);
  *m.mutable_push() = push;
  auto ctx = Ctx();
  auto stream = stub->Stream(ctx.get());
  stream->Write(m);  // The shard may end the stream before this returns.
  stream->WritesDone();
  StreamResponse r;
  EXPECT_FALSE(stream->Read(&r));
  st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(),
            "Stream: message 1: more than 64 chunks, more than a job has (--max_chunks_per_job)");
  // One budget per message: a batch of two pushes of 40 chunks each is refused at its second.
  m.Clear();
  for (int e = 0; e < 2; ++e) {
    StreamRequest* op = m.add_batch();
    op->set_call(e + 1);
    *op->mutable_push() = push;
    op->mutable_push()->mutable_chunks()->DeleteSubrange(0, 25);
  }
  auto batch_ctx = Ctx();
  auto batch = stub->Stream(batch_ctx.get());
  batch->Write(m);
  batch->WritesDone();
  EXPECT_FALSE(batch->Read(&r));
  st = batch->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(),
            "Stream: message 1 (batch element 2 of 2): more than 64 chunks, more than a job has "
            "(--max_chunks_per_job)");
  EXPECT_EQ(Snapshot(stub.get(), "chunks"), before);
  EXPECT_EQ(RawInfo(stub.get(), "chunks").pushes_applied(), 0);
}

}  // namespace
}  // namespace gradmesh
