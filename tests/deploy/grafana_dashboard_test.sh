#!/usr/bin/env bash
# deploy/grafana/gradmesh.json: every panel's PromQL parses (each expression becomes a
# recording rule checked by `promtool check rules`) and names only metrics the daemons export
# (the names in the collectors' source: coordinator_metrics.cc, shard_metrics.cc,
# worker_metrics.cc, common/metrics.cc), `up`, or what deploy/prometheus records; the same
# name check runs over the rules' expressions. Negative cases prove both checks can fail.
# (//tests/deploy:prometheus_e2e_test checks the names against a real scrape as well.)
set -euo pipefail
fail() { echo "FAIL: $*"; exit 1; }
command -v promtool >/dev/null || fail "promtool not on PATH (deploy/setup.sh installs it)"
[ -x /usr/bin/python3 ] || fail "/usr/bin/python3 missing"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
src=(coordinator/coordinator_metrics.cc server/shard_metrics.cc worker/worker_metrics.cc
     common/metrics.cc)
for f in "${src[@]}"; do [ -s "$f" ] || fail "$f missing (collector source moved?)"; done
grep -ohE '"gradmesh_[a-z0-9_]+"' "${src[@]}" | tr -d '"' | sort -u >"$tmp/exported.txt"
[ "$(wc -l <"$tmp/exported.txt")" -ge 20 ] || fail "too few metric names in the collectors"

check() {  # dashboard rules -> 0 when both checks pass
  /usr/bin/python3 tests/deploy/promql_names.py "$1" "$2" "$tmp/exported.txt" "$tmp/dash.rules.yml" &&
    promtool check rules "$tmp/dash.rules.yml" >"$tmp/promtool.out" 2>&1 ||
    { cat "$tmp/promtool.out" 2>/dev/null; return 1; }
}
D=deploy/grafana/gradmesh.json R=deploy/prometheus/gradmesh.rules.yml
check "$D" "$R" || fail "dashboard check"
echo "dashboard: $(grep -c '"expr"' "$D") expressions parse and name exported metrics"

sed 's/gradmesh_job_loss{/gradmesh_job_loss{{/' "$D" >"$tmp/bad1.json"
check "$tmp/bad1.json" "$R" >/dev/null 2>&1 && fail "a PromQL syntax error passed"
sed 's/gradmesh_job_loss{/gradmesh_job_losses{/' "$D" >"$tmp/bad2.json"
check "$tmp/bad2.json" "$R" >"$tmp/bad2.out" 2>&1 && fail "an unknown metric name passed"
grep -q 'gradmesh_job_losses is not exported' "$tmp/bad2.out" || fail "unknown name: wrong message"
sed 's/gradmesh_job_paused == 1/gradmesh_job_pause == 1/' "$R" >"$tmp/bad.rules.yml"
check "$D" "$tmp/bad.rules.yml" >"$tmp/bad3.out" 2>&1 && fail "an unknown name in the rules passed"
grep -q 'gradmesh_job_pause is not exported' "$tmp/bad3.out" || fail "rules name: wrong message"
echo "PASS: dashboard PromQL parses; names exported; negative cases rejected"
