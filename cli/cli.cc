// The `gradmesh` command-line client (see cli.h): argument handling, the commands, and the
// mapping of errors to exit codes. Rendering lives in format.h, the RPCs in
// coordinator_client.h and shard_export.h, the files in state_dict.h and torchscript_export.h.
#include "cli/cli.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "cli/coordinator_client.h"
#include "cli/flags.h"
#include "cli/format.h"
#include "cli/shard_export.h"
#include "cli/state_dict.h"
#include "cli/torchscript_export.h"
#include "common/job_name.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "compression/compressor.h"
#include "google/protobuf/util/json_util.h"
#include "rpc/auth.h"
#include "rpc/tls.h"

namespace gradmesh {
namespace cli {
namespace {

constexpr char kDefaultCoordinator[] = "127.0.0.1:7000";
constexpr char kCoordinatorEnv[] = "GRADMESH_COORDINATOR";
constexpr char kTokenFileEnv[] = "GRADMESH_AUTH_TOKEN_FILE";

struct Command;

// One invocation: parsed arguments, resolved settings and the coordinator client.
struct Session {
  const CliOptions& options;
  const CliIo& io;
  const Command* command = nullptr;
  ParsedArgs args;
  std::string coordinator;
  RpcOptions rpc;  // Channels to the coordinator and the shards (TLS flags).
  std::unique_ptr<CoordinatorClient> client;

  std::ostream& out() { return *io.out; }
  std::ostream& err() { return *io.err; }
  const std::string& arg(size_t i) const { return args.positional[i]; }
};

struct Command {
  std::string name;
  std::string usage_args;  // After "gradmesh <name>".
  size_t min_args = 0;
  size_t max_args = 0;
  std::string summary;  // One line, for the command list.
  std::string details;  // Description and examples, for `<name> --help`.
  std::vector<FlagSpec> flags;
  int (*run)(Session& s) = nullptr;
};

std::vector<FlagSpec> GlobalFlags() {
  return {
      {"coordinator", true, "HOST:PORT",
       "coordinator address (default $GRADMESH_COORDINATOR, else 127.0.0.1:7000)"},
      {"auth_token_file", true, "FILE",
       "file holding the coordinator's API token (default $GRADMESH_AUTH_TOKEN_FILE)"},
      {"tls_ca_file", true, "FILE", "TLS: verify the coordinator and shards against this CA"},
      {"tls_cert_file", true, "FILE", "TLS: client certificate (for --tls_client_auth servers)"},
      {"tls_key_file", true, "FILE", "TLS: key of --tls_cert_file"},
      {"tls_client_auth", false, "", "accepted for symmetry with the daemons (servers only)"},
      {"allow_insecure", false, "", "allow the token over plaintext to a non-loopback address"},
      {"help", false, "", "show help"},
  };
}

int UsageError(Session& s, const std::string& message, const std::string& help_for) {
  s.err() << "error: " << message << "\nRun '" << help_for << " --help' for usage.\n";
  return kExitUsage;
}

// A failed coordinator call: unreachable (3) or refused (1).
int CoordinatorError(Session& s, const absl::Status& st) {
  if (st.code() == absl::StatusCode::kUnavailable ||
      st.code() == absl::StatusCode::kDeadlineExceeded) {
    s.err() << "error: cannot reach the coordinator at " << s.coordinator << " ("
            << StatusCodeName(st.code()) << ": " << st.message()
            << "): is gradmesh_coordinator running? set --coordinator or $" << kCoordinatorEnv
            << "\n";
    return kExitUnreachable;
  }
  s.err() << "error: " << StatusCodeName(st.code()) << ": " << st.message() << "\n";
  if (st.code() == absl::StatusCode::kUnauthenticated) {
    s.err() << "hint: give the coordinator's API token with --auth_token_file or $" << kTokenFileEnv
            << "\n";
  }
  return kExitFailed;
}

// Any other failure of a command (export from shards, writing a file): exit 1.
int Failure(Session& s, const absl::Status& st) {
  s.err() << "error: " << StatusCodeName(st.code()) << ": " << st.message() << "\n";
  return kExitFailed;
}

// --- watch -----------------------------------------------------------------------------------

// Renders a stream of JobStatus updates: on a terminal one progress line redrawn in place,
// otherwise plain throttled lines; state changes on their own lines; the final line at the end.
class WatchPrinter {
 public:
  explicit WatchPrinter(Session* s) : s_(s) {}

  bool done() const { return done_; }
  const JobStatus& last() const { return last_; }

  void OnUpdate(const JobStatus& job) {
    last_ = job;
    // The job's rate is the sum over its running ranks: remember it only while every rank
    // counts (ranks that finished early report no rate), so the final line shows the total
    // samples/s of all workers, as the quickstart's RESULT line does.
    if (job.progress().samples_per_s() > 0 && (AllRanksRunning(job) || last_rate_ == 0)) {
      last_rate_ = job.progress().samples_per_s();
    }
    if (IsFinalState(job.state())) {
      // A finished job's figure sums its ranks' whole-run rates; a coordinator from before
      // that (or a job that failed) reports none: show the last one measured.
      JobStatus shown = job;
      if (!(shown.progress().samples_per_s() > 0)) {
        shown.mutable_progress()->set_samples_per_s(last_rate_);
      }
      ClearBar();
      s_->out() << FinalLine(shown) << "\n";
      s_->out().flush();
      done_ = true;
      return;
    }
    if (!have_state_ || job.state() != state_ || job.message() != message_) {
      have_state_ = true;
      state_ = job.state();
      message_ = job.message();
      ClearBar();
      s_->out() << "job " << job.job_id() << " " << StateName(job.state())
                << (job.message().empty() ? "" : ": ") << job.message() << "\n";
    }
    if (job.state() == RUNNING) {
      if (s_->io.out_is_terminal) {
        s_->out() << "\r\033[K" << ProgressBar(job.progress()) << " "
                  << ProgressText(job.progress());
        bar_shown_ = true;
      } else {
        const absl::Time now = s_->options.now();
        if (now - last_plain_ >= s_->options.plain_update_interval) {
          last_plain_ = now;
          s_->out() << PercentDone(job.progress()) << "% " << ProgressText(job.progress()) << "\n";
        }
      }
    }
    s_->out().flush();
  }

  // A line on stderr that must not be mixed into the progress line.
  void Note(const std::string& line) {
    ClearBar();
    s_->out().flush();
    s_->err() << line << "\n";
    s_->err().flush();
  }

 private:
  void ClearBar() {
    if (bar_shown_) s_->out() << "\r\033[K";
    bar_shown_ = false;
  }

  // Every rank that is not lost is "running".
  static bool AllRanksRunning(const JobStatus& job) {
    for (const WorkerPlacement& w : job.workers()) {
      if (w.state() != "lost" && w.state() != "running") return false;
    }
    return job.workers_size() > 0;
  }

  Session* const s_;
  JobStatus last_;
  bool done_ = false;
  bool have_state_ = false;
  JobState state_ = JOB_STATE_UNSPECIFIED;
  std::string message_;
  bool bar_shown_ = false;
  double last_rate_ = 0;  // Last positive samples/s of all ranks seen.
  absl::Time last_plain_ = absl::InfinitePast();
};

// Errors after which the stream is worth opening again (the coordinator restarted, the
// connection broke); anything else is the coordinator's answer.
bool Reconnectable(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:  // Ended without a final state (coordinator shutting down).
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
      return true;
    default:
      return false;
  }
}

int WatchUntilDone(Session& s, const std::string& job_id) {
  WatchPrinter printer(&s);
  absl::Duration backoff = s.options.reconnect_initial_backoff;
  bool connected = false;  // Some message arrived (on any attempt).
  bool outage = false;     // A note about a broken stream was printed.
  const absl::Time first_attempt_until = absl::Now() + absl::Seconds(10);
  while (true) {
    bool got = false;
    const absl::Status st = s.client->WatchJob(job_id, [&](const JobStatus& job) {
      if (outage) {
        printer.Note(absl::StrCat("note: reconnected to the coordinator at ", s.coordinator));
        outage = false;
      }
      got = true;
      printer.OnUpdate(job);
    });
    if (printer.done()) return printer.last().state() == SUCCEEDED ? kExitOk : kExitFailed;
    if (got) {
      connected = true;
      backoff = s.options.reconnect_initial_backoff;
    }
    if (!Reconnectable(st.code())) return CoordinatorError(s, st);
    if (!connected && st.code() == absl::StatusCode::kUnavailable &&
        absl::Now() < first_attempt_until) {
      // Not reached yet: a coordinator that is (re)starting gets a short grace.
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, s.options.reconnect_max_backoff);
      continue;
    }
    if (!connected) {
      if (st.ok()) {
        return Failure(
            s, absl::InternalError(absl::StrCat("the coordinator ended the watch of job ", job_id,
                                                " without sending its status")));
      }
      return CoordinatorError(s, st);
    }
    if (!outage) {
      printer.Note(absl::StrCat("note: lost the watch stream of job ", job_id, " (",
                                st.ok()
                                    ? std::string("ended early")
                                    : absl::StrCat(StatusCodeName(st.code()), ": ", st.message()),
                                "); reconnecting to ", s.coordinator, " until the job ends"));
      outage = true;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, s.options.reconnect_max_backoff);
  }
}

// --- commands --------------------------------------------------------------------------------

int RunSubmit(Session& s) {
  const std::string& path = s.arg(0);
  const bool dry_run = s.args.Bool("dry-run");
  const bool resume = s.args.Bool("resume");
  const bool watch = s.args.Bool("watch");
  if (dry_run && watch)
    return UsageError(s, "--watch cannot be used with --dry-run", "gradmesh submit");
  if (dry_run && resume)
    return UsageError(s, "--resume cannot be used with --dry-run", "gradmesh submit");
  absl::StatusOr<JobSpec> spec = LoadJobSpecFile(path);
  if (!spec.ok()) {
    s.err() << "error: " << spec.status().message() << "\n";
    return kExitUsage;
  }
  // Catch bad values here (exit 2, nothing sent); the coordinator applies the defaults for
  // real, with its own number of servers.
  JobSpec checked = *spec;
  ApplyJobSpecDefaults(/*num_servers=*/0, &checked);
  absl::Status st = ValidateJobSpec(checked);
  if (st.ok()) st = ValidatePushCodec(checked.compression().push());
  if (!st.ok()) {
    s.err() << "error: " << path << ": " << st.message() << "\n";
    return kExitUsage;
  }
  absl::StatusOr<JobStatus> job = s.client->SubmitJob(*spec, dry_run, resume);
  if (!job.ok()) return CoordinatorError(s, job.status());
  if (dry_run) {
    s.out() << "dry run: job " << job->job_id() << " would be accepted (nothing was started)\n";
  } else {
    s.out() << "job " << job->job_id() << (resume ? " resumed" : " submitted") << " ("
            << StateName(job->state()) << ")\n";
  }
  s.out() << FormatPlacement(*job);
  s.out().flush();
  if (!watch) return kExitOk;
  return WatchUntilDone(s, job->job_id());
}

int RunList(Session& s) {
  absl::StatusOr<std::vector<JobStatus>> jobs = s.client->ListJobs();
  if (!jobs.ok()) return CoordinatorError(s, jobs.status());
  s.out() << FormatJobTable(*jobs, s.options.now());
  return kExitOk;
}

int RunStatus(Session& s) {
  absl::StatusOr<JobStatus> job = s.client->GetJob(s.arg(0));
  if (!job.ok()) return CoordinatorError(s, job.status());
  if (s.args.Bool("json")) {
    JobStatus shown = *job;
    shown.clear_job_token();  // A credential: not for logs and scripts' output.
    google::protobuf::util::JsonPrintOptions options;
    options.add_whitespace = true;
    options.always_print_primitive_fields = true;
    std::string json;
    if (auto st = google::protobuf::util::MessageToJsonString(shown, &json, options); !st.ok()) {
      return Failure(s, absl::InternalError(absl::StrCat("JobStatus to JSON: ", st.ToString())));
    }
    s.out() << json;
    if (json.empty() || json.back() != '\n') s.out() << "\n";
    return kExitOk;
  }
  s.out() << FormatJobStatus(*job, s.options.now());
  return kExitOk;
}

int RunWatch(Session& s) { return WatchUntilDone(s, s.arg(0)); }

int RunCancel(Session& s) {
  absl::StatusOr<JobStatus> job = s.client->CancelJob(s.arg(0));
  if (!job.ok()) return CoordinatorError(s, job.status());
  s.out() << "job " << job->job_id() << " " << StateName(job->state())
          << (job->message().empty() ? "" : ": ") << job->message() << "\n";
  return kExitOk;
}

// Prints lines as "[rank R] TEXT" (every rank) or "TEXT" (one rank); returns the last
// sequence printed (`after` if none).
int64_t PrintLogLines(Session& s, const GetLogsResponse& logs, bool all_ranks, int64_t after) {
  for (const LogLine& l : logs.lines()) {
    if (all_ranks) s.out() << "[rank " << l.rank() << "] ";
    s.out() << l.text() << "\n";
    after = l.sequence();
  }
  s.out().flush();
  return after;
}

int RunLogs(Session& s) {
  const std::string& job_id = s.arg(0);
  int rank = -1;
  if (const std::string r = s.args.Get("rank"); !r.empty()) {
    if (!absl::SimpleAtoi(r, &rank) || rank < 0) {
      return UsageError(s,
                        absl::StrCat("--rank must be a rank number (0, 1, ...), not \"", r, "\""),
                        "gradmesh logs");
    }
  }
  const bool follow = s.args.Bool("follow");
  int64_t after = 0;
  bool connected = false;   // An answer came: following, a lost coordinator is waited for.
  bool outage = false;      // The note about it was printed.
  int64_t incarnation = 0;  // The coordinator process that numbered the lines printed.
  absl::Duration backoff = s.options.reconnect_initial_backoff;
  while (true) {
    absl::StatusOr<GetLogsResponse> logs = s.client->GetLogs(job_id, rank, after);
    if (!logs.ok()) {
      if (!follow || !connected || !Reconnectable(logs.status().code())) {
        return CoordinatorError(s, logs.status());
      }
      if (!outage) {
        s.err() << "note: lost the coordinator at " << s.coordinator << " ("
                << StatusCodeName(logs.status().code()) << ": " << logs.status().message()
                << "); reconnecting until the job ends\n";
        outage = true;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, s.options.reconnect_max_backoff);
      continue;
    }
    connected = true;
    backoff = s.options.reconnect_initial_backoff;
    if (outage) {
      s.err() << "note: reconnected to the coordinator at " << s.coordinator << "\n";
      outage = false;
    }
    // A restarted coordinator numbers its lines from 1 again: start over.
    const bool restarted =
        (logs->has_incarnation() && incarnation != 0 && logs->incarnation() != incarnation) ||
        (logs->has_last_sequence() && logs->last_sequence() < after);
    if (logs->has_incarnation()) incarnation = logs->incarnation();
    if (restarted) {
      after = 0;
      continue;
    }
    after = PrintLogLines(s, *logs, rank < 0, after);
    // A full answer may have more behind it: ask again at once.
    if (logs->lines_size() >= 2000) continue;
    if (!follow || IsFinalState(logs->state())) return kExitOk;
    absl::SleepFor(s.options.logs_poll_interval);
  }
}

constexpr char kTorchScriptModel[] = "torchscript";

// What `export` writes and where the values came from.
struct ExportSource {
  std::vector<ExportedTensor> tensors;
  std::string from;  // "from 2 shards", "published by rank 0 at step 120 (final)".
};

// A ps job's tensors from its shards (the job token authorises the pulls).
absl::StatusOr<ExportSource> TensorsFromShards(Session& s, const JobStatus& job) {
  const std::string& job_id = job.job_id();
  std::vector<ShardPlacement> shards(job.shards().begin(), job.shards().end());
  std::sort(shards.begin(), shards.end(),
            [](const ShardPlacement& a, const ShardPlacement& b) { return a.shard() < b.shard(); });
  ShardExportOptions options;
  options.job = job_id;
  options.job_token = job.job_token();
  options.rpc = s.rpc;
  options.deadline = s.options.rpc_deadline;
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].shard() != static_cast<int32_t>(i) || shards[i].address().empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " (", StateName(job.state()), ") has no address for shard ",
                       i, " of ", shards.size()));
    }
    options.shards.push_back(shards[i].address());
  }
  if (options.shards.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " (", StateName(job.state()), ") has no shards placed yet"));
  }
  absl::StatusOr<std::vector<ExportedTensor>> tensors = FetchJobTensors(options);
  if (!tensors.ok()) return Annotate(tensors.status(), absl::StrCat("export of job ", job_id));
  ExportSource src;
  src.tensors = *std::move(tensors);
  src.from = absl::StrCat("from ", options.shards.size(),
                          options.shards.size() == 1 ? " shard" : " shards");
  return src;
}

// The tensors of a model rank 0 published (header + float32 little-endian payload).
absl::StatusOr<ExportSource> TensorsFromPublished(const CoordinatorClient::PublishedModel& model) {
  static_assert(sizeof(float) == 4, "float32 payload");
  ExportSource src;
  size_t offset = 0;
  for (const ModelTensorInfo& info : model.header.tensors()) {
    ExportedTensor t;
    t.name = info.name();
    t.shape.assign(info.shape().begin(), info.shape().end());
    t.dtype = info.dtype() == DTYPE_UNSPECIFIED ? FLOAT32 : info.dtype();
    t.buffer = info.buffer();
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
    if (numel < 0 || offset + bytes > model.payload.size()) {
      return absl::DataLossError(absl::StrCat("the published model of job ", model.header.job_id(),
                                              " is too short for tensor ", t.name));
    }
    t.values.resize(static_cast<size_t>(numel));
    if (bytes > 0) std::memcpy(t.values.data(), model.payload.data() + offset, bytes);
    offset += bytes;
    src.tensors.push_back(std::move(t));
  }
  if (offset != model.payload.size()) {
    return absl::DataLossError(absl::StrCat("the published model of job ", model.header.job_id(),
                                            " has ", model.payload.size() - offset,
                                            " bytes beyond its tensors"));
  }
  src.from = absl::StrCat("published by rank 0 at step ", model.header.step(),
                          model.header.final() ? " (final)" : "");
  return src;
}

// Adds each alias of `tied` as a copy of its first name's tensor, right after it.
void AddTiedNames(const std::vector<TiedName>& tied, std::vector<ExportedTensor>* tensors) {
  for (const TiedName& t : tied) {
    auto first = std::find_if(tensors->begin(), tensors->end(),
                              [&](const ExportedTensor& e) { return e.name == t.first; });
    auto taken = std::find_if(tensors->begin(), tensors->end(),
                              [&](const ExportedTensor& e) { return e.name == t.alias; });
    if (first == tensors->end() || taken != tensors->end()) continue;
    ExportedTensor copy = *first;
    copy.name = t.alias;
    tensors->insert(first + 1, std::move(copy));
  }
}

// Appends the tensors of `more` whose names `tensors` lacks.
void AddMissing(std::vector<ExportedTensor> more, std::vector<ExportedTensor>* tensors) {
  for (ExportedTensor& t : more) {
    const bool present = std::any_of(tensors->begin(), tensors->end(),
                                     [&](const ExportedTensor& e) { return e.name == t.name; });
    if (!present) tensors->push_back(std::move(t));
  }
}

int RunExport(Session& s) {
  const std::string& job_id = s.arg(0);
  const std::string out_path = s.args.Get("out");
  if (out_path.empty()) {
    return UsageError(s, "export needs --out=FILE (where to write the state_dict)",
                      "gradmesh export");
  }
  const std::string format = s.args.Get("format", "state_dict");
  if (format != "state_dict" && format != "torchscript") {
    return UsageError(
        s, absl::StrCat("--format must be state_dict or torchscript, got \"", format, "\""),
        "gradmesh export");
  }
  absl::StatusOr<JobStatus> job = s.client->GetJob(job_id);
  if (!job.ok()) return CoordinatorError(s, job.status());
  const JobSpec& spec = job->spec();
  if (format == "torchscript" && spec.model().name() != kTorchScriptModel) {
    return Failure(s, absl::InvalidArgumentError(absl::StrCat(
                          "--format torchscript needs a job whose model is a TorchScript module "
                          "(job ",
                          job_id, "'s model is \"", spec.model().name(), "\")")));
  }
  absl::StatusOr<ExportSource> src;
  if (IsPsMode(spec.mode())) {
    src = TensorsFromShards(s, *job);
  } else {
    absl::StatusOr<CoordinatorClient::PublishedModel> model =
        s.client->GetModel(job_id, MODEL_STATE);
    if (!model.ok()) return CoordinatorError(s, model.status());
    src = TensorsFromPublished(*model);
  }
  if (!src.ok()) return Failure(s, src.status());
  if (!IsFinalState(job->state())) {
    s.err() << "note: job " << job_id << " is " << StateName(job->state())
            << ": exporting its current parameters (export after it ends for the final model)\n";
  }
  if (format == "torchscript") {
    absl::StatusOr<CoordinatorClient::PublishedModel> module =
        s.client->GetModel(job_id, MODEL_MODULE);
    if (!module.ok()) return CoordinatorError(s, module.status());
    absl::StatusOr<TorchScriptExportResult> r =
        SaveTorchScriptWithWeights(module->payload, src->tensors, out_path);
    if (!r.ok()) return Failure(s, Annotate(r.status(), absl::StrCat("export of job ", job_id)));
    if (r->frozen_kept > 0) {
      s.err() << "note: " << r->frozen_kept
              << " frozen parameters (requires_grad off) keep the module's values\n";
    }
    if (!r->unused.empty()) {
      s.err() << "note: the module has no parameter or buffer for " << r->unused.size()
              << " exported tensors (not written): " << absl::StrJoin(r->unused, ", ") << "\n";
    }
  } else {
    if (spec.model().name() == kTorchScriptModel) {
      // Tied weights are trained once, under their first name; PyTorch's state_dict() has
      // every name, and load_state_dict(strict=True) wants them all.
      absl::StatusOr<CoordinatorClient::PublishedModel> module =
          s.client->GetModel(job_id, MODEL_MODULE);
      absl::StatusOr<std::vector<TiedName>> tied =
          module.ok() ? TiedTensorNames(module->payload) : module.status();
      if (tied.ok()) {
        AddTiedNames(*tied, &src->tensors);
      } else {
        s.err() << "note: tied weights are written under their first name only (the job's "
                   "module: "
                << tied.status().message() << ")\n";
      }
      // Frozen parameters were not trained: the module's values, under their names.
      absl::StatusOr<std::vector<ExportedTensor>> frozen =
          module.ok() ? FrozenTensors(module->payload) : module.status();
      if (!frozen.ok()) return Failure(s, Annotate(frozen.status(), "export of job " + job_id));
      AddMissing(*std::move(frozen), &src->tensors);
    }
    if (absl::Status st = SaveStateDict(out_path, src->tensors); !st.ok()) return Failure(s, st);
  }
  int64_t params = 0;
  for (const ExportedTensor& t : src->tensors) params += static_cast<int64_t>(t.values.size());
  s.out() << "exported job " << job_id << " (" << src->tensors.size() << " tensors, " << params
          << " parameters, step " << job->progress().step() << "/" << job->progress().total_steps()
          << ") " << src->from << " to " << out_path
          << (format == "torchscript" ? " as a TorchScript module" : "") << "\n";
  return kExitOk;
}

std::vector<Command> Commands() {
  return {
      {"submit",
       "JOB_SPEC",
       1,
       1,
       "Submit a job described by a YAML or JSON spec file",
       "Submits the job in JOB_SPEC (YAML or JSON, protobuf JSON field names; see JobSpec in\n"
       "proto/gradmesh.proto). The spec is checked here first: unknown fields and bad values\n"
       "fail with exit code 2 before anything is sent. Prints the job id and where its shards\n"
       "and workers were placed.\n"
       "\n"
       "Examples:\n"
       "  gradmesh submit deploy/jobs/mnist_mlp.yaml\n"
       "  gradmesh submit job.yaml --dry-run     # check and place on paper only\n"
       "  gradmesh submit job.yaml --watch       # then follow it until it ends\n"
       "  gradmesh submit job.yaml --resume      # restart a stopped job from its checkpoint\n",
       {{"dry-run", false, "", "check the spec and show the placement; change nothing"},
        {"resume", false, "", "restart an existing stopped job from its last checkpoint"},
        {"watch", false, "", "watch the job after submitting it (exit code as `watch`)"}},
       &RunSubmit},
      {"list",
       "",
       0,
       0,
       "List jobs, newest first",
       "Prints one row per job: JOB, STATE, MODE, WORKERS, STEP/TOTAL, LOSS, ACC, AGE.\n"
       "\n"
       "Examples:\n"
       "  gradmesh list\n"
       "  gradmesh --coordinator=10.0.0.5:7000 list\n",
       {},
       &RunList},
      {"status",
       "JOB",
       1,
       1,
       "Show a job's state, progress and placement",
       "Prints the job's state and message, a summary of its spec, its progress and where its\n"
       "shards and workers run. With --json, the JobStatus in protobuf's JSON mapping (for\n"
       "scripts; the job token is left out).\n"
       "\n"
       "Examples:\n"
       "  gradmesh status mnist-mlp\n"
       "  gradmesh status mnist-mlp --json | jq .progress.step\n",
       {{"json", false, "", "print the JobStatus as JSON"}},
       &RunStatus},
      {"watch",
       "JOB",
       1,
       1,
       "Follow a job's progress until it ends",
       "Streams the job's status. On a terminal a progress line is redrawn in place; otherwise\n"
       "one plain line per update (at most about one a second) and every state change. If the\n"
       "connection breaks (e.g. the coordinator restarts) it reconnects until the job ends.\n"
       "Exits 0 when the job SUCCEEDED, 1 when it FAILED or was CANCELLED.\n"
       "\n"
       "Examples:\n"
       "  gradmesh watch mnist-mlp\n"
       "  gradmesh watch mnist-mlp > progress.log && echo trained\n",
       {},
       &RunWatch},
      {"cancel",
       "JOB",
       1,
       1,
       "Cancel a job",
       "Stops the job's workers and marks it CANCELLED (it can be restarted with\n"
       "`submit --resume`).\n"
       "\n"
       "Examples:\n"
       "  gradmesh cancel mnist-mlp\n",
       {},
       &RunCancel},
      {"logs",
       "JOB",
       1,
       1,
       "Show the last log lines of a job's workers",
       "Prints the last log lines (the Logger events: task_start, progress, evaluated,\n"
       "task_end, ...) of the job's ranks, as the coordinator received them with the workers'\n"
       "heartbeats: up to 200 lines / 64 KiB per rank, kept in the coordinator's memory (a\n"
       "restarted coordinator has only the lines since). Lines of every rank are prefixed\n"
       "with [rank R]; --rank shows one rank's lines only. --follow keeps printing new lines\n"
       "(polling every second) until the job ends.\n"
       "\n"
       "Examples:\n"
       "  gradmesh logs mnist-mlp\n"
       "  gradmesh logs mnist-mlp --rank 1 --follow\n",
       {{"rank", true, "R", "only rank R's lines"},
        {"follow", false, "", "keep printing new lines until the job ends"}},
       &RunLogs},
      {"export",
       "JOB",
       1,
       1,
       "Save a job's model as a PyTorch state_dict or TorchScript module",
       "Writes the job's model to --out. Parameter-server jobs (async, ssp, sync) are read from\n"
       "their shards; gossip and allreduce jobs from the model their rank 0 last published to\n"
       "the coordinator (at checkpoints, every 60 s and at the end). A running job exports its\n"
       "current model.\n"
       "\n"
       "--format state_dict (default): a state_dict (tensor name -> tensor, parameters and\n"
       "buffers in their dtypes) that Python loads with torch.load(FILE).\n"
       "--format torchscript: for jobs whose model is a TorchScript module (model.name\n"
       "\"torchscript\"): that module with the trained weights, for torch.jit.load(FILE).\n"
       "\n"
       "Examples:\n"
       "  gradmesh export mnist-mlp --out model.pt\n"
       "  python3 -c 'import torch; print(torch.load(\"model.pt\").keys())'\n"
       "  gradmesh export my-ts-job --out trained.pt --format torchscript\n",
       {{"out", true, "FILE", "where to write the model (required)"},
        {"format", true, "state_dict|torchscript",
         "state_dict (default) or torchscript (TorchScript jobs: the module with the weights)"}},
       &RunExport},
  };
}

std::string MainHelp(const std::vector<Command>& commands) {
  std::string out =
      "gradmesh: submit and manage training jobs on a gradmesh coordinator.\n"
      "\n"
      "Usage: gradmesh [--coordinator=HOST:PORT] [--auth_token_file=FILE] <command> [flags] "
      "[args]\n"
      "\n"
      "Commands:\n";
  std::vector<std::vector<std::string>> rows;
  for (const Command& c : commands) rows.push_back({"  " + c.name, c.summary});
  absl::StrAppend(&out, FormatTable(rows), "\nGlobal flags:\n", FlagHelp(GlobalFlags()),
                  "\n"
                  "Exit codes: 0 success; 1 the coordinator refused or the job failed; 2 usage "
                  "error;\n"
                  "3 the coordinator cannot be reached.\n"
                  "\n"
                  "Examples:\n"
                  "  gradmesh submit deploy/jobs/mnist_mlp.yaml --watch\n"
                  "  gradmesh list\n"
                  "  gradmesh status mnist-mlp\n"
                  "  gradmesh export mnist-mlp --out model.pt\n"
                  "  gradmesh export my-ts-job --out trained.pt --format torchscript\n"
                  "\n"
                  "Run 'gradmesh <command> --help' for a command's flags and examples.\n");
  return out;
}

std::string CommandHelp(const Command& c) {
  std::string out = absl::StrCat("gradmesh ", c.name, ": ", c.summary, "\n\nUsage: gradmesh ",
                                 c.name, c.flags.empty() ? "" : " [flags]",
                                 c.usage_args.empty() ? "" : " ", c.usage_args, "\n\n", c.details);
  if (!c.flags.empty()) absl::StrAppend(&out, "\nFlags:\n", FlagHelp(c.flags));
  absl::StrAppend(&out, "\nGlobal flags:\n", FlagHelp(GlobalFlags()));
  return out;
}

std::string CommandNames(const std::vector<Command>& commands) {
  std::vector<std::string> names;
  for (const Command& c : commands) names.push_back(c.name);
  return absl::StrJoin(names, ", ");
}

std::string EnvOr(const CliOptions& o, const char* name, const std::string& def) {
  auto it = o.env.find(name);
  return it == o.env.end() || it->second.empty() ? def : it->second;
}

}  // namespace

int RunCli(const std::vector<std::string>& args, const CliOptions& options, const CliIo& io) {
  Session s{options, io};
  const std::vector<Command> commands = Commands();
  const std::vector<FlagSpec> globals = GlobalFlags();
  absl::StatusOr<ParsedArgs> head = ParseArgs(args, globals, /*stop_at_positional=*/true);
  if (!head.ok()) return UsageError(s, std::string(head.status().message()), "gradmesh");
  if (head->Bool("help")) {
    s.out() << MainHelp(commands);
    return kExitOk;
  }
  if (head->rest.empty()) {
    s.err() << "error: no command given\n\n" << MainHelp(commands);
    return kExitUsage;
  }
  const std::string& name = head->rest[0];
  auto cmd = std::find_if(commands.begin(), commands.end(),
                          [&](const Command& c) { return c.name == name; });
  if (cmd == commands.end()) {
    return UsageError(
        s, absl::StrCat("unknown command \"", name, "\" (commands: ", CommandNames(commands), ")"),
        "gradmesh");
  }
  s.command = &*cmd;
  const std::string help_for = absl::StrCat("gradmesh ", cmd->name);
  std::vector<FlagSpec> specs = globals;
  specs.insert(specs.end(), cmd->flags.begin(), cmd->flags.end());
  absl::StatusOr<ParsedArgs> parsed =
      ParseArgs(std::vector<std::string>(head->rest.begin() + 1, head->rest.end()), specs);
  if (!parsed.ok()) return UsageError(s, std::string(parsed.status().message()), help_for);
  s.args = std::move(parsed).value();
  // Global flags may come before or after the command; the later one wins.
  for (const auto& [flag, value] : head->flags) s.args.flags.emplace(flag, value);
  if (s.args.Bool("help")) {
    s.out() << CommandHelp(*cmd);
    return kExitOk;
  }
  const size_t n = s.args.positional.size();
  if (n < cmd->min_args) {
    return UsageError(s, absl::StrCat(cmd->name, " needs ", cmd->usage_args), help_for);
  }
  if (n > cmd->max_args) {
    return UsageError(s,
                      absl::StrCat("too many arguments for ", cmd->name, ": ",
                                   absl::StrJoin(s.args.positional.begin() +
                                                     static_cast<std::ptrdiff_t>(cmd->max_args),
                                                 s.args.positional.end(), " ")),
                      help_for);
  }
  // A job name follows the name rule (common/job_name.h) before any call is made.
  if (cmd->usage_args == "JOB" && n >= 1) {
    if (absl::Status st = CheckName("JOB", s.arg(0)); !st.ok()) {
      return UsageError(s, std::string(st.message()), help_for);
    }
  }

  s.coordinator = s.args.Get("coordinator", EnvOr(options, kCoordinatorEnv, kDefaultCoordinator));
  if (s.coordinator.empty()) return UsageError(s, "--coordinator is empty", help_for);
  // gRPC would take port 99999 as 99999 mod 65536 and report a failure to another port.
  if (const size_t colon = s.coordinator.rfind(':'); colon != std::string::npos) {
    const std::string port = s.coordinator.substr(colon + 1);
    int64_t value = 0;
    if (!port.empty() && absl::SimpleAtoi(port, &value) && (value < 1 || value > 65535)) {
      return UsageError(
          s, absl::StrCat("--coordinator ", s.coordinator, ": port ", port, " is not in 1..65535"),
          help_for);
    }
  }
  CoordinatorClientOptions client;
  client.address = s.coordinator;
  client.deadline = options.rpc_deadline;
  const std::string token_file = s.args.Get("auth_token_file", EnvOr(options, kTokenFileEnv, ""));
  if (!token_file.empty()) {
    absl::StatusOr<std::string> token = ReadTokenFile(token_file);
    if (!token.ok()) {
      s.err() << "error: " << token.status().message() << "\n";
      return kExitUsage;
    }
    client.auth_token = *std::move(token);
  }
  absl::StatusOr<TlsOptions> tls = MakeTlsOptions(
      s.args.Get("tls_cert_file"), s.args.Get("tls_key_file"), s.args.Get("tls_ca_file"),
      /*client_auth=*/false, s.args.Bool("allow_insecure"));
  if (!tls.ok()) return UsageError(s, std::string(tls.status().message()), help_for);
  if (absl::Status st = CheckTokenTransport(s.coordinator, *tls, client.auth_token, "API token");
      !st.ok()) {
    s.err() << "error: " << st.ToString() << "\n";
    return kExitUsage;
  }
  client.rpc.tls = *tls;
  s.rpc = client.rpc;
  s.client = NewGrpcCoordinatorClient(std::move(client));
  return cmd->run(s);
}

}  // namespace cli
}  // namespace gradmesh
