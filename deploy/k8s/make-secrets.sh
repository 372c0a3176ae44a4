#!/usr/bin/env bash
# Creates the two Secrets the gradmesh pods mount (deploy/k8s/base), never stored in the repo:
#   gradmesh-api-token   key "token": the API token (JobService: the CLI); coordinator only
#   gradmesh-node-token  key "token": the node token (NodeService: server and worker daemons)
#   gradmesh-tls         keys ca.pem, node.pem, node.key: mutual TLS for every daemon, made by
#                        deploy/tls/make_certs.sh with the Services' DNS names as SANs
#                        (gradmesh-coordinator[.<ns>.svc], *.gradmesh-server.<ns>.svc,
#                        *.gradmesh-worker.<ns>.svc). The CA is kept in $TLS_DIR
#                        ($OUT_DIR/tls, mode 0700) so running this again renews the leaf
#                        certificates under the same CA; the CLI's client.pem/client.key are
#                        there too (pass them with the CLI's --tls_* flags, see README Security).
# Tokens come from API_TOKEN_FILE / NODE_TOKEN_FILE if set, else are generated (24 random
# bytes, base64) and the API token is written to $OUT_DIR/api.token (mode 0600) for the CLI
# (GRADMESH_AUTH_TOKEN_FILE). Namespace: $NAMESPACE (gradmesh).
#   deploy/k8s/make-secrets.sh            # create or replace them with kubectl apply
#   deploy/k8s/make-secrets.sh --print    # print the manifests instead (nothing applied)
set -euo pipefail
NAMESPACE="${NAMESPACE:-gradmesh}"
OUT_DIR="${OUT_DIR:-$HOME/.config/gradmesh}"
TLS_DIR="${TLS_DIR:-$OUT_DIR/tls}"
print=0
[ "${1:-}" = --print ] && print=1
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
umask 077
token() { head -c 24 /dev/urandom | base64 | tr -d '/+=\n'; }
if [ -n "${API_TOKEN_FILE:-}" ]; then cp "$API_TOKEN_FILE" "$tmp/api"; else token >"$tmp/api"; fi
if [ -n "${NODE_TOKEN_FILE:-}" ]; then cp "$NODE_TOKEN_FILE" "$tmp/node"; else token >"$tmp/node"; fi
cmp -s "$tmp/api" "$tmp/node" && { echo "make-secrets: the API and node tokens must differ" >&2; exit 2; }
# --print (the offline manifest test) makes throwaway certificates and touches nothing else.
[ "$print" = 1 ] && TLS_DIR="$tmp/tls"
ns="$NAMESPACE"
bash "$(dirname "$0")/../tls/make_certs.sh" "$TLS_DIR" gradmesh-coordinator \
  "gradmesh-coordinator.$ns.svc" "gradmesh-coordinator.$ns.svc.cluster.local" \
  "*.gradmesh-server.$ns.svc" "*.gradmesh-server.$ns.svc.cluster.local" \
  "*.gradmesh-worker.$ns.svc" "*.gradmesh-worker.$ns.svc.cluster.local" >&2
manifests() {
  kubectl create secret generic gradmesh-api-token --namespace="$NAMESPACE" \
    --from-file=token="$tmp/api" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic gradmesh-node-token --namespace="$NAMESPACE" \
    --from-file=token="$tmp/node" --dry-run=client -o yaml
  echo "---"
  kubectl create secret generic gradmesh-tls --namespace="$NAMESPACE" \
    --from-file=ca.pem="$TLS_DIR/ca.pem" --from-file=node.pem="$TLS_DIR/node.pem" \
    --from-file=node.key="$TLS_DIR/node.key" --dry-run=client -o yaml
}
if [ "$print" = 1 ]; then manifests; exit 0; fi
manifests | kubectl apply -f -
if [ -z "${API_TOKEN_FILE:-}" ]; then
  mkdir -p "$OUT_DIR" && cp "$tmp/api" "$OUT_DIR/api.token"
  echo "make-secrets: API token for the CLI in $OUT_DIR/api.token" >&2
fi
