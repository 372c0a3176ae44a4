// Coordinator core (see coordinator.h for the semantics).
#include "coordinator/coordinator.h"

#include <algorithm>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_name.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "common/token_hash.h"
#include "compression/compressor.h"

namespace gradmesh {
namespace {

// Window of (time, step) samples behind eta_s, and the most samples kept in it.
constexpr int64_t kEtaWindowMs = 30'000;
constexpr std::ptrdiff_t kMaxStepSamples = 1024;
// Reported steps and totals are clamped to this (2^53: exact in a double, and far beyond any
// job), so that the ETA's differences and products cannot overflow.
constexpr int64_t kMaxReportedSteps = int64_t{1} << 53;

// Adds (now, step) to a job's samples for its ETA if the step moved. Samples older than the
// window go (two stay), and at most kMaxStepSamples stay in all, in one erase: a node whose
// heartbeat reports many steps of a job (one report each) cannot grow the list, or make
// trimming it quadratic, under the coordinator's lock.
void AddStepSample(int64_t now, int64_t step, std::deque<std::pair<int64_t, int64_t>>* samples) {
  if (samples->empty() || samples->back().second != step) samples->emplace_back(now, step);
  auto keep = samples->begin();
  while (samples->end() - keep > 2 && keep->first < now - kEtaWindowMs) ++keep;
  if (samples->end() - keep > kMaxStepSamples) keep = samples->end() - kMaxStepSamples;
  samples->erase(samples->begin(), keep);
}

bool IsActive(JobState s) { return s == PENDING || s == RUNNING || s == PAUSED; }
bool IsFinished(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

// Rank r's peer-plane token (Task.rank_token) from the job's rank secret.
std::string RankToken(const std::string& secret, int rank) {
  return HexOf(Sha256(absl::StrCat(secret, "/rank/", rank)));
}

std::string RandomHex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; i += 4) {
    out += absl::StrFormat("%08x", static_cast<uint32_t>(rd()));
  }
  return out.substr(0, 2 * bytes);
}

std::string RoleName(NodeRole role) { return NodeRole_Name(role); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction, loading, monitor.

Coordinator::Coordinator(Options options)
    : store_(std::move(options.store)),
      options_(std::move(options)),
      incarnation_(absl::ToUnixMicros(absl::Now())) {}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(Options options) {
  if (options.store == nullptr) {
    return absl::InvalidArgumentError("Coordinator::Options.store is required");
  }
  if (options.clock == nullptr) {
    return absl::InvalidArgumentError("Coordinator::Options.clock is required");
  }
  if (options.heartbeat_interval_ms <= 0 || options.heartbeat_timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("heartbeat_interval_ms and heartbeat_timeout_ms must be > 0, got ",
                     options.heartbeat_interval_ms, " and ", options.heartbeat_timeout_ms));
  }
  if (options.progress_persist_interval_ms < 0) {
    return absl::InvalidArgumentError("progress_persist_interval_ms must be >= 0");
  }
  if (options.finished_job_retention_ms < 0 || options.max_finished_jobs < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "finished_job_retention_ms and max_finished_jobs must be >= 0 (0: no limit), got ",
        options.finished_job_retention_ms, " and ", options.max_finished_jobs));
  }
  if (options.max_model_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_model_bytes must be > 0, got ", options.max_model_bytes));
  }
  if (options.monitor_interval_ms == 0) options.monitor_interval_ms = options.heartbeat_interval_ms;
  std::unique_ptr<Coordinator> c(new Coordinator(std::move(options)));
  RETURN_IF_ERROR(c->Load());
  if (c->options_.monitor_interval_ms > 0) {
    c->monitor_ = std::thread([p = c.get()] { p->MonitorLoop(); });
  }
  return c;
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mu_);
    shutting_down_ = true;
    changed_.SignalAll();
  }
  if (monitor_.joinable()) monitor_.join();
  absl::MutexLock lock(&mu_);
  for (auto& [id, job] : jobs_) {
    if (job.dirty) persist_jobs_.insert(id);
  }
  (void)PersistLocked();
}

absl::Status Coordinator::Load() {
  ASSIGN_OR_RETURN(std::vector<coordinator_state::NodeRecord> nodes, store_->LoadNodes());
  ASSIGN_OR_RETURN(std::vector<coordinator_state::JobRecord> jobs, store_->LoadJobs());
  absl::MutexLock lock(&mu_);
  const int64_t now = Now();
  const int64_t grace_ms = std::max(options_.restart_grace_ms, options_.heartbeat_timeout_ms);
  int alive = 0;
  for (auto& record : nodes) {
    NodeEntry& entry = nodes_[record.info().name()];
    entry.record = std::move(record);
    // Grace: a node alive at the last write counts as seen now and alive for the restart
    // grace, time to reach the restarted coordinator before its work is moved.
    entry.last_seen_ms = now;
    entry.grace_until_ms = now + grace_ms;
    if (entry.record.alive()) ++alive;
  }
  for (auto& record : jobs) {
    std::vector<TaskState> rank_states;
    for (const WorkerPlacement& w : record.status().workers()) {
      absl::StatusOr<TaskState> state = ParseTaskState(w.state());
      if (!state.ok()) {
        return absl::DataLossError(absl::StrCat("stored job \"", record.status().job_id(),
                                                "\" rank ", w.rank(), ": ",
                                                state.status().message()));
      }
      rank_states.push_back(*state);
    }
    JobEntry& entry = jobs_[record.status().job_id()];
    entry.record = std::move(record);
    entry.rank_states = std::move(rank_states);
    if (entry.record.has_final_published()) {
      entry.final_published = entry.record.final_published();
    } else if (IsActive(entry.record.status().state()) &&
               SpecMode(entry.record.status().spec()) == Mode::kGossip) {
      // Whether a final model is out is read back from the model the store holds (its header
      // only: the callback stops the read).
      const std::string& id = entry.record.status().job_id();
      store_
          ->ReadModel(
              id, MODEL_STATE,
              [&entry](const ModelHeader& h) {
                entry.final_published = h.final();
                return false;
              },
              [](absl::string_view) { return false; })
          .IgnoreError();
    }
    JobStatus published = entry.record.status();
    published.set_updated_ms(0);
    entry.published = published.SerializeAsString();
    entry.last_persist_ms = now;
    next_sequence_ = std::max(next_sequence_, entry.record.sequence() + 1);
    by_sequence_[entry.record.sequence()] = &entry;
  }
  LogInfo(options_.logger, "tables_loaded",
          {Kv("dir", store_->dir()), Kv("jobs", jobs_.size()), Kv("nodes", nodes_.size()),
           Kv("alive_nodes", alive), Kv("grace_ms", grace_ms)});
  return absl::OkStatus();
}

void Coordinator::MonitorLoop() {
  absl::MutexLock lock(&mu_);
  while (!shutting_down_) {
    mu_.AwaitWithTimeout(absl::Condition(&shutting_down_),
                         absl::Milliseconds(options_.monitor_interval_ms));
    if (shutting_down_) break;
    CheckNodesLocked();
    const int64_t now = Now();
    for (auto& [id, job] : jobs_) {
      if (job.dirty && now - job.last_persist_ms >= options_.progress_persist_interval_ms) {
        persist_jobs_.insert(id);
      }
    }
    (void)PersistLocked();
    CompactJobsLocked();
  }
}

int Coordinator::CompactJobs() {
  absl::MutexLock lock(&mu_);
  return CompactJobsLocked();
}

int Coordinator::CompactJobsLocked() {
  const int64_t now = Now();
  // Finished jobs, oldest ended first (records from before finished_ms: their last update).
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::string>> finished;
  for (const auto& [id, job] : jobs_) {
    const JobStatus& st = job.record.status();
    if (!IsFinished(st.state())) continue;
    const int64_t ended = job.record.finished_ms() > 0 ? job.record.finished_ms() : st.updated_ms();
    finished.push_back({{ended, job.record.sequence()}, id});
  }
  std::sort(finished.begin(), finished.end());
  const int64_t retention = options_.finished_job_retention_ms;
  const int64_t max_kept = options_.max_finished_jobs;
  std::vector<std::string> remove;
  for (size_t i = 0; i < finished.size(); ++i) {
    const bool expired = retention > 0 && now - finished[i].first.first > retention;
    const bool over_count = max_kept > 0 && static_cast<int64_t>(finished.size() - i) > max_kept;
    if (expired || over_count) remove.push_back(finished[i].second);
  }
  if (remove.empty()) return 0;
  if (absl::Status s = store_->Write({}, {}, remove); !s.ok()) {
    LogError(options_.logger, "compaction_failed", {Kv("error", s.ToString())});
    return 0;
  }
  for (const std::string& id : remove) {
    LogInfo(options_.logger, "job_compacted",
            {Kv("job", id), Kv("state", JobState_Name(jobs_.at(id).record.status().state()))});
    EraseJobLocked(id);
  }
  changed_.SignalAll();  // Watchers of a removed job end (NOT_FOUND).
  return static_cast<int>(remove.size());
}

void Coordinator::EraseJobLocked(const std::string& id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  auto seq = by_sequence_.find(it->second.record.sequence());
  if (seq != by_sequence_.end() && seq->second == &it->second) by_sequence_.erase(seq);
  persist_jobs_.erase(id);
  jobs_.erase(it);
}

void Coordinator::CheckNodes() {
  absl::MutexLock lock(&mu_);
  CheckNodesLocked();
  (void)PersistLocked();
}

void Coordinator::FlushProgress() {
  absl::MutexLock lock(&mu_);
  const int64_t now = Now();
  for (auto& [id, job] : jobs_) {
    if (job.dirty && now - job.last_persist_ms >= options_.progress_persist_interval_ms) {
      persist_jobs_.insert(id);
    }
  }
  (void)PersistLocked();
}

std::string Coordinator::NewToken() {
  return options_.token_source ? options_.token_source() : RandomHex(16);
}

// ---------------------------------------------------------------------------------------------
// Persistence and change publication.

absl::Status Coordinator::PersistLocked() {
  if (persist_jobs_.empty() && persist_nodes_.empty()) return absl::OkStatus();
  std::vector<const coordinator_state::JobRecord*> jobs;
  std::vector<const coordinator_state::NodeRecord*> nodes;
  for (const std::string& id : persist_jobs_) {
    auto it = jobs_.find(id);
    if (it != jobs_.end()) jobs.push_back(&it->second.record);
  }
  for (const std::string& name : persist_nodes_) {
    auto it = nodes_.find(name);
    if (it != nodes_.end()) nodes.push_back(&it->second.record);
  }
  absl::Status s = store_->Write(jobs, nodes);
  if (!s.ok()) {
    // Kept scheduled: the next call or the monitor thread retries.
    LogError(options_.logger, "persist_failed", {Kv("error", s.ToString())});
    return s;
  }
  const int64_t now = Now();
  for (const std::string& id : persist_jobs_) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    it->second.last_persist_ms = now;
    it->second.dirty = false;
  }
  persist_jobs_.clear();
  persist_nodes_.clear();
  return absl::OkStatus();
}

void Coordinator::ChangedLocked(JobEntry* job, bool persist_now) {
  JobStatus* st = job->record.mutable_status();
  const int64_t updated = st->updated_ms();
  st->set_updated_ms(0);
  std::string serialized = st->SerializeAsString();
  st->set_updated_ms(updated);
  if (serialized != job->published) {
    job->published = std::move(serialized);
    ++job->version;
    st->set_updated_ms(Now());
    changed_.SignalAll();
  }
  job->dirty = true;
  if (persist_now || Now() - job->last_persist_ms >= options_.progress_persist_interval_ms) {
    persist_jobs_.insert(st->job_id());
  }
}

void Coordinator::SetStateLocked(JobEntry* job, JobState state, const std::string& message) {
  JobStatus* st = job->record.mutable_status();
  if (st->state() == state && st->message() == message) return;
  LogInfo(options_.logger, "job_state",
          {Kv("job", st->job_id()), Kv("from", JobState_Name(st->state())),
           Kv("to", JobState_Name(state)), Kv("message", message)});
  st->set_state(state);
  st->set_message(message);
  if (state == RUNNING) job->record.set_reached_running(true);
  job->record.set_finished_ms(IsFinished(state) ? Now() : 0);
  persist_jobs_.insert(st->job_id());
}

void Coordinator::SetRankState(JobEntry* job, int rank, TaskState state) {
  job->rank_states[rank] = state;
  job->record.mutable_status()->mutable_workers(rank)->set_state(std::string(TaskStateName(state)));
}

// ---------------------------------------------------------------------------------------------
// Placement helpers.

std::string Coordinator::NodeAddressLocked(const std::string& name) const {
  auto it = nodes_.find(name);
  return it == nodes_.end() ? "" : it->second.record.info().address();
}

std::map<std::string, int> Coordinator::UsedSlotsLocked(const std::string& exclude_job) const {
  std::map<std::string, int> used;
  for (const auto& [id, job] : jobs_) {
    if (id == exclude_job || !IsActive(job.record.status().state())) continue;
    for (const ShardPlacement& s : job.record.status().shards()) used[s.node()]++;
    const auto& workers = job.record.status().workers();
    for (int r = 0; r < workers.size(); ++r) {
      if (!workers[r].node().empty() && IsUnfinished(job.rank_states[r])) {
        used[workers[r].node()]++;
      }
    }
  }
  return used;
}

absl::StatusOr<JobPlacement> Coordinator::PlaceLocked(const JobSpec& spec,
                                                      const std::string& strategy,
                                                      const std::string& exclude_job,
                                                      bool skip_shards) const {
  const std::map<std::string, int> used = UsedSlotsLocked(exclude_job);
  PlacementInput input;
  input.spec = spec;
  input.skip_shards = skip_shards;
  for (const auto& [name, node] : nodes_) {
    if (!node.record.alive()) continue;
    const NodeInfo& info = node.record.info();
    auto u = used.find(name);
    NodeLoad load{name, info.host(), info.slots(), u == used.end() ? 0 : u->second};
    (info.role() == SERVER ? input.servers : input.workers).push_back(std::move(load));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<PlacementStrategy> placement,
                   options_.placements.Create(strategy));
  return placement->Place(input);
}

void Coordinator::BumpGenerationLocked(JobEntry* job, bool all_ranks, bool all_shards, int rank) {
  coordinator_state::JobRecord& r = job->record;
  const int64_t g = r.generation() + 1;
  r.set_generation(g);
  for (int i = 0; i < r.ranks_size(); ++i) {
    if (all_ranks || i == rank) r.mutable_ranks(i)->set_generation(g);
  }
  if (all_shards) {
    for (int i = 0; i < r.shard_generation_size(); ++i) r.set_shard_generation(i, g);
  }
}

void Coordinator::AssignRankLocked(JobEntry* job, int rank, const NodeEntry& node) {
  WorkerPlacement* w = job->record.mutable_status()->mutable_workers(rank);
  const std::string from = w->node().empty() ? "(lost)" : w->node();
  w->set_node(node.record.info().name());
  w->set_address(node.record.info().address());
  SetRankState(job, rank, TaskState::kPending);
  w->set_reassignments(w->reassignments() + 1);
  // A new daemon takes over; its peers (gossip/allreduce) must learn the new address.
  BumpGenerationLocked(job, OneRankPerNode(job->record.status().spec()), false, rank);
  LogInfo(options_.logger, "reassign",
          {Kv("job", job->record.status().job_id()), Kv("rank", rank), Kv("from", from),
           Kv("to", w->node()), Kv("reassignments", w->reassignments()),
           Kv("generation", job->record.ranks(rank).generation())});
}

void Coordinator::MoveRankLocked(JobEntry* job, int rank, const std::string& reason) {
  const JobStatus& st = job->record.status();
  const std::string from = st.workers(rank).node();
  const bool one_per_node = OneRankPerNode(st.spec());
  const bool sync = UsesSyncBarrier(SpecMode(st.spec()));
  const std::map<std::string, int> used = UsedSlotsLocked("");
  std::vector<NodeLoad> candidates;
  for (const auto& [name, node] : nodes_) {
    if (!node.record.alive() || node.record.info().role() != WORKER || name == from) continue;
    if (one_per_node) {
      bool holds = false;
      for (const WorkerPlacement& w : st.workers()) holds = holds || w.node() == name;
      if (holds) continue;
    }
    auto u = used.find(name);
    NodeLoad load{name, node.record.info().host(), node.record.info().slots(),
                  u == used.end() ? 0 : u->second};
    // sync: the barrier runs at the pace of the slowest rank, so a node doubled up would slow
    // every rank; the group is re-formed without the rank instead (UpdateGroupLocked).
    if (sync && load.free() == 0) continue;
    candidates.push_back(std::move(load));
  }
  // A gossip rank whose peers have all finished has no one left to gossip with, and their
  // final model is out (rank 0's, or a fallback root's): it is not moved.
  bool peers_done = SpecMode(st.spec()) == Mode::kGossip && (rank != 0 || job->final_published);
  for (int i = 0; peers_done && i < static_cast<int>(job->rank_states.size()); ++i) {
    peers_done = i == rank || job->rank_states[i] == TaskState::kSucceeded;
  }
  std::optional<std::string> to = peers_done ? std::nullopt : PickReplacement(candidates);
  if (to.has_value()) {
    LogInfo(options_.logger, "rank_moving",
            {Kv("job", st.job_id()), Kv("rank", rank), Kv("from", from), Kv("reason", reason)});
    AssignRankLocked(job, rank, nodes_.at(*to));
    return;
  }
  WorkerPlacement* w = job->record.mutable_status()->mutable_workers(rank);
  w->set_node("");
  w->set_address("");
  SetRankState(job, rank, TaskState::kLost);
  if (one_per_node) BumpGenerationLocked(job, true, false, -1);  // Peers lost an address.
  LogWarning(options_.logger, "rank_lost",
             {Kv("job", st.job_id()), Kv("rank", rank), Kv("from", from), Kv("reason", reason),
              Kv("note", "given to the next worker node that registers")});
}

bool Coordinator::RestartAfterPeerLossLocked(JobEntry* job, int rank, const std::string& node,
                                             const std::string& message) {
  // An allreduce rank fails when a peer dies (its ring link breaks: UNAVAILABLE) or goes
  // silent (DEADLINE_EXCEEDED), often before the dead peer's node misses its heartbeats. With
  // checkpoints the job can go on: every rank starts again (a new generation), resuming from
  // the checkpoints (a moved rank is sent them, worker/allreduce/checkpoint.h); the dead
  // node's rank moves once the node is declared dead. Bounded, so a fault that is not a lost
  // peer still ends the job: at most kMaxPeerLossRestarts restarts in a row without a new
  // checkpoint between them (a long job meets many independent faults; each that it trained
  // past is over).
  const JobSpec& spec = job->record.status().spec();
  if (SpecMode(spec) != Mode::kAllreduce || spec.checkpoint().every_steps() <= 0) return false;
  if (!absl::StartsWith(message, "UNAVAILABLE:") &&
      !absl::StartsWith(message, "DEADLINE_EXCEEDED:")) {
    return false;
  }
  const int64_t checkpoint = job->record.status().progress().checkpoint_step();
  if (checkpoint > job->restart_checkpoint) job->peer_restarts = 0;
  if (job->peer_restarts >= kMaxPeerLossRestarts) return false;
  ++job->peer_restarts;
  job->restart_checkpoint = checkpoint;
  SetRankState(job, rank, TaskState::kPending);
  BumpGenerationLocked(job, /*all_ranks=*/true, /*all_shards=*/false, -1);
  LogWarning(
      options_.logger, "job_restarting",
      {Kv("job", job->record.status().job_id()), Kv("rank", rank), Kv("node_name", node),
       Kv("restart", job->peer_restarts), Kv("of", kMaxPeerLossRestarts), Kv("cause", message)});
  return true;
}

void Coordinator::UpdateGroupLocked(JobEntry* job) {
  coordinator_state::JobRecord& r = job->record;
  JobStatus* st = r.mutable_status();
  if (!UsesSyncBarrier(SpecMode(st->spec()))) return;
  std::vector<int> active;
  for (int i = 0; i < st->workers_size(); ++i) {
    if (job->rank_states[i] != TaskState::kLost) active.push_back(i);
  }
  const int n = st->spec().num_workers();
  const bool full = static_cast<int>(active.size()) == n;
  const std::vector<int> current(r.active_ranks().begin(), r.active_ranks().end());
  if (active.empty()) {
    // Nobody left to train. A whole group lost every rank at once, or a re-formed one lost
    // its survivors within a heartbeat timeout of re-forming (nodes that died together
    // expire in separate checks as their last heartbeats were apart): it waits for worker
    // nodes, as async ranks do, whole again, and each rank resumes from the shards' records.
    // A re-formed group whose survivors trained on alone for longer is over (RefreshLocked
    // fails the job).
    const bool at_once =
        current.empty() || Now() - job->reformed_ms <= options_.heartbeat_timeout_ms;
    if (at_once && !r.awaiting_whole_group()) {
      r.set_awaiting_whole_group(true);
      if (!current.empty()) {
        r.clear_active_ranks();
        r.set_lr_scale(1.0);
        st->set_active_workers(n);
        BumpGenerationLocked(job, true, true, -1);
      }
      LogWarning(options_.logger, "group_lost",
                 {Kv("job", st->job_id()), Kv("num_workers", n),
                  Kv("note",
                     "every rank lost at once; they are placed again as worker nodes "
                     "register, and start once all are")});
    }
    return;
  }
  if (r.awaiting_whole_group()) {
    // Ranks come back one node at a time: the group stays whole until all are placed.
    if (full) r.set_awaiting_whole_group(false);
    return;
  }
  if (full ? current.empty() : current == active) return;
  r.clear_active_ranks();
  if (full) {
    r.set_lr_scale(1.0);
  } else {
    for (int i : active) r.add_active_ranks(i);
    // lr_scaling, when set, decides (its rule on the smaller global batch); otherwise
    // sync_lr_scaling (linear in the survivors, or none).
    const JobSpec& spec = st->spec();
    const bool by_rule = !spec.lr_scaling().rule().empty() && spec.lr_scaling().rule() != "none";
    r.set_lr_scale(by_rule ? LrScalingFactor(spec, static_cast<int64_t>(active.size())) /
                                 LrScalingFactor(spec, n)
                   : spec.sync_lr_scaling() == "none" ? 1.0
                                                      : static_cast<double>(active.size()) / n);
  }
  st->set_active_workers(static_cast<int>(active.size()));
  BumpGenerationLocked(job, true, true, -1);
  if (!full) job->reformed_ms = Now();
  LogInfo(options_.logger, full ? "group_restored" : "group_reformed",
          {Kv("job", st->job_id()), Kv("active_ranks", absl::StrJoin(active, ",")),
           Kv("num_workers", n), Kv("lr_scale", r.lr_scale()), Kv("generation", r.generation())});
}

// ---------------------------------------------------------------------------------------------
// Progress and derived state.

int Coordinator::PublisherRank(const JobEntry& job) {
  if (SpecMode(job.record.status().spec()) != Mode::kGossip) return 0;
  for (size_t r = 0; r < job.rank_states.size(); ++r) {
    if (job.rank_states[r] != TaskState::kLost) return static_cast<int>(r);
  }
  return 0;
}

bool Coordinator::GossipSurvivorsDone(const JobEntry& job) {
  // Rank 0 gathers, averages and publishes the final model, or, if it was lost, the lowest
  // surviving rank does: until one of them has, nothing was.
  if (SpecMode(job.record.status().spec()) != Mode::kGossip || job.rank_states.empty() ||
      (job.rank_states[0] != TaskState::kSucceeded && !job.final_published)) {
    return false;
  }
  bool any_lost = false;
  for (const TaskState state : job.rank_states) {
    if (state != TaskState::kSucceeded && state != TaskState::kLost) return false;
    any_lost = any_lost || state == TaskState::kLost;
  }
  return any_lost;
}

std::string Coordinator::LostRanksNote(const JobEntry& job) {
  std::vector<int> lost;
  for (size_t i = 0; i < job.rank_states.size(); ++i) {
    if (job.rank_states[i] == TaskState::kLost) lost.push_back(static_cast<int>(i));
  }
  return absl::StrCat("finished without lost rank(s) ", absl::StrJoin(lost, ","),
                      ": the other ranks averaged and published the final model without them");
}

void Coordinator::RefreshLocked(JobEntry* job) {
  coordinator_state::JobRecord& r = job->record;
  JobStatus* st = r.mutable_status();
  const int n = st->workers_size();
  if (IsActive(st->state())) {
    // A sync job whose group was re-formed is done when every rank still in it is: its lost
    // ranks are out of the job for good.
    const bool reformed = UsesSyncBarrier(SpecMode(st->spec())) && r.active_ranks_size() > 0;
    // A gossip job whose every other rank has succeeded is done too: they gave up on the lost
    // ones in their final round, and rank 0 (or, with rank 0 lost, the lowest surviving rank,
    // gathering in its place) published the model they averaged; a lost rank given a node now
    // would train alone, with no peer left. (Until a final model is published, the job waits
    // for a node for rank 0, as other modes do.)
    const bool gossip_done = GossipSurvivorsDone(*job);
    bool all_done = n > 0, all_running = n > 0, any_succeeded = false, all_out = n > 0;
    for (const TaskState state : job->rank_states) {
      const bool out = (reformed || gossip_done) && state == TaskState::kLost;
      all_done = all_done && (state == TaskState::kSucceeded || out);
      all_running =
          all_running && (state == TaskState::kRunning || state == TaskState::kSucceeded || out);
      any_succeeded = any_succeeded || state == TaskState::kSucceeded;
      all_out = all_out && out;
    }
    if (all_out) {
      // Every rank of the group is gone: nobody can train it any more, and nothing finished
      // (it used to count as done, SUCCEEDED at step 0).
      SetStateLocked(job, FAILED,
                     "every rank of the sync group was lost (its nodes stopped heartbeating); "
                     "resume it with `gradmesh resume` once nodes are back");
    } else if (all_done && any_succeeded) {
      // Also from PAUSED: every rank finished (rank 0 evaluated) before the shard went down.
      SetStateLocked(job, SUCCEEDED, gossip_done ? LostRanksNote(*job) : "");
    } else if (all_running) {
      r.set_reached_running(true);
      if (st->state() == PENDING) SetStateLocked(job, RUNNING, "");
    }
  }

  JobProgress* p = st->mutable_progress();
  int64_t step = -1, total = 0, checkpoint = -2;
  int epoch = 0, with_loss = 0;
  double loss = 0, samples = 0, finished_samples = 0;
  bool running = false;
  for (int i = 0; i < n; ++i) {
    const WorkerPlacement& w = st->workers(i);
    const coordinator_state::RankRecord& rr = r.ranks(i);
    total = std::max(total, rr.total_steps());
    // Running ranks' current rates; once none runs, the succeeded ranks' whole-run rates, so
    // a finished job shows the rate it trained at rather than 0.
    if (job->rank_states[i] == TaskState::kRunning) {
      samples += rr.samples_per_s();
      running = true;
    }
    if (job->rank_states[i] == TaskState::kSucceeded) finished_samples += rr.samples_per_s();
    if (rr.reported()) {
      loss += rr.loss();
      ++with_loss;
    }
    if (job->rank_states[i] == TaskState::kLost) continue;
    if (step < 0 || w.step() < step) {
      step = w.step();
      epoch = rr.epoch();
    }
    if (rr.reported())
      checkpoint =
          checkpoint == -2 ? rr.checkpoint_step() : std::min(checkpoint, rr.checkpoint_step());
  }
  if (step < 0) step = p->step();  // Every rank lost: keep the last figure.
  if (total == 0) total = st->spec().steps();
  const int64_t now = Now();
  AddStepSample(now, step, &job->step_samples);
  double eta = -1;
  bool stalled = false;
  if (total > 0 && step >= total) {
    eta = 0;
  } else if (job->step_samples.size() >= 2 && total > 0) {
    const auto& a = job->step_samples.front();
    const auto& b = job->step_samples.back();
    if (b.first > a.first && b.second > a.second) {
      const double ms_per_step = static_cast<double>(b.first - a.first) / (b.second - a.second);
      // No step for the whole window and three steps' time (a dead link, a paused shard):
      // the rate and the ETA are unknown, not the last ones measured.
      stalled = running && now - b.first > std::max<double>(kEtaWindowMs, 3 * ms_per_step);
      if (!stalled) {
        const double steps_per_ms =
            static_cast<double>(b.second - a.second) / (std::max(now, b.first) - a.first);
        eta = (total - step) / steps_per_ms / 1000.0;
      }
    }
  }
  p->set_step(step);
  p->set_total_steps(total);
  p->set_epoch(epoch);
  p->set_epochs(st->spec().epochs());
  p->set_loss(with_loss > 0 ? loss / with_loss : 0);
  p->set_samples_per_s(stalled ? 0 : running ? samples : finished_samples);
  // Rank 0 evaluates (the lowest rank still in a re-formed sync group if rank 0 is out).
  double accuracy = -1;
  for (int i = 0; i < n && accuracy < 0; ++i) accuracy = r.ranks(i).accuracy();
  p->set_accuracy(accuracy >= 0 ? accuracy : -1);
  p->set_test_loss(-1);
  p->set_perplexity(-1);
  for (int i = 0; i < n; ++i) {
    if (r.ranks(i).test_loss() > 0) {  // The evaluating rank (0 or -1: not evaluated).
      p->set_test_loss(r.ranks(i).test_loss());
      p->set_perplexity(r.ranks(i).perplexity() > 0 ? r.ranks(i).perplexity() : -1);
      break;
    }
  }
  p->set_eta_s(eta);
  p->set_checkpoint_step(checkpoint == -2 ? -1 : checkpoint);
  RecordHistoryLocked(job);
}

void Coordinator::RecordHistoryLocked(JobEntry* job) {
  const JobProgress& p = job->record.status().progress();
  if (p.step() <= 0) return;
  coordinator_state::HistoryPoint point;
  point.set_t_ms(Now());
  point.set_step(p.step());
  point.set_loss(p.loss());
  point.set_accuracy(p.accuracy());
  point.set_samples_per_s(p.samples_per_s());
  // Ranks that finished report no rate: a job whose ranks are all done keeps its last one.
  const auto& points = job->record.history().points();
  if (!(p.samples_per_s() > 0) && !points.empty()) {
    point.set_samples_per_s(points[points.size() - 1].samples_per_s());
  }
  AddHistoryPoint(std::move(point), options_.history_capacity, job->record.mutable_history());
}

// ---------------------------------------------------------------------------------------------
// Nodes.

void Coordinator::CheckNodesLocked() {
  const int64_t now = Now();
  // With the monitor thread checking every monitor_interval_ms, a gap of more than a
  // heartbeat timeout since the last check means this process did not run (stopped, its
  // machine frozen or starved): it cannot tell a dead node from its own absence, and every
  // node's heartbeats are late by that gap. Each gets one timeout from now to be heard from
  // (a probe saw a 4.6 s SIGSTOP declare all four daemons dead at once and end a sync job
  // that had lost every rank).
  if (options_.monitor_interval_ms > 0 && last_check_ms_ > 0 &&
      now - last_check_ms_ > options_.heartbeat_timeout_ms) {
    for (auto& [name, node] : nodes_) {
      node.grace_until_ms = std::max(node.grace_until_ms, now + options_.heartbeat_timeout_ms);
    }
    LogWarning(
        options_.logger, "coordinator_stalled",
        {Kv("stalled_ms", now - last_check_ms_), Kv("grace_ms", options_.heartbeat_timeout_ms)});
  }
  last_check_ms_ = now;
  std::vector<NodeEntry*> expired;
  for (auto& [name, node] : nodes_) {
    if (node.record.alive() && now - node.last_seen_ms > options_.heartbeat_timeout_ms &&
        now > node.grace_until_ms) {
      expired.push_back(&node);
    }
  }
  // All of them are out before any rank moves, so no rank moves onto a node that is
  // about to be declared dead in the same sweep.
  std::vector<DeadNode> dead;
  for (NodeEntry* node : expired) {
    node->record.set_alive(false);
    dead.push_back({node, absl::StrCat("no heartbeat for ", now - node->last_seen_ms,
                                       " ms (timeout ", options_.heartbeat_timeout_ms, " ms)")});
  }
  if (!dead.empty()) MarkDeadLocked(dead);
}

std::vector<Coordinator::JobEntry*> Coordinator::JobsInOrderLocked() {
  std::vector<JobEntry*> out;
  out.reserve(by_sequence_.size());
  for (auto& [sequence, job] : by_sequence_) out.push_back(job);
  return out;
}

void Coordinator::MarkDeadLocked(const std::vector<DeadNode>& dead) {
  for (const DeadNode& d : dead) {
    d.node->record.set_alive(false);
    persist_nodes_.insert(d.node->record.info().name());
    LogWarning(options_.logger, "node_down",
               {Kv("node_name", d.node->record.info().name()),
                Kv("node_role", RoleName(d.node->record.info().role())),
                Kv("address", d.node->record.info().address()), Kv("reason", d.reason)});
  }
  for (JobEntry* job : JobsInOrderLocked()) {
    bool moved = false;
    bool changed = false;
    for (const DeadNode& d : dead) {
      if (d.node->record.info().role() == WORKER) {
        moved = MoveRanksOffLocked(job, *d.node, d.reason) || moved;
      } else {
        changed = PauseShardsOnLocked(job, *d.node) || changed;
      }
    }
    if (moved) {
      // Once for all the nodes: ranks lost together leave no survivor group behind.
      UpdateGroupLocked(job);
      RefreshLocked(job);
    }
    if (moved || changed) ChangedLocked(job, true);
  }
}

bool Coordinator::MoveRanksOffLocked(JobEntry* job, const NodeEntry& node,
                                     const std::string& reason) {
  const JobStatus& st = job->record.status();
  if (!IsActive(st.state())) return false;
  const std::string& name = node.record.info().name();
  bool moved = false;
  for (int r = 0; r < st.workers_size(); ++r) {
    if (st.workers(r).node() == name && IsUnfinished(job->rank_states[r])) {
      MoveRankLocked(job, r, absl::StrCat("node ", name, " is down: ", reason));
      moved = true;
    }
  }
  return moved;
}

bool Coordinator::PauseShardsOnLocked(JobEntry* job, const NodeEntry& node) {
  JobStatus* st = job->record.mutable_status();
  const std::string& name = node.record.info().name();
  int down = -1;
  for (int s = 0; s < st->shards_size(); ++s) {
    ShardPlacement* sp = st->mutable_shards(s);
    if (sp->node() != name || !sp->alive()) continue;
    sp->set_alive(false);
    if (down < 0) down = s;
  }
  if (down < 0) return false;
  if (st->state() == PENDING || st->state() == RUNNING) {
    const ShardPlacement& sp = st->shards(down);
    SetStateLocked(job, PAUSED,
                   absl::StrCat("shard ", down, " on node ", sp.node(), " (", sp.address(),
                                ") is down; workers wait for it to come back"));
  }
  return true;
}

void Coordinator::NodeUpLocked(NodeEntry* node, bool address_changed) {
  const std::string& name = node->record.info().name();
  const std::string& address = node->record.info().address();
  const NodeRole role = node->record.info().role();
  for (JobEntry* job : JobsInOrderLocked()) {
    JobStatus* st = job->record.mutable_status();
    bool changed = false;
    if (role == SERVER) {
      for (ShardPlacement& sp : *st->mutable_shards()) {
        if (sp.node() != name || (sp.address() == address && sp.alive())) continue;
        sp.set_address(address);
        sp.set_alive(true);
        changed = true;
      }
      if (!changed) continue;
      // Workers must be told the shard's new address.
      if (address_changed && IsActive(st->state())) BumpGenerationLocked(job, true, true, -1);
      bool all_alive = true;
      for (const ShardPlacement& sp : st->shards()) all_alive = all_alive && sp.alive();
      if (st->state() == PAUSED && all_alive) {
        LogInfo(options_.logger, "job_resumed",
                {Kv("job", st->job_id()), Kv("node_name", name), Kv("address", address)});
        SetStateLocked(job, job->record.reached_running() ? RUNNING : PENDING, "");
      }
    } else {
      for (WorkerPlacement& w : *st->mutable_workers()) {
        if (w.node() != name || w.address() == address) continue;
        w.set_address(address);
        changed = true;
      }
      if (changed && IsActive(st->state()) && OneRankPerNode(st->spec())) {
        BumpGenerationLocked(job, true, false, -1);
      }
      if (IsActive(st->state())) {
        const bool one_per_node = OneRankPerNode(st->spec());
        const bool sync = UsesSyncBarrier(SpecMode(st->spec()));
        for (int r = 0; r < st->workers_size(); ++r) {
          if (job->rank_states[r] != TaskState::kLost) continue;
          if (one_per_node) {
            bool holds = false;
            for (const WorkerPlacement& w : st->workers()) holds = holds || w.node() == name;
            if (holds) break;
          }
          // A sync job that re-formed its group finishes with the survivors: a rank that
          // rejoined would start behind the group's step (its own record is older), and the
          // group's steps cannot wait for it. (Moving a rank with a free slot at once, in
          // MoveRankLocked, keeps the full group instead.) One that lost every rank at once
          // has no group ahead of them: its ranks come back as nodes register, each to a free
          // slot (the barrier runs at the pace of a node doubled up).
          if (sync && !job->record.awaiting_whole_group()) break;
          if (sync) {
            const std::map<std::string, int> used = UsedSlotsLocked("");
            auto u = used.find(name);
            if (u != used.end() && u->second >= node->record.info().slots()) break;
          }
          AssignRankLocked(job, r, *node);
          changed = true;
        }
        if (changed) UpdateGroupLocked(job);
      }
    }
    if (changed) {
      RefreshLocked(job);
      ChangedLocked(job, true);
    }
  }
}

namespace {

// INVALID_ARGUMENT naming the field if `info` is incomplete or outside the limits.
absl::Status ValidateNodeInfo(const NodeInfo& info) {
  if (info.name().empty()) {
    return absl::InvalidArgumentError(
        "node.name is required (a stable name per daemon, e.g. its --node flag)");
  }
  RETURN_IF_ERROR(CheckName("node.name", info.name()));  // common/job_name.h: the name rule.
  constexpr size_t kMaxBytes = Coordinator::kMaxNodeFieldBytes;
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"name", &info.name()},
        {"address", &info.address()},
        {"host", &info.host()}}) {
    if (value->size() > kMaxBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("node.", field, " is ", value->size(), " bytes; at most ", kMaxBytes));
    }
  }
  if (info.role() != SERVER && info.role() != WORKER) {
    return absl::InvalidArgumentError(
        absl::StrCat("node ", info.name(), ": node.role must be SERVER or WORKER"));
  }
  if (info.address().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node ", info.name(),
        ": node.address is required (host:port of its ParameterService or peer service)"));
  }
  constexpr int kMaxSlots = Coordinator::kMaxNodeSlots;
  if (info.slots() <= 0 || info.slots() > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node ", info.name(), ": node.slots must be in 1..", kMaxSlots, ", got ", info.slots()));
  }
  if (info.cores() < 0 || info.cores() > kMaxSlots || info.gpus() < 0 || info.gpus() > kMaxSlots) {
    return absl::InvalidArgumentError(
        absl::StrCat("node ", info.name(), ": node.cores and node.gpus must be in 0..", kMaxSlots,
                     ", got ", info.cores(), " and ", info.gpus()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Coordinator::CheckIdentityLocked(const std::string& name, const NodeEntry* node,
                                              const NodeCredentials& credentials,
                                              absl::string_view what) const {
  if (!credentials.proved_name.empty()) {
    if (credentials.proved_name == name) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        what, " as node \"", name, "\" refused: the caller's certificate is for node \"",
        credentials.proved_name, "\""));
  }
  if (node != nullptr && TokenMatchesHash(credentials.token, node->record.token_sha256())) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      what, " as node \"", name,
      "\" refused: ", credentials.token.empty() ? "no node token" : "wrong node token",
      " (metadata x-gradmesh-node-token: the token the coordinator issued when the node "
      "registered)"));
}

absl::StatusOr<RegisterResponse> Coordinator::Register(const RegisterRequest& request,
                                                       const NodeCredentials& credentials) {
  const NodeInfo& info = request.node();
  RETURN_IF_ERROR(ValidateNodeInfo(info));
  absl::MutexLock lock(&mu_);
  CheckNodesLocked();
  auto it = nodes_.find(info.name());
  const bool known = it != nodes_.end();
  const bool was_alive = known && it->second.record.alive();
  const bool address_changed = known && it->second.record.info().address() != info.address();
  // A live node's name is taken only as that node; an unknown or dead one by any caller the
  // service admitted (which then gets a new token). A legacy record (no hash) is open too.
  const absl::Status as_node =
      CheckIdentityLocked(info.name(), known ? &it->second : nullptr, credentials, "registering");
  if (!credentials.proved_name.empty() && !as_node.ok()) return as_node;
  if (was_alive && !it->second.record.token_sha256().empty() && !as_node.ok()) {
    return absl::PermissionDeniedError(absl::StrCat(
        as_node.message(), "; node \"", info.name(), "\" is alive (",
        it->second.record.info().address(),
        "): its own daemon keeps its token, and a restarted daemon without it is admitted once "
        "the old registration is declared dead (no heartbeat for ",
        options_.heartbeat_timeout_ms, " ms)"));
  }
  if (it != nodes_.end() && it->second.record.info().role() != info.role()) {
    for (const auto& [id, job] : jobs_) {
      const JobStatus& st = job.record.status();
      if (!IsActive(st.state()) && st.state() != SUCCEEDED) continue;
      bool uses = false;
      for (const ShardPlacement& s : st.shards()) uses = uses || s.node() == info.name();
      for (const WorkerPlacement& w : st.workers()) uses = uses || w.node() == info.name();
      if (uses) {
        return absl::FailedPreconditionError(
            absl::StrCat("node \"", info.name(), "\" is registered as ",
                         RoleName(it->second.record.info().role()), " and placed in job ", id,
                         "; register the ", RoleName(info.role()), " under another node name"));
      }
    }
  }
  // Every registration gets a new token, also the node's own (a daemon restarted with the
  // token it kept): whoever else still holds the old one (a copied token file, an instance
  // that outlived its replacement) is locked out rather than run as the same node.
  RegisterResponse response;
  NodeEntry& node = nodes_[info.name()];
  response.set_node_token(RandomHex(16));
  node.record.set_token_sha256(Sha256(response.node_token()));
  *node.record.mutable_info() = info;
  node.record.set_alive(true);
  node.record.set_registered_ms(Now());
  node.last_seen_ms = Now();
  node.grace_until_ms = 0;  // Back: the restart grace is over for it.
  persist_nodes_.insert(info.name());
  LogInfo(options_.logger, was_alive ? "node_registered" : "node_up",
          {Kv("node_name", info.name()), Kv("node_role", RoleName(info.role())),
           Kv("address", info.address()), Kv("slots", info.slots()), Kv("host", info.host()),
           Kv("known", known ? "true" : "false")});
  NodeUpLocked(&node, address_changed);
  RETURN_IF_ERROR(PersistLocked());
  response.set_heartbeat_interval_ms(static_cast<int32_t>(options_.heartbeat_interval_ms));
  return response;
}

void Coordinator::AppendLogsLocked(const NodeEntry& node, const TaskReport& report) {
  auto it = jobs_.find(report.job_id());
  if (it == jobs_.end() || report.log_lines().empty()) return;
  JobEntry* job = &it->second;
  const JobStatus& st = job->record.status();
  const int index = report.index();
  if (node.record.info().role() != WORKER || index < 0 || index >= st.workers_size() ||
      st.workers(index).node() != node.record.info().name()) {
    return;
  }
  if (job->rank_logs.size() < static_cast<size_t>(st.workers_size())) {
    job->rank_logs.resize(st.workers_size());
  }
  std::shared_ptr<LogTail>& tail = job->rank_logs[index];
  if (tail == nullptr) tail = std::make_shared<LogTail>(LogTail::Options());
  for (const std::string& line : report.log_lines()) {
    job->log_sequence = tail->AppendAs(job->log_sequence + 1, line);
  }
}

void Coordinator::ApplyReportLocked(const NodeEntry& node, const TaskReport& report) {
  AppendLogsLocked(node, report);
  auto it = jobs_.find(report.job_id());
  if (it == jobs_.end()) return;
  JobEntry* job = &it->second;
  coordinator_state::JobRecord& r = job->record;
  JobStatus* st = r.mutable_status();
  if (!IsActive(st->state())) return;
  const std::string& name = node.record.info().name();
  const int index = report.index();
  // The report's state enters here (unknown: ignored, logged for ranks below).
  const absl::StatusOr<TaskState> rs = ParseTaskState(report.state());
  if (node.record.info().role() == SERVER) {
    if (index < 0 || index >= st->shards_size() || st->shards(index).node() != name) return;
    const bool current =
        report.generation() == 0 || report.generation() == r.shard_generation(index);
    if (rs.ok() && *rs == TaskState::kFailed && current) {
      SetStateLocked(job, FAILED,
                     absl::StrCat("shard ", index, " on node ", name, ": ", report.message()));
      ChangedLocked(job, true);
    }
    return;
  }
  if (index < 0 || index >= st->workers_size() || st->workers(index).node() != name) return;
  WorkerPlacement* w = st->mutable_workers(index);
  coordinator_state::RankRecord* rr = r.mutable_ranks(index);
  const bool current = report.generation() == 0 || report.generation() == rr->generation();
  const JobState state_before = st->state();
  const TaskState rank_state_before = job->rank_states[index];
  // Clamped to what a job can count: the ETA subtracts and divides these.
  // A run that does not know its step yet (restarting, before it has restored) keeps the
  // rank's last figures.
  if (report.has_step()) {
    w->set_step(std::clamp<int64_t>(report.step(), 0, kMaxReportedSteps));
    if (report.epoch() > 0) rr->set_epoch(report.epoch());
  }
  if (report.total_steps() > 0) {
    rr->set_total_steps(std::clamp<int64_t>(report.total_steps(), 0, kMaxReportedSteps));
  }
  // A run that has trained no step yet (resumed at its last step) has no figures of its own:
  // the rank keeps its earlier ones.
  if (report.has_loss()) rr->set_loss(report.loss());
  rr->set_reported(true);
  rr->set_accuracy(report.accuracy());
  rr->set_test_loss(report.test_loss());
  rr->set_perplexity(report.perplexity());
  if (report.has_samples_per_s()) rr->set_samples_per_s(report.samples_per_s());
  rr->set_checkpoint_step(report.checkpoint_step());
  // "pending" and "lost" are the coordinator's own states, never a daemon's report.
  const bool reportable = rs.ok() && *rs != TaskState::kPending && *rs != TaskState::kLost;
  if (!reportable) {
    LogWarning(options_.logger, "unknown_report_state",
               {Kv("job", st->job_id()), Kv("rank", index), Kv("node_name", name),
                Kv("state", report.state())});
  } else if (*rs == TaskState::kRunning) {
    if (job->rank_states[index] == TaskState::kPending) {
      SetRankState(job, index, TaskState::kRunning);
    }
  } else if (*rs == TaskState::kSucceeded) {
    // Also from an earlier generation on this node, when it ran every step: a daemon paused
    // past its heartbeat timeout whose run then finished has done the rank's work (its rank
    // was meanwhile given back to it; the new run would wait for peers that are done).
    const bool finished = report.total_steps() > 0 && report.step() >= report.total_steps();
    if (current || finished) SetRankState(job, index, TaskState::kSucceeded);
  } else if (*rs == TaskState::kFailed) {
    if (current && !RestartAfterPeerLossLocked(job, index, name, report.message())) {
      SetRankState(job, index, TaskState::kFailed);
      SetStateLocked(job, FAILED,
                     absl::StrCat("rank ", index, " on node ", name, ": ", report.message()));
    }
  } else if (*rs == TaskState::kStopped) {
    if (current) {
      MoveRankLocked(job, index, absl::StrCat("rank stopped on node ", name));
      UpdateGroupLocked(job);
    }
  }
  RefreshLocked(job);
  const bool persist_now =
      state_before != st->state() || rank_state_before != job->rank_states[index];
  ChangedLocked(job, persist_now);
}

absl::StatusOr<HeartbeatResponse> Coordinator::Heartbeat(const HeartbeatRequest& request,
                                                         const NodeCredentials& credentials) {
  if (request.node().empty()) {
    return absl::InvalidArgumentError("heartbeat without a node name (HeartbeatRequest.node)");
  }
  absl::MutexLock lock(&mu_);
  HeartbeatResponse response;
  auto it = nodes_.find(request.node());
  // Unknown, or stored before node tokens (no hash): the daemon registers and gets a token.
  const bool legacy = it != nodes_.end() && it->second.record.token_sha256().empty() &&
                      credentials.proved_name.empty();
  if (it == nodes_.end() || legacy) {
    CheckNodesLocked();
    (void)PersistLocked();
    response.set_register_again(true);
    return response;
  }
  RETURN_IF_ERROR(CheckIdentityLocked(request.node(), &it->second, credentials, "heartbeat"));
  NodeEntry* node = &it->second;
  node->last_seen_ms = Now();
  node->grace_until_ms = 0;  // Back: the restart grace is over for it.
  if (!node->record.alive()) {
    // Declared dead (e.g. it stalled past the timeout) and back: same as registering again.
    node->record.set_alive(true);
    persist_nodes_.insert(request.node());
    LogInfo(options_.logger, "node_up",
            {Kv("node_name", request.node()), Kv("node_role", RoleName(node->record.info().role())),
             Kv("address", node->record.info().address()), Kv("via", "heartbeat")});
    NodeUpLocked(node, false);
  }
  CheckNodesLocked();
  for (const TaskReport& report : request.tasks()) ApplyReportLocked(*node, report);
  if (request.leaving() && node->record.alive()) {
    node->record.set_alive(false);
    MarkDeadLocked({{node, "leaving"}});
  }
  (void)PersistLocked();
  for (Task& t : TasksForLocked(*node)) *response.add_tasks() = std::move(t);
  return response;
}

std::vector<Task> Coordinator::TasksForLocked(const NodeEntry& node) const {
  const std::string& name = node.record.info().name();
  const bool worker = node.record.info().role() == WORKER;
  std::vector<Task> tasks;
  for (const auto& [sequence, job] : by_sequence_) {
    const coordinator_state::JobRecord& r = job->record;
    const JobStatus& st = r.status();
    if (!IsActive(st.state()) && !(st.state() == SUCCEEDED && !worker)) continue;
    auto make = [&](int index, int64_t generation) {
      Task t;
      t.set_job_id(st.job_id());
      t.set_index(index);
      *t.mutable_spec() = st.spec();
      if (IsPsMode(st.spec().mode())) {
        for (const ShardPlacement& s : st.shards()) t.add_servers(s.address());
      }
      if (OneRankPerNode(st.spec())) {
        for (const WorkerPlacement& w : st.workers()) t.add_peers(w.address());
        if (worker && !r.rank_secret().empty()) {
          t.set_rank_token(RankToken(r.rank_secret(), index));
          for (int k = 0; k < st.workers_size(); ++k) {
            t.add_rank_token_hashes(Sha256(RankToken(r.rank_secret(), k)));
          }
        }
      }
      t.set_job_token(st.job_token());
      for (int a : r.active_ranks()) t.add_active_ranks(a);
      t.set_lr_scale(r.lr_scale() > 0 ? r.lr_scale() : 1.0);
      t.set_generation(generation);
      return t;
    };
    if (worker) {
      // A sync group coming back whole starts once every rank is placed: a rank started alone
      // would wait at the barrier for ranks with no node yet and fail at its timeout.
      if (r.awaiting_whole_group()) continue;
      for (int i = 0; i < st.workers_size(); ++i) {
        if (st.workers(i).node() == name && IsUnfinished(job->rank_states[i])) {
          tasks.push_back(make(i, r.ranks(i).generation()));
        }
      }
    } else {
      for (int i = 0; i < st.shards_size(); ++i) {
        if (st.shards(i).node() == name) tasks.push_back(make(i, r.shard_generation(i)));
      }
    }
  }
  return tasks;
}

// ---------------------------------------------------------------------------------------------
// Jobs.

absl::StatusOr<std::vector<std::string>> Coordinator::ResumableShardNodesLocked(
    const JobSpec& spec, const JobEntry* existing, bool resume) const {
  const std::string& id = spec.name();
  if (existing == nullptr) {
    if (!resume) return std::vector<std::string>();
    return absl::NotFoundError(absl::StrCat("job \"", id,
                                            "\" does not exist: nothing to resume (submit it "
                                            "without resume to start it)"));
  }
  const JobState state = existing->record.status().state();
  if (!resume) {
    return absl::AlreadyExistsError(
        absl::StrCat("job \"", id, "\" already exists (", JobState_Name(state),
                     "); choose another name, or resubmit with resume once it has ended"));
  }
  if (IsActive(state)) {
    return absl::AlreadyExistsError(
        absl::StrCat("job \"", id, "\" is ", JobState_Name(state),
                     "; only a job that ended (FAILED, CANCELLED; SUCCEEDED with more steps) can "
                     "be resumed"));
  }
  const JobStatus& old = existing->record.status();
  // A job that succeeded has trained what it was asked to: resuming it as it was would
  // train nothing and overwrite its results. More steps or epochs train further.
  if (state == SUCCEEDED && spec.steps() <= old.spec().steps() &&
      spec.epochs() <= old.spec().epochs()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job \"", id,
                     "\" SUCCEEDED: nothing left to train; resume it with more steps or "
                     "epochs to train further, or submit it under another name"));
  }
  std::vector<std::string> shard_nodes;
  if (!IsPsMode(spec.mode()) || old.shards().empty()) return shard_nodes;
  if (old.spec().num_workers() != spec.num_workers()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job \"", id, "\" ran with ", old.spec().num_workers(),
        " workers, which its shards' state is laid out for; resume it with num_workers: ",
        old.spec().num_workers()));
  }
  if (old.shards_size() != spec.num_shards()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job \"", id, "\" ran with ", old.shards_size(),
        " shards, which hold its state; resume it with num_shards: ", old.shards_size()));
  }
  for (const ShardPlacement& s : old.shards()) {
    auto n = nodes_.find(s.node());
    if (n == nodes_.end() || !n->second.record.alive()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "resuming job \"", id, "\" needs shard ", s.shard(), "'s node ", s.node(),
          " (it holds the job's state), which is not alive; start gradmesh_server --node=",
          s.node(), " --coordinator=... again"));
    }
    // The name may have been registered again since, by another kind of daemon (a role may
    // change once no active job uses the node): its address has no ParameterService.
    if (n->second.record.info().role() != SERVER) {
      return absl::FailedPreconditionError(
          absl::StrCat("resuming job \"", id, "\" needs shard ", s.shard(), "'s node ", s.node(),
                       " (it holds the job's state), which is now registered as a ",
                       RoleName(n->second.record.info().role()),
                       ", not a server; start gradmesh_server "
                       "--node=",
                       s.node(), " --coordinator=... with the job's data directory again"));
    }
    shard_nodes.push_back(s.node());
  }
  return shard_nodes;
}

coordinator_state::JobRecord Coordinator::NewJobRecordLocked(const JobSpec& spec,
                                                             const JobPlacement& placement,
                                                             const std::string& strategy,
                                                             int64_t generation, int64_t created_ms,
                                                             int64_t now) const {
  coordinator_state::JobRecord record;
  record.set_generation(generation);
  record.set_lr_scale(1.0);
  record.set_placement(strategy);
  JobStatus* st = record.mutable_status();
  st->set_job_id(spec.name());
  *st->mutable_spec() = spec;
  st->set_state(PENDING);
  st->set_created_ms(created_ms);
  st->set_updated_ms(now);
  st->set_active_workers(spec.num_workers());
  JobProgress* p = st->mutable_progress();
  p->set_total_steps(spec.steps());
  p->set_epochs(spec.epochs());
  p->set_accuracy(-1);
  p->set_test_loss(-1);
  p->set_perplexity(-1);
  p->set_eta_s(-1);
  p->set_checkpoint_step(-1);
  for (size_t s = 0; s < placement.shard_nodes.size(); ++s) {
    ShardPlacement* sp = st->add_shards();
    sp->set_shard(static_cast<int>(s));
    sp->set_node(placement.shard_nodes[s]);
    sp->set_address(NodeAddressLocked(placement.shard_nodes[s]));
    sp->set_alive(true);
    record.add_shard_generation(generation);
  }
  for (size_t w = 0; w < placement.worker_nodes.size(); ++w) {
    WorkerPlacement* wp = st->add_workers();
    wp->set_rank(static_cast<int>(w));
    wp->set_node(placement.worker_nodes[w]);
    wp->set_address(NodeAddressLocked(placement.worker_nodes[w]));
    wp->set_state(std::string(TaskStateName(TaskState::kPending)));
    coordinator_state::RankRecord* rr = record.add_ranks();
    rr->set_generation(generation);
    rr->set_accuracy(-1);
    rr->set_test_loss(-1);
    rr->set_perplexity(-1);
    rr->set_checkpoint_step(-1);
  }
  return record;
}

absl::StatusOr<JobStatus> Coordinator::SubmitJob(const SubmitJobRequest& request) {
  absl::MutexLock lock(&mu_);
  CheckNodesLocked();
  (void)PersistLocked();
  JobSpec spec = request.spec();
  if (spec.name().empty()) {
    do {
      spec.set_name(absl::StrFormat("job-%d-%s", Now() / 1000, RandomHex(2)));
    } while (jobs_.count(spec.name()) > 0);
  }
  int alive_servers = 0;
  for (const auto& [name, node] : nodes_) {
    if (node.record.alive() && node.record.info().role() == SERVER) ++alive_servers;
  }
  ApplyJobSpecDefaults(alive_servers, &spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  RETURN_IF_ERROR(ValidatePushCodec(spec.compression().push()));
  const std::string id = spec.name();
  auto existing_it = jobs_.find(id);
  const JobEntry* existing = existing_it == jobs_.end() ? nullptr : &existing_it->second;
  ASSIGN_OR_RETURN(std::vector<std::string> shard_nodes,
                   ResumableShardNodesLocked(spec, existing, request.resume()));
  const bool keep_shards = !shard_nodes.empty();
  const std::string strategy = DefaultPlacementFor(spec);
  ASSIGN_OR_RETURN(JobPlacement placement, PlaceLocked(spec, strategy, id, keep_shards));
  if (keep_shards) placement.shard_nodes = shard_nodes;

  const int64_t now = Now();
  const int64_t generation = existing != nullptr ? existing->record.generation() + 1 : 1;
  coordinator_state::JobRecord record =
      NewJobRecordLocked(spec, placement, strategy, generation,
                         existing != nullptr ? existing->record.status().created_ms() : now, now);
  JobStatus* st = record.mutable_status();
  if (request.dry_run()) return *st;

  st->set_job_token(existing != nullptr ? existing->record.status().job_token() : NewToken());
  record.set_rank_secret(existing != nullptr && !existing->record.rank_secret().empty()
                             ? existing->record.rank_secret()
                             : RandomHex(16));
  record.set_sequence(existing != nullptr ? existing->record.sequence() : next_sequence_++);
  // A resumed job's store may still hold the last run's final model: this run has none yet.
  record.set_final_published(false);
  RETURN_IF_ERROR(store_->Write({&record}, {}));
  const int64_t version = existing != nullptr ? existing->version + 1 : 1;
  const bool resubmitted = existing != nullptr;
  JobEntry& entry = jobs_[id];
  entry = JobEntry();
  entry.record = std::move(record);
  by_sequence_[entry.record.sequence()] = &entry;
  entry.rank_states.assign(placement.worker_nodes.size(), TaskState::kPending);
  entry.version = version;
  JobStatus published = entry.record.status();
  published.set_updated_ms(0);
  entry.published = published.SerializeAsString();
  entry.last_persist_ms = now;
  changed_.SignalAll();
  LogInfo(options_.logger, resubmitted ? "job_resubmitted" : "job_submitted",
          {Kv("job", id), Kv("mode", spec.mode()), Kv("model", spec.model().name()),
           Kv("dataset", spec.dataset().name()), Kv("num_workers", spec.num_workers()),
           Kv("num_shards", placement.shard_nodes.size())});
  LogInfo(
      options_.logger, "job_placed",
      {Kv("job", id), Kv("strategy", strategy),
       Kv("shards", absl::StrJoin(placement.shard_nodes, ",")),
       Kv("workers", absl::StrJoin(placement.worker_nodes, ",")), Kv("generation", generation)});
  return entry.record.status();
}

absl::StatusOr<GetLogsResponse> Coordinator::GetLogs(const std::string& job_id, int rank,
                                                     int64_t after_sequence) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" not found"));
  }
  const JobEntry& job = it->second;
  const int n = job.record.status().workers_size();
  if (rank < -1 || rank >= n) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is out of range: job \"",
                                                   job_id, "\" has ranks 0..", n - 1,
                                                   " (-1 or no rank: every rank)"));
  }
  std::vector<LogLine> lines;
  for (int r = 0; r < static_cast<int>(job.rank_logs.size()); ++r) {
    if ((rank >= 0 && r != rank) || job.rank_logs[r] == nullptr) continue;
    for (auto& [seq, text] : job.rank_logs[r]->Since(after_sequence)) {
      LogLine& l = lines.emplace_back();
      l.set_rank(r);
      l.set_sequence(seq);
      l.set_text(std::move(text));
    }
  }
  std::sort(lines.begin(), lines.end(),
            [](const LogLine& a, const LogLine& b) { return a.sequence() < b.sequence(); });
  GetLogsResponse out;
  size_t bytes = 0;
  for (LogLine& l : lines) {
    if (out.lines_size() >= kMaxLogLinesPerCall || bytes + l.text().size() > (1 << 20)) break;
    bytes += l.text().size();
    *out.add_lines() = std::move(l);
  }
  out.set_state(job.record.status().state());
  out.set_last_sequence(job.log_sequence);
  out.set_incarnation(incarnation_);
  return out;
}

absl::StatusOr<coordinator_state::JobHistory> Coordinator::GetJobHistory(
    const std::string& job_id) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" not found"));
  }
  return it->second.record.history();
}

absl::StatusOr<JobStatus> Coordinator::GetJob(const std::string& job_id) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" not found"));
  }
  return it->second.record.status();
}

std::vector<coordinator_state::NodeRecord> Coordinator::ListNodes() {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<coordinator_state::NodeRecord> out;
  for (const auto& kv : nodes_) out.push_back(kv.second.record);
  return out;
}

std::vector<JobStatus> Coordinator::ListJobs() {
  absl::ReaderMutexLock lock(&mu_);
  std::vector<const coordinator_state::JobRecord*> records;
  for (const auto& kv : jobs_) records.push_back(&kv.second.record);
  std::sort(records.begin(), records.end(),
            [](const coordinator_state::JobRecord* a, const coordinator_state::JobRecord* b) {
              if (a->status().created_ms() != b->status().created_ms()) {
                return a->status().created_ms() > b->status().created_ms();
              }
              return a->sequence() > b->sequence();
            });
  std::vector<JobStatus> out;
  for (const auto* r : records) out.push_back(r->status());
  return out;
}

absl::StatusOr<JobStatus> Coordinator::CancelJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  CheckNodesLocked();
  (void)PersistLocked();
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" not found"));
  }
  JobEntry* job = &it->second;
  const JobState state = job->record.status().state();
  if (!IsActive(state)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job \"", job_id, "\" already ended (", JobState_Name(state), "); nothing to cancel"));
  }
  const JobEntry backup = *job;
  SetStateLocked(job, CANCELLED, "cancelled by CancelJob");
  RefreshLocked(job);
  ChangedLocked(job, true);
  absl::Status s = PersistLocked();
  if (!s.ok()) {
    *job = backup;
    persist_jobs_.erase(job_id);
    return s;
  }
  return job->record.status();
}

absl::StatusOr<Coordinator::JobView> Coordinator::WaitForJobChange(const std::string& job_id,
                                                                   int64_t after_version,
                                                                   absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  while (true) {
    if (shutting_down_) return absl::CancelledError("the coordinator is shutting down");
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("job \"", job_id, "\" not found"));
    }
    if (it->second.version > after_version || absl::Now() >= deadline) {
      return JobView{it->second.record.status(), it->second.version};
    }
    changed_.WaitWithDeadline(&mu_, deadline);
  }
}

}  // namespace gradmesh
