#!/usr/bin/env bash
# The coordinator's web dashboard in a real headless Chromium (Debian's `chromium`): a real
# coordinator, shard and worker (127.0.0.1, free ports) run a short MNIST job submitted with the
# CLI; the page is loaded during the job and after it. Checks: the rendered DOM draws the job's
# loss and samples/s curves from exactly the history points /api/jobs reports (one polyline
# point per history point, values equal), the job's state and node health;
# /job/NAME and an unknown job's 404; and `gradmesh logs` of the same job (the
# rank's progress and task_end lines, bounds, errors). Saves a 1280x900 screenshot
# ($TEST_UNDECLARED_OUTPUTS_DIR/dashboard.png; docs/dashboard.png is one). A missing chromium
# fails the test (deploy/setup.sh installs it), never skips it.
set -euo pipefail
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "--- $f"; tail -n 5 "$f"; done; exit 1; }
tmp="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
for tool in chromium curl; do command -v "$tool" >/dev/null || fail "$tool not on PATH (deploy/setup.sh)"; done
[ -x /usr/bin/python3 ] || fail "/usr/bin/python3 missing"
DATA="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
[ -d "$DATA/mnist" ] || fail "no MNIST in $DATA (deploy/setup.sh)"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 HOME="$tmp"
wait_file() { for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done; fail "$2 did not start"; }

timeout 300 coordinator/gradmesh_coordinator --host=127.0.0.1 --port=0 --port_file="$tmp/coord.port" \
  --data_dir="$tmp/coord" --metrics_port=0 --metrics_port_file="$tmp/coord.metrics" \
  2>"$tmp/coordinator.log" &
PIDS+=($!)
wait_file "$tmp/coord.port" coordinator
COORD="127.0.0.1:$(cat "$tmp/coord.port")"
timeout 300 server/gradmesh_server --host=127.0.0.1 --port=0 --port_file="$tmp/shard.port" --node=shard0 \
  --data_dir="$tmp/shard0" --coordinator="$COORD" 2>"$tmp/shard.log" &
PIDS+=($!)
timeout 300 worker/gradmesh_worker --host=127.0.0.1 --peer_port=0 --port_file="$tmp/worker.port" \
  --node=worker0 --coordinator="$COORD" --data_dir="$DATA" --checkpoint_dir="$tmp/ckpt" \
  2>"$tmp/worker.log" &
PIDS+=($!)
wait_file "$tmp/coord.metrics" "coordinator metrics"
WEB="http://127.0.0.1:$(cat "$tmp/coord.metrics")"

browse() {  # URL OUT [extra chromium flags...]: the DOM after load (scripts none; SVG inline)
  local url="$1" out="$2"; shift 2
  timeout 60 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d -p "$tmp")" "$@" "$url" >"$out" 2>>"$tmp/chromium.log" ||
    fail "chromium could not load $url"
}
# Python checks of a dumped DOM against /api/jobs: DOM JSON JOB MIN_POINTS.
check() {
  /usr/bin/python3 - "$@" <<'PY'
import html.parser, json, sys
dom, api, job, min_points = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
class P(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(); self.curves = {}
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "polyline" and a.get("class") == "curve" and a.get("data-job") == job:
            self.curves[a["data-metric"]] = a
p = P(); p.feed(open(dom).read())
j = [x for x in json.load(open(api))["jobs"] if x["job_id"] == job]
assert j, "job %s not in /api/jobs" % job
points = j[0]["history"]["points"]
assert len(points) >= min_points, "only %d history points" % len(points)
for metric in ("loss", "samples_per_s"):
    c = p.curves.get(metric)
    assert c is not None, "no %s curve in the DOM" % metric
    drawn = c["points"].split()
    values = [float(v) for v in c["data-values"].split()]
    want = [pt[metric] for pt in points]
    assert int(c["data-n"]) == len(points) == len(drawn) == len(values), \
        "%s: data-n %s, %d drawn, %d values, %d history points" % (metric, c["data-n"], len(drawn), len(values), len(points))
    assert values == want, "%s values differ: %s vs %s" % (metric, values, want)
    ys = [float(xy.split(",")[1]) for xy in drawn]
    assert len(set(ys)) > 1 or len(ys) == 1, "%s: flat curve %s" % (metric, ys)
print("%s: %d history points drawn as loss and samples/s curves; loss %.4f -> %.4f" %
      (job, len(points), points[0]["loss"], points[-1]["loss"]))
PY
}

cat >"$tmp/job.yaml" <<SPEC
name: dash-e2e
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 64
steps: 1500
mode: async
num_workers: 1
num_shards: 1
log_every: 10
SPEC
export GRADMESH_COORDINATOR="$COORD"
for attempt in $(seq 40); do
  cli/gradmesh submit "$tmp/job.yaml" >"$tmp/submit.log" 2>&1 && break
  [ "$attempt" = 40 ] && fail "submit: $(cat "$tmp/submit.log")"
  sleep 0.5
done

# During the job: a running job with a few points already drawn.
running=""
for _ in $(seq 300); do
  curl -sf "$WEB/api/jobs" >"$tmp/api.json" || fail "GET /api/jobs"
  if /usr/bin/python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0]; sys.exit(0 if j["state"]=="RUNNING" and len(j["history"]["points"])>=3 else 1)' "$tmp/api.json"; then
    running=1; break
  fi
  sleep 0.1
done
[ -n "$running" ] || fail "no RUNNING job with 3 history points in /api/jobs: $(cat "$tmp/api.json")"
browse "$WEB/" "$tmp/running.html" --dump-dom
grep -q 'class="s-RUNNING">RUNNING' "$tmp/running.html" || fail "the page does not show the job RUNNING"
grep -q 'data-job="dash-e2e" data-metric="loss"' "$tmp/running.html" || fail "no loss curve during the job"
echo "during the job: page shows dash-e2e RUNNING with its curves"

cli/gradmesh watch dash-e2e >"$tmp/watch.log" 2>&1 || fail "job did not succeed: $(tail -n 3 "$tmp/watch.log")"
browse "$WEB/" "$tmp/done.html" --dump-dom
curl -sf "$WEB/api/jobs" >"$tmp/api.json" || fail "GET /api/jobs"
check "$tmp/done.html" "$tmp/api.json" dash-e2e 5 || fail "DOM curves do not match /api/jobs"
grep -q 'class="s-SUCCEEDED">SUCCEEDED' "$tmp/done.html" || fail "the page does not show SUCCEEDED"
grep -q '<td>worker0</td><td>worker</td>' "$tmp/done.html" || fail "node worker0 not in the nodes table"
grep -q 'data-metric="accuracy" data-n="1"' "$tmp/done.html" || fail "no final accuracy point"
browse "$WEB/job/dash-e2e" "$tmp/job.html" --dump-dom
check "$tmp/job.html" "$tmp/api.json" dash-e2e 5 || fail "/job/dash-e2e curves do not match"
code="$(curl -s -o /dev/null -w '%{http_code}' "$WEB/job/nope")"
[ "$code" = 404 ] || fail "/job/nope answered $code, want 404"
curl -sf "$WEB/metrics" >"$tmp/metrics.txt" || fail "GET /metrics"
grep -q '^gradmesh_coordinator_jobs{state="succeeded"} 1' "$tmp/metrics.txt" || fail "/metrics: no SUCCEEDED job counted"
[ "$(curl -sf "$WEB/healthz")" = ok ] || fail "/healthz"

# gradmesh logs: the rank's progress lines came with the heartbeats; errors are clear.
cli/gradmesh logs dash-e2e >"$tmp/logs.txt" 2>&1 || fail "gradmesh logs: $(cat "$tmp/logs.txt")"
grep -q '^\[rank 0\] .*event=progress .*job=dash-e2e rank=0 .*step=1500 ' "$tmp/logs.txt" ||
  fail "gradmesh logs has no progress line of step 1500: $(tail -n 3 "$tmp/logs.txt")"
grep -q '^\[rank 0\] .*event=task_end .*job=dash-e2e rank=0 state=succeeded' "$tmp/logs.txt" ||
  fail "gradmesh logs has no task_end line: $(tail -n 3 "$tmp/logs.txt")"
n="$(wc -l <"$tmp/logs.txt")"
[ "$n" -le 200 ] || fail "gradmesh logs printed $n lines (tail bound 200)"
cli/gradmesh logs dash-e2e --rank=0 --follow >"$tmp/logs0.txt" 2>&1 || fail "logs --rank=0 --follow"
grep -q '^[0-9T:.-]*Z INFO event=task_end' "$tmp/logs0.txt" || fail "logs --rank=0: $(tail -n 2 "$tmp/logs0.txt")"
if cli/gradmesh logs dash-e2e --rank=3 >"$tmp/logs3.txt" 2>&1; then fail "logs --rank=3 succeeded"; fi
grep -q 'INVALID_ARGUMENT: rank 3 is out of range' "$tmp/logs3.txt" || fail "logs --rank=3: $(cat "$tmp/logs3.txt")"
if cli/gradmesh logs nope >"$tmp/logsx.txt" 2>&1; then fail "logs of an unknown job succeeded"; fi
grep -q 'NOT_FOUND: job "nope" not found' "$tmp/logsx.txt" || fail "logs nope: $(cat "$tmp/logsx.txt")"
echo "gradmesh logs: $n lines of rank 0 ($(grep -c 'event=progress' "$tmp/logs.txt") progress lines)"

shot="${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}/dashboard.png"
browse "$WEB/" "$tmp/shot.log" --screenshot="$shot" --window-size=1280,900 --hide-scrollbars
[ -s "$shot" ] || fail "no screenshot written"
/usr/bin/python3 -c 'import sys; d=open(sys.argv[1],"rb").read(24); assert d[:8]==b"\x89PNG\r\n\x1a\n"; import struct; w,h=struct.unpack(">II",d[16:24]); assert (w,h)==(1280,900),(w,h)' "$shot" ||
  fail "screenshot is not a 1280x900 PNG"
echo "PASS: dashboard rendered in headless Chromium during and after a real job; screenshot $shot"
