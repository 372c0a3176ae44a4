// The gossip peer plane's authentication over real gRPC on 127.0.0.1 (gossip_service.h,
// worker/core/peer_token.h): a call without the job token is UNAUTHENTICATED, one with another
// job's valid token, a guessed token, or from a rank the topology does not allow is
// PERMISSION_DENIED, and none of them changes anything (values, push-sum weight, step, the
// root's finals, checked exactly); a bad job name is INVALID_ARGUMENT; the right token is
// accepted; a rank registered without a token stays open. With rank tokens (coordinator-placed
// jobs) a call must also carry the token of the rank it claims to be.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "common/token_hash.h"
#include "gtest/gtest.h"
#include "proto/gossip.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "worker/gossip/gossip_service.h"
#include "worker/gossip/grpc_transport.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/topology.h"

namespace gradmesh {
namespace {

constexpr char kTokenA[] = "token-of-job-a-0123456789";
constexpr char kTokenB[] = "token-of-job-b-9876543210";

std::string Raw(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

// Rank `rank` of a 4-rank exponential job: in-neighbours of rank 1 are ranks 0 and 3.
std::shared_ptr<GossipReplica> Replica(const std::string& job, int32_t rank,
                                       std::vector<float> values) {
  GossipReplica::Options o;
  o.job = job;
  o.rank = rank;
  o.num_workers = 4;
  o.total_steps = 50;
  auto topology = TopologyRegistry::WithBuiltins().Create("exponential", 1);
  o.in_neighbours = InNeighbours(**topology, rank, 4);
  return std::make_shared<GossipReplica>(o, std::move(values), 1.0, 7);
}

GossipExchangeRequest Request(const std::string& job, int32_t from, int32_t to, GossipKind kind,
                              const std::vector<float>& v, double weight) {
  GossipExchangeRequest r;
  r.set_job(job);
  r.set_from_rank(from);
  r.set_to_rank(to);
  r.set_kind(kind);
  r.set_weight(weight);
  r.set_step(3);
  r.mutable_values()->set_numel(static_cast<int64_t>(v.size()));
  r.mutable_values()->set_data(Raw(v));
  return r;
}

class GossipPeerAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK(service_.Register(root_, kTokenA));
    ASSERT_OK(service_.Register(a1_, kTokenA));
    ASSERT_OK(service_.Register(b1_, kTokenB));
    ASSERT_OK(service_.Register(open1_));  // No token: open (standalone without one).
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = GossipService::NewStub(MakeChannel(address(), RpcOptions{}));
  }
  void TearDown() override { server_->Shutdown(); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // token nullptr: no metadata at all.
  grpc::Status Exchange(const GossipExchangeRequest& req, const char* token,
                        GossipExchangeResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (token != nullptr) ctx.AddMetadata("x-gradmesh-job-token", token);
    return stub_->Exchange(&ctx, req, resp);
  }
  grpc::Status GetState(const std::string& job, int32_t rank, const char* token,
                        GossipStateResponse* resp) {
    GossipStateRequest req;
    req.set_job(job);
    req.set_rank(rank);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (token != nullptr) ctx.AddMetadata("x-gradmesh-job-token", token);
    return stub_->GetState(&ctx, req, resp);
  }

  // Nothing changed: exact values, weight, step; the root has only its own (no) finals.
  void ExpectUntouched() {
    const ReplicaSnapshot s = a1_->Snapshot();
    EXPECT_EQ(s.values, (std::vector<float>{1, 2, 3}));
    EXPECT_EQ(s.weight, 1.0);
    EXPECT_EQ(s.step, 7);
    const ReplicaSnapshot r = root_->Snapshot();
    EXPECT_EQ(r.values, (std::vector<float>{0, 0, 0}));
    EXPECT_EQ(r.weight, 1.0);
    EXPECT_TRUE(root_->Finals().empty());
    EXPECT_EQ(a1_->TakeConsensus().count, 0);
  }

  GossipServiceImpl service_;
  std::shared_ptr<GossipReplica> root_ = Replica("job-a", 0, {0, 0, 0});
  std::shared_ptr<GossipReplica> a1_ = Replica("job-a", 1, {1, 2, 3});
  std::shared_ptr<GossipReplica> b1_ = Replica("job-b", 1, {5, 5, 5});
  std::shared_ptr<GossipReplica> open1_ = Replica("job-open", 1, {1, 1, 1});
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GossipService::Stub> stub_;
};

TEST_F(GossipPeerAuthTest, StrangersOtherJobsAndNonNeighboursChangeNothing) {
  const GossipExchangeRequest push = Request("job-a", 0, 1, GOSSIP_PUSH_SUM, {9, 9, 9}, 0.5);
  GossipExchangeResponse resp;
  grpc::Status st = Exchange(push, nullptr, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "GossipService.Exchange to gossip job job-a rank 1: no job token (metadata "
            "x-gradmesh-job-token) on the call");
  ExpectUntouched();
  // A rank of job b with its own valid token.
  st = Exchange(push, kTokenB, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message().find(kTokenA), std::string::npos);
  ExpectUntouched();
  // A guess: a prefix of the right token, and the empty one.
  for (const char* guess : {"token-of-job-a-012345678", ""}) {
    st = Exchange(push, guess, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << guess;
  }
  ExpectUntouched();
  // The right token from rank 2, which the exponential topology never lets send to rank 1.
  st = Exchange(Request("job-a", 2, 1, GOSSIP_PUSH_SUM, {9, 9, 9}, 0.5), kTokenA, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "gossip job job-a rank 1, push_sum from rank 2: rank 2 is not an in-neighbour of rank "
            "1 in this job's gossip topology");
  st = Exchange(Request("job-a", 2, 1, GOSSIP_AVERAGE, {9, 9, 9}, 0), kTokenA, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  ExpectUntouched();
  // Finals to the root: the gather trusts only holders of the job's token.
  const GossipExchangeRequest final = Request("job-a", 3, 0, GOSSIP_FINAL, {9, 9, 9}, 1.0);
  EXPECT_EQ(Exchange(final, nullptr, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Exchange(final, kTokenB, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  ExpectUntouched();
  // A job name that breaks the rule (would be a path): refused before any lookup.
  for (const std::string& bad :
       std::vector<std::string>{"../job-a", "job-a/..", "JOB-A", std::string(300, 'a')}) {
    st = Exchange(Request(bad, 0, 1, GOSSIP_PUSH_SUM, {9, 9, 9}, 0.5), kTokenA, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(st.error_message().find("GossipService.Exchange: job"), std::string::npos);
  }
  ExpectUntouched();

  // The real in-neighbour with the right token: absorbed exactly,
  // x = (1 * x + 0.5 * v) / 1.5, w = 1.5.
  ASSERT_TRUE(Exchange(push, kTokenA, &resp).ok());
  const ReplicaSnapshot s = a1_->Snapshot();
  const float a = static_cast<float>(0.5 / 1.5);
  EXPECT_EQ(s.values, (std::vector<float>{1 + a * (9 - 1), 2 + a * (9 - 2), 3 + a * (9 - 3)}));
  EXPECT_EQ(s.weight, 1.5);
  ASSERT_TRUE(Exchange(final, kTokenA, &resp).ok());
  ASSERT_EQ(root_->Finals().size(), 1u);
  EXPECT_EQ(root_->Finals().at(3).values, (std::vector<float>{9, 9, 9}));
  // Job b's replica never saw any of it.
  EXPECT_EQ(b1_->Snapshot().values, (std::vector<float>{5, 5, 5}));
  EXPECT_EQ(b1_->Snapshot().weight, 1.0);
}

TEST_F(GossipPeerAuthTest, GetStateNeedsTheToken) {
  GossipStateResponse resp;
  EXPECT_EQ(GetState("job-a", 1, nullptr, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(GetState("job-a", 1, kTokenB, &resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(GetState("..", 1, kTokenA, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(resp.step(), 0);  // Nothing was filled in.
  ASSERT_TRUE(GetState("job-a", 1, kTokenA, &resp).ok());
  EXPECT_EQ(resp.step(), 7);
  EXPECT_EQ(resp.total_steps(), 50);
  // An unknown (job, rank) is NOT_FOUND whatever the token (senders retry it as "not started").
  EXPECT_EQ(GetState("job-c", 1, nullptr, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(GossipPeerAuthTest, TheTransportSendsTheToken) {
  const std::vector<std::string> peers = {address(), address(), address(), address()};
  auto good = NewGrpcGossipTransport(peers, RpcOptions{}, kTokenA);
  auto other = NewGrpcGossipTransport(peers, RpcOptions{}, kTokenB);
  auto none = NewGrpcGossipTransport(peers, RpcOptions{});
  ExchangeHeader h;
  h.job = "job-a";
  h.from = 3;
  h.to = 1;
  h.kind = ExchangeKind::kPushSum;
  h.weight = 1.0;
  h.numel = 3;
  const std::string payload = Raw({5, 6, 7});
  EXPECT_STATUS(none->Exchange(1, h, payload, absl::Seconds(10)),
                absl::StatusCode::kUnauthenticated);
  EXPECT_STATUS(other->Exchange(1, h, payload, absl::Seconds(10)),
                absl::StatusCode::kPermissionDenied);
  EXPECT_STATUS(none->GetState(1, "job-a", absl::Seconds(10), -1),
                absl::StatusCode::kUnauthenticated);
  ExpectUntouched();
  ASSERT_OK(good->Exchange(1, h, payload, absl::Seconds(10)));
  EXPECT_EQ(a1_->Snapshot().values, (std::vector<float>{3, 4, 5}));  // (1*x + 1*v) / 2.
  EXPECT_EQ(a1_->Snapshot().weight, 2.0);
  ASSERT_OK_AND_ASSIGN(ReplicaState state, good->GetState(1, "job-a", absl::Seconds(10), -1));
  EXPECT_EQ(state.weight, 2.0);
}

// Coordinator-placed jobs: every rank has its own token, and a call must carry the token of
// the rank it claims to come from. Rank 3 (an in-neighbour of rank 1) holds the job token;
// rank 0 (also an in-neighbour) must not be able to send as rank 3, nor anyone without a rank
// token; each refusal changes nothing.
TEST_F(GossipPeerAuthTest, ACallerMustHoldTheTokenOfTheRankItClaims) {
  const std::vector<std::string> rank_tokens = {"rank-0-secret", "rank-1-secret", "rank-2-secret",
                                                "rank-3-secret"};
  std::vector<std::string> hashes;
  for (const std::string& t : rank_tokens) hashes.push_back(Sha256(t));
  auto r1 = Replica("job-r", 1, {1, 2, 3});
  ASSERT_OK(service_.Register(r1, kTokenA, hashes));
  const GossipExchangeRequest as3 = Request("job-r", 3, 1, GOSSIP_PUSH_SUM, {9, 9, 9}, 1.0);
  auto call = [&](const char* rank_token) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    ctx.AddMetadata("x-gradmesh-job-token", kTokenA);
    if (rank_token != nullptr) ctx.AddMetadata("x-gradmesh-rank-token", rank_token);
    GossipExchangeResponse resp;
    return stub_->Exchange(&ctx, as3, &resp);
  };
  auto untouched = [&] {
    const ReplicaSnapshot s = r1->Snapshot();
    EXPECT_EQ(s.values, (std::vector<float>{1, 2, 3}));
    EXPECT_EQ(s.weight, 1.0);
    EXPECT_EQ(r1->TakeConsensus().count, 0);
  };
  grpc::Status st = call(nullptr);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  untouched();
  st = call("rank-0-secret");  // Rank 0's real token, posing as rank 3.
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << st.error_message();
  EXPECT_EQ(st.error_message(),
            "GossipService.Exchange to gossip job job-r rank 1: the rank token (metadata "
            "x-gradmesh-rank-token) is not rank 3's");
  untouched();
  for (const char* wrong : {"", "rank-3-secre", "rank-3-secret ", "RANK-3-SECRET"}) {
    EXPECT_EQ(call(wrong).error_code(), grpc::StatusCode::PERMISSION_DENIED) << wrong;
  }
  untouched();
  // A claimed sender outside the job, with any token.
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-gradmesh-job-token", kTokenA);
    ctx.AddMetadata("x-gradmesh-rank-token", "rank-3-secret");
    GossipExchangeResponse resp;
    EXPECT_EQ(stub_->Exchange(&ctx, Request("job-r", 7, 1, GOSSIP_PUSH_SUM, {9, 9, 9}, 1.0), &resp)
                  .error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  untouched();
  // GetState is a read: the job token is enough.
  GossipStateResponse state;
  EXPECT_TRUE(GetState("job-r", 1, kTokenA, &state).ok());

  // Rank 3 itself, through the transport that sends its rank token: absorbed exactly.
  const std::vector<std::string> peers = {address(), address(), address(), address()};
  auto rank3 = NewGrpcGossipTransport(peers, RpcOptions{}, kTokenA, "rank-3-secret");
  auto rank0 = NewGrpcGossipTransport(peers, RpcOptions{}, kTokenA, "rank-0-secret");
  ExchangeHeader h;
  h.job = "job-r";
  h.from = 3;
  h.to = 1;
  h.kind = ExchangeKind::kPushSum;
  h.weight = 1.0;
  h.numel = 3;
  EXPECT_STATUS(rank0->Exchange(1, h, Raw({5, 6, 7}), absl::Seconds(10)),
                absl::StatusCode::kPermissionDenied);
  untouched();
  // Claiming a rank in GetState (the start rendezvous counts it as up) needs its token too.
  EXPECT_STATUS(rank0->GetState(1, "job-r", absl::Seconds(10), 3),
                absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(r1->Callers().empty());
  ASSERT_OK(rank3->GetState(1, "job-r", absl::Seconds(10), 3).status());
  EXPECT_EQ(r1->Callers(), (std::set<int32_t>{3}));
  ASSERT_OK(rank3->Exchange(1, h, Raw({5, 6, 7}), absl::Seconds(10)));
  EXPECT_EQ(r1->Snapshot().values, (std::vector<float>{3, 4, 5}));
  EXPECT_EQ(r1->Snapshot().weight, 2.0);
}

TEST_F(GossipPeerAuthTest, ARankWithoutATokenIsOpen) {
  GossipExchangeResponse resp;
  ASSERT_TRUE(
      Exchange(Request("job-open", 0, 1, GOSSIP_PUSH_SUM, {3, 3, 3}, 1.0), nullptr, &resp).ok());
  EXPECT_EQ(open1_->Snapshot().values, (std::vector<float>{2, 2, 2}));
  EXPECT_EQ(open1_->Snapshot().weight, 2.0);
}

}  // namespace
}  // namespace gradmesh
