#!/usr/bin/env bash
# Checks that every C++ file of the tree (not third_party/) is formatted as .clang-format says
# (Google style, 100 columns). Prints the files that are not and exits 1; fix them with
#   git ls-files '*.cc' '*.h' | grep -v ^third_party/ | xargs clang-format -i
set -uo pipefail
cd "$(dirname "$0")/../.."
command -v clang-format >/dev/null || { echo "format_check: FAILED: clang-format not installed"; exit 1; }
files=$(git ls-files -co --exclude-standard '*.cc' '*.h' | grep -v '^third_party/')
# One clang-format process for the whole tree; --Werror makes each misformatted file an error
# line "path:line:col: error: code should be clang-formatted".
bad=$(echo "$files" | xargs clang-format --dry-run --Werror 2>&1 | sed -nE 's/^([^:]+):[0-9]+:[0-9]+: error.*/\1/p' |
  sort -u)
if [ -n "$bad" ]; then
  echo "$bad" | sed 's/^/format_check: not formatted: /'
  echo "format_check: FAILED: $(echo "$bad" | wc -l) files"
  exit 1
fi
echo "format_check: $(echo "$files" | wc -l) C++ files formatted ($(clang-format --version | head -1))"
