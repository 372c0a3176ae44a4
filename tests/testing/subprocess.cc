#include "tests/testing/subprocess.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

extern char** environ;

namespace gradmesh {
namespace testutil {
namespace {

std::string ErrnoText(int err) { return absl::StrCat(std::strerror(err), " (errno ", err, ")"); }

// argv[0] if it names a path, else the first executable PATH entry of that name.
std::string ResolveProgram(const std::string& program) {
  if (program.find('/') != std::string::npos) return program;
  const char* path = std::getenv("PATH");
  for (absl::string_view dir :
       absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", program);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return program;  // execve fails with ENOENT; reported by Start().
}

void CloseIfOpen(int fd) {
  if (fd >= 0) close(fd);
}

// Decodes a waitpid() status: exit code, or -signal.
int DecodeWaitStatus(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return -1000;  // Not reached with the flags used here (no WUNTRACED/WCONTINUED).
}

}  // namespace

absl::StatusOr<std::unique_ptr<Subprocess>> Subprocess::Start(
    const std::vector<std::string>& argv,
    const std::vector<std::pair<std::string, std::string>>& env, const std::string& log_path) {
  if (argv.empty() || argv[0].empty()) {
    return absl::InvalidArgumentError("Subprocess::Start: argv is empty");
  }
  // Everything the child needs is prepared here: after fork() in a multi-threaded process the
  // child may only call async-signal-safe functions.
  const std::string program = ResolveProgram(argv[0]);
  std::vector<char*> c_argv;
  for (const std::string& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
  c_argv.push_back(nullptr);

  std::vector<std::string> env_strings;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    absl::string_view entry(*e);
    const absl::string_view key = entry.substr(0, entry.find('='));
    const bool overridden =
        std::any_of(env.begin(), env.end(), [&](const auto& kv) { return kv.first == key; });
    if (!overridden) env_strings.emplace_back(entry);
  }
  for (const auto& kv : env) env_strings.push_back(absl::StrCat(kv.first, "=", kv.second));
  std::vector<char*> c_env;
  for (const std::string& e : env_strings) c_env.push_back(const_cast<char*>(e.c_str()));
  c_env.push_back(nullptr);

  int log_fd = -1;
  if (!log_path.empty()) {
    log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::InternalError(absl::StrCat("Subprocess::Start: cannot open log file ", log_path,
                                              ": ", ErrnoText(errno)));
    }
  }
  const int null_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) {
    const int err = errno;
    CloseIfOpen(log_fd);
    return absl::InternalError(
        absl::StrCat("Subprocess::Start: cannot open /dev/null: ", ErrnoText(err)));
  }
  // The child reports a failed exec through this pipe; a successful exec closes it (CLOEXEC).
  int report[2];
  if (pipe2(report, O_CLOEXEC) != 0) {
    const int err = errno;
    CloseIfOpen(log_fd);
    close(null_fd);
    return absl::InternalError(absl::StrCat("Subprocess::Start: pipe2: ", ErrnoText(err)));
  }

  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    CloseIfOpen(log_fd);
    close(null_fd);
    close(report[0]);
    close(report[1]);
    return absl::InternalError(absl::StrCat("Subprocess::Start: fork: ", ErrnoText(err)));
  }
  if (pid == 0) {
    // Child: async-signal-safe calls only.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // The parent died before prctl took effect.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    struct sigaction dfl;
    std::memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGCHLD, SIGUSR1, SIGUSR2}) {
      sigaction(sig, &dfl, nullptr);
    }
    int err = 0;
    if (dup2(null_fd, STDIN_FILENO) < 0) err = errno;
    if (err == 0 && log_fd >= 0) {
      if (dup2(log_fd, STDOUT_FILENO) < 0 || dup2(log_fd, STDERR_FILENO) < 0) err = errno;
    }
    if (err == 0) {
      execve(program.c_str(), c_argv.data(), c_env.data());
      err = errno;
    }
    ssize_t ignored = write(report[1], &err, sizeof(err));
    (void)ignored;
    _exit(127);
  }

  // Parent.
  close(report[1]);
  CloseIfOpen(log_fd);
  close(null_fd);
  int child_errno = 0;
  ssize_t n;
  do {
    n = read(report[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  close(report[0]);
  if (n > 0) {
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const std::string what =
        absl::StrCat("Subprocess::Start: cannot execute ", program, ": ", ErrnoText(child_errno));
    if (child_errno == ENOENT || child_errno == EACCES || child_errno == ENOEXEC) {
      return absl::NotFoundError(what);
    }
    return absl::InternalError(what);
  }
  return std::unique_ptr<Subprocess>(new Subprocess(pid, argv[0], log_path));
}

Subprocess::~Subprocess() {
  if (result_.has_value()) return;
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
}

bool Subprocess::TryReap() {
  if (result_.has_value()) return true;
  int status = 0;
  pid_t r;
  do {
    r = waitpid(pid_, &status, WNOHANG);
  } while (r < 0 && errno == EINTR);
  if (r == pid_) {
    result_ = DecodeWaitStatus(status);
    return true;
  }
  if (r < 0) {
    // ECHILD: reaped elsewhere (e.g. SIGCHLD set to SIG_IGN); the exit status is lost.
    result_ = -1000;
    return true;
  }
  return false;
}

bool Subprocess::Running() { return !TryReap(); }

absl::Status Subprocess::Signal(int sig) {
  if (TryReap()) {
    return absl::FailedPreconditionError(absl::StrCat("Subprocess::Signal: ", name_, " (pid ", pid_,
                                                      ") has already ended with ", *result_));
  }
  if (kill(pid_, sig) != 0) {
    return absl::InternalError(
        absl::StrCat("Subprocess::Signal: kill(", pid_, ", ", sig, "): ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  while (true) {
    if (TryReap()) {
      if (*result_ == -1000) {
        return absl::InternalError(
            absl::StrCat("Subprocess::Wait: exit status of ", name_, " (pid ", pid_, ") was lost"));
      }
      return *result_;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("Subprocess::Wait: ", name_, " (pid ", pid_,
                                                      ") still running after ",
                                                      absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(50));
  }
}

bool WaitForLog(Subprocess* proc, const std::function<bool(const std::string&)>& pred,
                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (pred(ReadFile(proc->log_path()))) return true;
    if (!proc->Running()) return pred(ReadFile(proc->log_path()));
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

absl::StatusOr<int> WaitForPortFile(const std::string& path, absl::Duration timeout,
                                    Subprocess* process) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    // The daemons write a temp file and rename it, so a present file is complete.
    const std::string text = ReadFile(path);
    int port = 0;
    if (!text.empty() && absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &port) && port > 0 &&
        port < 65536) {
      return port;
    }
    if (process != nullptr && !process->Running()) {
      absl::StatusOr<int> code = process->Wait(absl::ZeroDuration());
      return absl::FailedPreconditionError(absl::StrCat(
          process->name(), " ended (", code.ok() ? absl::StrCat(*code) : code.status().ToString(),
          ") before writing port file ", path));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("no port in ", path, " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::Status WriteFile(const std::string& path, absl::string_view contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (out) out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("WriteFile: cannot write ", path));
  return absl::OkStatus();
}

std::vector<Subprocess*> Ptrs(const std::vector<std::unique_ptr<Subprocess>>& procs) {
  std::vector<Subprocess*> out;
  out.reserve(procs.size());
  for (const auto& p : procs) out.push_back(p.get());
  return out;
}

std::optional<std::string> LogField(absl::string_view line, absl::string_view key) {
  size_t i = 0;
  const size_t n = line.size();
  while (i < n) {
    while (i < n && line[i] == ' ') ++i;
    if (i >= n) break;
    // A token: either `word` (timestamp, level) or `key=value`.
    const size_t start = i;
    while (i < n && line[i] != ' ' && line[i] != '=') ++i;
    if (i >= n || line[i] == ' ') continue;  // No '=': not a field.
    const absl::string_view k = line.substr(start, i - start);
    ++i;  // '='
    std::string value;
    if (i < n && line[i] == '"') {
      ++i;
      while (i < n && line[i] != '"') {
        if (line[i] == '\\' && i + 1 < n) {
          ++i;
          value.push_back(line[i] == 'n' ? '\n' : line[i]);
        } else {
          value.push_back(line[i]);
        }
        ++i;
      }
      if (i < n) ++i;  // Closing quote.
    } else {
      const size_t vstart = i;
      while (i < n && line[i] != ' ') ++i;
      value = std::string(line.substr(vstart, i - vstart));
    }
    if (k == key) return value;
  }
  return std::nullopt;
}

std::vector<std::string> LinesWith(absl::string_view text, absl::string_view needle) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find(needle) != absl::string_view::npos) out.emplace_back(line);
  }
  return out;
}

std::string LastLines(absl::string_view text, int n) {
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();
  const size_t first = lines.size() > static_cast<size_t>(std::max(n, 0))
                           ? lines.size() - static_cast<size_t>(std::max(n, 0))
                           : 0;
  return absl::StrJoin(lines.begin() + first, lines.end(), "\n");
}

absl::StatusOr<std::string> RunfilePath(const std::string& workspace_relative_path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  if (srcdir == nullptr || *srcdir == '\0') {
    return absl::NotFoundError("RunfilePath: TEST_SRCDIR is not set (run the test with bazel)");
  }
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string path =
      absl::StrCat(srcdir, "/", workspace != nullptr && *workspace != '\0' ? workspace : "gradmesh",
                   "/", workspace_relative_path);
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(
        absl::StrCat("RunfilePath: ", path, " does not exist (is it in the test's data?)"));
  }
  return path;
}

}  // namespace testutil
}  // namespace gradmesh
