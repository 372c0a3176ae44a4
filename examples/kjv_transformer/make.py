#!/usr/bin/python3
"""King James Bible (Debian bible-kjv) at character level + a decoder-only transformer LM, for
gradmesh's "tensors" dataset and "torchscript" model.

Text: Debian's bible-kjv-text ships only a compressed, indexed file (/usr/lib/bible.data) read by
the `bible` program, so the text comes from `bible -f Gen1:1-Rev22:21` (pretty-printing off: one
verse per line, "Ge1:1 In the beginning ..."; 31102 verses, 66 books). --text takes a file in that
format (for example that command's output); without it the command is run.

Tokens: every distinct character of the verse texts plus "\n" (each verse is written as its text
followed by "\n"; the reference is dropped), ids in sorted character order, saved to
OUT/vocab.json. Split by book: the last --test_books books (default 5: 1 John, 2 John, 3 John,
Jude, Revelation) are the test set, the other 61 the training set. Each split's text is cut into
windows of T+1 characters with stride T: x = ids[i*T : i*T+T], y = ids[i*T+1 : i*T+T+1], both
int64 [N, T].

Writes
  OUT/data/train-00000.pt .. (--train_files files)  torch.save({"x": int64 [n,T], "y": int64 [n,T]})
  OUT/data/test-00000.pt
  OUT/vocab.json                                     {"chars": [...], "vocab_size": V, ...}
  OUT/model.pt                                       torch.jit.script(CharTransformer(...)), seeded
and prints one JSON line {"params": ..., "files": ..., "samples": ..., ...}.

Model: token + learned position embeddings, --layers pre-LayerNorm blocks of causal multi-head
self-attention (written out; the causal mask is a registered buffer `causal_mask` [T, T], bool by
default, 0/1 float32 with --mask_dtype float32: TorchScript 1.13 ignores persistent=False, so it is
an ordinary buffer that is saved, synced and exported like BatchNorm statistics; it never changes.
gloo cannot broadcast bool tensors, so torch DDP must be told to skip it) and a GELU MLP (4x), a final LayerNorm and
a linear head: int64 [N, T'] (T' <= T) -> logits float32 [N, T', V]. No dropout, no weight tying
(every parameter is its own tensor).

Run with Debian's python (torch 1.13):
  /usr/bin/python3 examples/kjv_transformer/make.py --out /tmp/kjv            # d=256 L=4 H=4 T=128, ~3.2M
  /usr/bin/python3 examples/kjv_transformer/make.py --out /tmp/kjv_s --small  # d=64 L=4 H=4 T=64, ~0.2M
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

REF = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def read_books(path):
    """Returns [(book, text)] in canonical order from `bible -f` output (file `path`, or run the program)."""
    if path:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        where = path
    else:
        try:
            out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], stdin=subprocess.DEVNULL,
                                 capture_output=True, check=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            sys.exit(f"make.py: running `bible -f Gen1:1-Rev22:21` failed ({e}); "
                     "install Debian's bible-kjv or pass --text FILE")
        lines = out.stdout.splitlines()
        where = "bible -f Gen1:1-Rev22:21"
    books = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        m = REF.match(line)
        if not m:
            sys.exit(f"make.py: {where}:{n}: expected 'Book<chapter>:<verse> text', got {line[:60]!r}")
        book, text = m.group(1), m.group(4)
        if not books or books[-1][0] != book:
            books.append((book, []))
        books[-1][1].append(text + "\n")
    return [(b, "".join(v)) for b, v in books]


def windows(ids, T):
    """Non-overlapping windows of T+1 tokens (stride T) -> x, y int64 [N, T], each with its own storage."""
    n = (len(ids) - 1) // T
    t = torch.tensor(ids[:n * T + 1], dtype=torch.int64)
    x = t[:n * T].reshape(n, T).clone()
    y = t[1:n * T + 1].reshape(n, T).clone()
    return x, y


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = d // heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.reshape(B, T, self.heads, self.head_dim).transpose(1, 2)  # B,H,T,hd
        k = k.reshape(B, T, self.heads, self.head_dim).transpose(1, 2)
        v = v.reshape(B, T, self.heads, self.head_dim).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(torch.logical_not(mask), float("-inf"))
        att = F.softmax(att, dim=-1)
        h = torch.matmul(att, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(h)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Decoder-only LM: int64 [N, T'] (T' <= seq_len) -> logits [N, T', vocab]."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq_len: int, mask_dtype=torch.bool):
        super().__init__()
        if d % heads:
            raise ValueError(f"d_model {d} is not a multiple of heads {heads}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # Nonzero where attention is allowed (key position <= query position).
        self.register_buffer("causal_mask", torch.tril(torch.ones(seq_len, seq_len)).to(mask_dtype))
        for name, p in self.named_parameters():  # GPT-2 style initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, x):
        T = x.size(1)
        if T > self.seq_len:
            raise ValueError("CharTransformer: sequence longer than seq_len")
        idx = x.long()
        pos = torch.arange(T, device=x.device)
        h = self.tok(idx) + self.pos(pos).unsqueeze(0)
        mask = self.causal_mask[:T, :T] != 0
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln_f(h))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=None, help="`bible -f` output (default: run `bible -f Gen1:1-Rev22:21`)")
    p.add_argument("--out", required=True)
    p.add_argument("--d_model", type=int, default=None, help="default 256 (64 with --small)")
    p.add_argument("--layers", type=int, default=None, help="default 4")
    p.add_argument("--heads", type=int, default=None, help="default 4")
    p.add_argument("--seq_len", type=int, default=None, help="T, default 128 (64 with --small)")
    p.add_argument("--small", action="store_true", help="test preset: d=64 L=4 H=4 T=64 (~0.2M parameters)")
    p.add_argument("--test_books", type=int, default=5, help="hold out the last N books (default 5: 1Jn..Rev)")
    p.add_argument("--train_files", type=int, default=4)
    p.add_argument("--max_train", type=int, default=0, help="keep only the first N training windows (0 = all)")
    p.add_argument("--max_test", type=int, default=0, help="keep only the first N test windows (0 = all)")
    p.add_argument("--seed", type=int, default=1, help="torch.manual_seed for the initial weights")
    p.add_argument("--mask_dtype", choices=["bool", "float32"], default="bool",
                   help="dtype of the causal_mask buffer (float32: 0/1, for consumers without bool buffers)")
    a = p.parse_args()
    d = a.d_model or (64 if a.small else 256)
    layers = a.layers or 4
    heads = a.heads or 4
    T = a.seq_len or (64 if a.small else 128)

    books = read_books(a.text)
    if not 0 < a.test_books < len(books):
        sys.exit(f"make.py: --test_books {a.test_books} must be in [1, {len(books) - 1}]")
    train_books, test_books = books[:-a.test_books], books[-a.test_books:]
    chars = sorted(set("".join(t for _, t in books)))
    index = {c: i for i, c in enumerate(chars)}
    encode = lambda s: [index[c] for c in s]  # noqa: E731
    xtr, ytr = windows(encode("".join(t for _, t in train_books)), T)
    xte, yte = windows(encode("".join(t for _, t in test_books)), T)
    if a.max_train:
        xtr, ytr = xtr[:a.max_train].clone(), ytr[:a.max_train].clone()
    if a.max_test:
        xte, yte = xte[:a.max_test].clone(), yte[:a.max_test].clone()

    data_dir = os.path.join(a.out, "data")
    os.makedirs(data_dir, exist_ok=True)
    files = []
    for prefix, x, y, nfiles in (("train", xtr, ytr, a.train_files), ("test", xte, yte, 1)):
        for i, (xs, ys) in enumerate(zip(x.tensor_split(nfiles), y.tensor_split(nfiles))):
            path = os.path.join(data_dir, f"{prefix}-{i:05d}.pt")
            torch.save({"x": xs.clone(), "y": ys.clone()}, path)  # clone: each file holds only its rows
            files.append(path)
    with open(os.path.join(a.out, "vocab.json"), "w") as f:
        json.dump({"chars": chars, "vocab_size": len(chars), "seq_len": T,
                   "source": a.text or "bible -f Gen1:1-Rev22:21",
                   "train_books": [b for b, _ in train_books], "test_books": [b for b, _ in test_books]},
                  f, indent=1)

    torch.manual_seed(a.seed)
    mask_dtype = torch.bool if a.mask_dtype == "bool" else torch.float32
    model = torch.jit.script(CharTransformer(len(chars), d, layers, heads, T, mask_dtype))
    model_path = os.path.join(a.out, "model.pt")
    model.save(model_path)
    print(json.dumps({
        "workload": "kjv_transformer", "model": model_path,
        "params": sum(t.numel() for t in model.parameters()),
        "buffer_elems": sum(t.numel() for t in model.buffers()), "state_dict_keys": len(model.state_dict()),
        "d_model": d, "layers": layers, "heads": heads, "seq_len": T, "mask_dtype": a.mask_dtype, "vocab_size": len(chars),
        "files": [os.path.basename(f) for f in files],
        "samples": {"train": int(xtr.shape[0]), "test": int(xte.shape[0])},
        "chars": {"train": sum(len(t) for _, t in train_books), "test": sum(len(t) for _, t in test_books)},
        "test_books": [b for b, _ in test_books], "x": f"int64[{T}]", "y": f"int64[{T}]",
        "bytes": {"data": sum(os.path.getsize(f) for f in files), "model": os.path.getsize(model_path)},
    }), flush=True)


if __name__ == "__main__":
    main()
