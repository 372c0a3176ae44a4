// The collective peer plane's authentication over real gRPC on 127.0.0.1
// (collective_service.h, worker/core/peer_token.h): a Ring stream without the job token is
// UNAUTHENTICATED, one with another job's token or a guess PERMISSION_DENIED, whether the
// inbox is already open or opens later (held stream); a stream from a rank that is not the
// receiver's ring predecessor PERMISSION_DENIED; a refused stream never takes the inbox
// (it stays unconnected and empty, and the real previous rank's chunks then arrive exactly);
// ring names that do not start with a valid job name are INVALID_ARGUMENT; whole rings (grpc
// and tcp transports) run with matching tokens and fail with mismatched ones, and with rank
// tokens a rank cannot send as another.
#include <grpcpp/grpcpp.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "common/token_hash.h"
#include "gtest/gtest.h"
#include "proto/collective.grpc.pb.h"
#include "rpc/grpc_status.h"
#include "worker/allreduce/collective.h"
#include "worker/allreduce/collective_service.h"
#include "worker/allreduce/grpc_ring.h"
#include "worker/allreduce/ring.h"

namespace gradmesh {
namespace {

constexpr char kTokenA[] = "token-of-job-a-0123456789";
constexpr char kTokenB[] = "token-of-job-b-9876543210";

struct Node {
  std::unique_ptr<CollectiveServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

std::unique_ptr<Node> StartNode(CollectiveServiceImpl::Options options = {}) {
  auto n = std::make_unique<Node>();
  n->service = std::make_unique<CollectiveServiceImpl>(options);
  grpc::ServerBuilder b;
  int port = 0;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(n->service.get());
  n->server = b.BuildAndStart();
  EXPECT_NE(n->server, nullptr);
  n->address = absl::StrCat("127.0.0.1:", port);
  return n;
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

RingChunk Chunk(const std::string& job, int from, int to, int ws, uint64_t seq,
                const std::string& data) {
  RingChunk c;
  c.set_job(job);
  c.set_from_rank(from);
  c.set_to_rank(to);
  c.set_world_size(ws);
  c.set_seq(seq);
  c.set_data(data);
  return c;
}

std::string Bytes(const RingMessage& m) {
  std::string out;
  for (auto p : m.pieces) out.append(p.data(), p.size());
  return out;
}

class RingAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = StartNode();
    stub_ = CollectiveService::NewStub(
        grpc::CreateChannel(node_->address, grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    for (auto& n : {node_.get(), other_.get()}) {
      if (n != nullptr) n->server->Shutdown(absl::ToChronoTime(absl::Now()));
    }
  }

  // Rank 0 on node_ and rank 1 on other_ all-reduce {1, 2, 3} and {10, 20, 30} over
  // `transport` as `job`, each rank's context shaped by `configure(rank, &context)` (tokens);
  // returns both ranks' data after the run and their statuses.
  struct TwoRankRun {
    std::vector<std::vector<float>> data = {{1, 2, 3}, {10, 20, 30}};
    std::vector<absl::Status> st = std::vector<absl::Status>(2);
  };
  TwoRankRun RunTwoRanks(const std::string& job, const std::string& transport,
                         const std::function<void(int, CollectiveContext*)>& configure) {
    TwoRankRun run;
    std::vector<absl::StatusOr<std::unique_ptr<RingTransport>>> t(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        CollectiveContext c;
        c.job = job;
        c.rank = r;
        c.peers = {node_->address, other_->address};
        c.local = r == 0 ? node_->service.get() : other_->service.get();
        c.timeout = absl::Seconds(3);
        c.transport = transport;
        configure(r, &c);
        // The registry outlives the factory it hands out (Find returns a pointer into it).
        const auto transports = RingTransportsWithBuiltins();
        auto factory = transports.Find(transport);
        t[r] = (**factory)(c);
        if (!t[r].ok()) {
          run.st[r] = t[r].status();
          return;
        }
        RingOptions ro;
        ro.timeout = absl::Seconds(3);
        run.st[r] = RingAllreduce(t[r]->get(), absl::MakeSpan(run.data[r]), ro);
      });
    }
    for (auto& th : threads) th.join();
    return run;
  }

  // One whole Ring call: writes `chunks`, half-closes, returns the server's status.
  // token nullptr: no metadata.
  absl::Status Send(const std::vector<RingChunk>& chunks, const char* token) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (token != nullptr) ctx.AddMetadata("x-gradmesh-job-token", token);
    RingAck ack;
    auto writer = stub_->Ring(&ctx, &ack);
    for (const RingChunk& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  }

  // The inbox is exactly as opened: nothing queued, never connected.
  void ExpectUntouched(const std::shared_ptr<CollectiveServiceImpl::Inbox>& inbox) {
    absl::StatusOr<RingMessage> m =
        node_->service->Receive(inbox, absl::Now() + absl::Milliseconds(100));
    EXPECT_STATUS_MSG(m, absl::StatusCode::kDeadlineExceeded, "(it never connected)");
  }

  std::unique_ptr<Node> node_, other_;
  std::unique_ptr<CollectiveService::Stub> stub_;
};

TEST_F(RingAuthTest, RefusedStreamsNeverTakeTheInbox) {
  ASSERT_OK_AND_ASSIGN(auto inbox,
                       node_->service->OpenInbox("job-a", 1, 3, "rank 0 (test)", kTokenA));
  const RingChunk first = Chunk("job-a", 0, 1, 3, 0, Floats({9, 9}));
  EXPECT_STATUS_MSG(Send({first}, nullptr), absl::StatusCode::kUnauthenticated,
                    "refused by rank 1: no job token");
  ExpectUntouched(inbox);
  // A rank of job b with its own valid token, and guesses.
  absl::Status st = Send({first}, kTokenB);
  EXPECT_STATUS_MSG(st, absl::StatusCode::kPermissionDenied, "wrong job token");
  EXPECT_EQ(st.message().find(kTokenA), absl::string_view::npos);
  EXPECT_STATUS(Send({first}, "token-of-job-a-012345678"), absl::StatusCode::kPermissionDenied);
  EXPECT_STATUS(Send({first}, ""), absl::StatusCode::kPermissionDenied);
  ExpectUntouched(inbox);

  // The real rank 0: its chunks arrive exactly, in order, from seq 0.
  ASSERT_OK(Send(
      {Chunk("job-a", 0, 1, 3, 0, Floats({1, 2, 3})), Chunk("job-a", 0, 1, 3, 1, Floats({4.5f}))},
      kTokenA));
  ASSERT_OK_AND_ASSIGN(RingMessage m0,
                       node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(Bytes(m0), Floats({1, 2, 3}));
  ASSERT_OK_AND_ASSIGN(RingMessage m1,
                       node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(Bytes(m1), Floats({4.5f}));
  EXPECT_STATUS_MSG(node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)),
                    absl::StatusCode::kUnavailable, "ended");
  node_->service->CloseInbox(inbox);
}

TEST_F(RingAuthTest, HeldStreamsAreCheckedWhenTheInboxOpens) {
  // The stranger's stream arrives before rank 2 starts: it is held, then refused.
  absl::Status stranger;
  std::thread t([&] { stranger = Send({Chunk("job-a", 1, 2, 3, 0, Floats({7}))}, kTokenB); });
  absl::SleepFor(absl::Milliseconds(200));  // Usually held by now; either order must pass.
  ASSERT_OK_AND_ASSIGN(auto inbox,
                       node_->service->OpenInbox("job-a", 2, 3, "rank 1 (test)", kTokenA));
  t.join();
  EXPECT_STATUS(stranger, absl::StatusCode::kPermissionDenied);
  ExpectUntouched(inbox);
  ASSERT_OK(Send({Chunk("job-a", 1, 2, 3, 0, Floats({8}))}, kTokenA));
  ASSERT_OK_AND_ASSIGN(RingMessage m,
                       node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(Bytes(m), Floats({8}));
  node_->service->CloseInbox(inbox);
}

// Streams for inboxes that are not open yet are held with their first chunk before their token
// can be checked (the inbox says which token it needs): the bytes held are bounded
// (Options::max_held_bytes), one stream always fits, and a stream that goes frees its share.
TEST(RingHeldBytesTest, HeldFirstChunksAreBoundedInBytes) {
  CollectiveServiceImpl::Options o;
  o.max_held_bytes = int64_t{1} << 20;
  std::unique_ptr<Node> n = StartNode(o);
  ASSERT_NE(n->server, nullptr);
  auto stub = CollectiveService::NewStub(
      grpc::CreateChannel(n->address, grpc::InsecureChannelCredentials()));
  // A first chunk of `bytes` for rank 1 of `job` (not served here), without a token; the
  // stream's status once it ends (a held stream waits for its inbox until its deadline).
  const auto send = [&](const std::string& job, size_t bytes) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(1500)));
    RingAck ack;
    auto w = stub->Ring(&ctx, &ack);
    w->Write(Chunk(job, 0, 1, 2, 0, std::string(bytes, 'x')));
    w->WritesDone();
    return FromGrpcStatus(w->Finish());
  };
  // 2 MiB and 1 KiB at once: whichever comes first is held, the other refused.
  absl::Status big, small;
  std::thread t([&] { big = send("ghost", 2 << 20); });
  small = send("ghost2", 1024);
  t.join();
  const bool big_held = big.code() == absl::StatusCode::kDeadlineExceeded;
  EXPECT_STATUS_MSG(big_held ? small : big, absl::StatusCode::kResourceExhausted,
                    "bytes of streams already wait for ranks not served here");
  EXPECT_STATUS(big_held ? big : small, absl::StatusCode::kDeadlineExceeded);
  // Both gone (the server sees the deadline pass a moment after the client): their shares are
  // free, and a 2 MiB one is held again.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_STATUS(send("ghost3", 2 << 20), absl::StatusCode::kDeadlineExceeded);
  n->server->Shutdown(absl::ToChronoTime(absl::Now()));
}

// A rank that is not the inbox's predecessor in the ring (even with the right token) is
// refused before it can be held or attached.
TEST_F(RingAuthTest, OnlyThePredecessorFeedsARank) {
  ASSERT_OK_AND_ASSIGN(auto inbox,
                       node_->service->OpenInbox("job-a", 1, 4, "rank 0 (test)", kTokenA));
  for (int from : {1, 2, 3}) {
    EXPECT_STATUS_MSG(Send({Chunk("job-a", from, 1, 4, 0, Floats({9}))}, kTokenA),
                      absl::StatusCode::kPermissionDenied,
                      "only rank 0 (its predecessor in the ring) feeds rank 1")
        << from;
  }
  ExpectUntouched(inbox);
  ASSERT_OK(Send({Chunk("job-a", 0, 1, 4, 0, Floats({2}))}, kTokenA));
  ASSERT_OK_AND_ASSIGN(RingMessage m,
                       node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(Bytes(m), Floats({2}));
  node_->service->CloseInbox(inbox);
}

TEST_F(RingAuthTest, RingNamesMustStartWithAValidJobName) {
  for (const std::string& bad :
       std::vector<std::string>{"../job-a", "Job-a", "job.a", "/leaders", std::string(100, 'a')}) {
    EXPECT_STATUS_MSG(Send({Chunk(bad, 0, 1, 2, 0, "")}, kTokenA),
                      absl::StatusCode::kInvalidArgument, "ring chunk: job")
        << bad;
  }
  // A sub-ring of a valid job (the hierarchical backend's) is fine.
  ASSERT_OK_AND_ASSIGN(auto inbox,
                       node_->service->OpenInbox("job-a/leaders", 1, 2, "rank 0 (test)", kTokenA));
  ASSERT_OK(Send({Chunk("job-a/leaders", 0, 1, 2, 0, Floats({3}))}, kTokenA));
  ASSERT_OK_AND_ASSIGN(RingMessage m,
                       node_->service->Receive(inbox, absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(Bytes(m), Floats({3}));
  node_->service->CloseInbox(inbox);
}

// Two ranks in two processes over each transport: the same token sums exactly; rank 1 holding
// another job's token refuses rank 0's stream, and the collective fails instead of mixing.
TEST_F(RingAuthTest, WholeRingsNeedMatchingTokens) {
  other_ = StartNode();
  for (const std::string transport : {"grpc", "tcp"}) {
    for (const bool match : {true, false}) {
      const std::string job = absl::StrCat("ring-", transport, match ? "-ok" : "-bad");
      TwoRankRun run = RunTwoRanks(job, transport, [&](int r, CollectiveContext* c) {
        c->job_token = (r == 1 && !match) ? kTokenB : kTokenA;
      });
      const std::vector<std::vector<float>>& data = run.data;
      const std::vector<absl::Status>& st = run.st;
      if (match) {
        EXPECT_OK(st[0]) << transport;
        EXPECT_OK(st[1]) << transport;
        EXPECT_EQ(data[0], (std::vector<float>{11, 22, 33})) << transport;
        EXPECT_EQ(data[1], (std::vector<float>{11, 22, 33})) << transport;
      } else {
        EXPECT_FALSE(st[0].ok()) << transport;
        EXPECT_FALSE(st[1].ok()) << transport;
        EXPECT_EQ(data[0], (std::vector<float>{1, 2, 3})) << transport;  // Nothing mixed in.
        EXPECT_EQ(data[1], (std::vector<float>{10, 20, 30})) << transport;
        // Each rank refuses the other's stream for its token; which error a rank reports
        // first (its refused link, or the refusal note on its silent inbox) is a race.
        EXPECT_NE(absl::StrCat(st[0].message(), st[1].message()).find("wrong job token"),
                  std::string::npos)
            << st[0] << " / " << st[1];
      }
    }
  }
}

// Coordinator-placed jobs: both ranks hold the job token, and each its own rank token. A
// ring where rank 1 sends with rank 0's token (a rank posing as another) is refused by rank
// 0's inbox and nothing is mixed; with the real tokens it sums exactly. Over each transport
// (the TCP ring's rendezvous runs over the authenticated gRPC ring).
TEST_F(RingAuthTest, EachRanksStreamMustCarryItsOwnRankToken) {
  other_ = StartNode();
  const std::vector<std::string> tokens = {"rank-0-secret-abc", "rank-1-secret-def"};
  const std::vector<std::string> hashes = {Sha256(tokens[0]), Sha256(tokens[1])};
  for (const std::string transport : {"grpc", "tcp"}) {
    for (const bool honest : {true, false}) {
      const std::string job = absl::StrCat("rank-", transport, honest ? "-ok" : "-posing");
      TwoRankRun run = RunTwoRanks(job, transport, [&](int r, CollectiveContext* c) {
        c->job_token = kTokenA;
        c->rank_token = (r == 1 && !honest) ? tokens[0] : tokens[r];
        c->rank_token_hashes = hashes;
      });
      const std::vector<std::vector<float>>& data = run.data;
      const std::vector<absl::Status>& st = run.st;
      if (honest) {
        EXPECT_OK(st[0]) << transport;
        EXPECT_OK(st[1]) << transport;
        EXPECT_EQ(data[0], (std::vector<float>{11, 22, 33})) << transport;
        EXPECT_EQ(data[1], (std::vector<float>{11, 22, 33})) << transport;
      } else {
        EXPECT_FALSE(st[0].ok()) << transport;
        EXPECT_FALSE(st[1].ok()) << transport;
        // Rank 0, whose inbox the poser tried, mixed nothing in (the poser itself did get
        // rank 0's honest first chunk).
        EXPECT_EQ(data[0], (std::vector<float>{1, 2, 3})) << transport;
        EXPECT_NE(absl::StrCat(st[0].message(), st[1].message()).find("is not rank 1's"),
                  std::string::npos)
            << st[0] << " / " << st[1];
      }
    }
  }
}

}  // namespace
}  // namespace gradmesh
