#include "common/job_spec.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(JobSpecTest, ParsesYaml) {
  ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpec(R"(
name: mnist-mlp
model: {name: mlp}
dataset:
  name: mnist
optimizer:
  name: adam
  lr: 0.001
  weight_decay: 0
batch_size: 64
epochs: 3
mode: async
num_workers: 2
seed: 42
)"));
  EXPECT_EQ(spec.name(), "mnist-mlp");
  EXPECT_EQ(spec.model().name(), "mlp");
  EXPECT_EQ(spec.dataset().name(), "mnist");
  EXPECT_EQ(spec.optimizer().name(), "adam");
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 0.001);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.epochs(), 3);
  EXPECT_EQ(spec.num_workers(), 2);
  EXPECT_EQ(spec.seed(), 42u);
}

TEST(JobSpecTest, ParsesJsonWithCamelCase) {
  ASSERT_OK_AND_ASSIGN(
      JobSpec spec,
      ParseJobSpec(
          R"({"name": "j", "batchSize": 32, "numWorkers": 4, "optimizer": {"name": "sgd",
          "lr": 0.1, "momentum": 0.9, "nesterov": true}})"));
  EXPECT_EQ(spec.batch_size(), 32);
  EXPECT_EQ(spec.num_workers(), 4);
  EXPECT_TRUE(spec.optimizer().nesterov());
  EXPECT_DOUBLE_EQ(spec.optimizer().momentum(), 0.9);
}

TEST(JobSpecTest, RejectsUnknownFieldsByName) {
  EXPECT_STATUS_MSG(ParseJobSpec("name: x\noptimiser: {name: sgd}\n"),
                    absl::StatusCode::kInvalidArgument,
                    "unknown field \"optimiser\" in job spec (known fields: name, model");
  EXPECT_STATUS_MSG(ParseJobSpec("optimizer: {name: sgd, learning_rate: 0.1}\n"),
                    absl::StatusCode::kInvalidArgument,
                    "unknown field \"learning_rate\" in job spec at \"optimizer\"");
}

TEST(JobSpecTest, RejectsWrongTypesAndSyntax) {
  EXPECT_STATUS_MSG(ParseJobSpec("batch_size: lots\n"), absl::StatusCode::kInvalidArgument,
                    "wrong type");
  EXPECT_STATUS_MSG(ParseJobSpec("optimizer: {nesterov: maybe}\n"),
                    absl::StatusCode::kInvalidArgument, "expected true or false");
  EXPECT_STATUS_MSG(ParseJobSpec("model: [1, 2]\n"), absl::StatusCode::kInvalidArgument,
                    "expected a mapping");
  EXPECT_STATUS_MSG(ParseJobSpec("{name: [unclosed\n"), absl::StatusCode::kInvalidArgument,
                    "not valid YAML");
  EXPECT_STATUS_MSG(ParseJobSpec(""), absl::StatusCode::kInvalidArgument, "empty");
}

TEST(JobSpecTest, DefaultsAndValidation) {
  JobSpec spec;
  ApplyJobSpecDefaults(2, &spec);
  EXPECT_EQ(spec.name(), "job");
  EXPECT_EQ(spec.model().name(), "mlp");
  EXPECT_EQ(spec.optimizer().name(), "adam");
  EXPECT_DOUBLE_EQ(spec.optimizer().lr(), 1e-3);
  EXPECT_EQ(spec.batch_size(), 64);
  EXPECT_EQ(spec.epochs(), 1);
  EXPECT_EQ(spec.mode(), "async");
  EXPECT_EQ(spec.num_shards(), 2);
  EXPECT_EQ(spec.chunk_bytes(), 1 << 20);
  EXPECT_OK(ValidateJobSpec(spec));

  JobSpec bad = spec;
  bad.set_batch_size(-4);
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "batch_size must be > 0, got -4");
  bad = spec;
  bad.set_name("a b");
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument, "name \"a b\"");
  bad = spec;
  bad.mutable_compression()->set_pull("topk:0.1");
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "compression.pull \"topk:0.1\" is not one of");
  bad = spec;
  bad.mutable_compression()->set_warmup_steps(-5);
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "compression.warmup_steps must be >= 0, got -5");
  bad = spec;
  bad.mutable_compression()->set_momentum(1.5);
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "compression.momentum must be in [0, 1), got 1.5");
  bad = spec;
  bad.set_chunk_bytes(6);
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument, "chunk_bytes");
}

TEST(JobSpecTest, AllreduceDefaultsAndValidation) {
  JobSpec spec;
  spec.set_mode("allreduce");
  ApplyJobSpecDefaults(2, &spec);
  EXPECT_EQ(spec.allreduce().backend(), "auto");
  EXPECT_EQ(spec.allreduce().transport(), "tcp");
  EXPECT_EQ(spec.allreduce().bucket_bytes(), 1 << 20);
  EXPECT_OK(ValidateJobSpec(spec));
  for (const char* backend : {"auto", "ring", "nccl", "hierarchical"}) {
    JobSpec ok = spec;
    ok.mutable_allreduce()->set_backend(backend);
    EXPECT_OK(ValidateJobSpec(ok));
  }
  JobSpec ok = spec;
  ok.mutable_allreduce()->set_transport("grpc");
  EXPECT_OK(ValidateJobSpec(ok));

  JobSpec bad = spec;
  bad.mutable_allreduce()->set_transport("udp");
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "allreduce.transport \"udp\" is not one of grpc, tcp");
  bad = spec;
  bad.mutable_allreduce()->set_backend("mpi");
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "allreduce.backend \"mpi\" is not one of auto, hierarchical, nccl, ring");
}

TEST(JobSpecTest, JsonRoundTrip) {
  JobSpec spec;
  ApplyJobSpecDefaults(1, &spec);
  ASSERT_OK_AND_ASSIGN(JobSpec back, ParseJobSpec(JobSpecToJson(spec)));
  EXPECT_EQ(back.SerializeAsString(), spec.SerializeAsString());
}

TEST(JobSpecTest, ShippedExamplesAreValid) {
  for (const char* path : {"deploy/jobs/mnist_mlp.yaml", "deploy/jobs/fashion_lenet.yaml"}) {
    ASSERT_OK_AND_ASSIGN(JobSpec spec, LoadJobSpecFile(path));
    ApplyJobSpecDefaults(2, &spec);
    EXPECT_OK(ValidateJobSpec(spec)) << path;
    EXPECT_EQ(spec.num_workers(), 2) << path;
  }
  EXPECT_STATUS_MSG(LoadJobSpecFile("deploy/jobs/missing.yaml"), absl::StatusCode::kNotFound,
                    "deploy/jobs/missing.yaml");
}

}  // namespace
}  // namespace gradmesh
