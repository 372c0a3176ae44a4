#!/usr/bin/env bash
# The Prometheus rules and scrape config in deploy/prometheus: syntax (promtool check rules /
# check config) and behaviour (promtool test rules: every alert fires when it should and not
# when it should not; see gradmesh.rules.test.yml). Needs promtool (Debian's prometheus
# package, installed by deploy/setup.sh): fails, never skips, without it.
set -euo pipefail
command -v promtool >/dev/null || { echo "FAIL: promtool not on PATH (apt-get install prometheus; deploy/setup.sh does)"; exit 1; }
dir=deploy/prometheus
promtool check rules "$dir/gradmesh.rules.yml"
promtool check config "$dir/prometheus.yml"
(cd "$dir" && promtool test rules gradmesh.rules.test.yml)

# The test must be able to fail: a rules file whose alert expects the wrong value is caught.
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
sed 's/gradmesh:job_worker_step_spread:max > 50/gradmesh:job_worker_step_spread:max > 500/' \
  "$dir/gradmesh.rules.yml" >"$tmp/gradmesh.rules.yml"
cp "$dir/gradmesh.rules.test.yml" "$tmp/"
if (cd "$tmp" && promtool test rules gradmesh.rules.test.yml >/dev/null 2>&1); then
  echo "FAIL: promtool test rules passed with a broken threshold"; exit 1
fi
echo "PASS: rules check, config check, rule unit tests, and a broken rule is caught"
