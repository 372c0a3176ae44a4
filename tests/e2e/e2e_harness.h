// Shared harness for the end-to-end tests that run gradmesh_server shards and gradmesh_worker
// processes as real subprocesses on 127.0.0.1 (consistency_test, recovery_test).
//
// E2eHarness is a gtest fixture: it finds both binaries in the runfiles, makes a per-test
// directory under $TEST_TMPDIR, starts shards (on a given or a free port, optionally with a
// --data_dir), workers, restarts, and on failure prints the tail of every child's log.
// Every child runs with OPENBLAS_NUM_THREADS=1 and OMP_NUM_THREADS=1 (four processes share
// the cores). MNIST comes from $GRADMESH_DATA_DIR/mnist.
#ifndef GRADMESH_TESTS_E2E_E2E_HARNESS_H_
#define GRADMESH_TESTS_E2E_E2E_HARNESS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.pb.h"
#include "tests/testing/subprocess.h"

namespace gradmesh {
namespace e2e {

using testutil::Subprocess;

// OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1.
const std::vector<std::pair<std::string, std::string>>& ChildEnv();

// $GRADMESH_DATA_DIR, or /var/lib/gradmesh/data.
std::string DataDir();

// True if the four MNIST IDX files (plain or gzipped) are under DataDir()/mnist.
bool HaveMnist();

// Parses a LogField value; -1 if absent or not a number.
int64_t ToInt(const std::optional<std::string>& s);
double ToDouble(const std::optional<std::string>& s);

// GetJobInfo over a raw gRPC stub (10 s deadline).
absl::StatusOr<JobInfoResponse> GetJobInfo(const std::string& address, const std::string& job);

// A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close).
absl::StatusOr<int> PickFreePort();

// The `step=` of the last event=progress line of a worker log; -1 if there is none.
int64_t LastProgressStep(absl::string_view log);

// The single event=done line of a worker log ("" if there is not exactly one).
std::string DoneLine(absl::string_view log);

class E2eHarness : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;

  // A fresh log path <dir>/<name>.log, remembered for failure output.
  std::string NewLog(const std::string& name);

  // Starts one shard named `name` on 127.0.0.1:`port` (0 = any free port) with --data_dir
  // `data_dir` ("" = memory only) and waits until it listens. Sets *address.
  absl::StatusOr<std::unique_ptr<Subprocess>> StartServer(const std::string& name, int port,
                                                          const std::string& data_dir,
                                                          std::string* address);

  // Starts `n` memory-only shards on free ports; fills servers_ and addresses_.
  void StartServers(int n);

  // SIGTERMs every shard in servers_; each must exit 0.
  void StopServers();

  // Starts gradmesh_worker with `args` (nullptr on failure, which is also a test failure).
  std::unique_ptr<Subprocess> StartWorker(const std::string& name, std::vector<std::string> args);

  // Waits for every process to end, at most `timeout`; stops waiting early as soon as one
  // exits with a non-zero code. Returns exit codes in order (-1000: still running).
  std::vector<int> WaitAll(const std::vector<Subprocess*>& procs, absl::Duration timeout);

  // Polls `proc`'s log every few milliseconds until `pred(log)` holds (true), or the process
  // ends or `timeout` passes (false).
  bool WaitForLog(Subprocess* proc, const std::function<bool(const std::string&)>& pred,
                  absl::Duration timeout);

  std::string ServersFlag() const;

  // Writes `yaml` to <dir>/<name>.yaml (a job spec) and returns the path.
  std::string WriteYaml(const std::string& name, const std::string& yaml);

  std::string server_bin_, worker_bin_, dir_;
  std::vector<std::string> logs_;
  std::vector<std::unique_ptr<Subprocess>> servers_;
  std::vector<std::string> addresses_;

 private:
  int port_files_ = 0;
};

}  // namespace e2e
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_E2E_E2E_HARNESS_H_
