#include "common/logging.h"

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradmesh {
namespace {

const char* LevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug:
      return "DEBUG";
    case LogLevel::kInfo:
      return "INFO";
    case LogLevel::kWarning:
      return "WARN";
    case LogLevel::kError:
      return "ERROR";
  }
  return "INFO";
}

// Values with spaces, quotes or '=' are quoted so lines stay machine-parseable.
void AppendField(std::string* line, const LogField& f) {
  absl::StrAppend(line, " ", f.first, "=");
  bool quote = f.second.empty();
  for (char c : f.second) {
    if (c == ' ' || c == '"' || c == '=' || c == '\n' || c == '\t') quote = true;
  }
  if (!quote) {
    absl::StrAppend(line, f.second);
    return;
  }
  line->push_back('"');
  for (char c : f.second) {
    if (c == '"' || c == '\\') line->push_back('\\');
    if (c == '\n') {
      line->append("\\n");
      continue;
    }
    line->push_back(c);
  }
  line->push_back('"');
}

}  // namespace

Logger::Logger(std::vector<LogField> base, std::FILE* out, LogLevel min_level, LineSink tee)
    : base_(std::move(base)), out_(out), min_level_(min_level), tee_(std::move(tee)) {}

Logger::Logger(const Logger& parent, LineSink tee)
    : base_(parent.base_), out_(parent.out_), min_level_(parent.min_level_), tee_(std::move(tee)) {}

std::string Logger::Format(LogLevel level, const std::string& event,
                           absl::Span<const LogField> fields) const {
  std::string line = absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone());
  absl::StrAppend(&line, " ", LevelName(level));
  AppendField(&line, {"event", event});
  for (const LogField& f : base_) AppendField(&line, f);
  for (const LogField& f : fields) AppendField(&line, f);
  return line;
}

void Logger::Log(LogLevel level, const std::string& event,
                 absl::Span<const LogField> fields) const {
  if (level < min_level_) return;
  std::string line = Format(level, event, fields);
  if (tee_) tee_(line);
  if (out_ == nullptr) return;
  line.push_back('\n');
  absl::MutexLock lock(&mu_);
  std::fwrite(line.data(), 1, line.size(), out_);
  std::fflush(out_);
}

}  // namespace gradmesh
