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
// Node identity: the coordinator answers the first registration with this node's own token
// (RegisterResponse.node_token); the agent sends it as `x-gradmesh-node-token` on every later
// call (besides the shared node token in `authorization`). A heartbeat answered
// PERMISSION_DENIED (the token no longer counts) makes the agent register again, which the
// coordinator grants once the name's previous registration is dead. With a NodeTokenStore
// the token outlives the daemon: a restarted daemon proves it is the node at once and
// registers again without waiting for its previous registration to be declared dead (a
// heartbeat timeout; the coordinator then sees a restart, as after a re-registration).
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
#include "common/fd.h"
#include "common/logging.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/rpc_options.h"

namespace gradmesh {

// The node's own token (RegisterResponse.node_token; "" until the coordinator issued one),
// shared by the NodeAgent that obtains it with the daemon's other NodeService callers on the
// node's behalf (e.g. worker/model_publisher.h), which send it as x-gradmesh-node-token.
// Thread-safe.
class NodeTokenHolder {
 public:
  void Set(std::string token) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    token_ = std::move(token);
  }
  std::string Get() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return token_;
  }

 private:
  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
};

// The node's own token in a file (mode 0600), kept across restarts of the daemon (flag
// --node_token_store). The file is locked (flock) while the store is open, so two daemons
// cannot share one: the second is refused. Thread safety: Load and Save from one thread at a
// time (the agent's).
class NodeTokenStore {
 public:
  // Opens, creating it if needed, and locks `path`. FAILED_PRECONDITION naming the path when
  // another process (or another store in this one) holds it, or when it is not a regular
  // file owned by this user (a symbolic link is never followed; group and other permissions
  // are removed); INTERNAL on other I/O errors.
  static absl::StatusOr<std::unique_ptr<NodeTokenStore>> Open(const std::string& path);
  // The stored token; "" when there is none, or when the file holds anything but a token
  // (1-256 characters of [A-Za-z0-9_-]: a torn or foreign file is ignored, not sent).
  std::string Load() const;
  // Replaces the stored token (written in place and synced). INTERNAL naming the path.
  absl::Status Save(const std::string& token);
  const std::string& path() const { return path_; }

 private:
  NodeTokenStore(Fd fd, std::string path) : fd_(std::move(fd)), path_(std::move(path)) {}
  Fd fd_;
  const std::string path_;
};

// The store's file for node `name` in `dir`: <dir>/node-<name>.token, with every character
// of the name outside [A-Za-z0-9._-] replaced by '_'.
std::string NodeTokenStorePath(const std::string& dir, const std::string& name);

// A daemon's --node_token_store: "none" keeps the token in memory only; "" (the default) a
// file in `default_dir` (NodeTokenStorePath, the directory made if needed; none when
// `default_dir` is empty); anything else is the file's path. A store that cannot be opened
// or is still held by another daemon after 3 s (a predecessor that was just killed may still
// be exiting) is logged (event=node_token_store_unavailable) and left out (null): the daemon
// runs as without one.
std::shared_ptr<NodeTokenStore> OpenNodeTokenStore(const std::string& flag,
                                                   const std::string& default_dir,
                                                   const std::string& node_name,
                                                   const Logger* logger);

struct NodeAgentOptions {
  std::string coordinator;  // host:port of gradmesh_coordinator.
  std::string auth_token;   // Sent as "authorization: Bearer <token>" when non-empty.
  // The daemon's channel options (limits, TLS): the coordinator channel uses them. A token
  // over plaintext to a non-loopback coordinator is refused (rpc/tls.h CheckTokenTransport:
  // the daemon's main checks it before starting the agent).
  RpcOptions rpc;
  NodeInfo node;  // name, role, address, cores, gpus, slots, host.
  absl::Duration rpc_deadline = absl::Seconds(5);
  const Logger* logger = nullptr;  // Not owned; may be null.
  // Where the agent keeps the node's own token; null: a holder of its own.
  std::shared_ptr<NodeTokenHolder> node_token;
  // Where the node's token outlives the daemon; null: in memory only. Its token, if any, is
  // presented from the first registration, and every token issued is saved to it.
  std::shared_ptr<NodeTokenStore> token_store;
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
  // Adds the node's own token (x-gradmesh-node-token), once the coordinator issued one.
  void AddNodeToken(grpc::ClientContext* context) const;

  const NodeAgentOptions options_;
  const Reconcile reconcile_;
  const Reports reports_;
  std::unique_ptr<NodeService::Stub> stub_;
  absl::Duration interval_ = absl::Milliseconds(500);  // Agent thread only.
  // The per-node token from the last registration that issued one (options.node_token, or
  // the agent's own holder), and options.token_store's until then. Without a store a
  // restarted daemon registers again only once the coordinator has declared its previous
  // registration dead.
  const std::shared_ptr<NodeTokenHolder> node_token_;
  absl::Notification stop_;
  std::thread thread_;
  bool started_ = false;
  bool stopped_ = false;
};

}  // namespace gradmesh

#endif  // GRADMESH_RUNTIME_NODE_AGENT_H_
