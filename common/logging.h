// Structured logging: one line per event, `key=value` pairs after a timestamp and level.
//
//   2026-11-22T10:00:00.123Z INFO event=push_applied node=h1 role=server job=mnist step=12
//
// A Logger carries the fields common to every line of a process (node, role, ...); it is
// created in main() and handed to components through their Options (no global logger).
// A null Logger* is allowed everywhere and means "discard".
//
// Thread safety: Log() may be called concurrently; lines are never interleaved.
#ifndef GRADMESH_COMMON_LOGGING_H_
#define GRADMESH_COMMON_LOGGING_H_

#include <cstdio>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"

namespace gradmesh {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// A key and a value already formatted as text (see Kv()).
using LogField = std::pair<std::string, std::string>;

template <typename T>
LogField Kv(std::string key, const T& value) {
  return {std::move(key), absl::StrCat(value)};
}
inline LogField Kv(std::string key, const std::string& value) { return {std::move(key), value}; }
inline LogField Kv(std::string key, const char* value) { return {std::move(key), value}; }

class Logger {
 public:
  // `base` fields are printed on every line, after `event`. Lines go to `out` (not owned;
  // default stderr). Lines below `min_level` are dropped.
  // Receives every line logged at or above the level (without the newline), on the thread
  // that logs it; must be thread-safe.
  using LineSink = std::function<void(const std::string& line)>;
  // `tee`, if set, also receives every line; `out` may be null (lines go only to `tee`).
  explicit Logger(std::vector<LogField> base, std::FILE* out = stderr,
                  LogLevel min_level = LogLevel::kInfo, LineSink tee = nullptr);
  // A logger like `parent` (same fields, output and level) whose lines also go to `tee`
  // (e.g. a worker daemon keeping each task's lines for `gradmesh logs`).
  Logger(const Logger& parent, LineSink tee);

  void Log(LogLevel level, const std::string& event, absl::Span<const LogField> fields) const;
  void Info(const std::string& event, absl::Span<const LogField> fields = {}) const {
    Log(LogLevel::kInfo, event, fields);
  }
  void Warning(const std::string& event, absl::Span<const LogField> fields = {}) const {
    Log(LogLevel::kWarning, event, fields);
  }
  void Error(const std::string& event, absl::Span<const LogField> fields = {}) const {
    Log(LogLevel::kError, event, fields);
  }

  // Formats one line (without the trailing newline); exposed for tests.
  std::string Format(LogLevel level, const std::string& event,
                     absl::Span<const LogField> fields) const;

 private:
  const std::vector<LogField> base_;
  std::FILE* const out_;
  const LogLevel min_level_;
  const LineSink tee_;
  mutable absl::Mutex mu_;  // Serialises writes to out_.
};

// Null-safe helpers: do nothing when logger is null.
inline void LogInfo(const Logger* logger, const std::string& event,
                    absl::Span<const LogField> fields = {}) {
  if (logger != nullptr) logger->Log(LogLevel::kInfo, event, fields);
}
inline void LogWarning(const Logger* logger, const std::string& event,
                       absl::Span<const LogField> fields = {}) {
  if (logger != nullptr) logger->Log(LogLevel::kWarning, event, fields);
}
inline void LogError(const Logger* logger, const std::string& event,
                     absl::Span<const LogField> fields = {}) {
  if (logger != nullptr) logger->Log(LogLevel::kError, event, fields);
}

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_LOGGING_H_
