// Trainer: runs one worker's part of a JobSpec.
//
// Modes: the ps modes (async, ssp, sync) are implemented here; gossip and allreduce are in
// worker/gossip/ and worker/allreduce/, and Run() hands over to them.
//
// The same Trainer runs a job given by flags (gradmesh_worker --job=...) or, later, placed by
// the coordinator. Each step: take this rank's next batch (prefetched by BatchLoader),
// forward/backward in LibTorch, push every gradient to its shards in parallel, pull fresh
// parameters. At the end the worker tells the shards it finished; rank 0 (or whoever has
// `evaluate` set) then waits for the other workers, pulls the final parameters, evaluates on
// the test set and saves the model if the spec names an output.
//
// Resume: if the shards already hold the job (InitJob finds it, e.g. after every process was
// stopped and durable shards restarted), the worker continues after the last step the shards
// recorded for its rank (the minimum over shards), with the data it would have seen then.
//
// The header is free of LibTorch on purpose (it is slow to compile): the model and tensors
// exist only inside Run().
//
// Thread safety: Run() is called once, from one thread. RequestStop() may be called from any
// thread (e.g. a signal-handling thread) while Run() is in progress.
#ifndef GRADMESH_WORKER_TRAINER_H_
#define GRADMESH_WORKER_TRAINER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "proto/gradmesh.pb.h"
#include "worker/parameter_client.h"
#include "worker/train_util.h"

namespace gradmesh {

class CollectiveServiceImpl;  // worker/allreduce/collective_service.h
class GossipServiceImpl;      // worker/gossip/gossip_service.h

// This process's peer services (serving on options.peers[rank]), needed by the gossip and
// allreduce modes; not owned.
struct PeerServices {
  CollectiveServiceImpl* collective = nullptr;
  GossipServiceImpl* gossip = nullptr;
};

class Trainer {
 public:
  // `client_factory` makes the ParameterClient once the model (and so the layout) is known.
  using ClientFactory =
      std::function<absl::StatusOr<std::unique_ptr<ParameterClient>>(JobLayout layout)>;

  // `client_factory` is used by the ps modes, `peer_services` by gossip and allreduce.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options,
                                                         ClientFactory client_factory,
                                                         PeerServices peer_services = {});
  ~Trainer();

  absl::StatusOr<TrainResult> Run();
  void RequestStop() { stop_requested_.store(true); }

  // A sync job's barrier group was re-formed by the coordinator while this rank runs: the
  // ranks still in it (empty: all) and whether this rank evaluates at the end (the lowest
  // rank of the group). Used by the final wait; may be called from any thread.
  void SetGroup(std::vector<int32_t> active_ranks, bool evaluate) ABSL_LOCKS_EXCLUDED(group_mu_);

 private:
  Trainer(TrainerOptions options, ClientFactory client_factory, PeerServices peer_services);
  absl::StatusOr<TrainResult> RunPs();

  const TrainerOptions options_;
  const ClientFactory client_factory_;
  const PeerServices peer_services_;
  absl::Mutex group_mu_;
  std::vector<int32_t> active_ranks_ ABSL_GUARDED_BY(group_mu_);
  bool evaluate_ ABSL_GUARDED_BY(group_mu_);
  std::atomic<bool> stop_requested_{false};
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_TRAINER_H_
