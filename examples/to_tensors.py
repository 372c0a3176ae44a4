#!/usr/bin/python3
"""Converts arrays or a torchvision-style dataset into a gradmesh "tensors" dataset directory.

gradmesh's `dataset: {name: tensors, path: DIR}` reads DIR/train*.pt and DIR/test*.pt, each
written by torch.save({"x": X, "y": Y}, f): X and Y contiguous tensors with the same first
(sample) dimension, the same dtypes and per-sample shapes in every file. This script writes
them, split into files of at most --shard_size samples:

  OUT/train-00000.pt, OUT/train-00001.pt, ...   OUT/test-00000.pt, ...

Sources (run with /usr/bin/python3; needs numpy and torch, and torchvision for --torchvision):

  NumPy arrays:     --x X.npy --y Y.npy [--test_x TX.npy --test_y TY.npy]
                    (an .npz member is named FILE.npz:KEY, e.g. --x data.npz:x_train)
                    Without --test_x/--test_y, the last --test_fraction of the samples
                    (default 0.1; after an optional --shuffle) becomes the test set.
  torchvision:      --torchvision FashionMNIST --root DIR [--download]
                    (a class of torchvision.datasets, or a full import path such as
                    mypkg.data.MyDataset, constructed as Class(root, train=True/False)).
                    Datasets with .data/.targets (MNIST family, CIFAR) are converted whole;
                    others sample by sample: x = numpy.asarray(image), y = label.

dtypes are kept (float32/64/16, int64/32/16/8, uint8, bool) unless --x_dtype/--y_dtype name
another (e.g. --x_dtype float32 --scale 255 divides by 255 after the cast). Example:

  /usr/bin/python3 examples/to_tensors.py --x images.npy --y labels.npy --out /data/mine \\
      --shard_size 50000 --x_dtype float32 --scale 255

Prints one JSON line: the files written, sample counts and per-sample shapes and dtypes.
"""
import argparse
import importlib
import json
import os
import sys

import numpy as np
import torch

SUPPORTED = {np.dtype(t) for t in ("float32", "float64", "float16", "int64", "int32", "int16",
                                   "int8", "uint8", "bool")}


def load_array(spec):
    """FILE.npy, or FILE.npz:KEY."""
    if ".npz:" in spec:
        path, key = spec.rsplit(":", 1)
        with np.load(path) as z:
            if key not in z:
                sys.exit(f"to_tensors: {path} has no array {key!r} (has {sorted(z.files)})")
            return z[key]
    if spec.endswith(".npz"):
        sys.exit(f"to_tensors: name the array of {spec} as {spec}:KEY")
    return np.load(spec, allow_pickle=False)


def from_torchvision(name, root, train, download):
    if "." in name:
        module, cls = name.rsplit(".", 1)
    else:
        module, cls = "torchvision.datasets", name
    ds = getattr(importlib.import_module(module), cls)(root, train=train, download=download)
    data, targets = getattr(ds, "data", None), getattr(ds, "targets", None)
    if data is not None and targets is not None:
        x, y = np.asarray(data), np.asarray(targets)
        if x.ndim == 3:  # [N, H, W] gray images: add the channel dimension models expect.
            x = x[:, None]
        elif x.ndim == 4 and x.shape[-1] in (1, 3):  # [N, H, W, C] -> [N, C, H, W].
            x = x.transpose(0, 3, 1, 2)
        return x, y.astype(np.int64) if y.dtype.kind in "iu" else y
    xs, ys = [], []
    for i in range(len(ds)):
        img, label = ds[i]
        xs.append(np.asarray(img))
        ys.append(label)
    return np.stack(xs), np.asarray(ys)


def prepare(a, dtype, scale, what):
    if dtype:
        a = a.astype(dtype)
    if scale:
        a = a / np.array(scale, dtype=a.dtype)
    if a.dtype not in SUPPORTED:
        sys.exit(f"to_tensors: {what} has dtype {a.dtype}, which torch.save cannot write for "
                 f"gradmesh; cast it with --{what}_dtype (one of "
                 f"{', '.join(sorted(str(d) for d in SUPPORTED))})")
    if a.ndim < 1:
        sys.exit(f"to_tensors: {what} needs a leading sample dimension")
    return np.ascontiguousarray(a)


def write(out, prefix, x, y, shard_size):
    if len(x) != len(y):
        sys.exit(f"to_tensors: {prefix}: x has {len(x)} samples but y has {len(y)}")
    files = []
    for k, start in enumerate(range(0, max(len(x), 1), shard_size)):
        path = os.path.join(out, f"{prefix}-{k:05d}.pt")
        # clone(): a slice would save the whole underlying storage into every file.
        torch.save({"x": torch.from_numpy(x[start:start + shard_size]).clone(),
                    "y": torch.from_numpy(y[start:start + shard_size]).clone()}, path)
        files.append(path)
    return files


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write train-*.pt / test-*.pt to")
    p.add_argument("--x", help="training inputs: FILE.npy or FILE.npz:KEY")
    p.add_argument("--y", help="training targets: FILE.npy or FILE.npz:KEY")
    p.add_argument("--test_x", help="test inputs (default: split off --test_fraction)")
    p.add_argument("--test_y", help="test targets")
    p.add_argument("--test_fraction", type=float, default=0.1,
                   help="share of --x/--y used as test set without --test_x (default 0.1)")
    p.add_argument("--shuffle", action="store_true",
                   help="shuffle --x/--y (seed --seed) before splitting off the test set")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--torchvision", metavar="CLASS",
                   help="torchvision.datasets class (FashionMNIST) or import path a.b.Class")
    p.add_argument("--root", help="dataset root directory for --torchvision")
    p.add_argument("--download", action="store_true", help="let --torchvision download")
    p.add_argument("--shard_size", type=int, default=100000,
                   help="samples per file (default 100000)")
    p.add_argument("--x_dtype", help="cast x to this NumPy dtype (e.g. float32)")
    p.add_argument("--y_dtype", help="cast y to this NumPy dtype (e.g. int64)")
    p.add_argument("--scale", type=float, help="divide x by this after the cast (e.g. 255)")
    a = p.parse_args(argv)
    if a.shard_size <= 0:
        p.error("--shard_size must be > 0")

    if a.torchvision:
        if a.x or a.y:
            p.error("give either --torchvision or --x/--y")
        if not a.root:
            p.error("--torchvision needs --root")
        x, y = from_torchvision(a.torchvision, a.root, True, a.download)
        tx, ty = from_torchvision(a.torchvision, a.root, False, a.download)
    else:
        if not (a.x and a.y):
            p.error("give --x and --y (or --torchvision)")
        x, y = load_array(a.x), load_array(a.y)
        if len(x) != len(y):
            sys.exit(f"to_tensors: {a.x} has {len(x)} samples but {a.y} has {len(y)}")
        if a.test_x or a.test_y:
            if not (a.test_x and a.test_y):
                p.error("give both --test_x and --test_y")
            tx, ty = load_array(a.test_x), load_array(a.test_y)
        else:
            if a.shuffle:
                perm = np.random.default_rng(a.seed).permutation(len(x))
                x, y = x[perm], y[perm]
            n_test = int(round(len(x) * a.test_fraction))
            if not 0 < n_test < len(x):
                sys.exit(f"to_tensors: --test_fraction {a.test_fraction} of {len(x)} samples "
                         f"leaves {n_test} test samples; give --test_x/--test_y")
            x, tx = x[:-n_test], x[-n_test:]
            y, ty = y[:-n_test], y[-n_test:]

    x, tx = (prepare(v, a.x_dtype, a.scale, "x") for v in (x, tx))
    y, ty = (prepare(v, a.y_dtype, None, "y") for v in (y, ty))
    for name, train_v, test_v in (("x", x, tx), ("y", y, ty)):
        if train_v.shape[1:] != test_v.shape[1:] or train_v.dtype != test_v.dtype:
            sys.exit(f"to_tensors: train {name} is {train_v.dtype}{list(train_v.shape[1:])} per "
                     f"sample but test {name} is {test_v.dtype}{list(test_v.shape[1:])}")
    os.makedirs(a.out, exist_ok=True)
    train_files = write(a.out, "train", x, y, a.shard_size)
    test_files = write(a.out, "test", tx, ty, a.shard_size)
    print(json.dumps({
        "out": a.out, "train_files": len(train_files), "test_files": len(test_files),
        "train_samples": len(x), "test_samples": len(tx),
        "x": f"{x.dtype}{list(x.shape[1:])}", "y": f"{y.dtype}{list(y.shape[1:])}",
    }))


if __name__ == "__main__":
    main()
