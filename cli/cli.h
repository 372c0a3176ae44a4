// The `gradmesh` command-line client: submit, list, status, watch, cancel and export jobs of a
// gradmesh_coordinator. RunCli() is the whole program minus process plumbing, so tests run it
// in process with captured output (cli/main.cc only collects argv, the environment and
// isatty(stdout)).
//
//   gradmesh [--coordinator=HOST:PORT] [--auth_token_file=FILE] <command> [flags] [args]
//
// Exit codes (CliExit): 0 success; 1 the coordinator refused the call or the job failed
// ("error: CODE_NAME: message" on stderr, or the job's final line); 2 usage error (bad flags,
// missing arguments, unreadable or invalid spec or token file; nothing was sent); 3 the
// coordinator cannot be reached.
//
// Thread safety: RunCli may run concurrently with itself when given distinct streams; it
// blocks until the command is done (`watch` until the job ends).
#ifndef GRADMESH_CLI_CLI_H_
#define GRADMESH_CLI_CLI_H_

#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradmesh {
namespace cli {

enum CliExit : int {
  kExitOk = 0,
  kExitFailed = 1,
  kExitUsage = 2,
  kExitUnreachable = 3,
};

// Where output goes. Results go to `out`; errors, notes and hints to `err`.
struct CliIo {
  std::ostream* out = nullptr;  // Required.
  std::ostream* err = nullptr;  // Required.
  // `out` is a terminal: `watch` redraws one progress line in place instead of printing
  // plain lines.
  bool out_is_terminal = false;
};

struct CliOptions {
  // Environment variables the CLI reads: GRADMESH_COORDINATOR (default coordinator address;
  // else 127.0.0.1:7000) and GRADMESH_AUTH_TOKEN_FILE (default --auth_token_file).
  std::map<std::string, std::string> env;
  // Wall clock, for ages and for throttling watch lines.
  std::function<absl::Time()> now = [] { return absl::Now(); };
  // Deadline of each unary call to the coordinator and the shards.
  absl::Duration rpc_deadline = absl::Seconds(30);
  // `watch` without a terminal: at most one progress line per interval (state changes and the
  // final line are always printed). Default 1 s.
  absl::Duration plain_update_interval = absl::Seconds(1);
  // `watch` reconnecting after the stream broke: first wait, doubling up to the max.
  absl::Duration reconnect_initial_backoff = absl::Milliseconds(250);
  absl::Duration reconnect_max_backoff = absl::Seconds(5);
  // `logs --follow`: time between two GetLogs calls.
  absl::Duration logs_poll_interval = absl::Seconds(1);
};

// Runs one command line (`args` without the program name) and returns the exit code.
int RunCli(const std::vector<std::string>& args, const CliOptions& options, const CliIo& io);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_CLI_H_
