#!/usr/bin/env python3
"""PyTorch DDP (gloo) baseline for the gradmesh mode comparison (tests/bench/modes.sh).

Trains the same model as gradmesh's built-in "mlp" (784-256-256-10, ReLU) on MNIST with the
same per-worker batch, epochs, optimizer (Adam, lr 1e-3, cosine schedule over the run) and
data normalisation, with N processes (DistributedDataParallel over gloo on 127.0.0.1, one
intra-op thread each, the system BLAS). Prints one JSON line:
  {"bench": "modes", "mode": "ddp_gloo", "workers": N, "samples_per_s": ..., "accuracy": ...,
   "wall_s": ..., "epochs": E, "batch": B}
samples_per_s counts every worker's samples over the training wall time (as gradmesh's
RESULT lines do). Run with Debian's /usr/bin/python3 (torch 1.13):
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/ddp_baseline.py --workers 2 --epochs 1
"""
import argparse
import gzip
import json
import math
import os
import struct
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find(d, name):
    for candidate in (os.path.join(d, name), os.path.join(d, name + ".gz")):
        if os.path.exists(candidate):
            return candidate
    raise FileNotFoundError(os.path.join(d, name))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 256)
        self.fc3 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def run(rank, args, port, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.workers)
    d = args.data_dir
    x = read_idx(find(d, "train-images-idx3-ubyte")).astype(np.float32) / 255.0
    y = read_idx(find(d, "train-labels-idx1-ubyte")).astype(np.int64)
    mean, std = float(x.mean()), float(x.std())
    x = torch.from_numpy((x - mean) / std).unsqueeze(1)
    y = torch.from_numpy(y)
    torch.manual_seed(args.seed)
    model = nn.parallel.DistributedDataParallel(Mlp())
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    n = x.shape[0]
    steps_per_epoch = n // (args.batch * args.workers)
    total = steps_per_epoch * args.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda u: 0.5 * (1 + math.cos(math.pi * min(u, total) / total)))
    g = torch.Generator().manual_seed(args.seed)
    dist.barrier()
    start = time.time()
    samples = 0
    for epoch in range(args.epochs):
        perm = torch.randperm(n, generator=g)
        for s in range(steps_per_epoch):
            base = s * args.batch * args.workers + rank * args.batch
            idx = perm[base:base + args.batch]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            sched.step()
            samples += args.batch
    dist.barrier()
    wall = time.time() - start
    if rank == 0:
        xt = read_idx(find(d, "t10k-images-idx3-ubyte")).astype(np.float32) / 255.0
        yt = torch.from_numpy(read_idx(find(d, "t10k-labels-idx1-ubyte")).astype(np.int64))
        xt = torch.from_numpy((xt - mean) / std).unsqueeze(1)
        with torch.no_grad():
            acc = (model.module(xt).argmax(1) == yt).float().mean().item()
        out.put({"bench": "modes", "mode": "ddp_gloo", "workers": args.workers,
                 "samples_per_s": round(samples * args.workers / wall, 1),
                 "accuracy": round(acc, 4), "wall_s": round(wall, 2),
                 "epochs": args.epochs, "batch": args.batch})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--data_dir", default=os.path.join(
        os.environ.get("GRADMESH_DATA_DIR", "/var/lib/gradmesh/data"), "mnist"))
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=run, args=(r, args, args.port, out)) for r in range(args.workers)]
    for proc in procs:
        proc.start()
    result = out.get()
    for proc in procs:
        proc.join()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
