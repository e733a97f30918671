"""Distil a teacher transformer's attention into a smaller student with streamkl.attn_kl.

MiniLM-style attention transfer on real text, this repository's own documentation (README.md
and docs/*.md) read as bytes, one token per byte. First a character-level teacher trains
briefly as a language model on that text and is frozen. Then a smaller student, with narrower
heads (head dim D2 < D1) and grouped key/value heads (GQA), learns to match the teacher's
last-layer attention, head by head, under torch.compile:

    loss = streamkl.attn_kl(q_t.detach(), k_t.detach(), q_s, k_s, causal=True,
                            scale1=1 / (tau * D1**0.5), scale2=1 / (tau * D2**0.5),
                            reduction="mean")

the mean over batch, heads and query rows of KL(teacher row || student row), both
distributions softened by the temperature tau. No Nq x Nk matrix is ever stored, so the same
loss runs at sequence lengths where the dense one would not fit.

    python examples/distill_attention.py                 # CPU: about a minute
    python examples/distill_attention.py --tiny          # the size CI runs: seconds
    python examples/distill_attention.py --device cuda   # GPU, full size: 2048 tokens,
                                                         # 12 heads, batch 8, bfloat16

torch.compile uses inductor on a GPU and aot_eager on a CPU (the same tracing, fake tensors and
autograd graph, without inductor's C++ compilation, which on a CPU takes about 70 s cold at the
default size, longer than this whole run); --compile-backend picks another, --no-compile runs
eagerly.

It prints the teacher's language-model loss, then the distillation loss falling with the mean
step time since the previous line, and ends with the loss on a held-out batch of text before
and after distillation. On a 2-core CPU, at the default size (50 s in all):

    teacher step    0  lm loss 5.7594  first step 3.4 s (includes compilation)
    ...
    teacher step  299  lm loss 2.5152  76.5 ms/step
    distil  step    0  kl 1.3561  first step 2.6 s (includes compilation)
    distil  step   49  kl 0.2018  50.0 ms/step
    ...
    distil  step  299  kl 0.0650  50.7 ms/step
    distillation loss: 1.0009 -> 0.0784
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import streamkl

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Size:
    seq_len: int
    batch: int
    teacher_steps: int
    steps: int
    lr: float
    # (width, layers, heads, kv_heads, head_dim) of each model
    teacher: tuple[int, int, int, int, int]
    student: tuple[int, int, int, int, int]


SIZES = {
    "tiny": Size(32, 4, 40, 40, 3e-3, teacher=(32, 1, 2, 2, 16), student=(16, 1, 2, 1, 8)),
    "cpu": Size(128, 8, 300, 300, 3e-3, teacher=(128, 2, 4, 4, 32), student=(64, 2, 4, 2, 16)),
    "gpu": Size(2048, 8, 400, 400, 1e-3, teacher=(768, 6, 12, 12, 64), student=(384, 4, 12, 4, 32)),
}


def read_corpus(device):
    """This repository's documentation as one tensor of byte tokens."""
    paths = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    paths = [path for path in paths if path.is_file()]
    if not paths:
        raise FileNotFoundError(
            f"no README.md or docs/*.md under {REPO}: run this script from a checkout of the repository"
        )
    text = b"\n\n".join(path.read_bytes() for path in paths)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long().to(device), len(paths)


def windows(tokens, batch, length, generator):
    """`batch` random windows of `length + 1` tokens: inputs and next-token targets."""
    start = torch.randint(len(tokens) - length - 1, (batch, 1), generator=generator)
    index = start.to(tokens.device) + torch.arange(length + 1, device=tokens.device)
    chunk = tokens[index]
    return chunk[:, :-1], chunk[:, 1:]


class Block(torch.nn.Module):
    """A pre-norm transformer block that also returns its attention's queries and keys."""

    def __init__(self, width, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1 = torch.nn.LayerNorm(width)
        self.wq = torch.nn.Linear(width, heads * head_dim, bias=False)
        self.wkv = torch.nn.Linear(width, 2 * kv_heads * head_dim, bias=False)
        self.wo = torch.nn.Linear(heads * head_dim, width, bias=False)
        self.norm2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # (B, H, S, D)
        k, v = (
            self.wkv(h).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        )  # (B, H_kv, S, D)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.norm2(x)), q, k


class Transformer(torch.nn.Module):
    """Byte-level causal transformer: next-byte logits and the last layer's q (B, H, S, D) and
    k (B, H_kv, S, D), as strided views of the projections (attn_kl reads any strides)."""

    def __init__(self, seq_len, width, layers, heads, kv_heads, head_dim):
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(width, heads, kv_heads, head_dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x, q, k = block(x)
        return self.head(self.norm(x)), q, k


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="(default: %(default)s)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="autocast dtype of the models (default: bfloat16 on a GPU, float32 on a CPU)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the size CI runs: a few seconds of work, the loss still falls"
    )
    parser.add_argument("--steps", type=int, help="distillation steps (default: by size)")
    parser.add_argument(
        "--teacher-steps", type=int, help="language-model steps of the teacher (default: by size)"
    )
    parser.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default: 128 on a CPU, 2048 on a GPU)"
    )
    parser.add_argument("--batch", type=int, help="sequences per step (default: 8)")
    parser.add_argument(
        "--temperature", type=float, default=2.0, help="tau, dividing both scales (default: %(default)s)"
    )
    parser.add_argument("--lr", type=float, help="AdamW learning rate (default: by size)")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run each training step under torch.compile (default: on)",
    )
    parser.add_argument(
        "--compile-backend",
        help="torch.compile backend (default: inductor on a GPU, aot_eager on a CPU)",
    )
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    args = parser.parse_args()

    device = torch.device(args.device)
    size = SIZES["tiny" if args.tiny else "gpu" if device.type == "cuda" else "cpu"]
    seq_len = args.seq_len or size.seq_len
    batch = args.batch or size.batch
    steps = size.steps if args.steps is None else args.steps
    teacher_steps = size.teacher_steps if args.teacher_steps is None else args.teacher_steps
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    compile_backend = args.compile_backend or ("inductor" if device.type == "cuda" else "aot_eager")
    for name, value in (("--seq-len", seq_len), ("--batch", batch), ("--steps", steps)):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    tokens, files = read_corpus(device)
    held_out = len(tokens) // 10  # the last tenth measures the loss before and after
    train_tokens, eval_tokens = tokens[:-held_out], tokens[-held_out:]
    if len(eval_tokens) <= seq_len + 1:
        raise ValueError(f"--seq-len {seq_len} is longer than the held-out text ({len(eval_tokens)} bytes)")
    teacher = Transformer(seq_len, *size.teacher).to(device)
    student = Transformer(seq_len, *size.student).to(device)
    d1, d2 = size.teacher[-1], size.student[-1]
    print(
        f"{len(tokens)} bytes of text from {files} files; {device}, {dtype}, "
        f"compile {compile_backend if args.compile else 'off'}\n"
        f"teacher: {size.teacher[2]} heads of dim {d1}, {sum(p.numel() for p in teacher.parameters())} "
        f"parameters; student: {size.student[2]} heads of dim {d2}, {size.student[3]} kv heads, "
        f"{sum(p.numel() for p in student.parameters())} parameters; batch {batch} x {seq_len} tokens"
    )
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def lm_loss(x, y):
        with autocast:
            logits, _, _ = teacher(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def distillation_loss(x):
        with autocast:
            _, q_t, k_t = teacher(x)
            _, q_s, k_s = student(x)
        return streamkl.attn_kl(
            q_t.detach(),
            k_t.detach(),
            q_s,
            k_s,
            causal=True,
            scale1=1 / (args.temperature * d1**0.5),
            scale2=1 / (args.temperature * d2**0.5),
            reduction="mean",
        )

    def train(name, model, loss_fn, steps, batch_of):
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or size.lr)
        step_fn = (
            torch.compile(loss_fn, fullgraph=True, dynamic=False, backend=compile_backend)
            if args.compile
            else loss_fn
        )
        every = max(1, steps // 6)
        start, last_step = time.perf_counter(), 0
        kind = "lm loss" if model is teacher else "kl"
        for step in range(steps):
            loss = step_fn(*batch_of())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step == 0 or (step + 1) % every == 0 or step == steps - 1:
                value = loss.item()  # waits for the device, so the clock below is honest
                now = time.perf_counter()
                if step == 0:
                    timing = f"first step {now - start:.1f} s"
                    timing += " (includes compilation)" if args.compile else ""
                else:
                    timing = f"{1e3 * (now - start) / (step - last_step):.1f} ms/step"
                print(f"{name} step {step:4d}  {kind} {value:.4f}  {timing}")
                start, last_step = now, step

    def train_batch():
        return windows(train_tokens, batch, seq_len, generator)

    train("teacher", teacher, lm_loss, teacher_steps, train_batch)
    teacher.requires_grad_(False)

    eval_x, _ = windows(eval_tokens, batch, seq_len, generator)
    with torch.no_grad():
        before = distillation_loss(eval_x).item()
    train("distil ", student, distillation_loss, steps, lambda: train_batch()[:1])
    with torch.no_grad():
        after = distillation_loss(eval_x).item()
    print(f"distillation loss: {before:.4f} -> {after:.4f}")


if __name__ == "__main__":
    main()
