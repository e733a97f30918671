"""Train a small lightning indexer against a frozen attention layer's head mixture with
streamkl.indexer_kl, as DeepSeek-V3.2 trains its indexer: a dense warm-up, then a sparse stage
on the indexer's own top-k keys. Prints the loss as it falls.

    python examples/train_indexer.py                 # tiny, CPU, a few seconds
    python examples/train_indexer.py --device cuda --seq 4096 --heads 16 --steps 300

The attention layer is a frozen MLA-like block: H query heads sharing one absorbed key (MQA).
The indexer reads the same hidden states: G heads of dimension Di, one key per token, and
per-token head weights with the G^-0.5 Di^-0.5 scale folded in.
"""

from __future__ import annotations

import argparse
import math

import torch

import streamkl


class FrozenAttention(torch.nn.Module):
    """The teacher: H query heads against one shared key per token (MLA's absorbed MQA form)."""

    def __init__(self, hidden, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq = torch.nn.Linear(hidden, heads * dim, bias=False)
        self.wk = torch.nn.Linear(hidden, dim, bias=False)
        for weight in (self.wq.weight, self.wk.weight):  # logits of a few units: peaked heads
            torch.nn.init.normal_(weight, std=1.5 / math.sqrt(hidden))
        self.requires_grad_(False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.dim).transpose(1, 2)  # (B, H, S, D), a view
        return q, self.wk(x)  # k: (B, S, D), one head


class Indexer(torch.nn.Module):
    """The student: I_j = sum_g w_g relu(qi_g . ki_j)."""

    def __init__(self, hidden, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq = torch.nn.Linear(hidden, heads * dim, bias=False)
        self.wk = torch.nn.Linear(hidden, dim, bias=False)
        self.ww = torch.nn.Linear(hidden, heads, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qi = self.wq(x).view(b, s, self.heads, self.dim).transpose(1, 2)  # (B, G, S, Di)
        w = self.ww(x).transpose(1, 2) * (self.heads * self.dim) ** -0.5  # (B, G, S)
        return qi, self.wk(x), w

    @torch.no_grad()
    def top_k(self, x, k):
        """Each row's k highest-scoring visible keys, -1 where fewer are visible. Dense here, at
        a toy size; a real model selects them with its indexer kernel."""
        qi, ki, w = self(x)
        scores = torch.einsum("bgs,bgst->bst", w, torch.relu(qi @ ki[:, None].transpose(-1, -2)))
        s = x.shape[1]
        hidden = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        values, index = scores.masked_fill(hidden, -math.inf).topk(min(k, s), dim=-1)
        return index.masked_fill(torch.isinf(values), -1)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=2, help="sequences (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="teacher heads H (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=32, help="teacher head dim D (default: %(default)s)")
    parser.add_argument("--index-heads", type=int, default=4, help="indexer heads G (default: %(default)s)")
    parser.add_argument(
        "--index-dim", type=int, default=16, help="indexer head dim Di (default: %(default)s)"
    )
    parser.add_argument(
        "--topk", type=int, default=32, help="keys per row, sparse stage (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=60, help="steps per stage (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default: %(default)s)")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    teacher = FrozenAttention(args.hidden, args.heads, args.dim).to(device)
    indexer = Indexer(args.hidden, args.index_heads, args.index_dim).to(device)
    optimizer = torch.optim.Adam(indexer.parameters(), lr=args.lr)
    # A fixed batch of hidden states: the indexer's input is detached from the model in DSA.
    x = torch.randn(args.batch, args.seq, args.hidden, device=device)
    q, k = teacher(x)

    for stage in ("dense", "sparse"):
        first = last = None
        for step in range(args.steps):
            # The sparse stage restricts both distributions to the indexer's current top-k set.
            topk = indexer.top_k(x, args.topk) if stage == "sparse" else None
            qi, ki, w = indexer(x)
            # lse=None: the op computes each head's log-sum-exp over the admitted keys. A model
            # passes the one its attention forward returned, which saves that pass.
            loss = streamkl.indexer_kl(q, k, qi, ki, w, scale=args.dim**-0.5, topk=topk)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            first = loss.item() if first is None else first
            last = loss.item()
            if step % max(1, args.steps // 6) == 0 or step == args.steps - 1:
                print(f"{stage:6s} step {step:4d}  indexer KL {last:.4f}")
        print(f"{stage}: {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
