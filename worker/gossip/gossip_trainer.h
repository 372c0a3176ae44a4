// Mode "gossip": decentralised training without shards (D-PSGD / AD-PSGD, and Stochastic
// Gradient Push).
//
// Every rank holds the full model (same seed, so all start identical) and its own optimizer
// (common/optimizer.h: the shards' math; a cosine schedule decays over the rank's own steps
// when decay_updates is 0), trains on its share of the data (LoaderOptions(spec, rank)), and
// every gossip.every_steps steps asks its Gossiper (gossiper.h) for a round with the peer the
// job's topology picks (topology.h), on a background thread: the training thread never waits
// for the network. The parameters live in a GossipReplica (replica.h) shared with the
// GossipService; the training thread copies them into the LibTorch model under the replica's
// lock before each forward pass and applies the optimizer step to them under the same lock,
// so an exchange never sees (or causes) a torn vector and mixing never loses a local step.
//
// Progress lines (every log_every steps):
//   event=progress job rank step total epoch epochs loss samples_per_s consensus weight
//                  mixed failed coalesced
// where consensus is the estimate of replica.h (sqrt((n-1)/(2n) * mean squared distance of
// the exchanges this rank took part in since the previous line; -1 if none) and weight the
// push-sum weight.
//
// End: after its last step a rank stops its Gossiper, finishes its replica and hands its final
// (x, w) to rank 0 (bounded by gossip.timeout_s-based limits: a dead rank 0 is given up after
// max(3 * timeout_s, 5 s)); rank 0 averages the finals of all ranks that deliver (waiting for
// live ones up to options.wait_for_workers, giving up on unreachable ones after the same
// bound), logs event=final_average (ranks, exact consensus of the finals), evaluates if
// options.evaluate and saves spec.output.
//
// Checkpoints: if spec.checkpoint.every_steps > 0 every rank writes values, push-sum weight,
// optimizer slots and step to <checkpoint.dir or options.checkpoint_dir>/<job>/rank-<r>.ckpt
// (atomically; checkpoint.h) every that many steps and when stopped, and a rank that finds its
// file at start resumes from it (event=resuming), with the data it would have seen. A rank
// stopped by `stop` first stops mixing (peers get ABORTED and retry it later), so its last
// checkpoint holds every share it absorbed; after a crash (no final checkpoint) the shares
// exchanged since the last periodic one are lost, which push-sum tolerates (the weights then
// sum to slightly more or less than n).
//
// Thread safety: RunGossip blocks its calling thread for the whole run (it starts the
// Gossiper's thread and joins it); `stop` may be set from any thread. Several RunGossip calls
// for different (job, rank) may share one GossipServiceImpl concurrently.
#ifndef GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_
#define GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_

#include <atomic>

#include "absl/status/statusor.h"
#include "worker/train_util.h"

namespace gradmesh {

class GossipServiceImpl;  // worker/gossip/gossip_service.h

// Runs options.rank's part of a gossip job. options.peers lists every rank's peer-service
// address; `local` is this process's GossipService (already serving on
// options.peers[options.rank]), through which peers' exchanges arrive. Returns when the job's
// last step is done and the final round is over (rank 0 evaluates if options.evaluate), or
// when `stop` becomes true (stopped_early; no final round). A dead or slow peer is skipped,
// never an error. Errors: InvalidArgument for bad options, data/model errors as LoadJobData
// and CreateModel return them, FailedPrecondition for a checkpoint of another model,
// AlreadyExists if this (job, rank) already runs in this process.
absl::StatusOr<TrainResult> RunGossip(const TrainerOptions& options,
                                      GossipServiceImpl* local,
                                      const std::atomic<bool>& stop);

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_GOSSIP_GOSSIP_TRAINER_H_
