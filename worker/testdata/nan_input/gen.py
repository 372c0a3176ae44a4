#!/usr/bin/python3
# Writes train.pt and test.pt of a "tensors" dataset for worker/training_loop_test.cc: x float32
# [8, 1, 28, 28] (MNIST-shaped, values i / 1000 for flat index i), y int64 [8] = arange(8); in
# train.pt sample 5 has a NaN pixel. Run with Debian's torch:
#   /usr/bin/python3 worker/testdata/nan_input/gen.py
import os
import torch

here = os.path.dirname(__file__)
x = torch.arange(8 * 28 * 28, dtype=torch.float32).div(1000).reshape(8, 1, 28, 28)
y = torch.arange(8, dtype=torch.int64)
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "test.pt"))
x[5, 0, 3, 7] = float("nan")
torch.save({"x": x, "y": y}, os.path.join(here, "train.pt"))
