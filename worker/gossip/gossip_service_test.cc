// GossipServiceImpl and the gRPC transport on 127.0.0.1: codes and messages over the wire,
// several jobs in one service, and the Gossiper over real gRPC skipping a dead peer (nothing
// listening) and a hung one (accepts TCP, never answers) within the timeout, then including a
// peer that starts late.
#include "worker/gossip/gossip_service.h"

#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <iostream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gossip.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "worker/gossip/gossiper.h"
#include "worker/gossip/grpc_transport.h"
#include "worker/gossip/replica.h"
#include "worker/gossip/topology.h"

namespace gradmesh {
namespace {

using Outcome = RoundResult::Outcome;

std::string Raw(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::shared_ptr<GossipReplica> Replica(const std::string& job, int32_t rank, int32_t n,
                                       std::vector<float> values) {
  GossipReplica::Options o;
  o.job = job;
  o.rank = rank;
  o.num_workers = n;
  o.total_steps = 50;
  return std::make_shared<GossipReplica>(o, std::move(values));
}

// A socket bound to a free 127.0.0.1 port; listening (accepts TCP, never speaks) if asked.
class PortHolder {
 public:
  explicit PortHolder(bool listen_forever) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    socklen_t len = sizeof(a);
    EXPECT_EQ(getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port_ = ntohs(a.sin_port);
    if (listen_forever) {
      EXPECT_EQ(listen(fd_, 16), 0);
    } else {
      Close();  // Free again: nothing listens there until someone binds it.
    }
  }
  ~PortHolder() { Close(); }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_ = -1;
  int port_ = 0;
};

std::unique_ptr<grpc::Server> Serve(GossipServiceImpl* service, const std::string& address,
                                    int* port = nullptr) {
  grpc::ServerBuilder b;
  b.AddListeningPort(address, grpc::InsecureServerCredentials(), port);
  b.RegisterService(service);
  return b.BuildAndStart();
}

GossipExchangeRequest Request(const std::string& job, int32_t from, int32_t to,
                              const std::vector<float>& v, double weight) {
  GossipExchangeRequest r;
  r.set_job(job);
  r.set_from_rank(from);
  r.set_to_rank(to);
  r.set_kind(GOSSIP_PUSH_SUM);
  r.set_weight(weight);
  r.mutable_values()->set_numel(static_cast<int64_t>(v.size()));
  r.mutable_values()->set_data(Raw(v));
  return r;
}

TEST(GossipServiceTest, RoutesByJobAndRankAndMapsErrorsToGrpcCodes) {
  GossipServiceImpl service;
  auto a = Replica("a", 1, 3, {1, 2});
  auto b = Replica("b", 1, 3, {10, 20});
  ASSERT_OK(service.Register(a));
  ASSERT_OK(service.Register(b));
  EXPECT_STATUS_MSG(service.Register(Replica("a", 1, 3, {0, 0})), absl::StatusCode::kAlreadyExists,
                    "gossip job a rank 1 is already served");
  int port = 0;
  auto server = Serve(&service, "127.0.0.1:0", &port);
  ASSERT_NE(server, nullptr);
  auto stub = GossipService::NewStub(MakeChannel(absl::StrCat("127.0.0.1:", port), RpcOptions{}));

  auto call = [&](const GossipExchangeRequest& req, GossipExchangeResponse* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub->Exchange(&ctx, req, resp);
  };
  GossipExchangeResponse resp;
  grpc::Status st = call(Request("c", 0, 1, {4, 8}, 0.5), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(st.error_message(), "gossip job c rank 1 is not running in this process");
  st = call(Request("a", 0, 1, {4, 8, 9}, 0.5), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("3 parameters sent, this replica has 2"), std::string::npos)
      << st.error_message();
  GossipExchangeRequest unknown_kind = Request("a", 0, 1, {4, 8}, 0.5);
  unknown_kind.set_kind(static_cast<GossipKind>(7));
  st = call(unknown_kind, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "gossip: unknown exchange kind 7 from rank 0");
  st = call(Request("a", 0, 1, {4, 8}, -1), &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(a->Snapshot().values, (std::vector<float>{1, 2}));

  st = call(Request("a", 0, 1, {4, 8}, 0.5), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(a->Snapshot().values, (std::vector<float>{2, 4}));
  EXPECT_DOUBLE_EQ(a->Snapshot().weight, 1.5);
  EXPECT_EQ(b->Snapshot().values, (std::vector<float>{10, 20}));  // Another job: untouched.

  // GetState and the transport's view of it.
  auto transport = NewGrpcGossipTransport(
      {"127.0.0.1:1", absl::StrCat("127.0.0.1:", port), "127.0.0.1:1"}, RpcOptions{});
  a->set_step(7);
  ASSERT_OK_AND_ASSIGN(ReplicaState s, transport->GetState(1, "a", absl::Seconds(5), -1));
  EXPECT_TRUE(a->Callers().empty());
  EXPECT_EQ(s.step, 7);
  EXPECT_EQ(s.total_steps, 50);
  EXPECT_FALSE(s.finished);
  EXPECT_DOUBLE_EQ(s.weight, 1.5);
  EXPECT_STATUS_MSG(transport->GetState(1, "zzz", absl::Seconds(5), -1),
                    absl::StatusCode::kNotFound,
                    absl::StrCat("gossip peer 1 (127.0.0.1:", port, "): gossip job zzz rank 1"));
  // A caller that names its rank is recorded as up (the start rendezvous); a rank outside the
  // job, or the callee's own, is refused and recorded nowhere.
  ASSERT_OK(transport->GetState(1, "a", absl::Seconds(5), 2).status());
  EXPECT_EQ(a->Callers(), (std::set<int32_t>{2}));
  EXPECT_STATUS_MSG(transport->GetState(1, "a", absl::Seconds(5), 3),
                    absl::StatusCode::kInvalidArgument,
                    "GossipService.GetState to gossip job a rank 1: from_rank 3 is not another "
                    "rank of its 3");
  EXPECT_STATUS(transport->GetState(1, "a", absl::Seconds(5), 1),
                absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->Callers(), (std::set<int32_t>{2}));
  a->Finish();
  EXPECT_STATUS(
      transport->Exchange(1, ExchangeHeader{"a", 0, 1, ExchangeKind::kPushSum, 0, 0, 0.5, "", 2},
                          Raw({1, 1}), absl::Seconds(5)),
      absl::StatusCode::kFailedPrecondition);
  service.Unregister("a", 1);
  EXPECT_STATUS(transport->GetState(1, "a", absl::Seconds(5), -1), absl::StatusCode::kNotFound);
  ASSERT_OK_AND_ASSIGN(s, transport->GetState(1, "b", absl::Seconds(5), -1));
  server->Shutdown();
}

// Under the coordinator a peer rank can lose its node (address "") or move to another
// (SetPeers, taken in place by the running rank): a rank without an address is unreachable
// at once, nothing sent, and calls follow a new address as soon as it is set.
TEST(GossipServiceTest, APeerWithoutAnAddressIsUnreachableAndSetPeersRedirectsCalls) {
  GossipServiceImpl service;
  auto a = Replica("a", 1, 3, {1, 2});
  ASSERT_OK(service.Register(a));
  int port = 0;
  auto server = Serve(&service, "127.0.0.1:0", &port);
  ASSERT_NE(server, nullptr);
  const std::string address = absl::StrCat("127.0.0.1:", port);
  auto transport = NewGrpcGossipTransport({"127.0.0.1:1", "", "127.0.0.1:1"}, RpcOptions{});
  const ExchangeHeader header{"a", 0, 1, ExchangeKind::kPushSum, 0, 0, 0.5, "", 2};
  const absl::Time t0 = absl::Now();
  const auto sent = transport->Exchange(1, header, Raw({4, 8}), absl::Seconds(5));
  EXPECT_STATUS_MSG(sent.status(), absl::StatusCode::kUnavailable,
                    "gossip peer 1 (-): no address (its rank has no node) (nothing was sent)");
  EXPECT_TRUE(sent.status().GetPayload(kGossipNotSentPayload).has_value());
  EXPECT_STATUS_MSG(transport->GetState(1, "a", absl::Seconds(5), 0).status(),
                    absl::StatusCode::kUnavailable, "gossip peer 1 (-): no address");
  EXPECT_LT(absl::Now() - t0, absl::Seconds(1)) << "no address must not wait for a deadline";
  // Another number of peers is not this job's: ignored.
  transport->SetPeers({address});
  EXPECT_STATUS(transport->GetState(1, "a", absl::Seconds(5), 0).status(),
                absl::StatusCode::kUnavailable);
  transport->SetPeers({"127.0.0.1:1", address, ""});
  a->set_step(3);
  ASSERT_OK_AND_ASSIGN(ReplicaState st, transport->GetState(1, "a", absl::Seconds(5), 0));
  EXPECT_EQ(st.step, 3);
  ASSERT_OK(transport->Exchange(1, header, Raw({4, 8}), absl::Seconds(5)).status());
  EXPECT_EQ(a->Snapshot().values, (std::vector<float>{2, 4}));
  EXPECT_STATUS_MSG(transport->GetState(2, "a", absl::Seconds(5), 0).status(),
                    absl::StatusCode::kUnavailable, "gossip peer 2 (-): no address");
  server->Shutdown();
}

TEST(GossipServiceTest, DeadAndHungPeersAreSkippedWithinTheTimeoutAndALateJoinerIsIncluded) {
  PortHolder hung(/*listen_forever=*/true);
  PortHolder late(/*listen_forever=*/false);
  GossipServiceImpl service0;
  int port0 = 0;
  auto server0 = Serve(&service0, "127.0.0.1:0", &port0);
  ASSERT_NE(server0, nullptr);
  const std::vector<std::string> peers = {absl::StrCat("127.0.0.1:", port0), hung.address(),
                                          late.address()};
  auto r0 = Replica("job", 0, 3, {0, 0});
  ASSERT_OK(service0.Register(r0));
  auto transport = NewGrpcGossipTransport(peers, RpcOptions{});
  GossiperOptions o;
  o.timeout = absl::Milliseconds(300);
  o.backoff_initial = absl::Milliseconds(200);
  o.backoff_max = absl::Milliseconds(400);
  ASSERT_OK_AND_ASSIGN(auto topology, TopologyRegistry::WithBuiltins().Create("random", 3));
  ASSERT_OK_AND_ASSIGN(auto gossiper,
                       Gossiper::Create(o, r0, std::move(topology), transport.get()));

  // Neither peer works: every round ends within the timeout (plus scheduling slack), and
  // both are tried and backed off.
  std::set<int32_t> failed;
  absl::Duration hung_wait = absl::ZeroDuration();
  for (int64_t round = 0; round < 40 && failed.size() < 2; ++round) {
    const absl::Time t0 = absl::Now();
    RoundResult r = gossiper->RunRound(round, round);
    const absl::Duration took = absl::Now() - t0;
    EXPECT_LT(took, o.timeout + absl::Milliseconds(700)) << "round " << round;
    EXPECT_NE(r.outcome, Outcome::kMixed);
    if (r.outcome == Outcome::kFailed) {
      std::cerr << "round " << round << " peer " << r.peer << " after " << took << ": " << r.error
                << "\n";
      failed.insert(r.peer);
      // gRPC reports a connection that never completes its handshake as UNAVAILABLE when
      // the call's deadline ends it.
      EXPECT_TRUE(r.error.code() == absl::StatusCode::kUnavailable ||
                  r.error.code() == absl::StatusCode::kDeadlineExceeded)
          << r.error;
      if (r.peer == 1) hung_wait = took;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(failed, (std::set<int32_t>{1, 2}));
  // The hung peer never costs more than the timeout (gRPC may give up on the handshake even
  // sooner: its connection attempt deadline follows the channel's reconnect backoff).
  EXPECT_GT(hung_wait, absl::ZeroDuration());
  EXPECT_LE(hung_wait, o.timeout + absl::Milliseconds(200));
  EXPECT_EQ(r0->Snapshot().values, (std::vector<float>{0, 0}));

  // Rank 2 starts late on its address: it is included once its backoff (and the channel's
  // reconnect backoff) expire.
  GossipServiceImpl service2;
  auto r2 = Replica("job", 2, 3, {4, 8});
  ASSERT_OK(service2.Register(r2));
  auto server2 = Serve(&service2, late.address());
  ASSERT_NE(server2, nullptr);
  bool mixed = false;
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  for (int64_t round = 100; !mixed && absl::Now() < give_up; ++round) {
    RoundResult r = gossiper->RunRound(round, round);
    mixed = r.outcome == Outcome::kMixed;
    if (mixed) {
      EXPECT_EQ(r.peer, 2);
    }
    if (!mixed) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(mixed);
  EXPECT_EQ(r0->Snapshot().values, (std::vector<float>{2, 4}));
  EXPECT_EQ(r2->Snapshot().values, (std::vector<float>{2, 4}));
  server2->Shutdown();
  server0->Shutdown();
}

}  // namespace
}  // namespace gradmesh
