#!/usr/bin/env bash
# Makes a private CA and the certificates gradmesh's mTLS needs, with openssl:
#   DIR/ca.pem, ca.key          the CA (keep ca.key offline; only ca.pem is distributed)
#   DIR/node.pem, node.key      daemons (coordinator, servers, workers): serverAuth and
#                               clientAuth, SANs localhost, 127.0.0.1, ::1, this host's name
#                               and every HOST given (names or IP addresses)
#   DIR/client.pem, client.key  the gradmesh CLI: clientAuth only
#
#   deploy/tls/make_certs.sh DIR [HOST...]
#   gradmesh_coordinator --tls_cert_file=DIR/node.pem --tls_key_file=DIR/node.key \
#       --tls_ca_file=DIR/ca.pem --tls_client_auth ...
#   gradmesh --tls_cert_file=DIR/client.pem --tls_key_file=DIR/client.key \
#       --tls_ca_file=DIR/ca.pem ...
#
# An existing CA in DIR is reused (so certificates can be renewed under the same CA); the
# leaf certificates are replaced atomically (written beside, then renamed), which the daemons
# pick up within 10 s without a restart. Environment: DAYS (leaf validity, default 365),
# CA_DAYS (default 3650), CA_CN (default "gradmesh CA"), NODE_CN, CLIENT_CN. EC P-256 keys.
#
# Kubernetes: give the node certificate the Services' DNS names as HOSTs (e.g.
# gradmesh-coordinator.gradmesh.svc, *.gradmesh-server.gradmesh.svc), put the files in a Secret
#   kubectl -n gradmesh create secret generic gradmesh-tls \
#     --from-file=ca.pem=DIR/ca.pem --from-file=node.pem=DIR/node.pem --from-file=node.key=DIR/node.key
# and mount it as a volume (not with subPath, so that an updated Secret reaches the pod) at
# /etc/gradmesh/tls, with --tls_cert_file=/etc/gradmesh/tls/node.pem
# --tls_key_file=/etc/gradmesh/tls/node.key --tls_ca_file=/etc/gradmesh/tls/ca.pem
# --tls_client_auth on every daemon. The kubelet swaps the files atomically when the Secret
# changes; the daemons pick the new certificate up within 10 s.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 DIR [HOST...]" >&2
  exit 2
fi
dir=$1
shift
days=${DAYS:-365}
mkdir -p "$dir"
umask 077
tmp=$(mktemp -d "$dir/.make_certs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

if [ ! -f "$dir/ca.pem" ] || [ ! -f "$dir/ca.key" ]; then
  openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/ca.key"
  openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days "${CA_DAYS:-3650}" \
    -subj "/CN=${CA_CN:-gradmesh CA}" -out "$tmp/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  mv "$tmp/ca.key" "$dir/ca.key"
  mv "$tmp/ca.pem" "$dir/ca.pem"
fi

sans="DNS:localhost,IP:127.0.0.1,IP:::1"
host=$(hostname 2>/dev/null || true)
[ -n "$host" ] && [ "$host" != localhost ] && sans="$sans,DNS:$host"
for h in "$@"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then sans="$sans,IP:$h"; else sans="$sans,DNS:$h"; fi
done

# leaf NAME CN EXTENDED_KEY_USAGE SANS
leaf() {
  local name=$1 cn=$2 eku=$3 san=$4
  openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/$name.key"
  openssl req -new -key "$tmp/$name.key" -subj "/CN=$cn" -out "$tmp/$name.csr"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [ -n "$san" ] && echo "subjectAltName=$san"
  } >"$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -CAserial "$tmp/ca.srl" -days "$days" -sha256 \
    -extfile "$tmp/$name.ext" -out "$tmp/$name.pem" 2>/dev/null
  chmod 600 "$tmp/$name.key"
  chmod 644 "$tmp/$name.pem"
  # Key first, then certificate: a reader between the two renames sees a mismatched pair for
  # a moment and keeps its previous credentials (gRPC checks the pair).
  mv "$tmp/$name.key" "$dir/$name.key"
  mv "$tmp/$name.pem" "$dir/$name.pem"
}

leaf node "${NODE_CN:-gradmesh-node}" "serverAuth,clientAuth" "$sans"
leaf client "${CLIENT_CN:-gradmesh-client}" "clientAuth" ""
chmod 644 "$dir/ca.pem"
echo "make_certs: wrote $dir/{ca,node,client}.{pem,key} (node SANs: $sans)"
