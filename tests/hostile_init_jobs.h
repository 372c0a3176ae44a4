// Hostile and mistaken InitJob requests, each with the exact answer a shard with
// HostileLimits() gives (issue #15 items 3 and 5): huge shapes, overflowing products, shard
// and worker counts near 2^31, non-finite or float32-overflowing hyper-parameters, long tensor
// lists, jobs that do not fit the memory budget, bad initial values. Shared by
// tests/shard_limits_grpc_test.cc (in-process shard over gRPC) and
// tests/shard_hostile_rss_test.cc (a gradmesh_server subprocess, RSS measured).
//
// Thread safety: pure functions.
#ifndef GRADMESH_TESTS_HOSTILE_INIT_JOBS_H_
#define GRADMESH_TESTS_HOSTILE_INIT_JOBS_H_

#include <grpcpp/support/status.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "proto/gradmesh.pb.h"
#include "server/shard_limits.h"

namespace gradmesh {
namespace hostile {

// The limits the cases are written against (gradmesh_server flags in HostileLimitFlags()).
inline ShardLimits HostileLimits() {
  ShardLimits l;
  l.max_memory_bytes = int64_t{256} << 20;
  l.max_tensors_per_job = 1024;
  l.max_jobs = 8;
  return l;
}

inline std::vector<std::string> HostileLimitFlags() {
  return {"--max_memory_bytes=268435456", "--max_tensors_per_job=1024", "--max_jobs=8"};
}

// A valid job: tensor w[8] in chunks of 4 on 1 shard, sgd lr 0.1, 1 worker; initial values
// 0..7.
inline InitJobRequest SmallJob(const std::string& job) {
  InitJobRequest r;
  r.set_job(job);
  TensorSpec* t = r.add_tensors();
  t->set_name("w");
  t->add_shape(8);
  r.set_chunk_elems(4);
  r.set_num_shards(1);
  r.set_shard_index(0);
  r.mutable_optimizer()->set_name("sgd");
  r.mutable_optimizer()->set_lr(0.1);
  r.set_num_workers(1);
  for (int c = 0; c < 2; ++c) {
    ChunkData* d = r.add_initial();
    d->set_tensor(0);
    d->set_chunk(c);
    d->set_dtype(FLOAT32);
    std::vector<float> v = {4.0f * c, 4.0f * c + 1, 4.0f * c + 2, 4.0f * c + 3};
    d->set_data(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  }
  return r;
}

struct Case {
  std::string name;
  InitJobRequest request;
  grpc::StatusCode code;
  std::string message;  // A part of the answer's message.
};

// The cases, all for job `job` (none of them creates it).
inline std::vector<Case> Cases(const std::string& job) {
  std::vector<Case> cases;
  auto add = [&cases](std::string name, InitJobRequest r, grpc::StatusCode code, std::string msg) {
    cases.push_back({name, r, code, msg});
  };
  using C = grpc::StatusCode;
  const InitJobRequest small = SmallJob(job);
  const double nan = std::nan("");
  const int32_t int32_max = std::numeric_limits<int32_t>::max();

  InitJobRequest r = small;
  r.clear_initial();
  r.mutable_optimizer()->set_name("adam");
  r.mutable_tensors(0)->set_shape(0, int64_t{1} << 38);
  r.set_chunk_elems(int64_t{1} << 22);
  add("adam shape [2^38]", r, C::INVALID_ARGUMENT,
      "tensors[0] (w) has more than 17179869184 elements (--max_elements_per_tensor)");
  r.mutable_tensors(0)->set_shape(0, int64_t{1} << 33);
  add("adam shape [2^33], over the budget", r, C::RESOURCE_EXHAUSTED,
      "needs 96.0 GiB (values 32.0 GiB, adam slots 64.0 GiB, ");
  r = small;
  r.set_num_shards(10000000);
  add("num_shards 10^7", r, C::INVALID_ARGUMENT,
      "num_shards 10000000 exceeds this shard's limit 1024 (--max_num_shards)");
  r = small;
  r.set_num_shards(int32_max);
  r.set_shard_index(int32_max - 1);
  add("num_shards 2^31-1", r, C::INVALID_ARGUMENT, "num_shards 2147483647 exceeds");
  r = small;
  r.set_num_workers(int32_max);
  add("num_workers 2^31-1", r, C::INVALID_ARGUMENT,
      "num_workers 2147483647 exceeds this shard's limit 4096 (--max_num_workers)");
  r.set_consistency("sync");
  add("num_workers 2^31-1 sync", r, C::INVALID_ARGUMENT, "num_workers 2147483647 exceeds");
  r = small;
  r.set_num_workers(4096);
  r.set_consistency("sync");
  add("4096 workers: request ledgers over the budget", r, C::RESOURCE_EXHAUSTED,
      "request ledgers 769.0 MiB");
  r = small;
  r.mutable_optimizer()->set_lr(1e39);
  add("lr 1e39 (inf as float32)", r, C::INVALID_ARGUMENT,
      "optimizer.lr 1e+39 is not a finite float32 > 0");
  r.mutable_optimizer()->set_lr(nan);
  add("lr NaN", r, C::INVALID_ARGUMENT, "optimizer.lr nan");
  r.mutable_optimizer()->set_lr(-1);
  add("lr -1", r, C::INVALID_ARGUMENT, "optimizer.lr -1");
  r = small;
  r.mutable_optimizer()->set_momentum(nan);
  add("momentum NaN", r, C::INVALID_ARGUMENT, "optimizer.momentum nan");
  r = small;
  r.mutable_optimizer()->set_name("adam");
  r.mutable_optimizer()->set_eps(1e-50);
  add("adam eps 1e-50 (0 as float32)", r, C::INVALID_ARGUMENT, "optimizer.eps 1e-50");
  r = small;
  r.mutable_optimizer()->set_name("lbfgs");
  add("unknown optimizer", r, C::INVALID_ARGUMENT, "unknown optimizer \"lbfgs\"");
  r = small;
  r.set_barrier_timeout_s(std::numeric_limits<double>::infinity());
  add("barrier_timeout_s inf", r, C::INVALID_ARGUMENT,
      "barrier_timeout_s must be >= 0 and at most 604800, got inf");
  r = small;
  r.set_consistency("ssp:-4");
  add("ssp:-4", r, C::INVALID_ARGUMENT, "staleness bound >= 0");
  r = small;
  r.clear_initial();
  for (int i = 0; i < 2000; ++i) {
    TensorSpec* t = r.add_tensors();
    t->set_name(std::to_string(i));
    t->add_shape(1);
  }
  add("2001 tensors", r, C::INVALID_ARGUMENT,
      "has 2001 tensors; this shard accepts at most 1024 (--max_tensors_per_job)");
  r = small;
  r.clear_initial();
  r.mutable_tensors(0)->set_shape(0, int64_t{1} << 20);
  r.set_chunk_elems(1);
  add("2^20 chunks", r, C::INVALID_ARGUMENT, "needs more than 262144 chunks of chunk_elems 1");
  r = small;
  r.clear_initial();
  r.mutable_tensors(0)->set_shape(0, int64_t{1} << 32);
  r.mutable_tensors(0)->add_shape(int64_t{1} << 32);
  r.mutable_tensors(0)->add_shape(int64_t{1} << 32);
  add("shape product overflows int64", r, C::INVALID_ARGUMENT, "has more than");
  r = small;
  r.mutable_tensors(0)->set_shape(0, -8);
  add("negative dimension", r, C::INVALID_ARGUMENT, "negative dimension");
  r = small;
  r.set_chunk_elems(0);
  add("chunk_elems 0", r, C::INVALID_ARGUMENT, "chunk_elems must be > 0");
  r = small;
  r.mutable_initial()->RemoveLast();
  add("initial values missing", r, C::INVALID_ARGUMENT,
      "shard 0 owns 2 chunks but the request carries initial values for 1");
  r = small;
  {
    const float bad = std::numeric_limits<float>::infinity();
    std::memcpy(&(*r.mutable_initial(1)->mutable_data())[8], &bad, sizeof(float));
  }
  add("initial value inf", r, C::INVALID_ARGUMENT, "element 2 is not finite");
  r = small;
  *r.mutable_initial(1) = r.initial(0);
  add("initial chunk twice", r, C::INVALID_ARGUMENT, "appears twice");
  r = small;
  r.set_job("..");
  add("job name ..", r, C::INVALID_ARGUMENT, "is not a valid name");
  return cases;
}

}  // namespace hostile
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_HOSTILE_INIT_JOBS_H_
