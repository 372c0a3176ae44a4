#include "runtime/daemon_main.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/daemon.h"
#include "common/job_name.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/coordinator.grpc.pb.h"

namespace gradmesh {
namespace {

std::string TmpPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(DaemonMainTest, NodeNameAndAdvertisedHost) {
  EXPECT_EQ(NodeNameOrHostName("n1"), "n1");
  EXPECT_EQ(NodeNameOrHostName(""), NameFromHost(HostName()));
  EXPECT_TRUE(IsValidName(NodeNameOrHostName("")));
  EXPECT_EQ(AdvertisedHost("10.0.0.7"), "10.0.0.7");
  EXPECT_EQ(AdvertisedHost("0.0.0.0"), HostName());
}

TEST(DaemonMainTest, ServesOnAFreePortWritesThePortFileAndShutsDownInOrder) {
  DaemonOptions o;
  o.address = "127.0.0.1:0";
  o.port_file = TmpPath("daemon_main_port");
  o.shutdown_grace = absl::Milliseconds(100);
  Daemon daemon(o, nullptr);
  EXPECT_EQ(daemon.port(), 0);
  NodeService::Service service;  // Any service: gRPC starts no server without one.
  ASSERT_OK(daemon.Serve({&service}));
  ASSERT_GT(daemon.port(), 0);
  EXPECT_EQ(daemon.host(), "127.0.0.1");
  EXPECT_EQ(daemon.ListenAddress(), "127.0.0.1:" + std::to_string(daemon.port()));
  EXPECT_EQ(ReadAll(o.port_file), std::to_string(daemon.port()) + "\n");
  EXPECT_STATUS(daemon.Serve({&service}), absl::StatusCode::kFailedPrecondition);
  MetricsRegistry registry;
  ASSERT_OK(daemon.StartMetrics(&registry));  // Port -1: no endpoint, OK.

  std::vector<std::string> order;
  ShutdownSteps steps;
  steps.before_server_stop = [&] { order.push_back("before"); };
  steps.after_server_stop = [&] { order.push_back("after"); };
  daemon.Shutdown(steps);
  daemon.Shutdown(steps);  // Idempotent.
  EXPECT_EQ(order, (std::vector<std::string>{"before", "after"}));
}

TEST(DaemonMainTest, ServeFailsOnABadAddress) {
  DaemonOptions o;
  o.address = "256.1.1.1:1";
  Daemon daemon(o, nullptr);
  NodeService::Service service;
  EXPECT_STATUS(daemon.Serve({&service}), absl::StatusCode::kUnavailable);
  EXPECT_EQ(daemon.port(), 0);
}

TEST(DaemonMainTest, MetricsEndpointOnAFreePort) {
  DaemonOptions o;
  o.metrics.host = "127.0.0.1";
  o.metrics.port = 0;
  o.metrics.port_file = TmpPath("daemon_main_metrics_port");
  Daemon daemon(o, nullptr);
  MetricsRegistry registry;
  ASSERT_OK(daemon.StartMetrics(&registry));
  EXPECT_FALSE(ReadAll(o.metrics.port_file).empty());
  daemon.Shutdown();
}

}  // namespace
}  // namespace gradmesh
