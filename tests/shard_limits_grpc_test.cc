// A shard over real gRPC on 127.0.0.1 refuses hostile and mistaken InitJobs with the exact
// code and a message naming the field (issue #15 items 3 and 5), and its state is unchanged:
// no job appears, a running job still trains, GetJobInfo answers the same, the reserved memory
// is the same. Also: the job-count limit, the memory budget across jobs, and that no answer is
// UNKNOWN (no exception escapes a handler).
#include <grpcpp/client_context.h>

#include <memory>
#include <string>
#include <vector>

#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_util.h"
#include "tests/hostile_init_jobs.h"
#include "tests/testing/loopback.h"

namespace gradmesh {
namespace {

using loopback::Ctx;
using loopback::StartShardServer;
using loopback::TestServer;

grpc::Status Init(ParameterService::Stub* stub, const InitJobRequest& r,
                  InitJobResponse* resp = nullptr) {
  InitJobResponse scratch;
  return stub->InitJob(Ctx().get(), r, resp != nullptr ? resp : &scratch);
}

// One SGD step of worker 0 on job `job` (SmallJob layout) with gradient 1 everywhere.
grpc::Status PushOnes(ParameterService::Stub* stub, const std::string& job, int64_t step) {
  PushRequest p;
  p.set_job(job);
  p.set_worker(0);
  p.set_step(step);
  p.set_request_id(static_cast<uint64_t>(step) + 1);
  for (int c = 0; c < 2; ++c) {
    ChunkData* d = p.add_chunks();
    d->set_tensor(0);
    d->set_chunk(c);
    d->set_version(step);
    d->set_data(loopback::Bytes(std::vector<float>(4, 1.0f)));
  }
  return loopback::RawPush(stub, p);
}

class ShardLimitsGrpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ShardOptions options;
    options.limits = hostile::HostileLimits();
    server_ = StartShardServer(std::move(options));
    ASSERT_NE(server_, nullptr);
    stub_ = ParameterService::NewStub(MakeChannel(server_->addr, RpcOptions()));
  }

  std::unique_ptr<TestServer> server_;
  std::unique_ptr<ParameterService::Stub> stub_;
};

TEST_F(ShardLimitsGrpcTest, HostileInitJobsAreRefusedExactlyAndChangeNothing) {
  ASSERT_TRUE(Init(stub_.get(), hostile::SmallJob("good")).ok());
  ASSERT_TRUE(PushOnes(stub_.get(), "good", 0).ok());
  const JobInfoResponse info_before = loopback::RawInfo(stub_.get(), "good");
  const std::string values_before = loopback::Snapshot(stub_.get(), "good");
  const int64_t reserved_before = server_->shard->memory_reserved();
  ASSERT_GT(reserved_before, 0);

  const std::vector<hostile::Case> cases = hostile::Cases("hostile");
  ASSERT_GE(cases.size(), 20u);
  for (const hostile::Case& c : cases) {
    SCOPED_TRACE(c.name);
    const grpc::Status st = Init(stub_.get(), c.request);
    EXPECT_EQ(st.error_code(), c.code) << st.error_message();
    EXPECT_NE(st.error_message().find(c.message), std::string::npos)
        << st.error_message() << "\nlacks: " << c.message;
    // The message says which job; never "Unexpected error in RPC handling".
    EXPECT_NE(st.error_message().find("InitJob: job"), std::string::npos) << st.error_message();
  }

  // Nothing was created and nothing of "good" changed.
  EXPECT_EQ(server_->shard->JobNames(), std::vector<std::string>{"good"});
  JobInfoRequest q;
  q.set_job("hostile");
  JobInfoResponse unused;
  EXPECT_EQ(stub_->GetJobInfo(Ctx().get(), q, &unused).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(
      loopback::RawInfo(stub_.get(), "good"), info_before));
  EXPECT_EQ(loopback::Snapshot(stub_.get(), "good"), values_before);
  EXPECT_EQ(server_->shard->memory_reserved(), reserved_before);

  // It still trains: w = 0..7 - 0.1 * 1 twice.
  ASSERT_TRUE(PushOnes(stub_.get(), "good", 1).ok());
  const JobInfoResponse info_after = loopback::RawInfo(stub_.get(), "good");
  EXPECT_EQ(info_after.pushes_applied(), info_before.pushes_applied() + 1);
  PullRequest pull;
  pull.set_job("good");
  PullResponse resp;
  ASSERT_TRUE(loopback::RawPull(stub_.get(), pull, &resp).ok());
  ASSERT_EQ(resp.chunks_size(), 2);
  const std::vector<float> first = loopback::Floats(resp.chunks(0).data());
  ASSERT_EQ(first.size(), 4u);
  EXPECT_FLOAT_EQ(first[1], 1.0f - 0.1f - 0.1f);
  EXPECT_EQ(resp.chunks(0).version(), 2);
}

TEST_F(ShardLimitsGrpcTest, JobCountLimit) {
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(Init(stub_.get(), hostile::SmallJob(absl::StrCat("j", i))).ok()) << i;
  }
  const int64_t reserved = server_->shard->memory_reserved();
  const grpc::Status st = Init(stub_.get(), hostile::SmallJob("j8"));
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(st.error_message(),
            "InitJob: job j8: this shard already holds 8 jobs, the most it allows (--max_jobs)");
  EXPECT_EQ(server_->shard->memory_reserved(), reserved);
  EXPECT_EQ(server_->shard->JobNames().size(), 8u);
  // A retried InitJob of a job the shard holds is still answered (idempotent, not created).
  InitJobResponse again;
  ASSERT_TRUE(Init(stub_.get(), hostile::SmallJob("j3"), &again).ok());
  EXPECT_FALSE(again.created());
}

TEST(ShardLimitsGrpcBudgetTest, JobsReserveUntilTheBudgetIsSpentThenAreRefused) {
  ShardOptions options;
  options.limits.max_memory_bytes = int64_t{1} << 20;  // 1 MiB.
  std::unique_ptr<TestServer> server = StartShardServer(std::move(options));
  ASSERT_NE(server, nullptr);
  auto stub = ParameterService::NewStub(MakeChannel(server->addr, RpcOptions()));
  // Each job reserves its request ledger (1 worker x 4096 ids x 48 B, ~197 KiB) and a little
  // more, so a few fit in 1 MiB.
  int created = 0;
  grpc::Status st;
  for (; created < 20; ++created) {
    const int64_t before = server->shard->memory_reserved();
    st = Init(stub.get(), hostile::SmallJob(absl::StrCat("b", created)));
    if (!st.ok()) {
      EXPECT_EQ(server->shard->memory_reserved(), before);  // The refusal reserved nothing.
      break;
    }
    EXPECT_GT(server->shard->memory_reserved(), before);
  }
  EXPECT_GE(created, 3);
  EXPECT_LE(created, 5);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find(absl::StrCat("InitJob: job b", created, " needs ")),
            std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find("(values 32 B, request ledgers 192.2 KiB, bookkeeping "),
            std::string::npos)
      << st.error_message();
  EXPECT_NE(st.error_message().find(" of the 1.0 MiB budget is left (--max_memory_bytes)"),
            std::string::npos)
      << st.error_message();
  // The jobs that fit still train.
  EXPECT_TRUE(PushOnes(stub.get(), "b0", 0).ok());
  EXPECT_EQ(loopback::RawInfo(stub.get(), "b0").pushes_applied(), 1);
}

}  // namespace
}  // namespace gradmesh
