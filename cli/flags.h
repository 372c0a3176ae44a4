// Command-line parsing for the `gradmesh` CLI: GNU-style long flags and positional arguments.
//
// Accepted forms: `--name=value`, `--name value` (flags that take a value), `--name`,
// `--name=true|false` (boolean flags), `-h` for `--help`, and `--` to end the flags. Names are
// matched with '_' and '-' treated alike (`--dry_run` is `--dry-run`). Flags and positional
// arguments may be interleaved, unless `stop_at_positional` is set (then parsing stops at the
// first positional argument, which is how the global flags before the command are read).
//
// Thread safety: pure functions.
#ifndef GRADMESH_CLI_FLAGS_H_
#define GRADMESH_CLI_FLAGS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gradmesh {
namespace cli {

struct FlagSpec {
  // As shown in help, e.g. "dry-run" or "auth_token_file"; matched with '_' and '-' alike.
  // Parsed values are keyed by this name.
  std::string name;
  bool takes_value = false;
  std::string value_name;  // For help: "HOST:PORT". Empty for boolean flags.
  std::string help;        // One line.
};

struct ParsedArgs {
  // Canonical flag name -> value ("true"/"false" for boolean flags). The last one wins.
  std::map<std::string, std::string> flags;
  std::vector<std::string> positional;
  // With stop_at_positional: the arguments from the first positional one on (unparsed).
  std::vector<std::string> rest;

  bool Has(const std::string& name) const { return flags.count(name) > 0; }
  // The flag's value, or `def` when it was not given.
  std::string Get(const std::string& name, const std::string& def = "") const;
  // Boolean flags: given and not "false".
  bool Bool(const std::string& name) const;
};

// InvalidArgument naming the argument for an unknown flag, a missing value, a value given to
// a boolean flag other than true/false, or an empty flag name.
absl::StatusOr<ParsedArgs> ParseArgs(const std::vector<std::string>& args,
                                     const std::vector<FlagSpec>& specs,
                                     bool stop_at_positional = false);

// Help lines for `specs`, one per flag: "  --name=VALUE   help".
std::string FlagHelp(const std::vector<FlagSpec>& specs);

}  // namespace cli
}  // namespace gradmesh

#endif  // GRADMESH_CLI_FLAGS_H_
