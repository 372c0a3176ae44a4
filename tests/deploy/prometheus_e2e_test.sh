#!/usr/bin/env bash
# A real Prometheus (Debian's package) scrapes a real coordinator, shard and worker (service
# mode, 127.0.0.1, free ports) during a short MNIST job submitted with the CLI, with the rules
# of deploy/prometheus loaded; then reads gradmesh series back through its HTTP API, and checks
# the metric names: every gradmesh_* name scraped is known to the collectors' source, and
# every name the Grafana dashboard plots was scraped (accuracy aside: only once evaluated;
# gradmesh_role is the target label).
set -euo pipefail
# The logs first and the reason last: CI shows the tail of a failing test's output.
fail() { for f in "$tmp"/*.log; do echo "--- $f"; tail -n 5 "$f"; done; echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
for tool in prometheus curl; do command -v "$tool" >/dev/null || fail "$tool not on PATH (deploy/setup.sh)"; done
[ -x /usr/bin/python3 ] || fail "/usr/bin/python3 missing"
DATA="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
[ -d "$DATA/mnist" ] || fail "no MNIST in $DATA (deploy/setup.sh)"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
wait_file() { for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done; fail "$2 did not start"; }

head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$tmp/token"
timeout 300 coordinator/gradmesh_coordinator --host=127.0.0.1 --port=0 --port_file="$tmp/coord.port" \
  --data_dir="$tmp/coord" --auth_token_file="$tmp/token" --metrics_port=0 \
  --metrics_port_file="$tmp/coord.metrics" 2>"$tmp/coordinator.log" &
PIDS+=($!)
wait_file "$tmp/coord.port" coordinator
COORD="127.0.0.1:$(cat "$tmp/coord.port")"
timeout 300 server/gradmesh_server --host=127.0.0.1 --port=0 --port_file="$tmp/shard.port" --node=shard0 \
  --data_dir="$tmp/shard0" --coordinator="$COORD" --auth_token_file="$tmp/token" \
  --metrics_port=0 --metrics_port_file="$tmp/shard.metrics" 2>"$tmp/shard.log" &
PIDS+=($!)
timeout 300 worker/gradmesh_worker --host=127.0.0.1 --peer_port=0 --port_file="$tmp/worker.port" --node=worker0 \
  --coordinator="$COORD" --auth_token_file="$tmp/token" --data_dir="$DATA" \
  --checkpoint_dir="$tmp/ckpt" --metrics_port=0 --metrics_port_file="$tmp/worker.metrics" \
  2>"$tmp/worker.log" &
PIDS+=($!)
for f in coord shard worker; do wait_file "$tmp/$f.metrics" "$f metrics"; done

# Prometheus on 127.0.0.1, a free port, a temp data dir, bounded run time, 1 s scrapes.
PROM_PORT="$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
# The shipped rules, evaluated every second here instead of every 30 s.
sed 's/interval: 30s/interval: 1s/' deploy/prometheus/gradmesh.rules.yml >"$tmp/gradmesh.rules.yml"
grep -q 'interval: 1s' "$tmp/gradmesh.rules.yml" || fail "rules interval not rewritten"
cat >"$tmp/prometheus.yml" <<CONF
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: [gradmesh.rules.yml]
scrape_configs:
  - job_name: gradmesh-coordinator
    static_configs: [{targets: ["127.0.0.1:$(cat "$tmp/coord.metrics")"], labels: {gradmesh_role: coordinator}}]
  - job_name: gradmesh-server
    static_configs: [{targets: ["127.0.0.1:$(cat "$tmp/shard.metrics")"], labels: {gradmesh_role: server}}]
  - job_name: gradmesh-worker
    static_configs: [{targets: ["127.0.0.1:$(cat "$tmp/worker.metrics")"], labels: {gradmesh_role: worker}}]
CONF
timeout 280 prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" --log.level=warn 2>"$tmp/prometheus.log" &
PIDS+=($!)
API="http://127.0.0.1:$PROM_PORT/api/v1"
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null && break; sleep 0.2; done
curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null || fail "prometheus not ready"

cat >"$tmp/job.yaml" <<SPEC
name: prom-e2e
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 64
steps: 6000
mode: async
num_workers: 1
num_shards: 1
log_every: 10
SPEC
export GRADMESH_COORDINATOR="$COORD" GRADMESH_AUTH_TOKEN_FILE="$tmp/token"
for attempt in $(seq 40); do
  cli/gradmesh submit "$tmp/job.yaml" >"$tmp/submit.log" 2>&1 && break
  [ "$attempt" = 40 ] && fail "submit: $(cat "$tmp/submit.log")"
  sleep 0.5
done

query() {  # PromQL -> the first sample's value, or empty
  curl -sf --get "$API/query" --data-urlencode "query=$1" |
    /usr/bin/python3 -c 'import json,sys; r=json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else "")'
}
step=""
for _ in $(seq 240); do
  step="$(query 'max(max_over_time(gradmesh_job_step{job_id="prom-e2e"}[5m]))')"
  [ -n "$step" ] && [ "${step%.*}" -gt 0 ] && break
  sleep 0.5
done
[ -n "$step" ] && [ "${step%.*}" -gt 0 ] || fail "no gradmesh_job_step > 0 read back from Prometheus"
echo "read back: gradmesh_job_step{job_id=\"prom-e2e\"} = $step"
# The worker's series exist only while its task runs: read one back before the job ends (a
# loaded machine may otherwise finish the job between two scrapes of the worker).
wstep=""
for _ in $(seq 240); do
  wstep="$(query 'max(max_over_time(gradmesh_worker_step{job_id="prom-e2e"}[5m]))')"
  [ -n "$wstep" ] && [ "${wstep%.*}" -gt 0 ] && break
  sleep 0.25
done
[ -n "$wstep" ] && [ "${wstep%.*}" -gt 0 ] || fail "no gradmesh_worker_step > 0 read back while the job ran"
cli/gradmesh watch prom-e2e >"$tmp/watch.log" 2>&1 || fail "job did not succeed: $(tail -n 3 "$tmp/watch.log")"
sleep 3  # Last scrapes after the end.
for q in 'max(gradmesh_shard_updates_applied{job_id="prom-e2e"})' \
         'max_over_time(gradmesh_worker_step{job_id="prom-e2e"}[5m])' \
         'gradmesh:nodes_alive:sum{role="worker"}' 'count(up{gradmesh_role!=""} == 1)'; do
  # Recording rules run every second here: wait for their first evaluation.
  for _ in $(seq 90); do
    v="$(query "$q")"
    [ -n "$v" ] && [ "$v" != 0 ] && break
    sleep 0.5
  done
  [ -n "$v" ] && [ "$v" != 0 ] || fail "$q: nothing read back"
  echo "read back: $q = $v"
done

# Names: scraped vs the collectors' source vs the dashboard.
curl -sf "$API/label/__name__/values" | /usr/bin/python3 -c \
  'import json,sys; print("\n".join(n for n in json.load(sys.stdin)["data"] if n.startswith("gradmesh_")))' |
  sort -u >"$tmp/scraped"
grep -ohE '"gradmesh_[a-z0-9_]+"' coordinator/coordinator_metrics.cc server/shard_metrics.cc \
  worker/worker_metrics.cc common/metrics.cc | tr -d '"' | sort -u >"$tmp/source"
unknown="$(comm -23 "$tmp/scraped" "$tmp/source")"
[ -z "$unknown" ] || fail "scraped but not in the collectors' source: $unknown"
grep -oE 'gradmesh_[a-z0-9_]+' deploy/grafana/gradmesh.json | sort -u |
  grep -vxE 'gradmesh_role|gradmesh_(job|worker)_accuracy' >"$tmp/dashboard"
missing="$(comm -23 "$tmp/dashboard" "$tmp/scraped")"
[ -z "$missing" ] || fail "the dashboard plots names never scraped: $missing"
echo "PASS: $(wc -l <"$tmp/scraped") gradmesh series names scraped by a real Prometheus; dashboard names all scraped"
