#!/usr/bin/env bash
# Runs every test: sets up the machine if needed (deploy/setup.sh is idempotent), runs the
# source checks (tests/lint/: formatting, dependency rules, function length), then
# `bazel test //...`, then the libFuzzer targets for 15 s each (tests/fuzz/run_fuzzers.sh,
# when clang is installed). Ends with a line "N passed, N failed, N skipped" (skipped: test
# targets bazel did not run on this machine, e.g. the GPU tests without --config=cuda),
# preceded by the checks' verdict. Exits non-zero if a check or a test failed. The sanitizer
# runs (tests/sanitizers.sh) are separate: they take longer than CI allows.
set -uo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh || exit 1
lint_failed=()
bash tests/lint/format_check.sh || lint_failed+=(format)
bash tests/lint/deps_check.sh || lint_failed+=(deps)
# No function of the daemons' code over 120 lines (tests and common/ are reported only).
/usr/bin/python3 tests/lint/function_length.py worker server coordinator rpc runtime ||
  lint_failed+=(function_length)
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
# libFuzzer runs of every tests/fuzz/ target (clang, its own output base; the gcc replays of
# their corpora ran above as //tests/fuzz:*_test). GRADMESH_FUZZ_SECONDS per target; 0 skips.
fuzz_s="${GRADMESH_FUZZ_SECONDS:-15}"
checks="format, deps, function_length"
if [ "$fuzz_s" != 0 ] && command -v clang >/dev/null; then
  bash tests/fuzz/run_fuzzers.sh "$fuzz_s" || lint_failed+=(fuzz)
  checks="$checks, fuzz"
else
  echo "fuzz runs skipped (clang not installed, or GRADMESH_FUZZ_SECONDS=0)"
fi
echo "function length report, not enforced (tests/lint/function_length.py, > 120 lines):"
/usr/bin/python3 tests/lint/function_length.py common compression cli tests || true
if [ "${#lint_failed[@]}" -gt 0 ]; then
  echo "source checks FAILED: ${lint_failed[*]}"
  [ "$rc" = 0 ] && rc=1
else
  echo "source checks passed: $checks"
fi
echo "${passed} passed, ${failed} failed, ${skipped} skipped"
if [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
  echo "bazel test exited with $rc (see $log)"
fi
exit "$rc"
