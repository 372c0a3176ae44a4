#!/usr/bin/python3
# Writes TorchScript models for MNIST-shaped input (float32 [N,1,28,28] -> logits [N,10]) for
# worker/training_loop_test.cc: two whose forwards change their buffers other than in place,
# and one whose backward gives a sparse gradient:
#   ema_buffer.pt       assigns its buffer `ema` (float32 [1]) anew in every training-mode
#                       forward, `self.ema = 0.9 * self.ema + 0.1 * x.mean()`: the loop must
#                       follow the new tensor (exchange its delta, write the mode's value).
#   resizing_buffer.pt  shrinks its buffer `hist` (float32 [4]) in place to 2 elements in its
#                       third training-mode forward (the check of the model against a batch
#                       before the run, which restores buffers, takes one; the run's steps the
#                       rest). The loop must refuse it (buffers keep their shapes) rather than
#                       read the buffer past its end.
#   sparse_embedding.pt embeds each pixel, quantised to 0..9, with nn.Embedding(10, 2,
#                       sparse=True): its weight's gradient is a sparse tensor, which the loop
#                       exchanges as the dense gradient it stands for.
#   dense_embedding.pt  the same model and initial weights with sparse=False: the reference.
#   fixed_batch.pt      a linear model written for batches of exactly 4 (x.view(4, 784)), with
#                       a method loss(x, y) (cross-entropy) for loss: module: evaluation must
#                       use the training batch size, padding the last partial batch.
#   free_batch.pt       the same initial weights taking any batch: the reference.
#   inf_mask.pt         a linear model with a causal-mask buffer `mask` (float32 [3, 3], -inf
#                       above the diagonal, as attention code registers it) that its forward
#                       reads (exp(mask).sum() * 0: NaN there would make the loss NaN).
# Run with Debian's torch: /usr/bin/python3 worker/testdata/export_buffer_models.py
import os
import torch


class EmaBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)
        self.register_buffer("ema", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.mean()
        return self.fc(x.flatten(1))


class InfMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)
        self.register_buffer("mask", torch.full((3, 3), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1)) + torch.exp(self.mask).sum() * 0.0


class ResizingBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)
        self.register_buffer("hist", torch.zeros(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls >= 3:
                self.hist.resize_(2)
        return self.fc(x.flatten(1))


class Embedding(torch.nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 2, sparse=sparse)
        self.fc = torch.nn.Linear(28 * 28 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.flatten(1) * 9).round().long().clamp(0, 9)
        return self.fc(self.embed(ids).flatten(1))


class Batch(torch.nn.Module):
    def __init__(self, fixed: bool):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return self.fc(x.view(4, 28 * 28))
        return self.fc(x.flatten(1))

    @torch.jit.export
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.forward(x), y)


here = os.path.dirname(__file__)
torch.manual_seed(0)
torch.jit.script(EmaBuffer()).save(os.path.join(here, "ema_buffer.pt"))
torch.manual_seed(0)
torch.jit.script(ResizingBuffer()).save(os.path.join(here, "resizing_buffer.pt"))
for sparse in (True, False):
    torch.manual_seed(0)
    torch.jit.script(Embedding(sparse)).save(
        os.path.join(here, "sparse_embedding.pt" if sparse else "dense_embedding.pt"))
for fixed in (True, False):
    torch.manual_seed(0)
    torch.jit.script(Batch(fixed)).save(
        os.path.join(here, "fixed_batch.pt" if fixed else "free_batch.pt"))
torch.manual_seed(0)
torch.jit.script(InfMask()).save(os.path.join(here, "inf_mask.pt"))
