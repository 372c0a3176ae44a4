#!/usr/bin/python3
"""PyTorch gloo all-reduce baseline for //tests/bench:allreduce (Debian's /usr/bin/python3).

Starts --np processes (torch.multiprocessing), each with torch.distributed's gloo backend on
127.0.0.1, and times dist.all_reduce (sum) of float32 tensors of each size exactly like the
C++ benchmark: warm-up, a barrier, then --iters-style repetitions chosen by size, the time
of one all-reduce being the slowest rank's mean. Rank 0 prints one JSON line per size:

  {"impl": "gloo", "np": 2, "bytes": 1048576, "iters": 100, "time_us": ..., "algbw_gbps": ...,
   "busbw_gbps": ...}

with algbw = bytes / time and busbw = algbw * 2 (n - 1) / n (nccl-tests' definitions,
GB = 1e9 bytes).

    /usr/bin/python3 tests/bench/gloo_allreduce.py --np 2 --sizes 4096,1048576 --port 29512
"""
import argparse
import json
import os
import time


def iterations(nbytes, budget_bytes, lo, hi):
    return max(lo, min(hi, budget_bytes // max(nbytes, 1)))


def worker(rank, args):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=rank, world_size=args.np)
    n = args.np
    for nbytes in args.sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = iterations(nbytes, args.budget_bytes, args.min_iters, args.max_iters)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        mean = (time.perf_counter() - t0) / iters
        t = torch.tensor([mean], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            secs = t.item()
            algbw = nbytes / secs / 1e9
            print(json.dumps({
                "impl": "gloo", "np": n, "bytes": nbytes, "iters": iters,
                "time_us": round(secs * 1e6, 1), "algbw_gbps": round(algbw, 3),
                "busbw_gbps": round(algbw * 2 * (n - 1) / n, 3),
            }), flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--sizes", default="4096,16384,65536,262144,1048576,4194304,16777216,67108864")
    p.add_argument("--port", type=int, default=29512)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget_bytes", type=int, default=256 << 20)
    p.add_argument("--min_iters", type=int, default=5)
    p.add_argument("--max_iters", type=int, default=200)
    args = p.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(args,), nprocs=args.np, join=True)


if __name__ == "__main__":
    main()
