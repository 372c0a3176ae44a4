// Fake coordinator JobService for CLI tests (see fake_job_service.h).
#include "cli/fake_job_service.h"

#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_builder.h>

#include <chrono>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace cli {
namespace {

// Writes a script's messages one by one, then finishes (or, with hold, waits for the call to
// be cancelled). gRPC may run OnCancel concurrently with the other reactions, hence the lock.
template <typename Message>
class ScriptWriter final : public grpc::ServerWriteReactor<Message> {
 public:
  ScriptWriter(std::vector<Message> messages, grpc::Status end, bool hold)
      : messages_(std::move(messages)), end_(std::move(end)), hold_(hold) {
    absl::MutexLock lock(&mu_);
    NextLocked();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "write failed"));
      return;
    }
    ++next_;
    NextLocked();
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (!writing_)
      FinishLocked(grpc::Status(grpc::StatusCode::CANCELLED, "coordinator going away"));
  }

  void OnDone() override { delete this; }

 private:
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (next_ < messages_.size()) {
      writing_ = true;
      this->StartWrite(&messages_[next_]);
    } else if (!hold_) {
      FinishLocked(end_);
    }
  }

  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    this->Finish(status);
  }

  absl::Mutex mu_;
  std::vector<Message> messages_;
  const grpc::Status end_;
  const bool hold_;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
  r->Finish(status);
  return r;
}

grpc::Status NotFound(const std::string& id) {
  return grpc::Status(grpc::StatusCode::NOT_FOUND, absl::StrCat("job ", id, " not found"));
}

}  // namespace

void FakeJobService::AddJob(const JobStatus& job) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(job);
}

void FakeJobService::SetSubmitError(grpc::Status status) {
  absl::MutexLock lock(&mu_);
  submit_error_ = std::move(status);
}

void FakeJobService::SetRequiredToken(std::string token) {
  absl::MutexLock lock(&mu_);
  required_token_ = std::move(token);
}

void FakeJobService::AddWatchScript(WatchScript script) {
  absl::MutexLock lock(&mu_);
  scripts_.push_back(std::move(script));
}

std::vector<SubmitJobRequest> FakeJobService::submits() const {
  absl::MutexLock lock(&mu_);
  return submits_;
}

std::vector<std::string> FakeJobService::authorizations() const {
  absl::MutexLock lock(&mu_);
  return authorizations_;
}

int FakeJobService::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

int FakeJobService::watches() const {
  absl::MutexLock lock(&mu_);
  return watches_;
}

grpc::Status FakeJobService::Admit(grpc::CallbackServerContext* ctx) {
  std::string header;
  const auto& md = ctx->client_metadata();
  auto it = md.find("authorization");
  if (it != md.end()) header.assign(it->second.data(), it->second.size());
  absl::MutexLock lock(&mu_);
  ++calls_;
  authorizations_.push_back(header);
  if (!required_token_.empty() && header != "Bearer " + required_token_) {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or wrong API token");
  }
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* FakeJobService::SubmitJob(grpc::CallbackServerContext* ctx,
                                                    const SubmitJobRequest* request,
                                                    SubmitJobResponse* response) {
  if (grpc::Status st = Admit(ctx); !st.ok()) return Reply(ctx, st);
  absl::MutexLock lock(&mu_);
  submits_.push_back(*request);
  if (!submit_error_.ok()) return Reply(ctx, submit_error_);
  JobStatus* job = response->mutable_job();
  job->set_job_id(request->spec().name());
  *job->mutable_spec() = request->spec();
  job->set_state(PENDING);
  for (int s = 0; s < request->spec().num_shards(); ++s) {
    ShardPlacement* p = job->add_shards();
    p->set_shard(s);
    p->set_node(absl::StrCat("srv-", s));
    p->set_address(absl::StrCat("127.0.0.1:", 7100 + s));
  }
  for (int r = 0; r < request->spec().num_workers(); ++r) {
    WorkerPlacement* p = job->add_workers();
    p->set_rank(r);
    p->set_node(absl::StrCat("wrk-", r));
    p->set_state("pending");
  }
  return Reply(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* FakeJobService::GetJob(grpc::CallbackServerContext* ctx,
                                                 const GetJobRequest* request,
                                                 JobStatus* response) {
  if (grpc::Status st = Admit(ctx); !st.ok()) return Reply(ctx, st);
  absl::MutexLock lock(&mu_);
  for (const JobStatus& j : jobs_) {
    if (j.job_id() == request->job_id()) {
      *response = j;
      return Reply(ctx, grpc::Status::OK);
    }
  }
  return Reply(ctx, NotFound(request->job_id()));
}

grpc::ServerUnaryReactor* FakeJobService::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const ListJobsRequest*,
                                                   ListJobsResponse* response) {
  if (grpc::Status st = Admit(ctx); !st.ok()) return Reply(ctx, st);
  absl::MutexLock lock(&mu_);
  for (const JobStatus& j : jobs_) *response->add_jobs() = j;
  return Reply(ctx, grpc::Status::OK);
}

void FakeJobService::AddLogsAnswer(grpc::Status status, GetLogsResponse response) {
  absl::MutexLock lock(&mu_);
  logs_answers_.emplace_back(std::move(status), std::move(response));
}

std::vector<GetLogsRequest> FakeJobService::logs_requests() const {
  absl::MutexLock lock(&mu_);
  return logs_requests_;
}

grpc::ServerUnaryReactor* FakeJobService::GetLogs(grpc::CallbackServerContext* ctx,
                                                  const GetLogsRequest* request,
                                                  GetLogsResponse* response) {
  if (grpc::Status st = Admit(ctx); !st.ok()) return Reply(ctx, st);
  absl::MutexLock lock(&mu_);
  logs_requests_.push_back(*request);
  if (logs_answers_.empty()) return Reply(ctx, NotFound(request->job_id()));
  auto [status, answer] = std::move(logs_answers_.front());
  logs_answers_.pop_front();
  if (status.ok()) *response = std::move(answer);
  return Reply(ctx, status);
}

grpc::ServerUnaryReactor* FakeJobService::CancelJob(grpc::CallbackServerContext* ctx,
                                                    const CancelJobRequest* request,
                                                    JobStatus* response) {
  if (grpc::Status st = Admit(ctx); !st.ok()) return Reply(ctx, st);
  absl::MutexLock lock(&mu_);
  for (JobStatus& j : jobs_) {
    if (j.job_id() != request->job_id()) continue;
    if (j.state() == SUCCEEDED || j.state() == FAILED || j.state() == CANCELLED) {
      return Reply(ctx, grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                     absl::StrCat("job ", j.job_id(), " already ended (",
                                                  JobState_Name(j.state()), ")")));
    }
    j.set_state(CANCELLED);
    j.set_message("cancelled by the user");
    *response = j;
    return Reply(ctx, grpc::Status::OK);
  }
  return Reply(ctx, NotFound(request->job_id()));
}

grpc::ServerWriteReactor<JobStatus>* FakeJobService::WatchJob(grpc::CallbackServerContext* ctx,
                                                              const WatchJobRequest* request) {
  WatchScript script;
  if (grpc::Status st = Admit(ctx); !st.ok()) {
    script.end = st;
  } else {
    absl::MutexLock lock(&mu_);
    ++watches_;
    if (scripts_.empty()) {
      script.end = NotFound(request->job_id());
    } else {
      script = std::move(scripts_.front());
      scripts_.pop_front();
    }
  }
  return new ScriptWriter<JobStatus>(std::move(script.messages), script.end, script.hold);
}

void FakeJobService::SetModel(ModelHeader header, std::string payload) {
  absl::MutexLock lock(&mu_);
  std::pair<std::string, int> key(header.job_id(), header.kind());
  models_[key] = {std::move(header), std::move(payload)};
}

std::vector<GetModelRequest> FakeJobService::model_requests() const {
  absl::MutexLock lock(&mu_);
  return model_requests_;
}

grpc::ServerWriteReactor<ModelChunk>* FakeJobService::GetModel(grpc::CallbackServerContext* ctx,
                                                               const GetModelRequest* request) {
  std::vector<ModelChunk> messages;
  grpc::Status end = Admit(ctx);
  if (end.ok()) {
    absl::MutexLock lock(&mu_);
    model_requests_.push_back(*request);
    const JobStatus* job = nullptr;
    for (const JobStatus& j : jobs_) {
      if (j.job_id() == request->job_id()) job = &j;
    }
    auto it = models_.find({request->job_id(), request->kind()});
    if (job == nullptr) {
      end = NotFound(request->job_id());
    } else if (it == models_.end()) {
      // The coordinator's wording (coordinator/coordinator_models.cc).
      end = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                         absl::StrCat("job ", job->job_id(), " (", job->spec().mode(),
                                      ") has not published a model yet; rank 0 publishes at "
                                      "checkpoints, every 60 s and at the end"));
    } else {
      messages.emplace_back();
      *messages.back().mutable_header() = it->second.first;
      const std::string& payload = it->second.second;
      for (size_t off = 0; off < payload.size(); off += kModelChunkBytes) {
        messages.emplace_back();
        messages.back().set_data(payload.substr(off, kModelChunkBytes));
      }
    }
  }
  return new ScriptWriter<ModelChunk>(std::move(messages), end, /*hold=*/false);
}

std::unique_ptr<FakeCoordinator> FakeCoordinator::Start(int port) {
  std::unique_ptr<FakeCoordinator> c(new FakeCoordinator());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                           &c->port_);
  builder.RegisterService(&c->service_);
  c->server_ = builder.BuildAndStart();
  if (c->server_ == nullptr || c->port_ == 0) return nullptr;
  return c;
}

FakeCoordinator::~FakeCoordinator() { Shutdown(); }

std::string FakeCoordinator::address() const { return absl::StrCat("127.0.0.1:", port_); }

void FakeCoordinator::Shutdown() {
  if (server_ == nullptr) return;
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  server_->Wait();
  server_.reset();
}

}  // namespace cli
}  // namespace gradmesh
