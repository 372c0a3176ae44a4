#!/usr/bin/python3
"""Fashion-MNIST + a small ResNet-style CNN for gradmesh's "tensors" dataset and "torchscript" model.

Writes
  OUT/data/train-00000.pt .. train-0000{k-1}.pt   torch.save({"x": float32 [n,1,28,28], "y": int64 [n]})
  OUT/data/test-00000.pt                          the 10000 test images, same layout
  OUT/model.pt                                    torch.jit.script(FashionResNet()), seeded
and prints one JSON line {"params": ..., "files": ..., "samples": ..., ...}.

x = (pixel / 255 - 0.2860) / 0.3530 (Fashion-MNIST's training-set mean and std); y = class 0..9.

Run with Debian's python (torch 1.13):
  /usr/bin/python3 examples/fashion_resnet/make.py --data /var/lib/gradmesh/data/fashion-mnist --out /tmp/fashion
"""
import argparse
import gzip
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

MEAN, STD = 0.2860, 0.3530


def read_idx(d, name):
    """Reads IDX file `name` (or name.gz) from directory d into a uint8 numpy array."""
    for path, opener in ((os.path.join(d, name), open), (os.path.join(d, name + ".gz"), gzip.open)):
        if os.path.exists(path):
            with opener(path, "rb") as f:
                raw = f.read()
            break
    else:
        sys.exit(f"make.py: {os.path.join(d, name)}[.gz] not found")
    if len(raw) < 4 or raw[2] != 0x08:  # 0x08: unsigned byte elements
        sys.exit(f"make.py: {path}: not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        sys.exit(f"make.py: {path}: {data.size} bytes of data for dims {dims}")
    return data.reshape(dims)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (1x1 conv + BN when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class FashionResNet(nn.Module):
    """[N,1,28,28] float32 -> logits [N,10].

    Stem: 3x3 conv 1->widths[0] with stride 2 (28->14: keeps a 1-thread CPU step of batch 64 near
    15-20 ms) + BN + ReLU, one residual block at widths[0] (14x14), then one stride-2 block per
    further width (default 8 @14x14, 16 @7x7, 32 @4x4, 64 @2x2; ~78k parameters), global average
    pool, linear to num_classes.
    """

    def __init__(self, widths=(8, 16, 32, 64), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(1, widths[0], 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        blocks = [BasicBlock(widths[0], widths[0], 1)]
        for cin, cout in zip(widths[:-1], widths[1:]):
            blocks.append(BasicBlock(cin, cout, 2))
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.blocks(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


def save_split(x_u8, y_u8, out_dir, prefix, files):
    """Normalises and writes the split into `files` near-equal files; returns their paths."""
    paths = []
    for i, idx in enumerate(np.array_split(np.arange(len(x_u8)), files)):
        x = torch.from_numpy(x_u8[idx].astype(np.float32) / 255.0)
        x = ((x - MEAN) / STD).unsqueeze(1).contiguous()
        y = torch.from_numpy(y_u8[idx].astype(np.int64)).contiguous()
        path = os.path.join(out_dir, f"{prefix}-{i:05d}.pt")
        torch.save({"x": x, "y": y}, path)
        paths.append(path)
    return paths


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/var/lib/gradmesh/data/fashion-mnist",
                   help="directory with the Fashion-MNIST IDX files (gzipped or not)")
    p.add_argument("--out", required=True)
    p.add_argument("--train_files", type=int, default=4, help="train-*.pt files (60000 samples split evenly)")
    p.add_argument("--widths", default="8,16,32,64", help="channels of the residual stages")
    p.add_argument("--seed", type=int, default=1, help="torch.manual_seed for the initial weights")
    a = p.parse_args()

    widths = tuple(int(w) for w in a.widths.split(","))
    data_dir = os.path.join(a.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    xtr, ytr = read_idx(a.data, "train-images-idx3-ubyte"), read_idx(a.data, "train-labels-idx1-ubyte")
    xte, yte = read_idx(a.data, "t10k-images-idx3-ubyte"), read_idx(a.data, "t10k-labels-idx1-ubyte")
    if len(xtr) != len(ytr) or len(xte) != len(yte):
        sys.exit("make.py: image and label counts differ")
    files = save_split(xtr, ytr, data_dir, "train", a.train_files)
    files += save_split(xte, yte, data_dir, "test", 1)

    torch.manual_seed(a.seed)
    model = torch.jit.script(FashionResNet(widths))
    model_path = os.path.join(a.out, "model.pt")
    model.save(model_path)

    params = sum(t.numel() for t in model.parameters())
    buffers = sum(t.numel() for t in model.buffers())
    print(json.dumps({
        "workload": "fashion_resnet", "model": model_path, "params": params, "buffer_elems": buffers,
        "state_dict_keys": len(model.state_dict()), "files": [os.path.basename(f) for f in files],
        "samples": {"train": int(len(xtr)), "test": int(len(xte))},
        "x": "float32[1,28,28]", "y": "int64[]", "classes": 10,
        "bytes": {"data": sum(os.path.getsize(f) for f in files), "model": os.path.getsize(model_path)},
    }), flush=True)


if __name__ == "__main__":
    main()
