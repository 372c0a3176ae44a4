#!/usr/bin/env bash
# Builds the gradmesh image from deploy/container/Containerfile with podman and checks it:
# `gradmesh_coordinator --helpfull` runs inside it, as the non-root user 10001.
#   deploy/container/build.sh                        -> localhost/gradmesh:latest
#   IMAGE=localhost/gradmesh:cuda BAZEL_CONFIG=cuda deploy/container/build.sh
# Environment: IMAGE, BAZEL_CONFIG (cuda for the GPU build), BASE_IMAGE (a Debian 12 image;
# default debian:12-slim from a registry, or, where none is reachable, one made here with
# debootstrap from Debian's mirrors and cached in $WORK/base), WORK (/var/tmp/gradmesh-image),
# PODMAN (podman; e.g. "podman --storage-driver=vfs" where overlayfs is unavailable).
# Slow (the build stage runs deploy/setup.sh and a full Bazel build: tens of minutes), so CI
# runs //tests/deploy:container_static_test instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE="${IMAGE:-localhost/gradmesh:latest}"
WORK="${WORK:-/var/tmp/gradmesh-image}"
read -r -a PODMAN <<<"${PODMAN:-podman}"
say() { echo "build.sh: $*" >&2; }
# The image tools are not part of deploy/setup.sh (CI does not need them): install them here.
for p in podman runc debootstrap; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$p" >/dev/null ||
    { say "apt-get install $p failed"; exit 1; }
done
command -v "${PODMAN[0]}" >/dev/null || { say "${PODMAN[0]} not found (apt-get install podman)"; exit 1; }
mkdir -p "$WORK"

# Base image: a registry's debian:12-slim, else debootstrap (Debian's mirrors only).
BASE_IMAGE="${BASE_IMAGE:-}"
if [ -z "$BASE_IMAGE" ]; then
  if "${PODMAN[@]}" pull -q docker.io/library/debian:12-slim >/dev/null 2>&1; then
    BASE_IMAGE=docker.io/library/debian:12-slim
  else
    BASE_IMAGE=localhost/gradmesh-base:bookworm
    if ! "${PODMAN[@]}" image exists "$BASE_IMAGE"; then
      say "no registry reachable: making $BASE_IMAGE with debootstrap"
      command -v debootstrap >/dev/null || { say "debootstrap not found (apt-get install debootstrap)"; exit 1; }
      rm -rf "$WORK/base"
      debootstrap --variant=minbase bookworm "$WORK/base" http://deb.debian.org/debian \
        >"$WORK/debootstrap.log" 2>&1 || { tail -5 "$WORK/debootstrap.log" >&2; exit 1; }
      tar -C "$WORK/base" -c . | "${PODMAN[@]}" import - "$BASE_IMAGE" >/dev/null
    fi
  fi
fi
say "base image $BASE_IMAGE"

# Where the default OCI runtime cannot start containers (seen in a VM with hybrid cgroups and
# capped rlimits: crun refuses), use runc with the limits this host allows.
RUN_OPTS=()
if ! "${PODMAN[@]}" run --rm --network=host "$BASE_IMAGE" true >/dev/null 2>&1; then
  RUN_OPTS=(--runtime=runc --ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=16384:16384)
  "${PODMAN[@]}" run --rm --network=host "${RUN_OPTS[@]}" "$BASE_IMAGE" true ||
    { say "podman cannot run containers here (tried the default runtime and runc)"; exit 1; }
  say "using ${RUN_OPTS[*]}"
fi

# Context: the repository's tracked files only (no bazel-* outputs, no untracked tokens).
ctx="$(mktemp -d "$WORK/context.XXXXXX")"
trap 'rm -rf "$ctx"' EXIT
git ls-files -z | xargs -0 -I{} sh -c '[ -e "{}" ] && printf "%s\0" "{}"' |
  tar --null -T - -c | tar -C "$ctx" -x
# The host's CA bundle, mounted only while setup.sh runs (a secret: not in any layer).
CA="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
[ -s "$CA" ] || { CA="$WORK/no-ca"; : >"$CA"; }
say "building $IMAGE (log: $WORK/build.log)"
if ! "${PODMAN[@]}" build --network=host "${RUN_OPTS[@]}" -f deploy/container/Containerfile \
    --secret id=cacerts,src="$CA" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg BAZEL_CONFIG="${BAZEL_CONFIG:-}" \
    -t "$IMAGE" "$ctx" >"$WORK/build.log" 2>&1; then
  tail -30 "$WORK/build.log" >&2; say "build failed"; exit 1
fi

# Check: the binaries run (their libraries are all there) and not as root.
"${PODMAN[@]}" run --rm --network=host "${RUN_OPTS[@]}" "$IMAGE" \
  gradmesh_coordinator --helpfull >"$WORK/help.txt" 2>&1 || true
grep -q -- '--data_dir' "$WORK/help.txt" ||
  { cat "$WORK/help.txt" >&2; say "gradmesh_coordinator --helpfull failed in $IMAGE"; exit 1; }
for b in gradmesh_server gradmesh_worker gradmesh; do
  "${PODMAN[@]}" run --rm --network=host "${RUN_OPTS[@]}" "$IMAGE" sh -c "ldd /usr/local/bin/$b" |
    grep -q 'not found' && { say "$b: missing libraries in $IMAGE"; exit 1; }
done
uid="$("${PODMAN[@]}" run --rm --network=host "${RUN_OPTS[@]}" "$IMAGE" id -u)"
[ "$uid" != 0 ] || { say "$IMAGE runs as root"; exit 1; }
say "OK: $IMAGE ($("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE") bytes), gradmesh_coordinator --helpfull runs inside as uid $uid"
