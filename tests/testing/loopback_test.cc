#include "tests/testing/loopback.h"

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "rpc/grpc_util.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace loopback {
namespace {

TEST(SameBitsTest, ComparesBitPatterns) {
  EXPECT_TRUE(SameBits({{1.0f, -2.5f}, {}}, {{1.0f, -2.5f}, {}}));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(SameBits({{nan}}, {{nan}}));         // same NaN bits are equal
  EXPECT_FALSE(SameBits({{0.0f}}, {{-0.0f}}));     // equal floats, different bits
  EXPECT_FALSE(SameBits({{1.0f}}, {{1.0f}, {}}));  // tensor count
  ::testing::AssertionResult sizes = SameBits({{1.0f}}, {{1.0f, 2.0f}});
  EXPECT_FALSE(sizes);
  EXPECT_NE(std::string(sizes.message()).find("tensor 0 sizes 1 vs 2"), std::string::npos)
      << sizes.message();
  ::testing::AssertionResult diff = SameBits({{1.0f, 2.0f}}, {{1.0f, 3.0f}});
  EXPECT_FALSE(diff);
  EXPECT_NE(std::string(diff.message()).find("tensor 0 element 1: got 2 (0x40000000), want 3"),
            std::string::npos)
      << diff.message();
}

TEST(MakeInitRequestTest, CarriesTheLayoutLikeTheRealClient) {
  JobLayout l;
  l.job = "j";
  l.tensors = {Tensor("a", {10}), Tensor("b", {3, 7})};
  l.chunk_elems = 4;
  l.consistency = "ssp";
  l.num_workers = 3;
  l.durability.set_mode("every_update");
  l.staleness_damping = true;
  l.barrier_timeout_s = 7;
  const Values init = OddInit(l);
  const InitJobRequest r = MakeInitRequest(l, 2, 1, init);
  EXPECT_EQ(r.shard_index(), 1);
  EXPECT_EQ(r.num_shards(), 2);
  EXPECT_EQ(r.consistency(), "ssp");
  EXPECT_EQ(r.num_workers(), 3);
  EXPECT_EQ(r.durability().mode(), "every_update");
  EXPECT_TRUE(r.staleness_damping());
  EXPECT_EQ(r.barrier_timeout_s(), 7);
  // Exactly the chunks shard 1 owns, with their slices of `init`.
  const Partition p = MakePartition(l, 2);
  ASSERT_EQ(r.initial_size(), static_cast<int>(p.shard_chunks(1).size()));
  for (int i = 0; i < r.initial_size(); ++i) {
    const ChunkInfo& c = p.chunks()[p.shard_chunks(1)[i]];
    EXPECT_EQ(Floats(r.initial(i).data()),
              std::vector<float>(init[c.tensor].begin() + c.offset,
                                 init[c.tensor].begin() + c.offset + c.numel));
  }
}

TEST(ClientOptionsTest, PullCodecDefaultsToDense) {
  EXPECT_EQ(ClientOptions({"a:1"}).pull_codec, "");
  EXPECT_EQ(ClientOptions({"a:1"}, 2, "changes").pull_codec, "changes");
  EXPECT_EQ(ClientOptions({"a:1"}, 2).worker, 2);
}

TEST(StartDurableServerTest, StopThenRestartRecoversTheJob) {
  ASSERT_OK_AND_ASSIGN(std::string dir, testutil::MakeUniqueTestDir("durable"));
  JobLayout l;
  l.job = "d";
  l.tensors = {Tensor("a", {10})};
  l.chunk_elems = 4;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(1.0);
  l.durability.set_mode("every_update");
  std::unique_ptr<TestServer> s = StartDurableServer(dir);
  ASSERT_NE(s, nullptr);
  auto stub = ParameterService::NewStub(MakeChannel(s->addr, RpcOptions()));
  InitJobResponse resp;
  grpc::Status st = stub->InitJob(Ctx().get(), MakeInitRequest(l, 1, 0, OddInit(l)), &resp);
  ASSERT_TRUE(st.ok()) << st.error_message();
  const std::string before = Snapshot(stub.get(), "d");
  ASSERT_FALSE(before.empty());

  s->Stop();
  EXPECT_EQ(s->server, nullptr);
  EXPECT_EQ(s->shard, nullptr);
  s->Stop();  // idempotent
  s = StartDurableServer(dir);
  ASSERT_NE(s, nullptr);
  stub = ParameterService::NewStub(MakeChannel(s->addr, RpcOptions()));
  EXPECT_TRUE(RawInfo(stub.get(), "d").restored());
  EXPECT_EQ(Snapshot(stub.get(), "d"), before);

  // A memory-only server knows nothing of the job.
  std::unique_ptr<TestServer> m = StartServer();
  ASSERT_NE(m, nullptr);
  auto mstub = ParameterService::NewStub(MakeChannel(m->addr, RpcOptions()));
  JobInfoRequest req;
  req.set_job("d");
  JobInfoResponse info;
  EXPECT_EQ(mstub->GetJobInfo(Ctx().get(), req, &info).error_code(), grpc::StatusCode::NOT_FOUND);
}

}  // namespace
}  // namespace loopback
}  // namespace gradmesh
