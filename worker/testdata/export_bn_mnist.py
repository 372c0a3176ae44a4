#!/usr/bin/python3
# Writes worker/testdata/bn_mnist.pt: a tiny TorchScript CNN with BatchNorm for MNIST-shaped
# input (float32 [N,1,28,28] -> logits [N,10]), whose buffers (running_mean, running_var:
# float32 [4]; num_batches_tracked: int64 []) the training loop test follows through a step.
# Run with Debian's torch: /usr/bin/python3 worker/testdata/export_bn_mnist.py
import os
import torch


class BnMnist(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 4, stride=4)  # [N, 4, 7, 7]
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 7 * 7, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


torch.manual_seed(0)
torch.jit.script(BnMnist()).save(os.path.join(os.path.dirname(__file__), "bn_mnist.pt"))
