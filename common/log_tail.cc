// Bounded log tail (see log_tail.h).
#include "common/log_tail.h"

#include <algorithm>

namespace gradmesh {

int64_t LogTail::Append(std::string line) { return AppendAs(0, std::move(line)); }

int64_t LogTail::AppendAs(int64_t sequence, std::string line) {
  if (line.size() > options_.max_line_bytes) {
    const size_t keep = options_.max_line_bytes > 3 ? options_.max_line_bytes - 3 : 0;
    line.resize(keep);
    line += std::string("...").substr(0, options_.max_line_bytes - keep);
  }
  absl::MutexLock lock(&mu_);
  bytes_ += line.size();
  last_ = std::max(sequence, last_ + 1);
  lines_.emplace_back(last_, std::move(line));
  while (!lines_.empty() && (lines_.size() > options_.max_lines || bytes_ > options_.max_bytes)) {
    bytes_ -= lines_.front().second.size();
    lines_.pop_front();
  }
  return last_;
}

std::vector<LogTail::Line> LogTail::Since(int64_t after, size_t max_lines, size_t max_bytes) const {
  absl::MutexLock lock(&mu_);
  std::vector<Line> out;
  size_t bytes = 0;
  for (const Line& l : lines_) {
    if (l.first <= after) continue;
    if (out.size() >= max_lines || bytes + l.second.size() > max_bytes) break;
    bytes += l.second.size();
    out.push_back(l);
  }
  return out;
}

int64_t LogTail::last_sequence() const {
  absl::MutexLock lock(&mu_);
  return last_;
}

size_t LogTail::size() const {
  absl::MutexLock lock(&mu_);
  return lines_.size();
}

size_t LogTail::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace gradmesh
