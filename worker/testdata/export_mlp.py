"""Writes a small TorchScript MLP (784-64-10) for worker/model_test.cc.

Usage: /usr/bin/python3 export_mlp.py OUTPUT.pt

Run with Debian's /usr/bin/python3 (python3-torch 1.13, the same version as the system
LibTorch the C++ code links against), so the archive format matches.
"""
import sys

import torch


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(784, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def main(argv):
    if len(argv) != 2:
        sys.stderr.write("usage: %s OUTPUT.pt\n" % argv[0])
        return 2
    torch.manual_seed(0)
    torch.jit.script(Mlp()).save(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
