#!/usr/bin/python3
# Writes the "tensors" datasets of worker/training_loop_test.cc, each sample x float32
# [1, 28, 28] (MNIST-shaped, values i / 1000 for flat index i over the file) and y int64
# (its index):
#   nan_input/train.pt, test.pt  8 samples; in train.pt sample 5 has a NaN pixel.
#   train_only/train.pt          the same 8 samples without it, and no test file.
#   late_label/train.pt          the same 8 samples, sample 6 labelled 12 (out of range for
#                                10 classes), and no test file.
#   odd_test/train.pt, test.pt   the same 8 samples; 10 test samples (x (i + 0.5) / 1000,
#                                y index % 10): 2 left after batches of 4.
#   bad_test/train.pt, test.pt   the same 8 samples; the test file's sample 6 labelled 12 (past
#                                the first batch of 4, which is checked before the run).
#   bad_first_test/train.pt, test.pt  the same; the test file's sample 3 labelled 12.
# Run with Debian's torch: /usr/bin/python3 worker/testdata/gen_loop_data.py
import os
import torch

here = os.path.dirname(__file__)
for d in ("nan_input", "train_only", "late_label", "odd_test", "bad_test", "bad_first_test"):
    os.makedirs(os.path.join(here, d), exist_ok=True)
x = torch.arange(8 * 28 * 28, dtype=torch.float32).div(1000).reshape(8, 1, 28, 28)
y = torch.arange(8, dtype=torch.int64)
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "nan_input", "test.pt"))
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "train_only", "train.pt"))
late = y.clone()
late[6] = 12
torch.save({"x": x.clone(), "y": late}, os.path.join(here, "late_label", "train.pt"))
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "odd_test", "train.pt"))
odd_x = torch.arange(10 * 28 * 28, dtype=torch.float32).add(0.5).div(1000).reshape(10, 1, 28, 28)
odd_y = torch.arange(10, dtype=torch.int64) % 10
torch.save({"x": odd_x, "y": odd_y}, os.path.join(here, "odd_test", "test.pt"))
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "bad_test", "train.pt"))
bad = y.clone()
bad[6] = 12
torch.save({"x": x.clone(), "y": bad}, os.path.join(here, "bad_test", "test.pt"))
torch.save({"x": x.clone(), "y": y.clone()}, os.path.join(here, "bad_first_test", "train.pt"))
bad_first = y.clone()
bad_first[3] = 12
torch.save({"x": x.clone(), "y": bad_first}, os.path.join(here, "bad_first_test", "test.pt"))
x[5, 0, 3, 7] = float("nan")
torch.save({"x": x, "y": y}, os.path.join(here, "nan_input", "train.pt"))
