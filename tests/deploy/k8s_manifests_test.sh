#!/usr/bin/env bash
# deploy/k8s: renders both overlays with `kubectl kustomize` and checks every object with
# k8s_validate.mjs (Kubernetes / Prometheus Operator OpenAPI schemas, unknown fields, flags
# against each binary's --helpfull, references between objects), plus the Secrets that
# deploy/k8s/make-secrets.sh makes; then proves that it catches mistakes (a misspelled field,
# a wrong type, a flag the binary does not have). Needs kubectl, node and the npm packages of
# tests/deploy/package.json in $GRADMESH_DEPLOY_NPM_DIR (deploy/setup.sh installs them):
# fails, never skips, without them.
set -euo pipefail
NPM_DIR="${GRADMESH_DEPLOY_NPM_DIR:-/var/lib/gradmesh/npm-deploy}"
fail() { echo "FAIL: $*"; exit 1; }
for tool in kubectl node; do
  command -v "$tool" >/dev/null || fail "$tool not on PATH (deploy/setup.sh installs it)"
done
[ -d "$NPM_DIR/node_modules/kubernetes-models" ] &&
  [ -d "$NPM_DIR/node_modules/@kubernetes-models/prometheus-operator" ] ||
  fail "npm packages missing in $NPM_DIR (run deploy/setup.sh)"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
export HOME="$tmp"  # kubectl's cache; nothing from a real kubeconfig is used or needed.

# Flags each binary accepts, from its --helpfull (abseil's --help lists only the flags of the
# file named like the binary; --helpfull lists all of them, --flagfile included; it exits 1).
{
  echo "{"
  sep=""
  for b in coordinator/gradmesh_coordinator server/gradmesh_server worker/gradmesh_worker; do
    [ -x "$b" ] || fail "$b not built (run through bazel test)"
    flags="$({ "$b" --helpfull 2>&1 || true; } | sed -nE 's/^ +--([A-Za-z0-9_]+) \(.*/"\1"/p' | paste -sd, -)"
    [ -n "$flags" ] || fail "no flags read from $b --helpfull"
    printf '%s"%s": [%s]\n' "$sep" "$(basename "$b")" "$flags"
    sep=","
  done
  echo "}"
} >"$tmp/flags.json"

validate() { node tests/deploy/k8s_validate.mjs "$NPM_DIR" "$tmp/flags.json" "$@"; }

bash deploy/k8s/make-secrets.sh --print >"$tmp/secrets.yaml"
# A real copy: kustomize does not follow the symlinks Bazel's runfiles are made of.
cp -rL deploy/k8s "$tmp/k8s"
for overlay in cpu gpu; do
  kubectl kustomize "$tmp/k8s/overlays/$overlay" >"$tmp/$overlay.yaml" 2>"$tmp/$overlay.err" ||
    { cat "$tmp/$overlay.err"; fail "kubectl kustomize overlays/$overlay"; }
  echo "overlays/$overlay: $(validate "$tmp/$overlay.yaml" "$tmp/secrets.yaml")"
done

# What the overlays and the base promise (README "Kubernetes").
grep -q 'nvidia.com/gpu: "1"' "$tmp/gpu.yaml" || fail "gpu overlay: no nvidia.com/gpu"
grep -q 'nvidia.com/gpu' "$tmp/cpu.yaml" && fail "cpu overlay asks for GPUs"
grep -q 'image: localhost/gradmesh:cuda' "$tmp/gpu.yaml" || fail "gpu overlay: not the cuda image"
grep -q 'terminationGracePeriodSeconds: 120' "$tmp/cpu.yaml" || fail "workers: grace period"
grep -q 'kill -TERM 1' "$tmp/cpu.yaml" || fail "workers: no preStop SIGTERM"
grep -q -- '--node=$(POD_NAME)' "$tmp/cpu.yaml" || fail "pods are not named after themselves"
grep -q 'kind: PodMonitor' "$tmp/cpu.yaml" || fail "no PodMonitor"
# Every daemon runs with mutual TLS, and the certificate in the Secret names the Services.
[ "$(grep -c -- '--tls_client_auth' "$tmp/cpu.yaml")" = 3 ] || fail "not every daemon has mTLS"
[ "$(grep -c 'secretName: gradmesh-tls' "$tmp/cpu.yaml")" = 3 ] || fail "tls Secret not mounted"
/usr/bin/python3 - "$tmp/secrets.yaml" >"$tmp/node.pem" <<'PY' || fail "no node.pem in gradmesh-tls"
import base64, re, sys
doc = open(sys.argv[1]).read().split("---")
tls = [d for d in doc if "name: gradmesh-tls" in d][0]
print(base64.b64decode(re.search(r"node.pem: (\S+)", tls).group(1)).decode())
PY
sans=$(openssl x509 -in "$tmp/node.pem" -noout -ext subjectAltName)
for san in gradmesh-coordinator '*.gradmesh-server.gradmesh.svc' '*.gradmesh-worker.gradmesh.svc'; do
  grep -qF "DNS:$san" <<<"$sans" || fail "node certificate lacks SAN $san"
done

# It must catch mistakes: each broken copy fails with the expected complaint.
expect_invalid() {  # name sed-expression expected-text
  sed "$2" "$tmp/cpu.yaml" >"$tmp/bad.yaml"
  cmp -s "$tmp/bad.yaml" "$tmp/cpu.yaml" && fail "negative case '$1' changed nothing"
  if validate "$tmp/bad.yaml" "$tmp/secrets.yaml" >"$tmp/bad.out"; then
    fail "negative case '$1' passed validation"
  fi
  grep -qF "$3" "$tmp/bad.out" || { cat "$tmp/bad.out"; fail "negative case '$1': expected '$3'"; }
  echo "negative case '$1': rejected ($(head -1 "$tmp/bad.out"))"
}
expect_invalid "misspelled container field" \
  '0,/^        image: /s//        imagePullPolcy: Always\n        image: /' \
  'unknown field StatefulSet.spec.template.spec.containers[0].imagePullPolcy'
expect_invalid "string replicas" '0,/^  replicas: 1$/s//  replicas: "1"/' '/spec/replicas type'
expect_invalid "misspelled PodMonitor field" 's/podMetricsEndpoints/podMetricEndpoints/' \
  'unknown field PodMonitor.spec.podMetricEndpoints'
expect_invalid "misspelled NetworkPolicy field" '0,/endPort: 40999/s//endport: 40999/' \
  'unknown field NetworkPolicy.spec'
expect_invalid "unknown flag in the flagfile" '0,/--metrics_port=9400/s//--metric_port=9400/' \
  'has no flag --metric_port'
expect_invalid "unknown flag in args" 's/--advertise_host=/--advertise_hostname=/' \
  'gradmesh_worker has no flag --advertise_hostname'
if validate "$tmp/cpu.yaml" >"$tmp/nosecret.out"; then fail "missing Secrets not noticed"; fi
grep -q 'no Secret gradmesh-node-token' "$tmp/nosecret.out" || fail "missing Secret: wrong message"
echo "PASS: deploy/k8s overlays valid; negative cases rejected"
