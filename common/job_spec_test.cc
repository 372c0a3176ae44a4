#include "common/job_spec.h"

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/optimizer.h"
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

TEST(JobSpecTest, AnyModelAndTensorsDatasetAreValid) {
  ASSERT_OK_AND_ASSIGN(JobSpec spec, ParseJobSpec(R"(
name: kjv
model: {name: torchscript, path: /models/lm.pt}
dataset: {name: tensors, path: /data/kjv}
loss: module
)"));
  ApplyJobSpecDefaults(1, &spec);
  EXPECT_EQ(spec.dataset().name(), "tensors");
  EXPECT_EQ(spec.loss(), "module");
  EXPECT_OK(ValidateJobSpec(spec));
  spec.set_loss("mse");
  EXPECT_OK(ValidateJobSpec(spec));
  spec.set_loss("cross_entropy");
  EXPECT_OK(ValidateJobSpec(spec));
}

// diloco's default barrier timeout grows with its rounds (10 s per inner step) but stops at
// the limit on timeouts: a long round's default never refuses the spec.
TEST(JobSpecTest, DilocoDefaultBarrierTimeoutStaysWithinTheLimit) {
  for (const auto& [inner, want] : std::vector<std::pair<int32_t, double>>{
           {5, 120}, {50, 500}, {60480, 604800}, {100000, 604800}, {1 << 30, 604800}}) {
    JobSpec spec;
    spec.set_name("d");
    spec.set_mode("diloco");
    spec.mutable_diloco()->set_inner_steps(inner);
    ApplyJobSpecDefaults(1, &spec);
    EXPECT_EQ(spec.barrier_timeout_s(), want) << inner;
    EXPECT_OK(ValidateJobSpec(spec)) << inner;
  }
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

TEST(JobSpecTest, RejectsAFieldGivenTwice) {
  EXPECT_STATUS_MSG(ParseJobSpec("name: x\nbatch_size: 32\nbatch_size: 64\n"),
                    absl::StatusCode::kInvalidArgument,
                    "field \"batch_size\" appears twice in job spec");
  EXPECT_STATUS_MSG(ParseJobSpec("optimizer: {name: sgd, lr: 0.1, lr: 0.2}\n"),
                    absl::StatusCode::kInvalidArgument,
                    "field \"lr\" appears twice in job spec at \"optimizer\"");
  // Both spellings of one field are the same field.
  EXPECT_STATUS_MSG(ParseJobSpec("batch_size: 32\nbatchSize: 64\n"),
                    absl::StatusCode::kInvalidArgument,
                    "field \"batch_size\" appears twice in job spec");
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
  EXPECT_EQ(spec.chunk_bytes(), 0);  // Auto: common/partitioner.h AutoChunkElems.
  EXPECT_OK(ValidateJobSpec(spec));
  JobSpec gossip;
  gossip.set_mode("gossip");
  ApplyJobSpecDefaults(2, &gossip);
  EXPECT_EQ(gossip.gossip().topology(), "exponential");
  EXPECT_DOUBLE_EQ(gossip.gossip().timeout_s(), 2);
  EXPECT_DOUBLE_EQ(gossip.gossip().start_wait_s(), 60);

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
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "chunk_bytes must be 0 (auto) or a positive multiple of 4, got 6");
  bad.set_chunk_bytes(-4);
  EXPECT_STATUS_MSG(ValidateJobSpec(bad), absl::StatusCode::kInvalidArgument,
                    "chunk_bytes must be 0 (auto) or a positive multiple of 4, got -4");
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

// Every field a strategy is made from or a number the shards or workers act on, as a user
// writes it (YAML or JSON): INVALID_ARGUMENT naming the field and the value, from parsing
// (unknown fields, wrong types) or from ValidateJobSpec after the defaults.
TEST(JobSpecTest, ValidationTable) {
  struct Case {
    std::string text;  // Lines added to a valid spec (YAML), or a whole JSON spec.
    std::string says;
  };
  const std::vector<Case> cases = {
      // Unknown fields, nested, in YAML and in JSON.
      {"gossip: {topolgy: random}", "unknown field \"topolgy\" in job spec at \"gossip\""},
      {R"({"name": "t", "optimizer": {"name": "sgd", "lrr": 1}})", "unknown field \"lrr\""},
      // Optimizer: names and float32 hyper-parameters.
      {"optimizer: {name: lion}",
       "job spec: optimizer.name: \"lion\" is not one of adam, adamw, sgd"},
      {"optimizer: {lr: 1e39}", "job spec: optimizer.lr: 1e+39 is not a finite float32"},
      {R"({"name": "t", "optimizer": {"lr": "Infinity"}})",
       "job spec: optimizer.lr: inf is not a finite float32"},
      {R"({"name": "t", "optimizer": {"lr": "NaN"}})", "optimizer.lr must be > 0, got nan"},
      {"optimizer: {lr: -0.1}", "optimizer.lr must be > 0, got -0.1"},
      {"optimizer: {lr: 1e-50}",
       "job spec: optimizer.lr: 1e-50 must be > 0 (and > 0 as a float32)"},
      {"optimizer: {name: sgd, momentum: 1}",
       "job spec: optimizer.momentum: 1 is out of range [0, 1)"},
      {"optimizer: {name: sgd, dampening: -0.5}", "optimizer.dampening: -0.5 is out of range"},
      {R"({"name": "t", "optimizer": {"beta2": "NaN"}})",
       "job spec: optimizer.beta2: nan is not a finite float32"},
      {"optimizer: {beta1: 1.5}", "optimizer.beta1: 1.5 is out of range [0, 1)"},
      {"optimizer: {eps: 1e39}", "optimizer.eps: 1e+39 is not a finite float32"},
      {"optimizer: {weight_decay: -1}", "optimizer.weight_decay: -1 is out of range [0, 1e+09]"},
      {"optimizer: {min_lr_fraction: 2}", "optimizer.min_lr_fraction: 2 is out of range [0, 1]"},
      {"optimizer: {warmup_updates: -3}", "optimizer.warmup_updates: -3 is out of range"},
      {"optimizer: {lr_schedule: step}",
       "optimizer.lr_schedule: \"step\" is not one of constant, cosine"},
      {"optimizer: {name: sgd, nesterov: true}",
       "optimizer.nesterov: true needs momentum > 0 and dampening 0"},
      // Training guardrails (#14).
      {"precision: int8", "job spec: precision: \"int8\" is not one of fp32, bf16, fp16"},
      {"loss_scale: {mode: static}", "loss_scale.mode: \"static\" is not one of dynamic, none"},
      {"loss_scale: {mode: dynamic, growth_factor: 0.5}",
       "loss_scale.growth_factor: 0.5 is out of range [1, 1e+06]"},
      {"loss_scale: {mode: dynamic, backoff_factor: 1}",
       "loss_scale.backoff_factor: 1 is out of range [0, 1)"},
      {"loss_scale: {mode: dynamic, init_scale: -2}", "loss_scale.init_scale: -2 is out of range"},
      {"loss_scale: {mode: dynamic, growth_interval: -1}",
       "loss_scale.growth_interval: -1 is out of range"},
      {"accumulation_steps: -1", "job spec: accumulation_steps: -1 is out of range [0, 65536]"},
      {"accumulation_steps: 100000", "accumulation_steps: 100000 is out of range"},
      {"clip_grad_norm: -1", "job spec: clip_grad_norm: -1 is out of range [0, 1e+30]"},
      {"pipeline: 2", "job spec: pipeline: 2 is out of range [0, 1]"},
      {"mode: sync\npipeline: 1",
       "job spec: pipeline: 1 is not supported in mode sync: only async and ssp"},
      {"mode: allreduce\npipeline: 1", "pipeline: 1 is not supported in mode allreduce"},
      {"mode: diloco\npipeline: 1", "pipeline: 1 is not supported in mode diloco"},
      {"overlap: 3", "job spec: overlap: 3 is out of range [0, 2]"},
      {"mode: gossip\noverlap: 2", "job spec: overlap: 2 is not supported in mode gossip"},
      {"overlap: 2\npipeline: 1", "job spec: overlap: 2 cannot be combined with pipeline"},
      {"mode: gossip\noverlap: 1", "job spec: overlap: 1 is not supported in mode gossip"},
      {"mode: diloco\noverlap: 1", "overlap: 1 is not supported in mode diloco"},
      {"overlap: 1\npipeline: 1", "job spec: overlap: 1 cannot be combined with pipeline"},
      {"overlap: 1\nclip_grad_norm: 1", "overlap: 1 cannot be combined with clip_grad_norm"},
      {"mode: sync\noverlap: 1\nclip_grad_value: 1",
       "overlap: 1 cannot be combined with clip_grad_value"},
      {"overlap: 1\nprecision: fp16", "overlap: 1 cannot be combined with loss_scale (dynamic)"},
      {"placement: random", "job spec: placement: \"random\" is not one of greedy, ordered"},
      {"mode: allreduce\nplacement: ordered",
       "job spec: placement: \"ordered\" applies to the ps modes (async, ssp, sync, diloco), not "
       "allreduce"},
      {R"({"name": "t", "clipGradValue": "NaN"})", "clip_grad_value: nan is not a finite float32"},
      {"lr_scaling: {rule: cubic}",
       "job spec: lr_scaling.rule: \"cubic\" is not one of none, linear, sqrt"},
      {"lr_scaling: {rule: linear}",
       "job spec: lr_scaling.base_batch_size: 0 must be > 0 with rule linear"},
      {"lr_scaling: {rule: sqrt, base_batch_size: 64, warmup_steps: -1}",
       "lr_scaling.warmup_steps: -1 is out of range"},
      {"optimizer: {lr: 1e38}\nlr_scaling: {rule: linear, base_batch_size: 1}",
       "job spec: lr_scaling: 6.4e+39 makes optimizer.lr out of float32 range"},
      {"optimizer: {warmup_start_fraction: 2}",
       "job spec: optimizer.warmup_start_fraction: 2 is out of range [0, 1]"},
      {"mode: diloco\nlr_scaling: {rule: linear, base_batch_size: 64}",
       "lr_scaling.rule: \"linear\" is not supported in mode diloco"},
      {"mode: diloco\ndiloco: {outer_optimizer: adam}",
       "job spec: diloco.outer_optimizer: \"adam\" is not one of nesterov, sgd"},
      {"mode: diloco\ndiloco: {outer_lr: -1}", "diloco.outer_lr: -1 is out of range"},
      {"mode: diloco\ndiloco: {outer_momentum: 1}", "diloco.outer_momentum: 1 is out of range"},
      {"mode: diloco\ndiloco: {inner_steps: -5}", "diloco.inner_steps: -5 is out of range"},
      // Counts within limits.
      {"num_workers: 2000", "job spec: num_workers: 2000 is out of range [1, 1024]"},
      {"num_workers: 2147483647", "num_workers: 2147483647 is out of range [1, 1024]"},
      {"num_shards: 10000000", "job spec: num_shards: 10000000 is out of range [1, 256]"},
      {"batch_size: 2097152", "batch_size: 2097152 is out of range [1, 1048576]"},
      {"steps: 2199023255553", "steps: 2199023255553 is out of range [0, 1099511627776]"},
      {"epochs: 2000000", "epochs: 2000000 is out of range [0, 1000000]"},
      {"chunk_bytes: 2147483648", "chunk_bytes: 2147483648 is out of range [0, 1073741824]"},
      {"checkpoint: {every_steps: 2199023255553}", "checkpoint.every_steps: 2199023255553"},
      {"allreduce: {bucket_bytes: 2147483648}",
       "allreduce.bucket_bytes: 2147483648 is out of range"},
      // Times: finite and at most 7 days.
      {R"({"name": "t", "barrier_timeout_s": "Infinity"})",
       "job spec: barrier_timeout_s: inf is not a finite float32"},
      {"mode: gossip\ngossip: {timeout_s: 1e7}",
       "gossip.timeout_s: 1e+07 is out of range [0, 604800]"},
      {"mode: gossip\ngossip: {start_wait_s: -1}",
       "gossip.start_wait_s: -1 is out of range [0, 604800]"},
      {R"({"name": "t", "mode": "allreduce", "allreduce": {"timeout_s": "NaN"}})",
       "allreduce.timeout_s: nan is not a finite float32"},
      {"durability: {mode: periodic, snapshot_every_seconds: 1e9}",
       "durability.snapshot_every_seconds: 1e+09 is out of range"},
      // Strategy names.
      {"mode: hogwild", "mode \"hogwild\""},
      {"mode: ssp:-1", "mode \"ssp:-1\""},
      {"durability: {mode: sometimes}", "durability.mode \"sometimes\" is not one of"},
      {"sync_lr_scaling: sqrt", "sync_lr_scaling \"sqrt\" is not one of linear, none"},
      {"mode: gossip\ngossip: {topology: ring}", "gossip.topology \"ring\" is not one of"},
      {"mode: gossip\ngossip: {codec: zstd}", "gossip.codec \"zstd\""},
      {"compression: {pull: topk}", "compression.pull \"topk\" is not one of"},
      {"dataset: {name: cifar10}", "unknown dataset \"cifar10\""},
      {"model: {name: resnet}", "unknown model \"resnet\""},
      {"loss: hinge", "unknown loss \"hinge\" (known: cross_entropy, module, mse)"},
      {"loss: module",
       "loss \"module\" needs a TorchScript model with a loss(x, y) method; "
       "model \"mlp\" has none"},
      // Strings bounded.
      {"model: {name: torchscript, path: " + std::string(5000, 'p') + "}",
       "job spec: model.path: 5000 bytes is too long (at most 4096)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text.substr(0, 80));
    const std::string text = c.text[0] == '{' ? c.text : "name: t\n" + c.text + "\n";
    absl::StatusOr<JobSpec> spec = ParseJobSpec(text);
    absl::Status st = spec.status();
    if (spec.ok()) {
      ApplyJobSpecDefaults(1, &*spec);
      st = ValidateJobSpec(*spec);
    }
    EXPECT_STATUS_MSG(st, absl::StatusCode::kInvalidArgument, c.says);
  }
  // The limits themselves are accepted.
  ASSERT_OK_AND_ASSIGN(JobSpec max, ParseJobSpec("name: t\nnum_workers: 1024\nnum_shards: 256\n"
                                                 "optimizer: {lr: 3e38, beta2: 0.999999}\n"));
  ApplyJobSpecDefaults(1, &max);
  EXPECT_OK(
      ValidateJobSpec(max));  // fp16 turns dynamic loss scaling on, with GradScaler's defaults.
  {
    ASSERT_OK_AND_ASSIGN(JobSpec h, ParseJobSpec("name: t\nmode: allreduce\nprecision: fp16\n"));
    ApplyJobSpecDefaults(1, &h);
    EXPECT_OK(ValidateJobSpec(h));
    EXPECT_EQ(h.loss_scale().mode(), "dynamic");
    EXPECT_EQ(h.loss_scale().init_scale(), 65536);
    EXPECT_EQ(h.loss_scale().growth_factor(), 2);
    EXPECT_EQ(h.loss_scale().backoff_factor(), 0.5);
    EXPECT_EQ(h.loss_scale().growth_interval(), 2000);
    ASSERT_OK_AND_ASSIGN(JobSpec f, ParseJobSpec("name: t\n"));
    ApplyJobSpecDefaults(1, &f);
    EXPECT_EQ(f.loss_scale().mode(), "none");
  }
  // sync clips the averaged gradient and skips non-finite steps through its two-phase apply.
  for (const char* extra : {"clip_grad_norm: 1", "clip_grad_value: 2", "precision: fp16",
                            "loss_scale: {mode: dynamic}"}) {
    ASSERT_OK_AND_ASSIGN(JobSpec p, ParseJobSpec(absl::StrCat("name: t\nmode: sync\n", extra)));
    ApplyJobSpecDefaults(1, &p);
    EXPECT_OK(ValidateJobSpec(p)) << extra;
  }
  for (const char* mode : {"async", "ssp:2", "sync"}) {
    ASSERT_OK_AND_ASSIGN(JobSpec p,
                         ParseJobSpec(absl::StrCat("name: t\nmode: \"", mode,
                                                   "\"\noverlap: 1\nplacement: ordered\n")));
    ApplyJobSpecDefaults(1, &p);
    EXPECT_OK(ValidateJobSpec(p)) << mode;
  }
  // pipeline: 1 where a step may start before the previous step's exchange ends.
  for (const char* mode : {"async", "ssp:2"}) {
    ASSERT_OK_AND_ASSIGN(
        JobSpec p, ParseJobSpec(absl::StrCat("name: t\nmode: \"", mode, "\"\npipeline: 1\n")));
    ApplyJobSpecDefaults(1, &p);
    EXPECT_OK(ValidateJobSpec(p)) << mode;
  }
}

// A spec that arrives as protobuf bytes may carry fields this binary does not know.
TEST(JobSpecTest, LrScalingFollowsTheGlobalBatch) {
  JobSpec spec;
  spec.set_mode("sync");  // One schedule update per step.
  spec.set_batch_size(32);
  spec.set_accumulation_steps(2);
  spec.mutable_optimizer()->set_lr(0.1);
  EXPECT_EQ(LrScalingFactor(spec, 4), 1.0);  // Off.
  EXPECT_EQ(ScaledOptimizer(spec, 4).DebugString(), spec.optimizer().DebugString());
  spec.mutable_lr_scaling()->set_rule("linear");
  spec.mutable_lr_scaling()->set_base_batch_size(64);
  EXPECT_EQ(LrScalingFactor(spec, 4), 4.0);  // 32 * 2 * 4 / 64.
  EXPECT_EQ(LrScalingFactor(spec, 1), 1.0);
  OptimizerSpec o = ScaledOptimizer(spec, 4);
  EXPECT_DOUBLE_EQ(o.lr(), 0.4);
  EXPECT_EQ(o.warmup_updates(), 0);
  spec.mutable_lr_scaling()->set_warmup_steps(10);
  o = ScaledOptimizer(spec, 4);
  EXPECT_EQ(o.warmup_updates(), 10);
  EXPECT_DOUBLE_EQ(o.warmup_start_fraction(), 0.25);
  // Goyal warm-up: from the base lr (0.1) at the first update to 0.4 at the tenth.
  EXPECT_NEAR(o.lr() * LrScheduleFactor(o, 0), 0.1 + 0.3 * 0.1, 1e-7);
  EXPECT_NEAR(o.lr() * LrScheduleFactor(o, 9), 0.4, 1e-7);
  EXPECT_NEAR(o.lr() * LrScheduleFactor(o, 100), 0.4, 1e-7);
  // async: the shards count every worker's pushes, so 10 steps of 4 workers are 40 updates;
  // a longer warm-up the optimizer already has is kept.
  spec.set_mode("async");
  EXPECT_EQ(ScaledOptimizer(spec, 4).warmup_updates(), 40);
  spec.mutable_optimizer()->set_warmup_updates(100);
  EXPECT_EQ(ScaledOptimizer(spec, 4).warmup_updates(), 100);
  spec.mutable_optimizer()->set_warmup_updates(0);
  spec.set_mode("sync");
  spec.mutable_lr_scaling()->set_rule("sqrt");
  EXPECT_DOUBLE_EQ(LrScalingFactor(spec, 4), 2.0);
  EXPECT_DOUBLE_EQ(LrScalingFactor(spec, 2), std::sqrt(2.0));
  ApplyJobSpecDefaults(1, &spec);
  EXPECT_OK(ValidateJobSpec(spec));
  // diloco defaults: H 50, Nesterov 0.7 / 0.9, no lr change when the group shrinks, a round
  // barrier of 10 s per inner step (at least 120 s), checkpoints in rounds.
  JobSpec dl;
  dl.set_mode("diloco");
  dl.mutable_checkpoint()->set_every_steps(120);
  ApplyJobSpecDefaults(2, &dl);
  EXPECT_OK(ValidateJobSpec(dl));
  EXPECT_EQ(dl.diloco().inner_steps(), 50);
  EXPECT_EQ(dl.diloco().outer_optimizer(), "nesterov");
  EXPECT_EQ(dl.diloco().outer_lr(), 0.7);
  EXPECT_EQ(dl.diloco().outer_momentum(), 0.9);
  EXPECT_EQ(dl.sync_lr_scaling(), "none");
  EXPECT_EQ(dl.barrier_timeout_s(), 500);
  EXPECT_EQ(dl.durability().snapshot_every_updates(), 3);  // ceil(120 / 50) rounds.
  JobSpec d;
  ApplyJobSpecDefaults(1, &d);
  EXPECT_EQ(d.precision(), "fp32");
  EXPECT_EQ(d.accumulation_steps(), 1);
  EXPECT_EQ(d.lr_scaling().rule(), "none");
}

TEST(JobSpecTest, UnknownProtoFieldsAreRefused) {
  JobSpec spec;
  ApplyJobSpecDefaults(1, &spec);
  ASSERT_OK(ValidateJobSpec(spec));
  JobSpec top = spec;
  top.GetReflection()->MutableUnknownFields(&top)->AddVarint(1000, 7);
  EXPECT_STATUS_MSG(ValidateJobSpec(top), absl::StatusCode::kInvalidArgument,
                    "job spec: unknown field number 1000 in the spec");
  JobSpec nested = spec;
  DurabilitySpec* d = nested.mutable_durability();
  d->GetReflection()->MutableUnknownFields(d)->AddVarint(77, 1);
  EXPECT_STATUS_MSG(ValidateJobSpec(nested), absl::StatusCode::kInvalidArgument,
                    "unknown field number 77 in durability");
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
