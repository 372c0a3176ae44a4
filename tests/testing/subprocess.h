// Test helpers for running the gradmesh daemons as real processes.
//
//   ASSERT_OK_AND_ASSIGN(std::string server, RunfilePath("server/gradmesh_server"));
//   ASSERT_OK_AND_ASSIGN(auto proc, Subprocess::Start({server, "--port=0", "--port_file=" + pf},
//                                                     {{"OMP_NUM_THREADS", "1"}}, log_path));
//   ASSERT_OK_AND_ASSIGN(int port, WaitForPortFile(pf, absl::Seconds(30), proc.get()));
//   ...
//   ASSERT_OK(proc->Signal(SIGTERM));
//   ASSERT_OK_AND_ASSIGN(int code, proc->Wait(absl::Seconds(20)));  // 0, or -SIGNUM.
//
// Children are started with fork/exec. Each child gets PR_SET_PDEATHSIG=SIGKILL, so it dies
// with the thread that started it (call Start() from the test's main thread), and it stays in
// the test's process group, so Bazel's timeout handling kills it too. A Subprocess that is
// destroyed while its child still runs SIGKILLs and reaps it.
//
// Thread safety: a Subprocess is not thread-safe; use it from one thread. The free functions
// are thread-safe.
#ifndef GRADMESH_TESTS_TESTING_SUBPROCESS_H_
#define GRADMESH_TESTS_TESTING_SUBPROCESS_H_

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/test_dirs.h"  // TestTmpDir, MakeTestDir, MakeUniqueTestDir: for its users.

namespace gradmesh {
namespace testutil {

class Subprocess {
 public:
  // Starts argv[0] (a path, or a name looked up in PATH) with arguments argv[1..]. The child's
  // environment is the test's plus `env` (which overrides variables of the same name). Its
  // stdout and stderr both go to `log_path` (created or truncated); an empty `log_path`
  // leaves them as the test's. Its stdin is /dev/null.
  // InvalidArgument for an empty argv; NotFound if the program cannot be found or executed
  // (the message names it and the errno); Internal for other failures.
  static absl::StatusOr<std::unique_ptr<Subprocess>> Start(
      const std::vector<std::string>& argv,
      const std::vector<std::pair<std::string, std::string>>& env = {},
      const std::string& log_path = "");

  // SIGKILLs the child if it is still running, then reaps it.
  ~Subprocess();

  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& log_path() const { return log_path_; }
  // The program as started (argv[0]); for messages.
  const std::string& name() const { return name_; }

  // Sends `sig` (e.g. SIGTERM, SIGKILL) to the child. FailedPrecondition if the child has
  // already been reaped (a signal would then hit an unrelated process).
  absl::Status Signal(int sig);

  // Waits up to `timeout` for the child to end. Returns its exit code (>= 0) if it exited, or
  // -N if signal N killed it (-9 for SIGKILL). DeadlineExceeded if it is still running at the
  // deadline (it is left running). Once the child has ended, every call returns the same.
  absl::StatusOr<int> Wait(absl::Duration timeout);

  // True until the child has ended (reaps it if it has).
  bool Running();

 private:
  Subprocess(pid_t pid, std::string name, std::string log_path)
      : pid_(pid), name_(std::move(name)), log_path_(std::move(log_path)) {}
  // Non-blocking reap; true if the child has ended (and result_ is set).
  bool TryReap();

  const pid_t pid_;
  const std::string name_;
  const std::string log_path_;
  std::optional<int> result_;  // Set once reaped: exit code or -signal.
};

// Waits until `path` holds a port number (as written by the daemons' --port_file, atomically)
// and returns it. DeadlineExceeded after `timeout`. If `process` is given and ends before the
// file appears, FailedPrecondition naming its exit code.
absl::StatusOr<int> WaitForPortFile(const std::string& path, absl::Duration timeout,
                                    Subprocess* process = nullptr);

// Whole contents of a file; "" if it cannot be read.
std::string ReadFile(const std::string& path);

// Polls `proc`'s log every few milliseconds until `pred(log)` holds (true), or the process
// ends or `timeout` passes (false).
bool WaitForLog(Subprocess* proc, const std::function<bool(const std::string&)>& pred,
                absl::Duration timeout);

// Creates or truncates `path` and writes `contents` to it. Internal (naming the path) if it
// cannot be written.
absl::Status WriteFile(const std::string& path, absl::string_view contents);

// The raw pointers of `procs`, in order (null stays null); for functions that take a set of
// processes without owning them.
std::vector<Subprocess*> Ptrs(const std::vector<std::unique_ptr<Subprocess>>& procs);

// The value of `key` in a structured log line (common/logging.h): `... key=value ...` or
// `key="quoted value"` (with \" \\ \n unescaped). nullopt if the line has no such key. Only
// whole keys match ("step" does not match "steps=1"). The first occurrence wins.
std::optional<std::string> LogField(absl::string_view line, absl::string_view key);

// The lines of `text` (without their '\n') that contain `needle`, in order.
std::vector<std::string> LinesWith(absl::string_view text, absl::string_view needle);

// The last `n` lines of `text`, for failure messages.
std::string LastLines(absl::string_view text, int n);

// Absolute path of a file in the test's runfiles, given relative to the workspace root
// ("server/gradmesh_server"): $TEST_SRCDIR/$TEST_WORKSPACE/<path> (TEST_WORKSPACE defaults
// to "gradmesh"). NotFound if TEST_SRCDIR is unset or the file does not exist.
absl::StatusOr<std::string> RunfilePath(const std::string& workspace_relative_path);

}  // namespace testutil
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_TESTING_SUBPROCESS_H_
