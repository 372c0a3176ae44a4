// ModelPublisher against the real coordinator services in process (over gRPC on 127.0.0.1):
// the snapshot arrives exactly (header, dtypes, buffer flags, values across small chunks),
// the module file too, a node that is not rank 0's or has no token is refused, and an
// inconsistent snapshot is refused before anything is sent.
#include "worker/model_publisher.h"

#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "coordinator/service.h"
#include "gtest/gtest.h"
#include "rpc/auth.h"
#include "rpc/grpc_util.h"
#include "worker/core/train_util.h"

namespace gradmesh {
namespace {

constexpr char kToken[] = "api-token";

class ModelPublisherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int counter = 0;
    dir_ = absl::StrCat(::testing::TempDir(), "/publisher_", getpid(), "_", counter++);
    ASSERT_EQ(::mkdir(dir_.c_str(), 0755), 0) << dir_;
    auto store = CoordinatorStore::Open(dir_ + "/db", {});
    ASSERT_OK(store);
    Coordinator::Options o;
    o.store = std::move(store).value();
    o.clock = &clock_;
    o.monitor_interval_ms = -1;
    auto core = Coordinator::Create(std::move(o));
    ASSERT_OK(core);
    core_ = std::move(core).value();
    auth_ = std::make_unique<TokenChecker>(kToken);
    jobs_ = std::make_unique<JobServiceImpl>(core_.get(), auth_.get());
    nodes_ = std::make_unique<NodeServiceImpl>(core_.get(), auth_.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(jobs_.get());
    builder.RegisterService(nodes_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    address_ = absl::StrCat("127.0.0.1:", port);
    for (const char* name : {"w0", "w1"}) {
      Coordinator::NodeCredentials none;
      RegisterRequest req;
      req.mutable_node()->set_name(name);
      req.mutable_node()->set_role(WORKER);
      req.mutable_node()->set_address(absl::StrCat(name, ":1"));
      req.mutable_node()->set_slots(1);
      auto r = core_->Register(req, none);
      ASSERT_OK(r);
      tokens_[name] = std::make_shared<NodeTokenHolder>();
      tokens_[name]->Set(r->node_token());
    }
  }

  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // Submits job `name` (1 worker) and returns the node of its rank 0.
  std::string Submit(const std::string& name, const std::string& model = "mlp") {
    SubmitJobRequest req;
    req.mutable_spec()->set_name(name);
    req.mutable_spec()->set_mode("allreduce");
    req.mutable_spec()->set_num_workers(1);
    req.mutable_spec()->set_steps(10);
    req.mutable_spec()->mutable_model()->set_name(model);
    if (model == "torchscript") req.mutable_spec()->mutable_model()->set_path("/m.pt");
    auto job = core_->SubmitJob(req);
    EXPECT_OK(job);
    return job.ok() ? job->workers(0).node() : "";
  }

  ModelPublisher Publisher(const std::string& node, size_t chunk_bytes = 10) {
    ModelPublisherOptions o;
    o.coordinator = address_;
    o.auth_token = kToken;
    o.node = node;
    o.node_token = tokens_[node];
    o.chunk_bytes = chunk_bytes;
    return ModelPublisher(std::move(o));
  }

  absl::Status Read(const std::string& job, ModelKind kind, ModelHeader* header,
                    std::string* payload) {
    return core_->GetModel(
        job, kind,
        [&](const ModelHeader& h) {
          *header = h;
          return true;
        },
        [&](absl::string_view piece) {
          payload->append(piece.data(), piece.size());
          return true;
        });
  }

  std::string dir_, address_;
  FakeClock clock_;
  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<TokenChecker> auth_;
  std::unique_ptr<JobServiceImpl> jobs_;
  std::unique_ptr<NodeServiceImpl> nodes_;
  std::unique_ptr<grpc::Server> server_;
  std::map<std::string, std::shared_ptr<NodeTokenHolder>> tokens_;
};

ModelSnapshot Snapshot() {
  ModelSnapshot m;
  m.step = 40;
  m.final = true;
  m.names = {"fc.weight", "bn.running_mean", "bn.num_batches_tracked"};
  m.shapes = {{2, 3}, {3}, {}};
  m.dtypes = {ElemType::kFloat32, ElemType::kFloat32, ElemType::kInt64};
  m.buffer = {false, true, true};
  m.values = {{0.5f, -1.f, 1.5f, 2.f, -2.5f, 3.f}, {0.125f, 0.25f, -4.f}, {40.f}};
  return m;
}

TEST_F(ModelPublisherTest, PublishesTheSnapshotExactly) {
  const std::string rank0 = Submit("j");
  ModelPublisher p = Publisher(rank0);  // 10-byte chunks: values split across messages.
  ASSERT_OK(p.PublishState("j", Snapshot()));
  ModelHeader h;
  std::string payload;
  ASSERT_OK(Read("j", MODEL_STATE, &h, &payload));
  EXPECT_EQ(h.node(), rank0);
  EXPECT_EQ(h.step(), 40);
  EXPECT_TRUE(h.final());
  ASSERT_EQ(h.tensors_size(), 3);
  EXPECT_EQ(h.tensors(0).name(), "fc.weight");
  EXPECT_EQ(h.tensors(0).shape_size(), 2);
  EXPECT_EQ(h.tensors(0).dtype(), FLOAT32);
  EXPECT_FALSE(h.tensors(0).buffer());
  EXPECT_EQ(h.tensors(1).name(), "bn.running_mean");
  EXPECT_TRUE(h.tensors(1).buffer());
  EXPECT_EQ(h.tensors(2).dtype(), INT64);
  EXPECT_EQ(h.tensors(2).shape_size(), 0);
  EXPECT_EQ(h.total_bytes(), 40);
  const std::vector<float> want = {0.5f, -1.f, 1.5f, 2.f, -2.5f, 3.f, 0.125f, 0.25f, -4.f, 40.f};
  ASSERT_EQ(payload.size(), want.size() * 4);
  std::vector<float> got(want.size());
  std::memcpy(got.data(), payload.data(), payload.size());
  EXPECT_EQ(got, want);
}

// While another publish of the job's state is in flight the coordinator answers ABORTED, and
// the publisher tries again with backoff, sending the whole snapshot again from its start.
TEST_F(ModelPublisherTest, APublishWaitsForTheOneInFlight) {
  const std::string rank0 = Submit("j");
  ModelHeader held;
  held.set_job_id("j");
  held.set_kind(MODEL_STATE);
  ASSERT_OK(core_->BeginPublish(held));  // As the service holds it for a publish in flight.
  absl::Status st;
  std::thread publish([&] { st = Publisher(rank0).PublishState("j", Snapshot()); });
  absl::SleepFor(absl::Milliseconds(500));  // Its first attempt is refused meanwhile.
  core_->EndPublish(held);
  publish.join();
  ASSERT_OK(st);
  ModelHeader h;
  std::string payload;
  ASSERT_OK(Read("j", MODEL_STATE, &h, &payload));
  const std::vector<float> want = {0.5f, -1.f, 1.5f, 2.f, -2.5f, 3.f, 0.125f, 0.25f, -4.f, 40.f};
  ASSERT_EQ(payload.size(), want.size() * 4);
  std::vector<float> got(want.size());
  std::memcpy(got.data(), payload.data(), payload.size());
  EXPECT_EQ(got, want);
}

TEST_F(ModelPublisherTest, OnlyRankZerosNodeWithItsTokenPublishes) {
  const std::string rank0 = Submit("j");
  const std::string other = rank0 == "w0" ? "w1" : "w0";
  EXPECT_STATUS_MSG(Publisher(other).PublishState("j", Snapshot()),
                    absl::StatusCode::kPermissionDenied, "only the node running rank 0");
  tokens_[rank0]->Set("not-the-token");
  EXPECT_STATUS_MSG(Publisher(rank0).PublishState("j", Snapshot()),
                    absl::StatusCode::kPermissionDenied, "wrong node token");
  ModelHeader h;
  std::string payload;
  EXPECT_STATUS(Read("j", MODEL_STATE, &h, &payload), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModelPublisherTest, InconsistentSnapshotsAreRefusedBeforeSending) {
  const std::string rank0 = Submit("j");
  ModelSnapshot m = Snapshot();
  m.values[1].pop_back();
  EXPECT_STATUS_MSG(Publisher(rank0).PublishState("j", m), absl::StatusCode::kInvalidArgument,
                    "tensor bn.running_mean has 2 values for 3 elements");
  m = Snapshot();
  m.shapes.pop_back();
  EXPECT_STATUS_MSG(Publisher(rank0).PublishState("j", m), absl::StatusCode::kInvalidArgument,
                    "3 names, 2 shapes");
}

TEST_F(ModelPublisherTest, PublishesTheModuleFile) {
  const std::string rank0 = Submit("ts", "torchscript");
  const std::string path = dir_ + "/module.pt";
  std::string bytes;
  for (int i = 0; i < 1000; ++i) bytes.push_back(static_cast<char>(i * 7));
  std::ofstream(path, std::ios::binary) << bytes;
  ASSERT_OK(Publisher(rank0, 64).PublishModule("ts", path));
  ModelHeader h;
  std::string payload;
  ASSERT_OK(Read("ts", MODEL_MODULE, &h, &payload));
  EXPECT_EQ(h.kind(), MODEL_MODULE);
  EXPECT_TRUE(payload == bytes);
  EXPECT_STATUS_MSG(Publisher(rank0).PublishModule("ts", dir_ + "/missing.pt"),
                    absl::StatusCode::kNotFound, "cannot open");
}

}  // namespace
}  // namespace gradmesh
