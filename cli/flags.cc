// Command-line parsing for the `gradmesh` CLI (see flags.h).
#include "cli/flags.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace gradmesh {
namespace cli {
namespace {

std::string Normalize(const std::string& name) { return absl::StrReplaceAll(name, {{"_", "-"}}); }

const FlagSpec* FindSpec(const std::vector<FlagSpec>& specs, const std::string& name) {
  for (const FlagSpec& s : specs) {
    if (Normalize(s.name) == name) return &s;
  }
  return nullptr;
}

}  // namespace

std::string ParsedArgs::Get(const std::string& name, const std::string& def) const {
  auto it = flags.find(name);
  return it == flags.end() ? def : it->second;
}

bool ParsedArgs::Bool(const std::string& name) const {
  auto it = flags.find(name);
  return it != flags.end() && it->second != "false";
}

absl::StatusOr<ParsedArgs> ParseArgs(const std::vector<std::string>& args,
                                     const std::vector<FlagSpec>& specs, bool stop_at_positional) {
  ParsedArgs out;
  bool flags_done = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const bool is_flag = !flags_done && arg.size() > 1 && arg[0] == '-';
    if (!is_flag) {
      if (stop_at_positional) {
        out.rest.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
        return out;
      }
      out.positional.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    std::string body = arg.substr(arg.rfind("--", 0) == 0 ? 2 : 1);
    std::string value;
    bool has_value = false;
    const size_t eq = body.find('=');
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
      body = body.substr(0, eq);
      has_value = true;
    }
    std::string name = Normalize(body);
    if (name == "h") name = "help";
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("bad flag \"", arg, "\""));
    const FlagSpec* spec = FindSpec(specs, name);
    if (spec == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", body));
    }
    if (spec->takes_value) {
      if (!has_value) {
        if (i + 1 >= args.size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "flag --", spec->name, " needs a value (--", spec->name, "=", spec->value_name, ")"));
        }
        value = args[++i];
      }
      out.flags[spec->name] = value;
    } else {
      if (has_value && value != "true" && value != "false") {
        return absl::InvalidArgumentError(absl::StrCat(
            "flag --", spec->name, " takes no value (or true/false), got \"", value, "\""));
      }
      out.flags[spec->name] = has_value ? value : "true";
    }
  }
  return out;
}

std::string FlagHelp(const std::vector<FlagSpec>& specs) {
  std::vector<std::string> lefts;
  size_t width = 0;
  for (const FlagSpec& s : specs) {
    lefts.push_back(s.takes_value ? absl::StrCat("--", s.name, "=", s.value_name)
                                  : absl::StrCat("--", s.name));
    width = std::max(width, lefts.back().size());
  }
  std::string out;
  for (size_t i = 0; i < specs.size(); ++i) {
    absl::StrAppend(&out, "  ", lefts[i], std::string(width - lefts[i].size() + 3, ' '),
                    specs[i].help, "\n");
  }
  return out;
}

}  // namespace cli
}  // namespace gradmesh
