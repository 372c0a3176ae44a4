#!/usr/bin/python3
"""The shard-count model of docs/scaling.md, fitted to ps_load's JSON lines.

  bazel-bin/tests/bench/ps_load > load.jsonl            # and any other --params sweeps
  /usr/bin/python3 tests/bench/ps_load_model.py load.jsonl [more.jsonl ...]
      [--cores 2] [--workers 100] [--params 1e9] [--step_times 1,5] [--link_gbps 25,100]
      [--cores_per_shard 16] [--util 0.7] [--slots 2] [--shard_mem_gb 64]

Fits, by least squares on the relative error, over every line read (each line is one
(shards, workers, params) point):
  shard CPU per update      = a + b * B    (B = bytes pushed to one shard per step = 4P/S;
                                            the update's pull returns as many)
  client CPU per shard-call = ac + bc * B  (client_cpu_us_per_step / S)
then prints, per point, the measured shard CPU per update next to the fit, and the measured
steps/s next to the ceiling the fit predicts for --cores cores shared by clients and shards:
  steps/s <= cores / (S*(a + b*B) + S*(ac + bc*B)).
Last, the shard hosts S a job of --params parameters, --workers workers and step time T needs
(k = --cores_per_shard usable cores, one NIC of L bits/s and M bytes of memory per host):
  CPU:     S >= (W/T) * b * 4P / (k*u - (W/T) * a)    (k cores per shard, u utilisation)
  network: S >= 4P * W / (T * u * L/8)               (per direction: pushes in, pulls out)
  memory:  S >= 4P * (1 + slots) / (u * M)
Python 3 standard library only.
"""

import argparse
import json
import math
import sys


def fit_line(xs, ys):
    """Least-squares y = a + b*x minimising the relative error (weights 1/y^2: the points span
    100 us to 6 ms, and a plain fit would ignore the small ones that set a). Returns (a, b,
    median relative error)."""
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    b = sxy / sxx if sxx > 0 else 0.0
    a = my - b * mx
    errs = sorted(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return a, b, errs[len(errs) // 2]


def read_points(paths):
    points = []
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    points.append(json.loads(line))
    return [p for p in points if p["updates"] > 0 and p["steps"] > 0]


def shards_needed(args, a_us, b_us_per_byte, t, link_gbps):
    """(S_cpu, S_net, S_mem) for the job of --params/--workers at step time t."""
    rate = args.workers / t  # steps/s over all workers
    bytes_per_step = 4 * args.params
    fixed = rate * a_us * 1e-6  # cores of per-message cost per shard
    avail = args.cores_per_shard * args.util - fixed
    s_cpu = math.inf if avail <= 0 else rate * b_us_per_byte * 1e-6 * bytes_per_step / avail
    s_net = bytes_per_step * args.workers / (t * args.util * link_gbps * 1e9 / 8)
    s_mem = bytes_per_step * (1 + args.slots) / (args.util * args.shard_mem_gb * 1e9)
    return s_cpu, s_net, s_mem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--cores", type=float, default=2, help="Cores of the measured machine.")
    ap.add_argument("--workers", type=int, default=100)
    ap.add_argument("--params", type=float, default=1e9)
    ap.add_argument("--step_times", default="1,5")
    ap.add_argument("--link_gbps", default="25,100")
    ap.add_argument("--cores_per_shard", type=float, default=16,
                    help="Usable cores per shard host: its cores, but at most clamp(cores/2, "
                    "2, 16) per gradmesh_server (gRPC's callback threads), so 16 means a "
                    "16-core host running two servers. S counts such hosts.")
    ap.add_argument("--util", type=float, default=0.7)
    ap.add_argument("--slots", type=int, default=2, help="Optimizer slots (Adam: 2).")
    ap.add_argument("--shard_mem_gb", type=float, default=64)
    args = ap.parse_args()
    pts = read_points(args.files)
    if len(pts) < 2:
        sys.exit("need at least two points")
    sizes = [p["bytes_per_update"] for p in pts]
    a, b, err = fit_line(sizes, [p["shard_cpu_us_per_update"] for p in pts])
    ac, bc, errc = fit_line(sizes, [p["client_cpu_us_per_step"] / p["shards"] for p in pts])
    print(f"points={len(pts)}")
    print(f"shard  us/update     = {a:.1f} + {b * 1e6:.1f} * MB   (median error {err:.0%}; "
          f"{b * 1e3:.3f} ns/byte)")
    print(f"client us/shard-call = {ac:.1f} + {bc * 1e6:.1f} * MB   (median error {errc:.0%})")
    print("| params | shards | workers | shard µs/update measured | fit | steps/s measured | "
          f"ceiling on {args.cores:g} cores | cores used (shards+client) |")
    print("|---|---|---|---|---|---|---|---|")
    for p in pts:
        s, bb = p["shards"], p["bytes_per_update"]
        per_step = s * (a + b * bb) + s * (ac + bc * bb)
        print(f"| {p['params']:,} | {s} | {p['workers']} | {p['shard_cpu_us_per_update']:.0f} | "
              f"{a + b * bb:.0f} | {p['steps_per_s']:.1f} | "
              f"{args.cores / per_step * 1e6:.1f} | {p['shard_cores'] + p['client_cores']:.2f} |")
    print(f"\nJob: P={args.params:g} params (fp32), W={args.workers}, {args.cores_per_shard:g} "
          f"cores/shard at u={args.util}, {args.slots} optimizer slots, "
          f"{args.shard_mem_gb:g} GB/shard")
    for t in (float(x) for x in args.step_times.split(",")):
        for link in (float(x) for x in args.link_gbps.split(",")):
            s_cpu, s_net, s_mem = shards_needed(args, a, b, t, link)
            need = max(s_cpu, s_net, s_mem)
            print(f"T={t:g}s link={link:g}Gbit/s: S_cpu={s_cpu:.1f} S_net={s_net:.1f} "
                  f"S_mem={s_mem:.2f} -> S={math.ceil(need)}")


if __name__ == "__main__":
    main()
