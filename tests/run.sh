#!/usr/bin/env bash
# Runs every test: sets up the machine if needed (deploy/setup.sh is idempotent), then
# `bazel test //...`. Ends with a line "N passed, M failed".
set -uo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh || exit 1
log="$(mktemp /tmp/gradmesh-test.XXXXXX.log)"
bazel test //... "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(grep -cE '^//.* PASSED in' "$log" || true)
failed=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD)' "$log" || true)
echo "${passed} passed, ${failed} failed"
if [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
  echo "bazel test exited with $rc (see $log)"
fi
exit "$rc"
