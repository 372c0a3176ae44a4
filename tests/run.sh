#!/usr/bin/env bash
# Runs every test: sets up the machine if needed (deploy/setup.sh is idempotent), checks the
# formatting of the C++ tree, then `bazel test //...`. Ends with a line
# "N passed, N failed, N skipped" (skipped: test targets bazel did not run on this machine,
# e.g. the GPU tests without --config=cuda).
set -uo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh || exit 1
log="$(mktemp /tmp/gradmesh-test.XXXXXX.log)"
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//.* PASSED in' "$log" || true)
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$log" || true)
skipped=$(grep -cE '^//.* SKIPPED' "$log" || true)
if [ "$skipped" = 0 ]; then
  # Bazel 4 reports targets skipped as incompatible only in its summary line.
  skipped=$(sed -nE 's/.* ([0-9]+) (was|were) skipped.*/\1/p' "$log" | tail -1)
  skipped=${skipped:-0}
fi
# Report only (does not change the exit status yet): functions longer than 120 lines.
echo "function length report (tests/lint/function_length.py, > 120 lines):"
/usr/bin/python3 tests/lint/function_length.py common compression server worker coordinator \
  cli tests || true
echo "${passed} passed, ${failed} failed, ${skipped} skipped"
if [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
  echo "bazel test exited with $rc (see $log)"
fi
exit "$rc"
