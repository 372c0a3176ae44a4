#!/usr/bin/env bash
# Runs the tests under sanitizers (issue #15 item 7). Not part of tests/run.sh: on 2 cores the
# instrumented builds take far longer than CI's 30 minutes.
#
#   tests/sanitizers.sh [asan|tsan|all] [TARGET...]     (default: all, the targets below)
#
# asan  AddressSanitizer + UndefinedBehaviorSanitizer (gcc, --config=asan: -fsanitize=
#       address,undefined, -fno-sanitize-recover=undefined) over the whole suite (every
#       top-level package's /...), in its own output base $HOME/.cache/gradmesh-asan.
# tsan  ThreadSanitizer (gcc, --config=tsan) over the concurrency-heavy targets (TSAN_TARGETS:
#       shard, consistency, barrier timers, gossip, rings, coordinator, metrics endpoint), in
#       $HOME/.cache/gradmesh-tsan.
#
# The system libraries are not instrumented, which shapes the options:
#   * LibTorch, gRPC, RocksDB: ASan still checks every access made by our code to their
#     memory; leaks are checked (detect_leaks=1) with tests/sanitizers/lsan.supp suppressing
#     the one-time allocations of LibTorch/OpenMP/gRPC start-up that are never freed.
#   * Abseil's absl::Mutex (libabsl_synchronization.so) locks with atomics TSan cannot see, so
#     every guarded field would be reported as a race: tests/sanitizers/tsan_absl_shim.cc,
#     LD_PRELOADed into every tsan test (and the daemons they start), tells TSan about each
#     lock and unlock. tests/sanitizers/tsan.supp suppresses reports inside the uninstrumented
#     libraries themselves (gRPC's and RocksDB's own threads).
# Timing assertions of some tests may fail only because instrumented code runs 2-15x slower;
# the script reports failures per target and keeps the logs (bazel-testlogs of each output
# base, and /tmp/gradmesh-sanitizers/<mode>.log). Exits 1 if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"
shift || true
TSAN_TARGETS=(
  //server:shard_test //server:consistency_test //server:wait_timer_test
  //server:shard_durability_test //server:request_ledger_test //tests:waiting_calls_test
  //tests:stream_test //tests:shm_test //worker/ps:ps_mode_test
  //worker/gossip:replica_test //worker/gossip:gossiper_test //worker/gossip:gossip_service_test
  //worker/gossip:peer_auth_test
  //worker/allreduce:ring_test //worker/allreduce:tcp_ring_test //worker/allreduce:grpc_ring_test
  //worker/allreduce:collective_test //worker/allreduce:bucket_reducer_test
  //coordinator:coordinator_test //coordinator:service_test
  //runtime:metrics_test //runtime:node_agent_test
)
out=/tmp/gradmesh-sanitizers
mkdir -p "$out"
supp="$PWD/tests/sanitizers"
failed=0

run() {  # run MODE OUTPUT_BASE TARGETS... ; prints the figures.
  local name="$1" base="$2"
  shift 2
  local log="$out/$name.log" start
  start=$(date +%s)
  # --symlink_prefix=/: leave the tree's bazel-* links to the shared output base.
  nice -n 10 bazel --output_base="$base" test --config="$name" --keep_going --symlink_prefix=/ \
    --test_output=errors "${env[@]}" "$@" >"$log" 2>&1
  local rc=$?
  local passed failed_n reports
  passed=$(grep -cE '^//.* PASSED in' "$log" || true)
  failed_n=$(grep -cE '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$log" || true)
  reports=$(grep -cE '^(==[0-9]+==ERROR: |WARNING: ThreadSanitizer|SUMMARY: (Address|UndefinedBehavior|Thread|Leak)Sanitizer|.*runtime error: )' "$log" || true)
  echo "sanitizers $name: $((passed + failed_n)) targets, $passed passed, $failed_n failed," \
    "$reports sanitizer reports, $(($(date +%s) - start)) s (log: $log)"
  grep -E '^//.* (FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$log" | head -40
  [ "$rc" = 0 ] || failed=1
}

if [ "$mode" = asan ] || [ "$mode" = all ]; then
  env=(
    "--test_env=ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:check_initialization_order=1:detect_stack_use_after_return=1"
    "--test_env=LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0"
    "--test_env=UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1"
  )
  targets=("$@")
  if [ "${#targets[@]}" = 0 ]; then
    # Every top-level package: `//...` would also walk the bazel-* links into the shared
    # output base, which this output base does not know as its own.
    for d in */; do
      d="${d%/}"
      case "$d" in bazel-* | third_party) continue ;; esac
      if [ -n "$(find "$d" -name BUILD -print -quit)" ]; then targets+=("//$d/..."); fi
    done
  fi
  run asan "$HOME/.cache/gradmesh-asan" "${targets[@]}"
fi
if [ "$mode" = tsan ] || [ "$mode" = all ]; then
  shim="$out/tsan_absl_shim.so"
  g++ -O2 -shared -fPIC -o "$shim" tests/sanitizers/tsan_absl_shim.cc -ldl || exit 1
  env=(
    "--test_env=LD_PRELOAD=$shim"
    "--test_env=TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
  )
  targets=("$@")
  [ "${#targets[@]}" = 0 ] && targets=("${TSAN_TARGETS[@]}")
  run tsan "$HOME/.cache/gradmesh-tsan" "${targets[@]}"
fi
exit "$failed"
