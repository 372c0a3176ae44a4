#!/usr/bin/python3
"""PyTorch baseline for //tests/bench:compression (run with Debian's /usr/bin/python3).

One intra-op thread, 25M (and 1M) random normal float32 values; for each operation prints
one JSON line: op, elements, k (top-k only), median seconds over the repetitions, and
gb_per_s (GB/s of float32 input, i.e. 4 bytes per element, 1e9 bytes/s), the same unit as
the C++ benchmark. Ops that return a new tensor (x.half(), x.abs() inside topk, clone) pay for
allocating it (a fresh mmap and page faults at 25M); the copy_ variants write into
preallocated tensors, as the C++ benchmark does.

    /usr/bin/python3 tests/bench/torch_topk_baseline.py [--reps 5] [--sizes 1000000,25000000]
"""
import argparse
import json
import statistics
import time

import torch


def median_seconds(fn, reps):
    fn()  # warm-up (allocations, lazy init)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sizes", default="1000000,25000000")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    for n in [int(s) for s in args.sizes.split(",")]:
        x = torch.randn(n, generator=gen, dtype=torch.float32)
        nbytes = 4 * n
        ops = []
        for ratio in (0.01, 0.001):
            k = max(1, int(-(-ratio * n // 1)))
            ops.append(("topk(x.abs(),k) ratio=%g" % ratio, k,
                        lambda k=k: torch.topk(x.abs(), k)))
        ops.append(("x.half()", None, lambda: x.half()))
        ops.append(("x.bfloat16()", None, lambda: x.bfloat16()))
        h = x.half()
        b = x.bfloat16()
        ops.append(("half.float()", None, lambda: h.float()))
        ops.append(("bfloat16.float()", None, lambda: b.float()))
        # The same conversions into preallocated tensors (no allocation / page faults), which
        # is how the C++ benchmark reuses its buffers.
        h_out = torch.empty(n, dtype=torch.float16)
        b_out = torch.empty(n, dtype=torch.bfloat16)
        f_out = torch.empty(n, dtype=torch.float32)
        ops.append(("h_out.copy_(x)", None, lambda: h_out.copy_(x)))
        ops.append(("b_out.copy_(x)", None, lambda: b_out.copy_(x)))
        ops.append(("f_out.copy_(h)", None, lambda: f_out.copy_(h)))
        ops.append(("f_out.copy_(b)", None, lambda: f_out.copy_(b)))
        ops.append(("x.clone()", None, lambda: x.clone()))
        ops.append(("f_out.copy_(x)", None, lambda: f_out.copy_(x)))
        for name, k, fn in ops:
            s = median_seconds(fn, args.reps)
            rec = {"op": name, "elements": n}
            if k is not None:
                rec["k"] = k
            rec["seconds"] = round(s, 5)
            rec["gb_per_s"] = round(nbytes / s / 1e9, 3)
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
