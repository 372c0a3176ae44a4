// Tests of the collective backends and their selection (collective.h): the placement rules as
// pure functions, then "ring", "auto" and "nccl" over real rings on 127.0.0.1 (two
// simulated processes as threads, each with its own CollectiveService). The NCCL cases run
// only in a --config=cuda build with at least two CUDA devices and are skipped otherwise; in
// a CPU build "nccl" must refuse with UNIMPLEMENTED naming --config=cuda.
#include "worker/allreduce/collective.h"

#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/allreduce/collective_service.h"
#include "worker/nccl/nccl_communicator.h"

namespace gradmesh {
namespace {

RankPlacement Gpu(const std::string& host, int devices) { return {host, devices, true}; }

TEST(PlacementTest, EncodeDecodeRoundTripAndRejectsGarbage) {
  const RankPlacement p{"node-7.example", 4, true};
  ASSERT_OK_AND_ASSIGN(RankPlacement q, DecodePlacement(EncodePlacement(p)));
  EXPECT_EQ(q.host, "node-7.example");
  EXPECT_EQ(q.cuda_devices, 4);
  EXPECT_TRUE(q.nccl_built_in);
  for (const char* bad : {"", "1", "1 2", "x 2 h", "2 2 h", "1 -1 h", "1 y h"}) {
    EXPECT_STATUS_MSG(DecodePlacement(bad), absl::StatusCode::kInvalidArgument,
                      "bad rank placement")
        << bad;
  }
}

TEST(PlacementTest, NcclOnlyOnOneHostWithAGpuPerRank) {
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 2), Gpu("a", 2)}), "nccl");
  EXPECT_EQ(NcclUnsuitable({Gpu("a", 8), Gpu("a", 8), Gpu("a", 8)}), "");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 1)}), "nccl");
  // Two hosts: not plain NCCL, but NCCL within each host + the ring across them.
  EXPECT_EQ(NcclUnsuitable({Gpu("a", 2), Gpu("b", 2)}),
            "rank 1 runs on host b, rank 0 on a (NCCL is used within one node; jobs across "
            "nodes use the ring)");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 2), Gpu("b", 2)}), "hierarchical");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 2), Gpu("a", 2), Gpu("b", 1)}), "hierarchical");
  EXPECT_EQ(HierarchicalUnsuitable({Gpu("a", 2), Gpu("a", 2), Gpu("b", 1)}), "");
  // ... as long as every host has a GPU per rank and every rank NCCL.
  EXPECT_EQ(HierarchicalUnsuitable({Gpu("a", 1), Gpu("a", 1), Gpu("b", 1)}),
            "2 ranks on host a but only 1 CUDA device(s) (one GPU per rank)");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 1), Gpu("a", 1), Gpu("b", 1)}), "ring");
  EXPECT_EQ(HierarchicalUnsuitable({Gpu("a", 1), RankPlacement{"b", 1, false}}),
            "rank 1 (host b) runs a worker built without --config=cuda");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 1), Gpu("b", 0)}), "ring");
  // A rank without a GPU, or without NCCL in its build.
  EXPECT_EQ(NcclUnsuitable({Gpu("a", 2), Gpu("a", 0)}), "rank 1 (host a) has no CUDA device");
  EXPECT_EQ(NcclUnsuitable({Gpu("a", 2), RankPlacement{"a", 2, false}}),
            "rank 1 (host a) runs a worker built without --config=cuda");
  // Two ranks cannot share one GPU in NCCL.
  EXPECT_EQ(NcclUnsuitable({Gpu("a", 1), Gpu("a", 1)}),
            "2 ranks on host a but only 1 CUDA device(s) (one GPU per rank)");
  EXPECT_EQ(ChooseAutoBackend({Gpu("a", 1), Gpu("a", 1)}), "ring");
}

TEST(ResolveBackendTest, EmptyMeansAuto) {
  EXPECT_EQ(ResolveBackend(""), "auto");
  EXPECT_EQ(ResolveBackend("ring"), "ring");
  EXPECT_EQ(ResolveBackend("nccl"), "nccl");
}

// One "process": a CollectiveService served on 127.0.0.1.
struct Node {
  std::unique_ptr<CollectiveServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

// Starts `n` nodes on 127.0.0.1, appending them and their addresses.
void StartNodes(int n, std::vector<Node>* nodes, std::vector<std::string>* peers) {
  for (int i = 0; i < n; ++i) {
    Node node;
    node.service = std::make_unique<CollectiveServiceImpl>();
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(node.service.get());
    node.server = b.BuildAndStart();
    ASSERT_NE(node.server, nullptr);
    node.address = absl::StrCat("127.0.0.1:", port);
    peers->push_back(node.address);
    nodes->push_back(std::move(node));
  }
}

class CollectiveRegistryTest : public ::testing::Test {
 protected:
  void SetUp() override { StartNodes(2, &nodes_, &peers_); }
  void TearDown() override {
    for (Node& n : nodes_) n.server->Shutdown(absl::ToChronoTime(absl::Now()));
  }

  CollectiveContext Context(int rank, const std::string& host) {
    CollectiveContext c;
    c.job = "j";
    c.rank = rank;
    c.peers = peers_;
    c.local = nodes_[rank].service.get();
    c.timeout = absl::Seconds(10);
    c.host = host;
    c.transport = transport_;
    return c;
  }

  // Creates `backend` on both ranks at once (host of rank r: hosts[r]); then, where that
  // worked, all-reduces {1, 2, 3} * (r + 1) and all-gathers "r<r>". Returns each rank's
  // status; `used` gets each rank's "backend()/transport()".
  std::vector<absl::Status> Run(const std::string& backend, std::vector<std::string> hosts,
                                std::vector<std::string>* used) {
    std::vector<absl::Status> st(2);
    used->assign(2, "");
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        absl::StatusOr<std::unique_ptr<Collective>> c =
            CollectiveRegistry::WithBuiltins().Create(backend, Context(r, hosts[r]));
        if (!c.ok()) {
          st[r] = c.status();
          return;
        }
        (*used)[r] = absl::StrCat((*c)->backend(), "/", (*c)->transport());
        std::vector<float> v = {1.0f * (r + 1), 2.0f * (r + 1), 3.0f * (r + 1)};
        st[r] = (*c)->AllreduceSum(absl::MakeSpan(v));
        if (!st[r].ok()) return;
        EXPECT_EQ(v, (std::vector<float>{3, 6, 9})) << "rank " << r;
        absl::StatusOr<std::vector<std::string>> all = (*c)->Allgather(absl::StrCat("r", r));
        st[r] = all.status();
        if (all.ok()) {
          EXPECT_EQ(*all, (std::vector<std::string>{"r0", "r1"})) << "rank " << r;
        }
      });
    }
    for (auto& t : threads) t.join();
    return st;
  }

  std::vector<Node> nodes_;
  std::vector<std::string> peers_;
  std::string transport_ = "tcp";
};

TEST_F(CollectiveRegistryTest, UnknownBackendIsInvalidArgument) {
  EXPECT_STATUS_MSG(CollectiveRegistry::WithBuiltins().Create("mpi", Context(0, "a")),
                    absl::StatusCode::kInvalidArgument, "mpi");
}

TEST_F(CollectiveRegistryTest, RingSumsAndGathersOverEveryTransport) {
  for (const char* transport : {"tcp", "grpc"}) {
    transport_ = transport;
    std::vector<std::string> used;
    std::vector<absl::Status> st = Run("ring", {"a", "a"}, &used);
    for (int r = 0; r < 2; ++r) ASSERT_OK(st[r]) << "rank " << r << " over " << transport;
    const std::string want = absl::StrCat("ring/", transport);
    EXPECT_EQ(used, (std::vector<std::string>{want, want}));
  }
}

TEST_F(CollectiveRegistryTest, UnknownTransportIsInvalidArgumentListingTheKnownOnes) {
  transport_ = "udp";
  EXPECT_STATUS_MSG(CollectiveRegistry::WithBuiltins().Create("ring", Context(0, "a")),
                    absl::StatusCode::kInvalidArgument,
                    "unknown allreduce transport \"udp\" (known: grpc, tcp)");
}

TEST_F(CollectiveRegistryTest, AutoOnTwoHostsIsTheRingWithoutGpus) {
  if (NcclBuiltIn() && CudaDeviceCount() > 0) GTEST_SKIP() << "has a GPU: auto may be hierarchical";
  std::vector<std::string> used;
  std::vector<absl::Status> st = Run("auto", {"host-a", "host-b"}, &used);
  for (int r = 0; r < 2; ++r) ASSERT_OK(st[r]) << "rank " << r;
  EXPECT_EQ(used, (std::vector<std::string>{"ring/tcp", "ring/tcp"}));
}

TEST_F(CollectiveRegistryTest, HierarchicalWithoutCudaBuildIsUnimplemented) {
  if (NcclBuiltIn()) GTEST_SKIP() << "built with --config=cuda";
  EXPECT_STATUS_MSG(CollectiveRegistry::WithBuiltins().Create("hierarchical", Context(0, "h")),
                    absl::StatusCode::kUnimplemented, "--config=cuda");
}

TEST_F(CollectiveRegistryTest, AutoOnOneHostIsNcclExactlyWhenEveryRankHasAGpu) {
  const bool nccl = NcclBuiltIn() && CudaDeviceCount() >= 2;
  std::vector<std::string> used;
  std::vector<absl::Status> st = Run("auto", {"h", "h"}, &used);
  for (int r = 0; r < 2; ++r) ASSERT_OK(st[r]) << "rank " << r;
  const std::string want = nccl ? "nccl/tcp" : "ring/tcp";
  EXPECT_EQ(used, (std::vector<std::string>{want, want}));
}

TEST_F(CollectiveRegistryTest, NcclWithoutCudaBuildIsUnimplementedNamingTheFlag) {
  if (NcclBuiltIn()) GTEST_SKIP() << "built with --config=cuda";
  EXPECT_STATUS_MSG(CollectiveRegistry::WithBuiltins().Create("nccl", Context(0, "h")),
                    absl::StatusCode::kUnimplemented, "--config=cuda");
}

TEST_F(CollectiveRegistryTest, NcclWithTooFewGpusFailsOnEveryRankNamingWhy) {
  if (!NcclBuiltIn()) GTEST_SKIP() << "needs --config=cuda";
  if (CudaDeviceCount() >= 2) GTEST_SKIP() << "this machine has 2 CUDA devices";
  std::vector<std::string> used;
  std::vector<absl::Status> st = Run("nccl", {"h", "h"}, &used);
  const std::string why = CudaDeviceCount() == 0 ? "rank 0 (host h) has no CUDA device"
                                                 : "2 ranks on host h but only 1 CUDA device";
  for (int r = 0; r < 2; ++r) {
    EXPECT_STATUS_MSG(st[r], absl::StatusCode::kFailedPrecondition, why) << "rank " << r;
  }
}

TEST_F(CollectiveRegistryTest, NcclOnTwoGpusSumsAndGathers) {
  if (!NcclBuiltIn() || CudaDeviceCount() < 2) {
    GTEST_SKIP() << "needs --config=cuda and 2 CUDA devices (have " << CudaDeviceCount() << ")";
  }
  std::vector<std::string> used;
  std::vector<absl::Status> st = Run("nccl", {"h", "h"}, &used);
  for (int r = 0; r < 2; ++r) ASSERT_OK(st[r]) << "rank " << r;
  EXPECT_EQ(used, (std::vector<std::string>{"nccl/tcp", "nccl/tcp"}));
}

TEST_F(CollectiveRegistryTest, NcclAcrossHostsFailsOnEveryRank) {
  if (!NcclBuiltIn()) GTEST_SKIP() << "needs --config=cuda";
  std::vector<std::string> used;
  std::vector<absl::Status> st = Run("nccl", {"a", "b"}, &used);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kFailedPrecondition) << st[r];
  }
}

// The hierarchical composition with a ring inside each "host" (so it runs without GPUs): n
// simulated processes, each with its own CollectiveService on 127.0.0.1; every ring over the
// tcp transport, then over grpc.
class HierarchicalTest : public ::testing::TestWithParam<std::vector<std::string>> {
 protected:
  void SetUp() override { StartNodes(static_cast<int>(GetParam().size()), &nodes_, &peers_); }
  void TearDown() override {
    for (Node& n : nodes_) n.server->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  std::vector<Node> nodes_;
  std::vector<std::string> peers_;
};

TEST_P(HierarchicalTest, SumsExactlyOnEveryRankAndGathersInRankOrder) {
  for (const std::string transport : {"tcp", "grpc"}) {
    const std::vector<std::string>& hosts = GetParam();
    const int n = static_cast<int>(hosts.size());
    // Integer-valued floats: every order of summation gives the same, exact result. Odd length,
    // not divisible by any group size.
    const int len = 1001;
    std::vector<float> want(len, 0);
    for (int r = 0; r < n; ++r) {
      for (int i = 0; i < len; ++i) want[i] += static_cast<float>((r + 1) * (i % 17) - r);
    }
    std::vector<absl::Status> st(n);
    std::vector<std::vector<float>> got(n);
    std::vector<std::string> backend(n);
    std::vector<std::vector<std::string>> gathered(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        CollectiveContext c;
        c.job = "h";
        c.rank = r;
        c.peers = peers_;
        c.local = nodes_[r].service.get();
        c.timeout = absl::Seconds(10);
        c.segment_bytes = 256;  // Several segments per ring step.
        c.host = hosts[r];
        c.transport = transport;
        absl::StatusOr<std::unique_ptr<Collective>> coll = ConnectHierarchical(c, "ring");
        if (!coll.ok()) {
          st[r] = coll.status();
          return;
        }
        backend[r] = absl::StrCat((*coll)->backend(), "/", (*coll)->transport());
        for (int round = 0; round < 2 && st[r].ok(); ++round) {  // Reusable.
          got[r].assign(len, 0);
          for (int i = 0; i < len; ++i) got[r][i] = static_cast<float>((r + 1) * (i % 17) - r);
          st[r] = (*coll)->AllreduceSum(absl::MakeSpan(got[r]));
        }
        if (!st[r].ok()) return;
        absl::StatusOr<std::vector<std::string>> all = (*coll)->Allgather(absl::StrCat("r", r));
        st[r] = all.status();
        if (all.ok()) gathered[r] = *all;
      });
    }
    for (auto& t : threads) t.join();
    std::vector<std::string> names;
    for (int r = 0; r < n; ++r) names.push_back(absl::StrCat("r", r));
    for (int r = 0; r < n; ++r) {
      ASSERT_OK(st[r]) << "rank " << r;
      EXPECT_EQ(got[r], want) << "rank " << r;
      EXPECT_EQ(backend[r], "hierarchical(ring+ring)/" + transport);
      EXPECT_EQ(gathered[r], names) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Hosts, HierarchicalTest,
    ::testing::Values(std::vector<std::string>{"a", "a", "b", "b"},  // Two nodes of two.
                      std::vector<std::string>{"a", "b", "b", "c"},  // Uneven, one-rank nodes.
                      std::vector<std::string>{"b", "a", "b", "a"},  // Interleaved ranks.
                      std::vector<std::string>{"a", "a", "a"},       // One node: no cross ring.
                      std::vector<std::string>{"a", "b", "c"}));     // No node-local group.

TEST(HierarchicalArgsTest, UnknownLocalBackendIsInvalidArgument) {
  CollectiveContext c;
  EXPECT_STATUS_MSG(ConnectHierarchical(c, "mpi"), absl::StatusCode::kInvalidArgument,
                    "\"mpi\" is not one of nccl, ring");
}

}  // namespace
}  // namespace gradmesh
