// CollectShardMetrics over a real Shard: exact samples after known pushes.
#include "server/shard_metrics.h"

#include <vector>

#include "absl/strings/match.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

// Job `name`: one tensor of 8 elements in one chunk, one shard, SGD, 2 workers.
InitJobRequest Init(const std::string& name) {
  InitJobRequest r;
  r.set_job(name);
  auto* t = r.add_tensors();
  t->set_name("w");
  t->add_shape(8);
  r.set_chunk_elems(8);
  r.set_num_shards(1);
  r.set_shard_index(0);
  r.mutable_optimizer()->set_name("sgd");
  r.mutable_optimizer()->set_lr(0.1);
  r.set_num_workers(2);
  ChunkData* d = r.add_initial();
  d->set_tensor(0);
  d->set_chunk(0);
  d->set_dtype(FLOAT32);
  d->set_data(std::string(8 * sizeof(float), '\0'));
  return r;
}

PushRequest Push(const std::string& job, int32_t worker, uint64_t id, int64_t step) {
  PushRequest p;
  p.set_job(job);
  p.set_worker(worker);
  p.set_step(step);
  p.set_request_id(id);
  ChunkData* d = p.add_chunks();
  d->set_tensor(0);
  d->set_chunk(0);
  d->set_dtype(FLOAT32);
  std::vector<float> g(8, 1.0f);
  d->set_data(std::string(reinterpret_cast<const char*>(g.data()), g.size() * sizeof(float)));
  return p;
}

TEST(ShardMetricsTest, ReportsEveryJobsCountersAndEveryWorkersStep) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Shard> shard, Shard::Create(ShardOptions()));
  MetricsWriter empty;
  CollectShardMetrics(shard.get(), &empty);
  EXPECT_EQ(empty.Render(),
            "# HELP gradmesh_shard_jobs Jobs held by this shard.\n"
            "# TYPE gradmesh_shard_jobs gauge\n"
            "gradmesh_shard_jobs 0\n");

  ASSERT_OK(shard->InitJob(Init("b")).status());
  ASSERT_OK(shard->InitJob(Init("a")).status());
  ASSERT_OK(shard->Push(Push("a", 0, 1, 0)).status());
  ASSERT_OK(shard->Push(Push("a", 0, 2, 1)).status());
  ASSERT_OK(shard->Push(Push("a", 0, 2, 1)).status());  // A retry: dropped.
  ASSERT_OK(shard->Push(Push("a", 1, 1, 0)).status());
  MetricsWriter w;
  CollectShardMetrics(shard.get(), &w);
  const std::string text = w.Render();
  for (const char* line : {
           "gradmesh_shard_jobs 2\n",
           "gradmesh_shard_pushes_applied{job_id=\"a\",shard=\"0\"} 3\n",
           "gradmesh_shard_pushes_applied{job_id=\"b\",shard=\"0\"} 0\n",
           "gradmesh_shard_duplicate_pushes{job_id=\"a\",shard=\"0\"} 1\n",
           "gradmesh_shard_updates_applied{job_id=\"a\",shard=\"0\"} 3\n",
           "gradmesh_shard_owned_elements{job_id=\"a\",shard=\"0\"} 8\n",
           "gradmesh_shard_worker_last_step{job_id=\"a\",shard=\"0\",worker=\"0\"} 1\n",
           "gradmesh_shard_worker_last_step{job_id=\"a\",shard=\"0\",worker=\"1\"} 0\n",
           "gradmesh_shard_worker_last_step{job_id=\"b\",shard=\"0\",worker=\"0\"} -1\n",
           "gradmesh_shard_worker_pushes_applied{job_id=\"a\",shard=\"0\",worker=\"0\"} 2\n",
           "# TYPE gradmesh_shard_pushes_applied gauge\n",
       }) {
    EXPECT_TRUE(absl::StrContains(text, line)) << line << "\nin:\n" << text;
  }
  // Jobs in name order: "a" before "b".
  EXPECT_LT(text.find("pushes_applied{job_id=\"a\""), text.find("pushes_applied{job_id=\"b\""));
}

}  // namespace
}  // namespace gradmesh
