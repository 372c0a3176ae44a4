"""Repository rule exposing Debian system libraries as cc_library targets.

Each library is described by pkg-config package names and/or extra linker flags.
`pkg-config --libs` (and `--cflags-only-I`) is run once when the repository is fetched,
so the build needs no network and follows whatever versions Debian installed.
"""

def _pkg_config(rctx, flag, pkgs):
    if not pkgs:
        return []
    res = rctx.execute(["pkg-config", flag] + pkgs)
    if res.return_code != 0:
        fail("pkg-config %s %s failed (run deploy/setup.sh first): %s" %
             (flag, " ".join(pkgs), res.stderr))
    return [f for f in res.stdout.strip().split(" ") if f]

def _system_libs_impl(rctx):
    build = ['package(default_visibility = ["//visibility:public"])', ""]
    for name, spec in rctx.attr.libs.items():
        parts = spec.split("|")
        pkgs = [p for p in parts[0].split(" ") if p]
        extra = [p for p in parts[1].split(" ") if p] if len(parts) > 1 else []
        includes = [p for p in parts[2].split(" ") if p] if len(parts) > 2 else []
        linkopts = _pkg_config(rctx, "--libs", pkgs) + extra
        copts = []
        # Include dirs outside /usr/include do not propagate through copts, so they are
        # linked into this repository and exported with `includes` (and their headers
        # declared, so sandboxed compiles see them).
        inc_dirs = []
        for i, path in enumerate(includes):
            link = "%s_include_%d" % (name, i)
            rctx.symlink(path, link)
            inc_dirs.append(link)
        for f in _pkg_config(rctx, "--cflags-only-I", pkgs):
            if f.startswith("-I") and f[2:] != "/usr/include":
                copts.append("-isystem" + f[2:])
        build.append("cc_library(")
        build.append('    name = "%s",' % (name + "_system" if name in rctx.attr.overrides else name))
        build.append("    linkopts = %s," % repr(linkopts))
        build.append("    copts = %s," % repr(copts))
        if inc_dirs:
            build.append("    hdrs = glob(%s)," % repr([d + "/**/*.h" for d in inc_dirs]))
            build.append("    includes = %s," % repr(inc_dirs))
        build.append("    defines = %s," % repr([]))
        build.append(")")
        build.append("")
        if name in rctx.attr.overrides:
            build.append('alias(name = "%s", actual = "%s")' % (name, rctx.attr.overrides[name]))
            build.append("")
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    rctx.file("BUILD", "\n".join(build))

system_libs = repository_rule(
    implementation = _system_libs_impl,
    attrs = {
        # name -> "pkg-config packages|extra linkopts|extra include dirs"
        "libs": attr.string_dict(mandatory = True),
        # name -> label: `name` becomes an alias of that label (which may select between
        # builds), and the library found here is `<name>_system`. Used for torch, which
        # --config=cuda can swap for a CUDA LibTorch (bazel/cuda.bzl).
        "overrides": attr.string_dict(default = {}),
    },
    environ = ["PKG_CONFIG_PATH"],
    local = True,
)
