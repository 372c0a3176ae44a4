#!/usr/bin/python3
# Writes worker/testdata/resizing_buffer.pt: a TorchScript model for MNIST-shaped input
# (float32 [N,1,28,28] -> logits [N,10]) whose third training-mode forward shrinks its buffer
# `hist` (float32 [4]) in place to 2 elements (the check of the model against a batch before
# the run, which restores buffers, takes one or two forwards; the run's steps the rest). The
# training loop must refuse it (buffers keep their shapes) rather than read the buffer past
# its end. Run with Debian's torch:
#   /usr/bin/python3 worker/testdata/export_resizing_buffer.py
import os
import torch


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


torch.manual_seed(0)
torch.jit.script(ResizingBuffer()).save(
    os.path.join(os.path.dirname(__file__), "resizing_buffer.pt"))
