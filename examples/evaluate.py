#!/usr/bin/python3
"""Independent check of a gradmesh export: evaluates a TorchScript module with an exported state_dict
on a "tensors" test set, with plain PyTorch.

  /usr/bin/python3 examples/evaluate.py --model model.pt --state exported.pt --data DIR [--loss cross_entropy]

Loads the TorchScript module (--model), load_state_dict(torch.load(--state), strict=True) (every
parameter and buffer must be there, with its shape; nothing else may be), model.eval(), then runs
every DIR/test*.pt file (torch.save({"x": X, "y": Y})), in name order, in batches without autograd.
Prints one JSON line, with gradmesh's definitions (worker/model.h, EvalMetrics):
  test_loss   mean loss per prediction: per sample for [N, C] logits vs int64 [N], per token for
              [N, T, C] vs integer [N, T] (cross_entropy); per sample for mse (mean over the elements of
              each sample, then over samples) and for module (the module's loss(x, y), a batch mean)
  accuracy    cross_entropy only: arg-max of the logits == y, per sample or per token
  perplexity  cross_entropy over [N, T] targets only: exp(test_loss)
plus samples, predictions and files. Keys that do not apply are left out. Without --state the
module's own weights are evaluated. Exit status 1 with a message on stderr when anything does not fit.
"""
import argparse
import glob
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

LOSSES = ("cross_entropy", "mse", "module")


def load_state(path):
    """The state_dict in `path`: a torch.save'd dict, or (fallback) a TorchScript archive's state_dict."""
    try:
        obj = torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - not a pickled object: maybe a TorchScript archive
        try:
            obj = torch.jit.load(path, map_location="cpu")
        except Exception:  # noqa: BLE001
            raise ValueError(f"{path}: not a torch.save'd state_dict ({e})") from None
    if isinstance(obj, torch.jit.ScriptModule):
        obj = obj.state_dict()
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{path}: expected a dict of name -> Tensor, got {type(obj).__name__}")
    return obj


def test_files(data_dir):
    files = sorted(glob.glob(os.path.join(data_dir, "test*.pt")))
    if not files:
        raise ValueError(f"{data_dir}: no test*.pt files")
    return files


def load_split(path):
    d = torch.load(path, map_location="cpu")
    if not isinstance(d, dict) or "x" not in d or "y" not in d:
        raise ValueError(f"{path}: expected torch.save({{'x': X, 'y': Y}})")
    x, y = d["x"], d["y"]
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"{path}: x has {x.shape[0]} samples, y {y.shape[0]}")
    return x, y


class Totals:
    """Running sums in gradmesh's EvalTotals sense."""

    def __init__(self):
        self.loss_sum = 0.0     # sum of per-prediction losses (per-sample for mse / module)
        self.samples = 0
        self.predictions = 0
        self.correct = 0
        self.classification = False
        self.sequence = False

    def metrics(self):
        out = {"test_loss": self.loss_sum / max(1, self.predictions), "samples": self.samples,
               "predictions": self.predictions}
        if self.classification:
            out["accuracy"] = self.correct / max(1, self.predictions)
        if self.sequence:
            out["perplexity"] = math.exp(out["test_loss"]) if out["test_loss"] < 700 else float("inf")
        return out


def prediction(out):
    """As the worker takes it: the tensor, the first of a tuple or list, or a dict's "logits"
    or "out" entry."""
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0]
    if isinstance(out, dict):
        for key in ("logits", "out"):
            if torch.is_tensor(out.get(key)):
                return out[key]
    if not torch.is_tensor(out):
        raise ValueError(f"forward returned a {type(out).__name__}, not a prediction tensor")
    return out


def batch_loss(model, loss, x, y, totals):
    """Adds batch (x, y) to totals (no autograd; the caller sets eval mode)."""
    n = x.shape[0]
    totals.samples += n
    if loss == "module":
        totals.loss_sum += float(model.loss(x, y)) * n
        totals.predictions += n
        return
    out = prediction(model(x))
    if loss == "mse":
        # As the worker (MseTarget): y of the output's shape, or [N] for an output [N, 1].
        if out.dim() == 2 and out.shape[1] == 1 and y.dim() == 1 and y.shape[0] == n:
            y = y.unsqueeze(1)
        if out.shape != y.shape:
            raise ValueError(f"mse: output {tuple(out.shape)} vs y {tuple(y.shape)} "
                             "(want the output's shape, or [N] for an output [N, 1])")
        per_sample = F.mse_loss(out.float(), y.float(), reduction="none").reshape(n, -1).mean(1)
        totals.loss_sum += float(per_sample.sum())
        totals.predictions += n
        return
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"cross_entropy: y must be integer class indices, got {y.dtype}")
    y = y.long()  # Any integer dtype, as the worker takes it.
    if out.dim() == 2 and y.dim() == 2 and y.shape[1] == 1 and y.shape[0] == n:
        y = y.reshape(-1)  # A label column [N, 1] is the [N] it stands for, as in the worker.
    if out.dim() != y.dim() + 1 or out.shape[:-1] != y.shape:
        raise ValueError(f"cross_entropy: logits {tuple(out.shape)} do not fit y {tuple(y.shape)} "
                         "(want [N,C] with [N] or [N,T,C] with [N,T])")
    logits = out.reshape(-1, out.shape[-1]).float()
    target = y.reshape(-1)
    totals.loss_sum += float(F.cross_entropy(logits, target, reduction="sum"))
    totals.correct += int((logits.argmax(1) == target).sum())
    totals.predictions += target.numel()
    totals.classification = True
    totals.sequence = y.dim() == 2


@torch.no_grad()
def evaluate(model, data_dir, loss="cross_entropy", batch=256):
    """Metrics of `model` (already in eval mode, on any device) on data_dir/test*.pt."""
    totals = Totals()
    files = test_files(data_dir)
    device = next(iter(model.parameters())).device  # batches go where the model is
    for path in files:
        x, y = load_split(path)
        for i in range(0, x.shape[0], batch):
            batch_loss(model, loss, x[i:i + batch].to(device), y[i:i + batch].to(device), totals)
    out = totals.metrics()
    out["files"] = [os.path.basename(f) for f in files]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="TorchScript module (torch.jit.save)")
    p.add_argument("--state", default=None, help="exported state_dict (gradmesh export / torch.save)")
    p.add_argument("--data", required=True, help="directory with test*.pt")
    p.add_argument("--loss", choices=LOSSES, default="cross_entropy")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0 = torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model = torch.jit.load(a.model, map_location="cpu")
        if a.state:
            state = load_state(a.state)
            try:
                model.load_state_dict(state, strict=True)
            except RuntimeError as e:
                raise ValueError(f"{a.state} does not fit {a.model}: {e}") from None
        model.eval()
        out = evaluate(model, a.data, a.loss, a.batch)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"evaluate.py: {e}", file=sys.stderr)
        sys.exit(1)
    out.update(model=a.model, state=a.state, loss=a.loss)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
