#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang and runs each for a bounded time.
#
#   tests/fuzz/run_fuzzers.sh [SECONDS] [TARGET...]
#
# SECONDS per target (default 30); TARGETs default to every *_fuzz.cc here. The build uses
# --config=fuzz (.bazelrc: clang, -fsanitize=fuzzer,address,undefined) in its own output base
# ($GRADMESH_FUZZ_OUTPUT_BASE, default ~/.cache/gradmesh-fuzz), so the shared gcc build is not
# touched. Each target runs on its committed seed corpus (corpus/<target>/, read only) plus a
# scratch corpus that keeps what it finds (under $GRADMESH_FUZZ_WORK, default
# /tmp/gradmesh-fuzz/<target>/, kept between runs). A crash, a leak, a sanitizer report or a
# timeout (10 s for one input) stops the target: the input is saved as
# $GRADMESH_FUZZ_WORK/<target>/crash-* (or leak-*, timeout-*), and the script goes on with
# the next target and exits 1 at the end. To keep a finding: fix it, add a unit test in the
# package of the bug, and copy the input into corpus/<target>/ (the gcc <target>_test then
# replays it in every `bazel test //...`).
#
# Prints one line per target: executions, executions/s, corpus size, findings.
# Exits 2 when clang is not installed (tests/run.sh checks that first).
set -uo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-30}"
shift || true
targets=("$@")
if [ "${#targets[@]}" = 0 ]; then
  for f in tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$f" .cc)"); done
fi
if ! command -v clang >/dev/null; then
  echo "run_fuzzers: clang not found (apt-get install clang)"
  exit 2
fi
output_base="${GRADMESH_FUZZ_OUTPUT_BASE:-$HOME/.cache/gradmesh-fuzz}"
work="${GRADMESH_FUZZ_WORK:-/tmp/gradmesh-fuzz}"
labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:$t"); done
echo "run_fuzzers: building ${#targets[@]} targets with clang (output base $output_base)"
# --symlink_prefix=/: leave the tree's bazel-* links to the shared output base.
if ! bazel --output_base="$output_base" build --config=fuzz --symlink_prefix=/ "${labels[@]}" \
  >"$work.build.log" 2>&1; then
  tail -30 "$work.build.log"
  echo "run_fuzzers: build FAILED (log: $work.build.log)"
  exit 1
fi
bin="$(bazel --output_base="$output_base" info --config=fuzz bazel-bin 2>/dev/null)"
failed=()
for t in "${targets[@]}"; do
  mkdir -p "$work/$t/corpus"
  log="$work/$t/fuzz.log"
  # Leak checks stay on; ASan aborts on the first error; UBSan is fatal (-fno-sanitize-recover).
  ASAN_OPTIONS="abort_on_error=1:detect_stack_use_after_return=1" \
    UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$bin/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -max_len=4096 -print_final_stats=1 -artifact_prefix="$work/$t/" \
    "$work/$t/corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  execs=$(sed -nE 's/^stat::number_of_executed_units: *([0-9]+)/\1/p' "$log" | tail -1)
  rate=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+)/\1/p' "$log" | tail -1)
  units=$(find "$work/$t/corpus" -type f | wc -l)
  findings=$(find "$work/$t" -maxdepth 1 -name 'crash-*' -o -maxdepth 1 -name 'leak-*' \
    -o -maxdepth 1 -name 'timeout-*' -o -maxdepth 1 -name 'oom-*' | wc -l)
  if [ "$rc" = 0 ]; then
    verdict="ok"
  else
    verdict="FAILED (exit $rc; see $log)"
    failed+=("$t")
    grep -E "ERROR: |FUZZ_CHECK|SUMMARY|Test unit written" "$log" | head -5
  fi
  echo "fuzz $t: ${seconds}s executions=${execs:-?} exec_per_s=${rate:-?}" \
    "new_corpus_units=$units findings_on_disk=$findings $verdict"
done
if [ "${#failed[@]}" -gt 0 ]; then
  echo "run_fuzzers: FAILED: ${failed[*]}"
  exit 1
fi
echo "run_fuzzers: ${#targets[@]} targets ran ${seconds}s each without a finding"
