// NodeAgent: the daemon side of the coordinator's NodeService, shared by gradmesh_server and
// gradmesh_worker in service mode (--coordinator=host:port).
//
// The agent registers the node, then heartbeats every interval the coordinator asks for. Each
// heartbeat carries the reports the daemon's `Reports` callback returns (one per task it runs
// or has finished since), and hands the coordinator's complete desired task list to the
// `Reconcile` callback, which starts what is new and stops what is no longer listed. When the
// coordinator is unreachable the agent keeps retrying (with backoff up to the interval x 4)
// and the daemon's work goes on; when the coordinator answers register_again (it lost its
// tables) the agent registers again.
//
// Thread safety: Start() once; Stop() from any thread, once. The callbacks run on the agent's
// thread, one at a time.
#ifndef GRADMESH_RUNTIME_NODE_AGENT_H_
#define GRADMESH_RUNTIME_NODE_AGENT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "proto/coordinator.grpc.pb.h"

namespace gradmesh {

struct NodeAgentOptions {
  std::string coordinator;  // host:port of gradmesh_coordinator.
  std::string auth_token;   // Sent as "authorization: Bearer <token>" when non-empty.
  NodeInfo node;            // name, role, address, cores, gpus, slots, host.
  absl::Duration rpc_deadline = absl::Seconds(5);
  const Logger* logger = nullptr;  // Not owned; may be null.
};

class NodeAgent {
 public:
  using Reconcile = std::function<void(const std::vector<Task>& desired)>;
  using Reports = std::function<std::vector<TaskReport>()>;

  NodeAgent(NodeAgentOptions options, Reconcile reconcile, Reports reports);
  ~NodeAgent();  // Stops if running.

  void Start();
  // Sends one last heartbeat (with leaving = `leaving` and the final reports), then stops.
  void Stop(bool leaving);

 private:
  absl::Status Register();
  absl::Status Heartbeat(bool leaving);
  void Loop();

  const NodeAgentOptions options_;
  const Reconcile reconcile_;
  const Reports reports_;
  std::unique_ptr<NodeService::Stub> stub_;
  absl::Duration interval_ = absl::Milliseconds(500);  // Agent thread only.
  absl::Notification stop_;
  std::thread thread_;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace gradmesh

#endif  // GRADMESH_RUNTIME_NODE_AGENT_H_
