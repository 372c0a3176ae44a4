#!/usr/bin/python3
"""Plain-PyTorch reference for gradmesh's TorchScript / "tensors" benchmark (examples/).

Trains the same TorchScript model file on the same "tensors" dataset (DIR/train*.pt, DIR/test*.pt,
each torch.save({"x": X, "y": Y})) with the same batch size per worker, optimizer, learning-rate
schedule, steps and seed as a gradmesh job, and reports throughput and test metrics:
  single      one process (default), --threads intra-op threads (default 1)
  --ddp N     DistributedDataParallel over gloo, N processes with 1 thread each, FileStore
              rendezvous in /tmp, sockets on loopback (as ../shared/peers/torch_baseline.py)
Data order: every epoch a permutation of all training samples (torch.randperm with a
Generator seeded with --seed, advanced once per epoch); step s of rank r takes
perm[(s * N + r) * batch : ... + batch] (N = 1 without --ddp); a partial last batch is dropped.
The initial weights are the ones in the model file (its make.py seeded them).
Optimizers and schedule follow proto/gradmesh.proto OptimizerSpec: sgd (momentum, dampening,
nesterov, weight_decay), adam (L2 weight_decay), adamw (decoupled); lr_schedule constant or
cosine: lr * (m + (1 - m) * (1 + cos(pi * min(u, D) / D)) / 2), D = the run's total steps unless
--decay_steps, m = --min_lr_fraction, times (u + 1) / warmup during the first --warmup_steps.
Test metrics (examples/evaluate.py's definitions: test_loss per prediction, accuracy, perplexity
for [N, T] targets) on DIR/test*.pt in eval mode after training.

Prints one line "RESULT {json}" (the peers' convention; progress goes to stderr) with
samples_per_s = samples of all workers / training wall time (data loading and evaluation
excluded), steps, train_s, test_loss, accuracy, perplexity, ...
  /usr/bin/python3 tests/bench/torch_reference.py --model /tmp/fashion/model.pt --data /tmp/fashion/data \
      --batch 64 --optimizer sgd --lr 0.05 --momentum 0.9 --steps 200
--device cuda (single process only) trains on the GPU: the model moves there once, every batch is
indexed on the CPU and copied over (as gradmesh's worker does), the timer stops after a
torch.cuda.synchronize(); evaluation runs there too, and --save_state saves a CPU copy.
--save_state F writes the trained state_dict (torch.save(model.state_dict())) for evaluate.py.
"""
import argparse
import glob
import importlib.util
import json
import math
import os
import queue
import sys
import tempfile
import time

T_START = time.time()


def _threads_from_argv(argv):
    # Must be decided before torch loads: OPENBLAS_NUM_THREADS is read when the BLAS library starts.
    if "--threads" in argv:
        return argv[argv.index("--threads") + 1]
    return "1"


for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, _threads_from_argv(sys.argv))
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _evaluate_module():
    spec = importlib.util.spec_from_file_location("gm_evaluate", os.path.join(REPO, "examples", "evaluate.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def load_train(data_dir):
    files = sorted(glob.glob(os.path.join(data_dir, "train*.pt")))
    if not files:
        sys.exit(f"torch_reference.py: {data_dir}: no train*.pt files")
    xs, ys = [], []
    for f in files:
        d = torch.load(f, map_location="cpu")
        xs.append(d["x"])
        ys.append(d["y"])
    return torch.cat(xs), torch.cat(ys), len(files)


def loss_of(model, loss, x, y):
    if loss == "module":
        return model.loss(x, y)
    out = model(x)
    if loss == "mse":
        return F.mse_loss(out, y.to(out.dtype))
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # mean per prediction


def make_optimizer(params, a):
    if a.optimizer == "sgd":
        return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum, dampening=a.dampening,
                               nesterov=a.nesterov, weight_decay=a.weight_decay)
    cls = torch.optim.Adam if a.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, weight_decay=a.weight_decay)


def lr_factor(a, total):
    decay = a.decay_steps or total

    def f(u):
        s = 1.0
        if a.lr_schedule == "cosine":
            m = a.min_lr_fraction
            s = m + (1 - m) * (1 + math.cos(math.pi * min(u, decay) / decay)) / 2
        if u < a.warmup_steps:
            s *= (u + 1) / a.warmup_steps
        return s
    return f


def train(rank, world, a, store_path, q):
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_load = time.time()
    x, y, nfiles = load_train(a.data)
    load_s = time.time() - t_load
    model = torch.jit.load(a.model, map_location="cpu")
    dev = torch.device(a.device)
    model.to(dev)
    model.train()
    net = model
    if world > 1:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", init_method="file://" + store_path, rank=rank, world_size=world)
        # DDP broadcasts rank 0's parameters and buffers; gloo cannot send bool tensors ("Invalid
        # scalar type"), so bool buffers (kjv_transformer's causal_mask: constant) are left out.
        skip = [name for name, b in model.named_buffers() if b.dtype == torch.bool]
        if skip:
            DDP._set_params_and_buffers_to_ignore_for_model(model, skip)
        net = DDP(model)
    opt = make_optimizer(model.parameters(), a)
    n = x.shape[0]
    per_epoch = n // (a.batch * world)
    if per_epoch == 0:
        sys.exit(f"torch_reference.py: {n} samples < batch {a.batch} x {world} workers")
    total = a.steps or per_epoch * a.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(a, total))
    g = torch.Generator().manual_seed(a.seed)
    if world > 1:
        dist.barrier()
    t0 = time.time()
    perm, losses = None, []
    for step in range(total):
        s = step % per_epoch
        if s == 0:
            perm = torch.randperm(n, generator=g)
        base = (s * world + rank) * a.batch
        idx = perm[base:base + a.batch]
        opt.zero_grad(set_to_none=True)
        loss = loss_of(net, a.loss, x[idx].to(dev), y[idx].to(dev))
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and (step + 1) % a.log_every == 0:
            losses.append(float(loss))
            print(f"step {step + 1}/{total} loss {losses[-1]:.4f} {(step + 1) * a.batch * world / (time.time() - t0):.1f} "
                  "samples/s", file=sys.stderr, flush=True)
    if world > 1:
        dist.barrier()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0
    res = dict(rank=rank, steps=total, samples=total * a.batch, train_s=train_s, load_s=load_s,
               train_samples=n, train_files=nfiles, final_train_loss=float(loss))
    if rank == 0:
        model.eval()
        t1 = time.time()
        metrics = _evaluate_module().evaluate(model, a.data, a.loss, a.eval_batch)
        for k in ("samples", "predictions", "files"):  # keep the training counts under their own names
            metrics["test_" + k] = metrics.pop(k)
        res.update(metrics)
        res["eval_s"] = time.time() - t1
        if a.save_state:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, a.save_state)
    if world > 1:
        dist.destroy_process_group()
    if q is None:
        return res
    q.put(res)


def run_ddp(a):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    fd, store = tempfile.mkstemp(prefix="torch_reference_store_", dir="/tmp")
    os.close(fd)
    os.unlink(store)  # FileStore creates it
    procs = [ctx.Process(target=train, args=(r, a.ddp, a, store, q)) for r in range(a.ddp)]
    for p in procs:
        p.start()
    res = []
    while len(res) < len(procs):  # a worker that dies never reports: fail instead of waiting forever
        try:
            res.append(q.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
                sys.exit(f"torch_reference.py: a DDP worker failed (exit codes {dead}); see its traceback above")
    for p in procs:
        p.join()
    if os.path.exists(store):
        os.unlink(store)
    out = next(r for r in res if r["rank"] == 0)
    out["samples"] = sum(r["samples"] for r in res)
    out["train_s"] = max(r["train_s"] for r in res)
    out["load_s"] = max(r["load_s"] for r in res)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="TorchScript module file")
    p.add_argument("--data", required=True, help="tensors dataset directory (train*.pt, test*.pt)")
    p.add_argument("--loss", choices=["cross_entropy", "mse", "module"], default="cross_entropy")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    p.add_argument("--steps", type=int, default=0, help="steps per worker (0: --epochs)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=1, help="data order (the weights come from the model file)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--dampening", type=float, default=0.0)
    p.add_argument("--nesterov", action="store_true")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--lr_schedule", choices=["constant", "cosine"], default="constant")
    p.add_argument("--decay_steps", type=int, default=0, help="cosine D (0: the run's total steps)")
    p.add_argument("--min_lr_fraction", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--ddp", type=int, default=0, help="N > 1: DDP over gloo with N processes")
    p.add_argument("--eval_batch", type=int, default=256)
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="single process: where to train")
    p.add_argument("--save_state", default=None, help="torch.save(model.state_dict()) here after training")
    a = p.parse_args()
    world = a.ddp if a.ddp > 1 else 1
    if world > 1 and a.device != "cpu":
        sys.exit("torch_reference.py: --device cuda is for a single process")
    r = run_ddp(a) if world > 1 else train(0, 1, a, None, None)
    r.pop("rank", None)
    r.update(bench="torch_reference", mode="ddp_gloo" if world > 1 else "single", workers=world,
             threads=a.threads, device=a.device, batch=a.batch, optimizer=a.optimizer, lr=a.lr, seed=a.seed,
             model=a.model, data=a.data, torch=torch.__version__,
             samples_per_s=r["samples"] / r["train_s"], wall_s=time.time() - T_START)
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
