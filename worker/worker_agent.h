// WorkerAgent: runs the training tasks the coordinator places on a worker daemon in service
// mode (gradmesh_worker --coordinator=host:port).
//
// Reconcile() gets the coordinator's complete desired task list on every heartbeat: a task
// not yet running is started on its own thread (a Trainer for rank Task.index, with the
// task's spec, shard addresses, peer addresses and job token), a running task no longer
// listed is asked to stop after its current step (cancelled job, or its rank moved), and a
// task whose generation changed is stopped and started again with the new placement (its
// rank resumes where the shards or its checkpoint say), except when only a sync job's group
// changed (active ranks, lr scale): then the running trainer takes it in place. Reports() returns
// one TaskReport per task: live progress while running, then its final state ("succeeded", "failed"
// with the error, or "stopped") until the coordinator stops listing it. Several tasks (of different
// jobs, or several ranks of one ps job after a failure) can run at once.
//
// Logs: each task gets the daemon's logger teeing into a LogTail (the last 200 lines / 64 KiB
// of its task_start, trainer and task_end lines); every report carries the lines written since
// the previous report, at most kMaxLogLinesPerReport lines / kMaxLogBytesPerReport bytes (the
// coordinator keeps them for `gradmesh logs`). A report that never reaches the coordinator
// loses its lines.
//
// StopAll() (SIGTERM, preemption) asks every task to stop after its current step and waits:
// ps ranks leave their position on the shards, gossip/allreduce ranks their checkpoints, and
// the final reports say "stopped", so the coordinator moves them elsewhere.
//
// Published models: with a ModelPublisher, rank 0 of every job uploads its model to the
// coordinator whenever the training loop calls TrainerOptions::on_model (gossip/allreduce:
// after checkpoints, every model_publish_interval, at the end), and a TorchScript job's rank 0
// uploads the module file (spec.model.path) once, before training; `gradmesh export` reads both.
// A failed upload is logged (model_publish_failed) and never fails the task.
//
// Thread safety: all methods may be called concurrently.
#ifndef GRADMESH_WORKER_WORKER_AGENT_H_
#define GRADMESH_WORKER_WORKER_AGENT_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "proto/coordinator.pb.h"
#include "worker/model_publisher.h"
#include "worker/modes.h"
#include "worker/ps/parameter_client.h"
#include "worker/trainer.h"

namespace gradmesh {

struct WorkerAgentOptions {
  // Applied to every task: data_dir, intra_op_threads, checkpoint_dir, step_delay, logger.
  TrainerOptions base;
  // Applied to every ps task's client (rpc limits, retries); servers/worker/codecs/token come
  // from the task.
  GrpcParameterClientOptions client;
  PeerServices peer_services;  // This process's peer services; not owned.
  const Logger* logger = nullptr;
  // Rank 0's uploads to the coordinator (not owned; null: none): the model through
  // TrainerOptions::on_model, and a TorchScript job's module once per job before it starts.
  const ModelPublisher* publisher = nullptr;
};

class WorkerAgent {
 public:
  static constexpr int kMaxLogLinesPerReport = 50;
  static constexpr int kMaxLogBytesPerReport = 16 << 10;

  explicit WorkerAgent(WorkerAgentOptions options);
  ~WorkerAgent();  // StopAll().

  void Reconcile(const std::vector<Task>& desired) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<TaskReport> Reports() ABSL_LOCKS_EXCLUDED(mu_);
  void StopAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Run;
  using Key = std::pair<std::string, int32_t>;  // (job, rank)

  std::shared_ptr<Run> Start(const Task& task);
  void Execute(Run* run);
  // Rank 0 with a publisher: sets `to->on_model` and uploads a TorchScript job's module (once
  // per job and job token; failures are logged, training goes on).
  void WirePublishing(const Task& task, const Logger* logger, TrainerOptions* to)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A live run whose task changed only in its group (and, with `gossip`, its peers) takes
  // `next`'s group, peers and generation in place.
  void TakeGroupInPlace(Run* run, const Task& next, bool gossip);

  const WorkerAgentOptions options_;
  absl::Mutex mu_;
  std::map<Key, std::shared_ptr<Run>> runs_ ABSL_GUARDED_BY(mu_);
  // Allreduce tasks held back because a peer rank has no node yet, with the generation
  // logged (event=task_waiting_for_peers once per generation).
  std::map<Key, int64_t> waiting_ ABSL_GUARDED_BY(mu_);
  // Set by StopAll: Reconcile no longer starts, stops or joins anything.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // "<job>/<job token>" of the modules uploaded (a job submitted again under the same id has
  // a new token; a resumed one keeps it and the coordinator keeps its module).
  std::set<std::string> modules_published_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradmesh

#endif  // GRADMESH_WORKER_WORKER_AGENT_H_
