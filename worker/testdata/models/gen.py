"""Writes the small TorchScript modules of worker/model_test.cc and the values it checks.

Usage: /usr/bin/python3 gen.py [OUTPUT_DIR]   (default: this script's directory)

Run with Debian's /usr/bin/python3 (python3-torch 1.13, the version of the system LibTorch the
C++ code links against), so the archive format matches. The .pt files and expected.txt are
committed; rerun this only when changing the modules, then commit all outputs together.

expected.txt holds one "key value..." line per figure, computed here with PyTorch on the
modules as saved (reloaded from disk) and on inputs that the C++ test rebuilds exactly from
the same integer formulas (see the *_batch functions; keep both sides in step).
"""
import os
import sys

import torch
import torch.nn.functional as F


class BnCnn(torch.nn.Module):
    """float32 [N, 1, 6, 6] -> logits [N, 4]; BatchNorm2d gives float and int64 buffers."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 3, 3)
        self.bn1 = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(48, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn1(self.conv1(x))).flatten(1))


class TinySeq(torch.nn.Module):
    """int64 token ids [N, T] -> next-token logits [N, T, 7]."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 5)
        self.out = torch.nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(x)))


class Regress(torch.nn.Module):
    """float32 [N, 3] -> [N, 1] (for mse)."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 8)
        self.fc2 = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class OwnLoss(torch.nn.Module):
    """float32 [N, 4] -> [N, 3], with its own loss: 2 * cross-entropy + 0.5 * mean(out^2)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    @torch.jit.export
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.forward(x)
        return 2.0 * F.cross_entropy(out, y) + 0.5 * (out * out).mean()


class BadLoss(torch.nn.Module):
    """Like OwnLoss, but loss() returns one value per sample (not a scalar)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)

    @torch.jit.export
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.forward(x), y, reduction="none")


class IntBuffer(torch.nn.Module):
    """float32 [N, 2] -> [N, 2]; counts training forwards in an int64 buffer (its only one)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls.add_(1)
        return self.fc(x)


class Dropout(torch.nn.Module):
    """float32 [N, 4] -> [N, 3] through dropout: draws from the RNG in training mode."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(x))


# The test batches: integer formulas that model_test.cc repeats exactly.
def cnn_batch():
    x = ((torch.arange(4 * 36).reshape(4, 1, 6, 6) % 11) - 5).float() * 0.3
    y = torch.tensor([0, 1, 2, 3])
    return x, y


def seq_batch():
    x = (torch.arange(15).reshape(3, 5) * 3) % 7
    y = (x + 1) % 7
    return x, y


def regress_batch():
    x = ((torch.arange(12).reshape(4, 3) % 5) - 2).float() * 0.5
    y = (torch.arange(4).float() * 0.25).reshape(4, 1)
    return x, y


def own_loss_batch():
    x = ((torch.arange(12).reshape(3, 4) % 7) - 3).float() * 0.5
    y = torch.tensor([0, 2, 1])
    return x, y


def fmt(values):
    if isinstance(values, torch.Tensor):
        values = values.flatten().tolist()
    if not isinstance(values, list):
        values = [values]
    return " ".join(repr(float(v)) for v in values)


def main(argv):
    out_dir = argv[1] if len(argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    modules = {
        "bn_cnn": BnCnn,
        "tiny_seq": TinySeq,
        "regress": Regress,
        "own_loss": OwnLoss,
        "bad_loss": BadLoss,
        "int_buffer": IntBuffer,
        "dropout": Dropout,
    }
    paths = {}
    for name, cls in modules.items():
        torch.manual_seed(0)
        paths[name] = os.path.join(out_dir, name + ".pt")
        torch.jit.script(cls()).save(paths[name])

    def load(name):
        m = torch.jit.load(paths[name])
        m.train(True)  # As the C++ loader leaves it.
        return m

    lines = []
    # bn_cnn: training-mode loss (batch statistics) and the buffers after that one forward;
    # evaluation-mode loss and accuracy with the initial running statistics.
    x, y = cnn_batch()
    m = load("bn_cnn")
    with torch.no_grad():
        lines.append(("bn_cnn.ce_train", fmt(F.cross_entropy(m(x), y))))
        lines.append(("bn_cnn.running_mean_after", fmt(m.bn1.running_mean)))
        lines.append(("bn_cnn.running_var_after", fmt(m.bn1.running_var)))
    m = load("bn_cnn")
    m.eval()
    with torch.no_grad():
        out = m(x)
        lines.append(("bn_cnn.ce_eval", fmt(F.cross_entropy(out, y))))
        lines.append(("bn_cnn.correct_eval", fmt(int((out.argmax(1) == y).sum()))))

    # tiny_seq: mean cross-entropy over all 15 tokens, token accuracy, perplexity.
    x, y = seq_batch()
    m = load("tiny_seq")
    with torch.no_grad():
        out = m(x)
        ce = F.cross_entropy(out.reshape(-1, 7), y.reshape(-1))
        lines.append(("tiny_seq.ce", fmt(ce)))
        lines.append(("tiny_seq.correct", fmt(int((out.argmax(2) == y).sum()))))
        lines.append(("tiny_seq.perplexity", fmt(torch.exp(ce.double()))))

    x, y = regress_batch()
    m = load("regress")
    with torch.no_grad():
        lines.append(("regress.mse", fmt(F.mse_loss(m(x), y))))

    x, y = own_loss_batch()
    m = load("own_loss")
    with torch.no_grad():
        lines.append(("own_loss.loss", fmt(m.loss(x, y))))
        lines.append(("own_loss.ce", fmt(F.cross_entropy(m(x), y))))

    with open(os.path.join(out_dir, "expected.txt"), "w") as f:
        f.write("# Written by gen.py; do not edit.\n")
        for key, value in lines:
            f.write("%s %s\n" % (key, value))
    for key, value in lines:
        print(key, value)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
