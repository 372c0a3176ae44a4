#!/usr/bin/env bash
# Builds gradmesh_worker and training_loop_test against a CUDA LibTorch on a machine without
# Bazel, from the bundle of tests/gpu/make_bundle.py: compiles the translation units that
# include LibTorch (worker/model.cc, worker/training_loop.cc, worker/torch_device_gradients.cc,
# worker/training_loop_test.cc)
# against TORCH (a LibTorch folder with include/ and lib/, e.g. PyTorch's wheel), then links
# them with the bundle's objects and libraries. Run from the repository root:
#
#   TORCH=/path/to/torch bash tests/gpu/build_on_gpu.sh BUNDLE_DIR BUILD_DIR
#
# Leaves BUILD_DIR/worker/gradmesh_worker and BUILD_DIR/worker/training_loop_test (which find
# the bundle's and LibTorch's libraries by their rpath) and BUILD_DIR/server/gradmesh_server (a
# wrapper that runs the bundle's server with the bundle's libraries).
# Also works here against Debian's CPU LibTorch (TORCH=/usr, CUDA_LIBS=""), which is how the
# script itself is checked before a GPU is at hand.
set -euo pipefail
BUNDLE="$(cd "$1" && pwd)"
BUILD="$(mkdir -p "$2" && cd "$2" && pwd)"
: "${TORCH:?set TORCH to the LibTorch folder (include/ and lib/)}"
CUDA_LIBS="${CUDA_LIBS-torch_cuda c10_cuda}"
CXX="${CXX:-g++}"
TORCH_LIB="$TORCH/lib"
[ -d "$TORCH_LIB" ] || TORCH_LIB=/usr/lib/x86_64-linux-gnu
TORCH_INC="$TORCH/include"
mkdir -p "$BUILD/obj" "$BUILD/worker" "$BUILD/server"
# The server, built by Bazel here, finds the bundle's libraries through a wrapper (nothing
# else in the process sees them: they are Debian 12's, older than the GPU machine's own).
cat >"$BUILD/server/gradmesh_server" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$BUNDLE/lib" exec "$BUNDLE/bin/server/gradmesh_server" "\$@"
EOF
chmod +x "$BUILD/server/gradmesh_server"

# Every other object of the bundle was compiled with the C++11 ABI (Debian's default); so must
# these be, and so must the LibTorch they call.
std="${CXX_STD:-c++17}"
flags=(-std="$std" -O2 -fPIC -DNDEBUG -Wno-deprecated-declarations -I. -I"$BUNDLE/inc"
  -isystem "$TORCH_INC/torch/csrc/api/include" -D_GLIBCXX_USE_CXX11_ABI=1)
# (/usr/include, Debian's, is searched anyway; naming it would break the C library's headers.)
[ "$TORCH_INC" = /usr/include ] || flags+=(-isystem "$TORCH_INC")
compile() {  # src obj
  "$CXX" "${flags[@]}" -c "$1" -o "$2"
}
pids=()
[ "${LINK_ONLY:-0}" = 1 ] && tus=() ||
  tus=(model training_loop torch_device_gradients training_loop_test)
for tu in "${tus[@]}"; do
  compile "worker/$tu.cc" "$BUILD/obj/$tu.o" 2>"$BUILD/obj/$tu.log" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ "$rc" != 0 ]; then
  for tu in "${tus[@]}"; do
    [ -s "$BUILD/obj/$tu.log" ] && { echo "== $tu" >&2; grep -m 20 -E 'error' "$BUILD/obj/$tu.log" >&2 || true; }
  done
  echo "build_on_gpu: compiling the LibTorch translation units failed (std=$std)" >&2
  exit 1
fi

torch_libs=(-L"$TORCH_LIB" -Wl,-rpath,"$TORCH_LIB" -Wl,--no-as-needed)
for l in $CUDA_LIBS torch torch_cpu c10; do torch_libs+=("-l$l"); done
torch_libs+=(-Wl,--as-needed)
# LINK_ORDER=torch_first names LibTorch's libraries before the bundle's, so that where both
# export a symbol, LibTorch's wins (the dynamic linker takes the first in load order).
first=() last=("${torch_libs[@]}")
if [ "${LINK_ORDER:-}" = torch_first ]; then first=("${torch_libs[@]}") last=(); fi
link() {  # out args-file objs...
  local out="$1" args="$2"; shift 2
  # The args files name bundle objects relative to the bundle.
  mapfile -t rest < <(sed -e "s|^obj/|$BUNDLE/obj/|" "$BUNDLE/$args")
  "$CXX" -o "$out" "$@" "${first[@]}" -Wl,--start-group "${rest[@]}" -Wl,--end-group \
    -L"$BUNDLE/lib" -Wl,-rpath,"$BUNDLE/lib" -Wl,--allow-shlib-undefined \
    "${last[@]}" -lpthread -ldl -lm
}
# -rdynamic: without it, PyTorch 2.11's wheel aborted in torch::jit::load ("free(): invalid
# pointer") in these binaries; exporting the executable's symbols makes LibTorch and this code
# bind to one copy of what both define (measured on the H200 machine: tests/gpu/README.md).
link "$BUILD/worker/gradmesh_worker" worker.args -rdynamic "$BUILD/obj/model.o" \
  "$BUILD/obj/training_loop.o" "$BUILD/obj/torch_device_gradients.o"
link "$BUILD/worker/training_loop_test" test.args -rdynamic "$BUILD/obj/model.o" \
  "$BUILD/obj/training_loop.o" "$BUILD/obj/torch_device_gradients.o" \
  "$BUILD/obj/training_loop_test.o"
echo "build_on_gpu: built $BUILD/worker/gradmesh_worker and training_loop_test against $TORCH" >&2
