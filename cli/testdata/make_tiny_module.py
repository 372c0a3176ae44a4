# Writes tiny_module.pt, the TorchScript module of cli_test's `export --format torchscript`
# tests: Linear(3, 2) then BatchNorm1d(2), so it has parameters (fc.weight [2,3], fc.bias [2],
# bn.weight, bn.bias) and buffers of two dtypes (bn.running_mean/var float32,
# bn.num_batches_tracked int64).
# Also tied_module.pt (see Tied below).
# Run with /usr/bin/python3 (torch 1.13): cd cli/testdata && /usr/bin/python3 make_tiny_module.py
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)
        self.bn = torch.nn.BatchNorm1d(2)

    def forward(self, x):
        return self.bn(self.fc(x))


torch.manual_seed(0)
torch.jit.script(Tiny()).save("tiny_module.pt")


class Tied(torch.nn.Module):
    """tied_module.pt: two Linear(2, 2) sharing one weight (b.weight is a.weight), as language
    models tie their embedding and output layers: named_parameters lists a.weight, a.bias,
    b.weight, b.bias; the worker trains the shared tensor once, as a.weight."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        self.b = torch.nn.Linear(2, 2)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


torch.manual_seed(0)
torch.jit.script(Tied()).save("tied_module.pt")
