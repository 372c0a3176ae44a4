#!/usr/bin/env bash
# deploy/container/Containerfile, checked without building it (a real build takes tens of
# minutes: deploy/container/build.sh): the COPY sources exist in the build context; the
# runtime stage installs exactly the Debian packages that own the four binaries' DT_NEEDED
# libraries (plus libopenblas0-pthread, LibTorch's BLAS); its USER is not root; no token,
# key or password is copied or set; build.sh parses. Negative cases prove it can fail.
set -euo pipefail
fail() { echo "FAIL: $*"; exit 1; }
CF=deploy/container/Containerfile
[ -s "$CF" ] || fail "$CF missing"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
EXTRA="libopenblas0-pthread"
BINS=(coordinator/gradmesh_coordinator server/gradmesh_server worker/gradmesh_worker cli/gradmesh)

# Packages owning the binaries' DT_NEEDED libraries (one dpkg -S for all; merged /usr: dpkg
# knows a library under /lib or /usr/lib, so ask for both and the resolved path).
for b in "${BINS[@]}"; do
  [ -x "$b" ] || fail "$b not built (run through bazel test)"
  readelf -d "$b" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p'
done | sort -u >"$tmp/needed"
/sbin/ldconfig -p >"$tmp/ldconfig"
: >"$tmp/paths"
while read -r lib; do
  path="$(awk -v l="$lib" '$1 == l { print $NF; exit }' "$tmp/ldconfig")"
  [ -n "$path" ] || fail "$lib: not found by ldconfig"
  real="$(readlink -f "$path")"
  printf '%s\n' "$path" "/usr$path" "${path#/usr}" "$real" "/usr$real" "${real#/usr}" >>"$tmp/paths"
done <"$tmp/needed"
sort -u "$tmp/paths" | xargs dpkg -S 2>/dev/null >"$tmp/owners" || true
while read -r lib; do
  grep -E "/${lib//./\\.}\$" "$tmp/owners" >/dev/null ||
    grep -F "$(basename "$(readlink -f "$(awk -v l="$lib" '$1 == l { print $NF; exit }' "$tmp/ldconfig")")")" "$tmp/owners" >/dev/null ||
    fail "$lib: no Debian package owns it"
done <"$tmp/needed"
cut -d: -f1 "$tmp/owners" | sort -u >"$tmp/want"

runtime_packages() {  # Containerfile -> the package names after the runtime-packages marker
  sed -n '/^# runtime-packages:/,/rm -rf/p' "$1" | tr ' \\' '\n\n' |
    grep -E '^[a-z0-9][a-z0-9.+-]+$' | grep -vE '^(apt-get|update|install|rm|run|-q|-y)$' | sort -u
}
check() {  # Containerfile -> 0 if it passes every check; prints what is wrong
  local cf="$1" bad=0
  runtime_packages "$cf" >"$tmp/have"
  { cat "$tmp/want"; tr ' ' '\n' <<<"$EXTRA"; } | sort -u >"$tmp/expect"
  if ! cmp -s "$tmp/have" "$tmp/expect"; then
    echo "runtime packages differ from what the binaries need (< Containerfile, > needed):"
    diff "$tmp/have" "$tmp/expect" || true
    bad=1
  fi
  # COPY sources (not --from a stage) exist in the build context (the repository root).
  while read -r src; do
    [ -e "$src" ] || { echo "COPY source $src does not exist"; bad=1; }
  done < <(grep -E '^COPY ' "$cf" | grep -v -- '--from=' | awk '{ for (i = 2; i < NF; i++) print $i }')
  local user
  user="$(awk '/^FROM /{u=""} /^USER /{u=$2} END{print u}' "$cf")"
  case "${user%%:*}" in
    "" | root | 0) echo "the runtime stage runs as root (USER '${user}')"; bad=1 ;;
  esac
  if grep -inE '^(COPY|ADD|ENV|ARG).*(token|secret|passw|\.key|\.pem)' "$cf"; then
    echo "a secret-looking file or variable is baked in"; bad=1
  fi
  return "$bad"
}
check "$CF" || fail "$CF"
bash -n deploy/container/build.sh || fail "build.sh does not parse"
echo "Containerfile: runtime packages = $(tr '\n' ' ' <"$tmp/expect")"

# Negative cases.
sed 's/ libtorch1.13 / /' "$CF" >"$tmp/cf1"
check "$tmp/cf1" >/dev/null && fail "a missing runtime package passed"
sed 's/^USER .*/USER root/' "$CF" >"$tmp/cf2"
check "$tmp/cf2" >/dev/null && fail "USER root passed"
sed 's#^COPY \. /src#COPY nonexistent/ /src#' "$CF" >"$tmp/cf3"
check "$tmp/cf3" >/dev/null && fail "a missing COPY source passed"
{ cat "$CF"; echo "COPY api.token /etc/gradmesh/"; } >"$tmp/cf4"
check "$tmp/cf4" >/dev/null && fail "a copied token passed"
echo "PASS: Containerfile static checks; negative cases rejected"
