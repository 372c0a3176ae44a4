// Tests of CoordinatorStore over a real RocksDB in a temp dir.
#include "coordinator/coordinator_store.h"

#include <unistd.h>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string FreshDir(const std::string& name) {
  return std::string(::testing::TempDir()) + "/" + name + "_" + std::to_string(getpid());
}

TEST(CoordinatorStoreTest, WritesAndReloadsRecords) {
  const std::string dir = FreshDir("store");
  {
    ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir, {}));
    coordinator_state::JobRecord a, b;
    a.mutable_status()->set_job_id("a");
    a.set_generation(3);
    b.mutable_status()->set_job_id("b");
    coordinator_state::NodeRecord n;
    n.mutable_info()->set_name("w0");
    n.set_alive(true);
    ASSERT_OK(store->Write({&a, &b}, {&n}));
    a.set_generation(4);  // Replaces.
    ASSERT_OK(store->Write({&a}, {}));
  }
  ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir, {}));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadJobs());
  ASSERT_EQ(jobs.size(), 2u);
  EXPECT_EQ(jobs[0].status().job_id(), "a");
  EXPECT_EQ(jobs[0].generation(), 4);
  EXPECT_EQ(jobs[1].status().job_id(), "b");
  ASSERT_OK_AND_ASSIGN(auto nodes, store->LoadNodes());
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].info().name(), "w0");
  EXPECT_TRUE(nodes[0].alive());
}

TEST(CoordinatorStoreTest, DeletesJobsAndCountsBatches) {
  const std::string dir = FreshDir("delete");
  {
    ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir, {}));
    coordinator_state::JobRecord a, b;
    a.mutable_status()->set_job_id("a");
    b.mutable_status()->set_job_id("b");
    ASSERT_OK(store->Write({&a, &b}, {}));
    EXPECT_EQ(store->writes(), 1);
    ASSERT_OK(store->Write({}, {}));  // Nothing to write: no batch.
    EXPECT_EQ(store->writes(), 1);
    ASSERT_OK(store->Write({}, {}, {"a", "unknown"}));
    EXPECT_EQ(store->writes(), 2);
  }
  ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir, {}));
  ASSERT_OK_AND_ASSIGN(auto jobs, store->LoadJobs());
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].status().job_id(), "b");
}

TEST(CoordinatorStoreTest, SecondOpenOfALockedDirIsInternal) {
  const std::string dir = FreshDir("locked");
  ASSERT_OK_AND_ASSIGN(auto store, CoordinatorStore::Open(dir, {}));
  EXPECT_STATUS_MSG(CoordinatorStore::Open(dir, {}), absl::StatusCode::kInternal,
                    "cannot open coordinator tables in " + dir);
}

}  // namespace
}  // namespace gradmesh
