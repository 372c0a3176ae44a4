#include "worker/worker_agent.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/log_tail.h"

namespace gradmesh {

struct WorkerAgent::Run {
  Task task;  // As started; read by the run's thread, never changed (see Reconcile).
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> abort{false};  // Implies stop.
  std::atomic<bool> ended{false};
  // The task's log lines (task_start, the trainer's lines, task_end) for `gradmesh logs`.
  std::shared_ptr<LogTail> log_tail = std::make_shared<LogTail>(LogTail::Options());
  std::unique_ptr<Logger> logger;  // The daemon's logger teeing into log_tail.
  absl::Mutex mu;
  Trainer* trainer ABSL_GUARDED_BY(mu) = nullptr;  // While Execute runs it.
  TaskReport report ABSL_GUARDED_BY(mu);
  int64_t log_sent ABSL_GUARDED_BY(mu) = 0;  // Last log sequence put in a report.
  // Gossip: the peers' addresses of the latest generation taken in place (empty: as started),
  // for a trainer created after it came.
  std::vector<std::string> peers ABSL_GUARDED_BY(mu);

  void RequestStop() {
    stop.store(true);
    absl::MutexLock lock(&mu);
    if (trainer != nullptr) trainer->RequestStop();
  }
  // Over at once, no collective stop (Trainer::Abort): its ranks are being restarted.
  void RequestAbort() {
    stop.store(true);
    abort.store(true);
    absl::MutexLock lock(&mu);
    if (trainer != nullptr) trainer->Abort();
  }
};

namespace {

// Rank 0 evaluates; in a re-formed sync group, the lowest rank still in it.
bool Evaluates(const Task& task) {
  if (task.active_ranks().empty()) return task.index() == 0;
  return task.index() == *std::min_element(task.active_ranks().begin(), task.active_ranks().end());
}

// True if `a` and `b` differ at most in the sync group (active ranks, lr scale), the
// generation and, with `peers_too`, the peers' addresses: the rank can go on in place.
bool OnlyGroupChanged(const Task& a, const Task& b, bool peers_too = false) {
  Task x = a, y = b;
  for (Task* t : {&x, &y}) {
    t->clear_active_ranks();
    t->clear_lr_scale();
    t->clear_generation();
    if (peers_too) t->clear_peers();
  }
  return x.SerializeAsString() == y.SerializeAsString();
}

}  // namespace

WorkerAgent::WorkerAgent(WorkerAgentOptions options) : options_(std::move(options)) {}

WorkerAgent::~WorkerAgent() { StopAll(); }

std::shared_ptr<WorkerAgent::Run> WorkerAgent::Start(const Task& task) {
  auto run = std::make_shared<Run>();
  run->task = task;
  Logger::LineSink tee = [tail = run->log_tail](const std::string& line) { tail->Append(line); };
  const Logger* parent = options_.base.logger != nullptr ? options_.base.logger : options_.logger;
  run->logger = parent != nullptr ? std::make_unique<Logger>(*parent, std::move(tee))
                                  : std::make_unique<Logger>(std::vector<LogField>{}, nullptr,
                                                             LogLevel::kInfo, std::move(tee));
  {
    absl::MutexLock lock(&run->mu);
    run->report.set_job_id(task.job_id());
    run->report.set_index(task.index());
    run->report.set_state("running");
    run->report.set_generation(task.generation());
    run->report.set_accuracy(-1);
    run->report.set_test_loss(-1);
    run->report.set_perplexity(-1);
    run->report.set_checkpoint_step(-1);
  }
  LogInfo(run->logger.get(), "task_start",
          {Kv("job", task.job_id()), Kv("rank", task.index()), Kv("mode", task.spec().mode()),
           Kv("generation", task.generation())});
  run->thread = std::thread([this, r = run.get()] { Execute(r); });
  return run;
}

void WorkerAgent::WirePublishing(const Task& task, const Logger* logger, TrainerOptions* to) {
  const ModelPublisher* publisher = options_.publisher;
  // Rank 0 publishes; in gossip another rank may publish the final model it gathered in a
  // lost rank 0's place (TrainingLoop::PublishModel).
  if (publisher == nullptr || (task.index() != 0 && SpecMode(task.spec()) != Mode::kGossip)) {
    return;
  }
  const std::string job = task.job_id();
  to->on_model = [publisher, job, logger](const ModelSnapshot& m) {
    absl::Status st = publisher->PublishState(job, m);
    if (st.ok()) {
      LogInfo(logger, "model_published",
              {Kv("job", job), Kv("step", m.step), Kv("final", m.final ? "true" : "false"),
               Kv("tensors", static_cast<int64_t>(m.names.size()))});
    } else {
      LogWarning(logger, "model_publish_failed",
                 {Kv("job", job), Kv("step", m.step), Kv("error", st.ToString())});
    }
  };
  if (task.spec().model().name() != "torchscript" || task.index() != 0) return;
  const std::string key = absl::StrCat(job, "/", task.job_token());
  {
    absl::MutexLock lock(&mu_);
    if (modules_published_.count(key) > 0) return;
  }
  const std::string& path = task.spec().model().path();
  absl::Status st = publisher->PublishModule(job, path);
  if (!st.ok()) {
    LogWarning(logger, "model_publish_failed",
               {Kv("job", job), Kv("module", path), Kv("error", st.ToString())});
    return;  // The next start of this rank tries again.
  }
  LogInfo(logger, "module_published", {Kv("job", job), Kv("module", path)});
  absl::MutexLock lock(&mu_);
  modules_published_.insert(key);
}

void WorkerAgent::Execute(Run* run) {
  const Task& task = run->task;
  TrainerOptions to = options_.base;
  to.spec = task.spec();
  to.rank = task.index();
  to.generation = task.generation();
  to.logger = run->logger.get();
  to.evaluate = Evaluates(task);
  to.peers.assign(task.peers().begin(), task.peers().end());
  to.job_token = task.job_token();
  to.rank_token = task.rank_token();
  to.rank_token_hashes.assign(task.rank_token_hashes().begin(), task.rank_token_hashes().end());
  to.active_ranks.assign(task.active_ranks().begin(), task.active_ranks().end());
  to.on_progress = [run](const TrainProgress& p) {
    absl::MutexLock lock(&run->mu);
    run->report.set_step(p.step);
    run->report.set_total_steps(p.total_steps);
    run->report.set_epoch(p.epoch);
    run->report.set_loss(p.loss);
    run->report.set_samples_per_s(p.samples_per_s);
    if (p.accuracy >= 0) run->report.set_accuracy(p.accuracy);
    if (p.test_loss >= 0) {
      run->report.set_test_loss(p.test_loss);
      run->report.set_perplexity(p.perplexity);
    }
    run->report.set_grad_norm(p.grad_norm);
    run->report.set_clipped_fraction(p.clipped_fraction);
    run->report.set_skipped_steps(p.skipped_steps);
    run->report.set_loss_scale(p.loss_scale);
    if (p.checkpoint_step >= 0) run->report.set_checkpoint_step(p.checkpoint_step);
  };
  to.on_start = [run](int64_t step, int64_t total_steps) {
    absl::MutexLock lock(&run->mu);
    run->report.set_step(step);
    run->report.set_total_steps(total_steps);
  };
  WirePublishing(task, run->logger.get(), &to);
  GrpcParameterClientOptions co = options_.client;
  co.servers.assign(task.servers().begin(), task.servers().end());
  co.worker = task.index();
  co.job_token = task.job_token();
  SetClientOptionsFromSpec(task.spec(), &co);

  absl::StatusOr<TrainResult> result;
  auto trainer = Trainer::Create(
      to, BuiltinTrainingModes(
              [co](JobLayout layout) { return NewGrpcParameterClient(std::move(layout), co); },
              options_.peer_services));
  if (!trainer.ok()) {
    result = trainer.status();
  } else {
    {
      absl::MutexLock lock(&run->mu);
      run->trainer = trainer->get();
      if (!run->peers.empty()) run->trainer->SetPeers(run->peers);
    }
    if (run->stop.load()) (*trainer)->RequestStop();
    if (run->abort.load()) (*trainer)->Abort();
    result = (*trainer)->Run();
    absl::MutexLock lock(&run->mu);
    run->trainer = nullptr;
  }
  // An allreduce rank stops with its peers (a collective stop): one that stopped without
  // being asked to here stopped because a peer did (its daemon leaving, or restarting its
  // rank for a new generation). That is a lost peer, not this node leaving: reported as
  // "stopped" it moved this healthy rank away for good. As UNAVAILABLE the coordinator
  // restarts the ranks from their checkpoints (or fails the job without them).
  if (result.ok() && result->stopped_early && !run->stop.load() &&
      SpecMode(task.spec()) == Mode::kAllreduce) {
    result = absl::UnavailableError(
        absl::StrCat("allreduce rank ", task.index(), " stopped at step ",
                     result->first_step + result->steps, " because a peer rank stopped"));
  }
  // task_end first: the report that carries the final state then carries this line too
  // (the coordinator stops listing the task once it has the final state).
  if (result.ok()) {
    LogInfo(
        run->logger.get(), "task_end",
        {Kv("job", task.job_id()), Kv("rank", task.index()),
         Kv("state", result->stopped_early ? "stopped" : "succeeded"), Kv("steps", result->steps),
         Kv("samples", result->samples), Kv("wall_s", absl::StrFormat("%.2f", result->wall_s)),
         Kv("samples_per_s", absl::StrFormat("%.1f", result->samples_per_s)),
         Kv("first_step", result->first_step),
         Kv("accuracy", absl::StrFormat("%.4f", result->test_accuracy)),
         Kv("test_loss", absl::StrFormat("%.4f", result->test_loss)),
         Kv("perplexity", absl::StrFormat("%.3f", result->perplexity))});
  } else {
    LogError(run->logger.get(), "task_end",
             {Kv("job", task.job_id()), Kv("rank", task.index()), Kv("state", "failed"),
              Kv("error", result.status().ToString())});
  }
  {
    absl::MutexLock lock(&run->mu);
    if (!result.ok()) {
      run->report.set_state("failed");
      run->report.set_message(result.status().ToString());
    } else if (result->stopped_early) {
      run->report.set_state("stopped");
    } else {
      run->report.set_state("succeeded");
      // The whole run's rate: the job's final figure sums these (a short run may have ended
      // before any progress line reported one). A run resumed at its last step trained
      // nothing: it has no rate or loss of its own, and the rank keeps its earlier ones.
      if (result->steps > 0) run->report.set_samples_per_s(result->samples_per_s);
      if (result->test_accuracy >= 0) run->report.set_accuracy(result->test_accuracy);
      if (result->test_loss >= 0) {
        run->report.set_test_loss(result->test_loss);
        run->report.set_perplexity(result->perplexity);
      }
      if (result->steps > 0) run->report.set_loss(result->final_loss);
      run->report.set_step(run->report.total_steps() > 0 ? run->report.total_steps()
                                                         : result->first_step + result->steps);
    }
  }
  run->ended.store(true);
}

void WorkerAgent::TakeGroupInPlace(Run* run, const Task& next, bool gossip) {
  // A sync group re-formed: every rank of a lock-step job must go on from the same step,
  // so the running trainer takes the new group in place (the shards apply it to the
  // barrier) instead of stopping, which could leave a survivor waiting at a barrier the
  // others have left. run.task stays as started (its thread reads it); the current
  // generation lives in the report.
  absl::MutexLock run_lock(&run->mu);
  run->report.set_generation(next.generation());
  if (run->trainer != nullptr) {
    run->trainer->SetGroup(
        std::vector<int32_t>(next.active_ranks().begin(), next.active_ranks().end()),
        Evaluates(next));
  }
  std::vector<LogField> fields = {Kv("job", next.job_id()), Kv("rank", next.index()),
                                  Kv("active_ranks", absl::StrJoin(next.active_ranks(), ",")),
                                  Kv("generation", next.generation())};
  if (gossip) {
    run->peers.assign(next.peers().begin(), next.peers().end());
    if (run->trainer != nullptr) run->trainer->SetPeers(run->peers);
    // The peers taken in place ("-": a rank without a node).
    fields.push_back(
        Kv("peers", absl::StrJoin(next.peers(), ",", [](std::string* out, const std::string& p) {
             out->append(p.empty() ? "-" : p);
           })));
  }
  LogInfo(options_.logger, "task_group_changed", fields);
}

void WorkerAgent::Reconcile(const std::vector<Task>& desired) {
  std::vector<std::shared_ptr<Run>> to_join;
  absl::MutexLock lock(&mu_);
  if (stopping_) return;  // StopAll owns the runs now.
  std::map<Key, const Task*> want;
  for (const Task& t : desired) want[{t.job_id(), t.index()}] = &t;
  // Stop what is no longer wanted; forget it once it has ended (its final report was sent).
  for (auto it = runs_.begin(); it != runs_.end();) {
    auto w = want.find(it->first);
    if (w == want.end()) {
      if (!it->second->ended.load()) {
        if (!it->second->stop.load()) {
          LogInfo(options_.logger, "task_withdrawn",
                  {Kv("job", it->first.first), Kv("rank", it->first.second)});
        }
        it->second->RequestStop();
        ++it;
        continue;
      }
      to_join.push_back(it->second);
      it = runs_.erase(it);
      continue;
    }
    Run& run = *it->second;
    const Task& next = *w->second;
    int64_t generation;
    {
      absl::MutexLock run_lock(&run.mu);
      generation = run.report.generation();
    }
    // A run that has ended (a failed one the coordinator restarts: allreduce after a lost
    // peer) starts again; only a live one can take a new group in place.
    // Not allreduce: a new generation there is a restart of every rank (the coordinator's
    // answer to a lost peer), even when the task reads the same (a peer's node restarted on
    // the same address): the ring must be built again from the checkpoints. Taken in place,
    // the run kept waiting on the old ring, was stopped, and its "stopped" report lost the
    // rank for good (the job then failed).
    // Gossip takes moved peers in place too: a rank restarted for a peer's new address (or
    // a peer that lost its node) started over from step 0 without a checkpoint.
    // Nor a run asked to stop (its task was withdrawn: a job cancelled and at once resumed
    // reads the same but for its generation): it is ending, and its "stopped" report under the
    // new generation would move the rank off this node.
    const bool gossip = SpecMode(next.spec()) == Mode::kGossip;
    if (next.generation() != generation && !run.ended.load() && !run.stop.load() &&
        SpecMode(next.spec()) != Mode::kAllreduce && OnlyGroupChanged(next, run.task, gossip)) {
      TakeGroupInPlace(&run, next, gossip);
    } else if (next.generation() != generation) {
      // New placement: stop this run; start the new one once it has ended. An allreduce
      // rank's new generation restarts every rank from the checkpoints (its ring lost a peer,
      // or a peer moved): the run is aborted, since a collective stop needs the ring it lost
      // and would wait out the ring's timeout (30 s by default, on a peer that is gone)
      // before the new run could start.
      if (SpecMode(next.spec()) == Mode::kAllreduce) {
        if (!run.abort.load() && !run.ended.load()) {
          LogInfo(options_.logger, "task_aborting",
                  {Kv("job", next.job_id()), Kv("rank", next.index()), Kv("generation", generation),
                   Kv("new_generation", next.generation())});
        }
        run.RequestAbort();  // Also a stop request.
      } else {
        run.RequestStop();
      }
      if (run.ended.load()) {
        to_join.push_back(it->second);
        it = runs_.erase(it);
        continue;
      }
    }
    ++it;
  }
  for (const auto& [key, task] : want) {
    if (runs_.count(key) > 0) continue;
    // An allreduce rank whose peer has no node yet (its rank waits for the next worker
    // daemon) cannot build its ring: it waits, reporting nothing, until the coordinator
    // places that rank (a new generation with every address). Started now, it failed at
    // once and failed the job.
    if (SpecMode(task->spec()) == Mode::kAllreduce &&
        std::any_of(task->peers().begin(), task->peers().end(),
                    [](const std::string& p) { return p.empty(); })) {
      auto [w, fresh] = waiting_.emplace(key, task->generation());
      if (fresh || w->second != task->generation()) {
        w->second = task->generation();
        LogInfo(options_.logger, "task_waiting_for_peers",
                {Kv("job", task->job_id()), Kv("rank", task->index()),
                 Kv("generation", task->generation())});
      }
      continue;
    }
    waiting_.erase(key);
    runs_[key] = Start(*task);
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    it = want.count(it->first) > 0 ? std::next(it) : waiting_.erase(it);
  }
  for (auto& r : to_join) {
    if (r->thread.joinable()) r->thread.join();
  }
}

std::vector<TaskReport> WorkerAgent::Reports() {
  std::vector<TaskReport> out;
  absl::MutexLock lock(&mu_);
  for (auto& [key, run] : runs_) {
    absl::MutexLock run_lock(&run->mu);
    out.push_back(run->report);
    // New log lines since the last report, bounded per heartbeat (the rest wait).
    for (auto& [seq, line] :
         run->log_tail->Since(run->log_sent, kMaxLogLinesPerReport, kMaxLogBytesPerReport)) {
      out.back().add_log_lines(std::move(line));
      run->log_sent = seq;
    }
  }
  return out;
}

void WorkerAgent::StopAll() {
  std::vector<std::shared_ptr<Run>> runs;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& [key, run] : runs_) runs.push_back(run);
  }
  for (auto& r : runs) r->RequestStop();
  for (auto& r : runs) {
    if (r->thread.joinable()) r->thread.join();
  }
}

}  // namespace gradmesh
