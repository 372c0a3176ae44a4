"""gradmesh_fuzz_target: one fuzz target source, two builds.

gradmesh_fuzz_target(name = "x_fuzz", srcs = ["x_fuzz.cc"], deps = [...]) makes
  :x_fuzz_lib     the target's code (defines LLVMFuzzerTestOneInput), alwayslink
  :x_fuzz_test    cc_test (gcc, the normal build): fuzz_driver.cc runs every file of
                  corpus/x_fuzz/ and then `runs` mutated and random inputs from a fixed seed,
                  so `bazel test //...` replays the corpus and the findings kept in it
  :x_fuzz         the libFuzzer binary; exists only under --config=fuzz (clang,
                  -fsanitize=fuzzer,address,undefined; tests/fuzz/run_fuzzers.sh), skipped by
                  `//...` otherwise
"""

def gradmesh_fuzz_target(name, srcs, deps, runs = 20000, size = "small"):
    native.cc_library(
        name = name + "_lib",
        testonly = True,
        srcs = srcs,
        deps = deps + ["//tests/fuzz:fuzz_util"],
        alwayslink = True,
    )
    native.cc_test(
        name = name + "_test",
        size = size,
        args = ["--runs=%d" % runs, "tests/fuzz/corpus/" + name],
        data = native.glob(["corpus/" + name + "/*"]),
        deps = [":" + name + "_lib", "//tests/fuzz:fuzz_driver"],
    )
    native.cc_binary(
        name = name,
        testonly = True,
        linkopts = ["-fsanitize=fuzzer"],
        target_compatible_with = select({
            "//tests/fuzz:fuzzing": [],
            "//conditions:default": ["//tests/fuzz:requires_config_fuzz"],
        }),
        deps = [":" + name + "_lib"],
    )
