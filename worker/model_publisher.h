// ModelPublisher: a service-mode worker's uploads of its job's model to the coordinator
// (NodeService.PublishModel, proto/coordinator.proto "Published models"), which
// `gradmesh export` downloads for gossip and allreduce jobs (they have no shards) and, for
// TorchScript jobs of every mode, the module file.
//
// WorkerAgent wires it into rank 0's TrainerOptions::on_model (the training loop calls it
// after checkpoints, at most every model_publish_interval, and at the end) and uploads the
// module once per job before rank 0 starts. Every call is authenticated as this node: the
// API/node token (authorization) and the node's own token from the NodeAgent's holder
// (x-gradmesh-node-token); the coordinator accepts it only from the node rank 0 is placed on.
//
// A call streams the header, then the payload in chunk_bytes pieces, built from the snapshot
// piece by piece (the model is not copied whole). It blocks until the coordinator answered or
// the deadline passed. A final state publish that the coordinator answers ABORTED (another
// publish of the job's model is in flight) is tried again with backoff, for up to 2 minutes;
// periodic ones and the module are not (rank 0's peers would time out meanwhile).
//
// Thread safety: all methods may be called concurrently.
#ifndef GRADMESH_WORKER_MODEL_PUBLISHER_H_
#define GRADMESH_WORKER_MODEL_PUBLISHER_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "proto/coordinator.grpc.pb.h"
#include "rpc/rpc_options.h"
#include "runtime/node_agent.h"

namespace gradmesh {

struct ModelSnapshot;  // worker/core/train_util.h

struct ModelPublisherOptions {
  std::string coordinator;  // host:port of gradmesh_coordinator. Required.
  std::string auth_token;   // NodeService's token (authorization: Bearer); empty: none.
  RpcOptions rpc;
  std::string node;  // This daemon's node name (NodeInfo.name). Required.
  // The node's own token as the NodeAgent obtained it. Required.
  std::shared_ptr<NodeTokenHolder> node_token;
  absl::Duration deadline = absl::Minutes(10);  // Per upload.
  size_t chunk_bytes = 1 << 20;                 // Payload per message.
  // Module files larger than this are not uploaded (the coordinator's limit is its own).
  int64_t max_module_bytes = int64_t{2} << 30;
};

class ModelPublisher {
 public:
  explicit ModelPublisher(ModelPublisherOptions options);

  // Uploads the snapshot as the job's MODEL_STATE. INVALID_ARGUMENT (nothing sent) when the
  // snapshot's vectors disagree (names, shapes, values; dtypes and buffer flags may be empty)
  // or a tensor's values do not match its shape; otherwise the coordinator's answer.
  absl::Status PublishState(const std::string& job_id, const ModelSnapshot& snapshot) const;
  // Uploads the file at `path` as the job's MODEL_MODULE. NOT_FOUND / INTERNAL naming the path
  // when it cannot be read, RESOURCE_EXHAUSTED above max_module_bytes; otherwise the
  // coordinator's answer.
  absl::Status PublishModule(const std::string& job_id, const std::string& path) const;

 private:
  const ModelPublisherOptions options_;
  const std::unique_ptr<NodeService::Stub> stub_;
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_MODEL_PUBLISHER_H_
