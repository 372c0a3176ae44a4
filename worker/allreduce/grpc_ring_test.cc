// Tests of the gRPC ring (grpc_ring.h, collective_service.h): real servers on 127.0.0.1, one
// CollectiveServiceImpl per simulated process, ring all-reduce through them.
#include "worker/allreduce/grpc_ring.h"

#include <grpcpp/grpcpp.h>

#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/collective.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {
namespace {

// One "process": a service and the server that serves it.
struct Node {
  std::unique_ptr<CollectiveServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

Node StartNode(CollectiveServiceImpl::Options options = {}) {
  Node n;
  n.service = std::make_unique<CollectiveServiceImpl>(options);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.SetMaxReceiveMessageSize(64 << 20);
  b.RegisterService(n.service.get());
  n.server = b.BuildAndStart();
  EXPECT_NE(n.server, nullptr);
  n.address = absl::StrCat("127.0.0.1:", port);
  return n;
}

float Input(int job, int rank, int64_t i) {
  return static_cast<float>((i % 89) * (rank + 1) + 1000 * job - rank);
}

class GrpcRingTest : public ::testing::Test {
 protected:
  void Start(int n, CollectiveServiceImpl::Options options = {}) {
    for (int i = 0; i < n; ++i) {
      nodes_.push_back(StartNode(options));
      addresses_.push_back(nodes_.back().address);
    }
  }
  void TearDown() override {
    for (Node& n : nodes_) {
      if (n.server) n.server->Shutdown(absl::ToChronoTime(absl::Now()));
    }
  }

  std::unique_ptr<RingTransport> Transport(const std::string& job, int rank, std::vector<int> nodes,
                                           const RingAbort* abort = nullptr) {
    GrpcRingOptions o;
    o.abort = abort;
    o.job = job;
    o.rank = rank;
    for (int i : nodes) o.peers.push_back(addresses_[i]);
    o.local = nodes_[nodes[rank]].service.get();
    o.close_timeout = absl::Seconds(5);
    auto t = NewGrpcRingTransport(o);
    EXPECT_OK(t.status());
    return t.ok() ? std::move(t).value() : nullptr;
  }

  std::vector<Node> nodes_;
  std::vector<std::string> addresses_;
};

// Regression: copied sends of a few bytes fit an inlined gRPC slice, whose bytes live in the
// slice struct itself; they used to be written after the struct was copied, so tiny
// all-gather strings (e.g. the checkpoint steps "50") and fp16 messages arrived as garbage.
TEST_F(GrpcRingTest, TinyCopiedMessagesArriveIntact) {
  Start(2);
  std::vector<std::vector<std::string>> got(2);
  std::vector<std::vector<float>> sums(2);
  std::vector<absl::Status> st(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto t = Transport("tiny", r, {0, 1});
      if (t == nullptr) return;
      RingOptions o;
      o.timeout = absl::Seconds(10);
      for (const std::string& mine : {std::string(""), std::string(1, 'a' + r),
                                      absl::StrCat("r", r), std::string(20, 'x' + r)}) {
        absl::StatusOr<std::vector<std::string>> all = RingAllgather(t.get(), mine, o);
        st[r] = all.status();
        if (!all.ok()) return;
        for (const std::string& s : *all) got[r].push_back(s);
      }
      o.codec = RingCodec::kFp16;  // Copied, 2 bytes per element.
      sums[r] = {1.0f + r, 2.0f * (r + 1), -3.0f};
      st[r] = RingAllreduce(t.get(), absl::MakeSpan(sums[r]), o);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(st[r]) << "rank " << r;
    EXPECT_EQ(got[r], (std::vector<std::string>{"", "", "a", "b", "r0", "r1", std::string(20, 'x'),
                                                std::string(20, 'y')}))
        << "rank " << r;
    EXPECT_EQ(sums[r], (std::vector<float>{3.0f, 6.0f, -6.0f})) << "rank " << r;
  }
}

TEST_F(GrpcRingTest, SeveralJobsAtOnceSumExactly) {
  Start(3);
  // Job 0: 3 ranks on nodes 0,1,2; job 1: 3 ranks on nodes 2,0,1; job 2: 2 ranks on 1,2.
  const std::vector<std::vector<int>> placement = {{0, 1, 2}, {2, 0, 1}, {1, 2}};
  const std::vector<int64_t> lengths = {1000003, 77, 300001};
  std::vector<std::vector<std::vector<float>>> bufs(3);
  std::vector<std::thread> threads;
  std::vector<std::vector<absl::Status>> status(3);
  for (int j = 0; j < 3; ++j) {
    const int n = static_cast<int>(placement[j].size());
    bufs[j].assign(n, std::vector<float>(lengths[j]));
    status[j].resize(n);
    for (int r = 0; r < n; ++r) {
      for (int64_t i = 0; i < lengths[j]; ++i) bufs[j][r][i] = Input(j, r, i);
    }
  }
  for (int j = 0; j < 3; ++j) {
    for (int r = 0; r < static_cast<int>(placement[j].size()); ++r) {
      threads.emplace_back([&, j, r] {
        // Ranks start at different times: early streams wait for their inbox.
        absl::SleepFor(absl::Milliseconds(37 * r));
        auto t = Transport(absl::StrCat("job", j), r, placement[j]);
        if (t == nullptr) return;
        RingOptions o;
        o.segment_bytes = 64 << 10;
        o.timeout = absl::Seconds(20);
        // Two all-reduces on the same transport: the stream carries on.
        status[j][r] = RingAllreduce(t.get(), absl::MakeSpan(bufs[j][r]), o);
        if (status[j][r].ok()) {
          for (float& v : bufs[j][r]) v = v * 0.5f;
          status[j][r] = RingAllreduce(t.get(), absl::MakeSpan(bufs[j][r]), o);
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  for (int j = 0; j < 3; ++j) {
    const int n = static_cast<int>(placement[j].size());
    for (int r = 0; r < n; ++r) {
      ASSERT_OK(status[j][r]) << "job " << j << " rank " << r;
      for (int64_t i = 0; i < lengths[j]; ++i) {
        float sum = 0;
        for (int q = 0; q < n; ++q) sum += Input(j, q, i);
        // Second round: n copies of sum / 2.
        const float want = static_cast<float>(n) * (sum * 0.5f);
        ASSERT_EQ(bufs[j][r][i], want) << "job " << j << " rank " << r << " element " << i;
      }
    }
  }
}

TEST_F(GrpcRingTest, SmallInboxBackpressureStillExact) {
  CollectiveServiceImpl::Options options;
  options.inbox_bytes = 40 << 10;  // Below one segment: every chunk pauses the stream.
  Start(2, options);
  const int64_t len = 1 << 20;
  std::vector<std::vector<float>> bufs(2, std::vector<float>(len));
  for (int r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < len; ++i) bufs[r][i] = Input(0, r, i);
  }
  std::vector<absl::Status> st(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto t = Transport("bp", r, {0, 1});
      RingOptions o;
      o.segment_bytes = 64 << 10;
      st[r] = RingAllreduce(t.get(), absl::MakeSpan(bufs[r]), o);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(st[r]);
    for (int64_t i = 0; i < len; ++i) ASSERT_EQ(bufs[r][i], Input(0, 0, i) + Input(0, 1, i));
  }
}

TEST_F(GrpcRingTest, DeadPeerFailsBothNeighboursFastNamingIt) {
  Start(3);
  std::vector<std::unique_ptr<RingTransport>> t;
  for (int r = 0; r < 3; ++r) t.push_back(Transport("dead", r, {0, 1, 2}));
  // A first all-reduce connects every link.
  {
    std::vector<std::vector<float>> bufs(3, std::vector<float>(100, 1));
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back(
          [&, r] { EXPECT_OK(RingAllreduce(t[r].get(), absl::MakeSpan(bufs[r]), RingOptions())); });
    }
    for (auto& th : threads) th.join();
    EXPECT_EQ(bufs[0][0], 3);
  }
  // Ranks 0 and 2 start the next one; rank 1's process dies (server gone, then transport).
  RingOptions o;
  o.timeout = absl::Seconds(20);
  std::vector<float> b0(1000, 1), b2(1000, 1);
  absl::Status s0, s2;
  const absl::Time start = absl::Now();
  std::thread t0([&] { s0 = RingAllreduce(t[0].get(), absl::MakeSpan(b0), o); });
  std::thread t2([&] { s2 = RingAllreduce(t[2].get(), absl::MakeSpan(b2), o); });
  absl::SleepFor(absl::Milliseconds(200));
  nodes_[1].server->Shutdown(absl::ToChronoTime(absl::Now()));
  nodes_[1].server.reset();
  t[1].reset();
  t0.join();
  t2.join();
  const std::string rank1 = absl::StrCat("rank 1 (", addresses_[1], ")");
  EXPECT_STATUS_MSG(s0, absl::StatusCode::kUnavailable, "ring link to " + rank1);
  EXPECT_STATUS_MSG(s2, absl::StatusCode::kUnavailable, "ring link from " + rank1);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "should not wait for the timeout";
}

TEST_F(GrpcRingTest, SilentPeerTimesOutNamingIt) {
  Start(2);
  auto t0 = Transport("silent", 0, {0, 1});
  auto t1 = Transport("silent", 1, {0, 1});  // Alive, but never takes part.
  RingOptions o;
  o.timeout = absl::Milliseconds(800);
  std::vector<float> b(10, 1);
  const absl::Time start = absl::Now();
  absl::Status st = RingAllreduce(t0.get(), absl::MakeSpan(b), o);
  const absl::Duration took = absl::Now() - start;
  EXPECT_STATUS_MSG(st, absl::StatusCode::kDeadlineExceeded,
                    absl::StrCat("nothing from rank 1 (", addresses_[1], ") within"));
  EXPECT_GE(took, absl::Milliseconds(790));
  EXPECT_LT(took, absl::Seconds(3));
}

TEST_F(GrpcRingTest, PeerThatNeverStartsTimesOutSayingSo) {
  Start(2);
  auto t0 = Transport("absent", 0, {0, 1});  // Rank 1 never opens its transport.
  RingOptions o;
  o.timeout = absl::Milliseconds(500);
  std::vector<float> b(10, 1);
  EXPECT_STATUS_MSG(RingAllreduce(t0.get(), absl::MakeSpan(b), o),
                    absl::StatusCode::kDeadlineExceeded, "(it never connected)");
}

TEST_F(GrpcRingTest, AnAbortEndsAWaitAtOnce) {
  Start(2);
  RingAbort abort{false};
  auto t0 = Transport("aborted", 0, {0, 1}, &abort);  // Rank 1 never opens its transport.
  RingOptions o;
  o.timeout = absl::Seconds(20);
  std::vector<float> b(10, 1);
  std::thread later([&] {
    absl::SleepFor(absl::Milliseconds(300));
    abort.store(true);
  });
  const absl::Time start = absl::Now();
  const absl::Status st = RingAllreduce(t0.get(), absl::MakeSpan(b), o);
  const absl::Duration took = absl::Now() - start;
  later.join();
  EXPECT_STATUS_MSG(st, absl::StatusCode::kAborted, "aborted");
  EXPECT_LT(took, absl::Seconds(3));
  t0.reset();
  // Nor does closing wait for rank 1's acknowledgement (close_timeout, 5 s here) once the
  // abort is set, even with no wait failed before it: a message sent, then the abort.
  RingAbort abort2{false};
  auto t2 = Transport("aborted2", 0, {0, 1}, &abort2);
  ASSERT_OK(t2->Send(absl::MakeConstSpan("hello", 5)));
  abort2.store(true);
  const absl::Time closing = absl::Now();
  t2.reset();
  EXPECT_LT(absl::Now() - closing, absl::Seconds(3));
}

TEST_F(GrpcRingTest, SameRankTwiceInOneProcessIsAlreadyExists) {
  Start(2);
  auto t0 = Transport("twice", 0, {0, 1});
  GrpcRingOptions o;
  o.job = "twice";
  o.rank = 0;
  o.peers = addresses_;
  o.local = nodes_[0].service.get();
  EXPECT_STATUS(NewGrpcRingTransport(o).status(), absl::StatusCode::kAlreadyExists);
  o.rank = 2;
  EXPECT_STATUS(NewGrpcRingTransport(o).status(), absl::StatusCode::kInvalidArgument);
}

// Bad requests end their own stream with the right code and leave the job's ring working.
TEST_F(GrpcRingTest, BadStreamsAreRefusedAndTheJobCarriesOn) {
  Start(2);
  auto stub = CollectiveService::NewStub(
      grpc::CreateChannel(addresses_[1], grpc::InsecureChannelCredentials()));
  auto send = [&](std::vector<RingChunk> chunks) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    RingAck ack;
    auto writer = stub->Ring(&ctx, &ack);
    for (const RingChunk& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  };
  RingChunk bad;
  bad.set_job("ok");
  bad.set_from_rank(0);
  bad.set_to_rank(0);  // Not (0 + 1) mod 2.
  bad.set_world_size(2);
  EXPECT_STATUS_MSG(send({bad}), absl::StatusCode::kPermissionDenied,
                    "only rank 1 (its predecessor in the ring) feeds rank 0");
  bad.set_to_rank(2);  // Outside the ring.
  EXPECT_STATUS_MSG(send({bad}), absl::StatusCode::kInvalidArgument, "bad identity");

  // The real job: rank 1's inbox gets its stream from the real rank 0 first.
  auto t0 = Transport("ok", 0, {0, 1});
  auto t1 = Transport("ok", 1, {0, 1});
  std::vector<std::vector<float>> bufs(2, std::vector<float>(1000, 2));
  auto run = [&] {
    std::vector<absl::Status> st(2);
    std::thread a([&] { st[0] = RingAllreduce(t0.get(), absl::MakeSpan(bufs[0]), {}); });
    std::thread b([&] { st[1] = RingAllreduce(t1.get(), absl::MakeSpan(bufs[1]), {}); });
    a.join();
    b.join();
    EXPECT_OK(st[0]);
    EXPECT_OK(st[1]);
  };
  run();
  EXPECT_EQ(bufs[1][999], 4);

  // An impostor for the same inbox, and a wrong world size.
  RingChunk dup;
  dup.set_job("ok");
  dup.set_from_rank(0);
  dup.set_to_rank(1);
  dup.set_world_size(2);
  dup.set_data(std::string(8, 'x'));
  EXPECT_STATUS_MSG(send({dup}), absl::StatusCode::kFailedPrecondition,
                    "already has its ring link");
  // A stream that changes identity mid-way.
  RingChunk a = dup, b = dup;
  a.set_job("other");
  b.set_job("other2");
  b.set_seq(1);
  auto other = Transport("other", 1, {0, 1});  // So that the first chunk is attached.
  EXPECT_STATUS_MSG(send({a, b}), absl::StatusCode::kInvalidArgument, "on the stream");

  run();  // Still fine.
  EXPECT_EQ(bufs[0][0], 8);
  EXPECT_EQ(bufs[1][0], 8);
}

}  // namespace
}  // namespace gradmesh
