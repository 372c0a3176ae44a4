#!/usr/bin/python3
"""Packs what tests/gpu/run_on_gpu.sh needs on a GPU machine that has a CUDA LibTorch (PyTorch's
wheel: include/ and lib/ with libtorch_cuda) but no Bazel, gRPC, protobuf, Abseil or RocksDB.

Built here by Bazel (--dynamic_mode=off, so every library is a static archive or object):
  * gradmesh_server, whole (it has no LibTorch), with the shared libraries it loads;
  * gradmesh_worker and //worker:training_loop_test, as their link inputs minus the translation
    units that include LibTorch (worker/model.cc, worker/training_loop.cc,
    worker/torch_device_gradients.cc and the test's own source): those are compiled there, against that LibTorch's headers, and linked with these
    objects (tests/gpu/build_on_gpu.sh). Only those TUs see LibTorch's API, so only they must
    match its version (gradmesh keeps torch out of every other file for this reason too);
  * the headers those TUs include besides the repository's own (Abseil, protobuf, gtest, the
    generated *.pb.h) and the shared libraries every other object needs (gRPC, protobuf, Abseil,
    yaml-cpp, ... from Debian 12; the GPU machine's glibc is newer, so they load there);
  * the data: MNIST (for the loop's tests) and the KJV text (`bible -f`, for
    examples/kjv_transformer/make.py there).

Writes OUT/bundle.tar.xz (default OUT: .gpu, which .git/info/exclude should list so it travels
only as the device tool's `carry`). Prints one JSON line with the sizes.

  /usr/bin/python3 tests/gpu/make_bundle.py [--out .gpu]
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = {"worker": "//worker:gradmesh_worker", "test": "//worker:training_loop_test"}
# Translation units compiled on the GPU machine (they include LibTorch), by object path piece
# (//worker:training_loop's objects are training_loop.o and torch_device_gradients.o).
TORCH_TUS = ("/_objs/model/", "/_objs/training_loop/", "/_objs/training_loop_test/")
# Libraries the GPU machine brings itself (its LibTorch, its C and C++ runtimes).
SYSTEM_LIBS = re.compile(r"^(torch|torch_cpu|torch_cuda|c10|c10_cuda|c|m|dl|rt|pthread|stdc\+\+|"
                         r"gcc_s|gomp|atomic|openblas|blas|lapack|gfortran|quadmath|ld-linux-x86-64)$")
LIBDIR = "/usr/lib/x86_64-linux-gnu"


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, cwd=REPO, text=True, capture_output=True, **kw).stdout


def soname(path):
    out = run(["objdump", "-p", path])
    m = re.search(r"SONAME\s+(\S+)", out)
    return m.group(1) if m else os.path.basename(path)


def lib_name(soname_or_file):
    m = re.match(r"lib(.+?)\.so", os.path.basename(soname_or_file))
    return m.group(1) if m else ""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(REPO, ".gpu"))
    a = p.parse_args()
    flags = ["--dynamic_mode=off"]
    run(["bazel", "build", *flags, "//server:gradmesh_server", *TARGETS.values()])
    execroot = run(["bazel", "info", *flags, "execution_root"]).strip()
    bin_dir = run(["bazel", "info", *flags, "bazel-bin"]).strip()
    stage = os.path.join(a.out, "stage")
    shutil.rmtree(stage, ignore_errors=True)
    for d in ("obj", "lib", "inc", "bin", "data"):
        os.makedirs(os.path.join(stage, d))

    copied = {}  # execroot-relative path -> bundle-relative path

    def take(rel):
        if rel not in copied:
            dst = os.path.join("obj", "%d_%s" % (len(copied), os.path.basename(rel)))
            shutil.copy(os.path.join(execroot, rel), os.path.join(stage, dst))
            copied[rel] = dst
        return copied[rel]

    wanted_libs = set()
    for key, target in TARGETS.items():
        pkg, name = target[2:].split(":")
        params = os.path.join(bin_dir, pkg, name + "-2.params")
        args = []
        lines = open(params).read().split("\n")
        skip_next = False
        group = None  # Objects of a -Wl,--start-lib group (gold only): made into an archive.
        for line in lines:
            if skip_next:
                skip_next = False
                continue
            if not line or line == "-o":
                skip_next = line == "-o"
                continue
            if line == "-Wl,--start-lib":
                group = []
            elif line == "-Wl,--end-lib":
                if group:
                    archive = os.path.join("obj", "%d_group.a" % len(copied))
                    copied[archive] = archive
                    run(["ar", "rcs", os.path.join(stage, archive)] +
                        [os.path.join(stage, o) for o in group])
                    args.append(archive)
                group = None
            elif line.startswith("bazel-out/"):
                if any(t in line for t in TORCH_TUS):
                    continue
                (group if group is not None else args).append(take(line))
            elif line.startswith("-l"):
                if SYSTEM_LIBS.match(line[2:]):
                    continue
                wanted_libs.add(line[2:])
                args.append(line)
            elif line.startswith(("-Wl,-rpath", "-L", "-B", "-fuse-ld")):
                continue
            else:
                args.append(line)
        with open(os.path.join(stage, key + ".args"), "w") as f:
            f.write("\n".join(args) + "\n")

    # Shared libraries: what the link names (-lNAME, as the dev symlink and the soname) and what
    # the binaries built here load at run time, minus what the GPU machine has itself.
    libs = {}
    for name in wanted_libs:
        if name.startswith(":"):  # -l:FILE names the library's file (//bazel:tcmalloc's).
            real = os.path.realpath(os.path.join(LIBDIR, name[1:]))
            if not os.path.exists(real):
                sys.exit("make_bundle: no %s for -l%s" % (os.path.join(LIBDIR, name[1:]), name))
            libs[name[1:]] = real
            continue
        dev = os.path.join(LIBDIR, "lib%s.so" % name)
        static = os.path.join(LIBDIR, "lib%s.a" % name)
        if not os.path.exists(dev) and os.path.exists(static):  # gtest, gmock: archives only
            shutil.copy(static, os.path.join(stage, "lib"))
            continue
        if not os.path.exists(dev):
            sys.exit("make_bundle: no %s for -l%s" % (dev, name))
        real = os.path.realpath(dev)
        libs[soname(real)] = real
        link = os.path.join(stage, "lib", "lib%s.so" % name)
        if not os.path.lexists(link):
            os.symlink(soname(real), link)
    # (Not the worker's: built here, it loads Debian's LibTorch and all of that's dependencies.)
    for binary in (os.path.join(bin_dir, "server", "gradmesh_server"),):
        for line in run(["ldd", binary]).splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if m and not SYSTEM_LIBS.match(lib_name(m.group(1))):
                libs[m.group(1)] = os.path.realpath(m.group(2))
    # Their own dependencies too (gRPC's c-ares, re2, upb, ...).
    for path in [p for p in libs.values() if ".so" in os.path.basename(p)]:
        for line in run(["ldd", path]).splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if m and not SYSTEM_LIBS.match(lib_name(m.group(1))):
                libs.setdefault(m.group(1), os.path.realpath(m.group(2)))
    for so, real in libs.items():
        shutil.copy(real, os.path.join(stage, "lib", so))

    # Headers the LibTorch TUs include besides the repository's.
    for d in ("absl", "google/protobuf", "gtest", "gmock"):
        shutil.copytree(os.path.join("/usr/include", d), os.path.join(stage, "inc", d))
    os.makedirs(os.path.join(stage, "inc", "proto"))
    for h in glob.glob(os.path.join(bin_dir, "proto", "*.pb.h")):
        shutil.copy(h, os.path.join(stage, "inc", "proto"))
    os.makedirs(os.path.join(stage, "bin", "server"))
    shutil.copy(os.path.join(bin_dir, "server", "gradmesh_server"),
                os.path.join(stage, "bin", "server"))

    data_dir = os.environ.get("GRADMESH_DATA_DIR", "/var/lib/gradmesh/data")
    shutil.copytree(os.path.join(data_dir, "mnist"), os.path.join(stage, "data", "mnist"))
    with open(os.path.join(stage, "data", "kjv.txt"), "w") as f:
        subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL, stdout=f,
                       check=True)

    tar = os.path.join(a.out, "bundle.tar.xz")
    with tarfile.open(tar, "w:xz", preset=3) as t:
        t.add(stage, arcname="bundle")
    shutil.rmtree(stage)
    print(json.dumps({"bundle": tar, "bytes": os.path.getsize(tar), "objects": len(copied),
                      "libs": len(libs)}))


if __name__ == "__main__":
    main()
