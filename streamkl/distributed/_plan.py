"""The plan of a context-parallel call: which blocks of keys this rank's queries meet, which
single-process calls cover each block (causal prefixes, docs/distributed.md, Causal), the head
steps that bound the keys held at once, and the exact merge of partial (kl, lse1, lse2)
(docs/distributed.md, Merge)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from ._comm import all_gather_flat
from ._layout import chunks_per_rank, owners


class Call(NamedTuple):
    """One attn_kl_fwd / attn_kl_bwd call: local query rows against the first `keys` keys of a
    key block, causal or not (bottom-right aligned, docs/contract.md, Causal alignment)."""

    rows: slice
    keys: int
    causal: bool


def plan(query_chunks, key_chunks, chunk: int, causal: bool) -> list[Call]:
    """The calls that cover local query chunks `query_chunks` against a key block holding
    global chunks `key_chunks` (both increasing, `chunk` tokens each).

    Causal: a query chunk sees every key chunk before it in full and its own chunk (the
    diagonal) causally; a key chunk after it is skipped. The keys it sees are a prefix of the
    block, and bottom-right alignment makes "full chunks, then the diagonal" one causal call with
    Nk = that prefix. All local query chunks go into one call when their needs line up
    (docs/distributed.md, Causal)."""
    needs = []  # per query chunk: (key chunks seen in full, whether its diagonal is in the block)
    for qc in query_chunks:
        if causal:
            needs.append((sum(1 for kc in key_chunks if kc < qc), qc in key_chunks))
        else:
            needs.append((len(key_chunks), False))
    count = len(query_chunks)
    rows = slice(0, count * chunk)
    if needs[0][0] > 0 and all(need == (needs[0][0], False) for need in needs):
        return [Call(rows, needs[0][0] * chunk, False)]
    if all(diag and full == needs[0][0] + t for t, (full, diag) in enumerate(needs)):
        return [Call(rows, (needs[-1][0] + 1) * chunk, True)]
    return [
        Call(slice(t * chunk, (t + 1) * chunk), (full + diag) * chunk, diag)
        for t, (full, diag) in enumerate(needs)
        if full + diag > 0
    ]


class HeadStep(NamedTuple):
    """A run of query heads and the key heads of k1 and of k2 they read (GQA)."""

    q: slice
    k1: slice
    k2: slice


def head_steps(heads: int, heads_kv1: int, heads_kv2: int, per_step: int) -> list[HeadStep]:
    """Runs of `per_step` query heads (a multiple of both GQA group sizes, so every key head
    belongs to one run) and their key heads."""
    g1, g2 = heads // heads_kv1, heads // heads_kv2
    steps = []
    for start in range(0, heads, per_step):
        stop = min(start + per_step, heads)
        steps.append(
            HeadStep(slice(start, stop), slice(start // g1, stop // g1), slice(start // g2, stop // g2))
        )
    return steps


def merge_into(kl, lse1, lse2, part_kl, part_lse1, part_lse2) -> None:
    """In place: the state over the union of two disjoint key sets (docs/distributed.md, Merge).

        LSE_t = logaddexp(LSE_t,a, LSE_t,b)
        KL    = sum_p w_p (KL_p + log w_p - log v_p),  w_p = exp(LSE1_p - LSE1), v_p = exp(LSE2_p - LSE2)

    which equals KL = E + LSE2 - LSE1 with E = sum_p w_p E_p, E_p = KL_p + LSE1_p - LSE2_p, without
    the cancellation between E and the LSEs at large logits. A part that sees no key (LSE = -inf)
    adds nothing; a row no part sees stays KL 0, LSE -inf."""
    new_lse1 = torch.logaddexp(lse1, part_lse1)
    new_lse2 = torch.logaddexp(lse2, part_lse2)
    total = torch.zeros_like(kl)
    for p_kl, p_lse1, p_lse2 in ((kl, lse1, lse2), (part_kl, part_lse1, part_lse2)):
        log_w = p_lse1 - new_lse1
        term = log_w.exp() * (p_kl + log_w - (p_lse2 - new_lse2))
        total += torch.where(torch.isneginf(p_lse1), 0.0, term)
    kl.copy_(total)
    lse1.copy_(new_lse1)
    lse2.copy_(new_lse2)


class Gathered(NamedTuple):
    """Key heads of one head step gathered from every rank, in sequence order."""

    step: HeadStep
    k1: Tensor
    k2: Tensor


def gathered_steps(k1, k2, steps, group, layout, world) -> Iterator[Gathered]:
    """For each head step, k1 and k2 (only the step's compact key heads) of the whole sequence.

    The gather of the next step is posted before the current one is handed out, so it travels
    while the caller computes (docs/distributed.md, All-gather)."""
    owner = owners(layout, world)
    chunk = k1.shape[2] // chunks_per_rank(layout)

    def post(step):
        posted = []
        for k, heads in ((k1, step.k1), (k2, step.k2)):
            local = k[:, heads].contiguous()
            out = local.new_empty((world, *local.shape))
            work = None
            if world == 1:
                out[0] = local
            else:
                work = all_gather_flat(out.view(-1), local.view(-1), group=group, async_op=True)
            posted.append((work, out))
        return posted

    def in_sequence_order(work, out):
        if work is not None:
            work.wait()
        return torch.cat([out[rank, :, :, slot * chunk : (slot + 1) * chunk] for rank, slot in owner], 2)

    pending = post(steps[0])
    for i, step in enumerate(steps):
        keys = [in_sequence_order(work, out) for work, out in pending]
        pending = None  # the gathered shards are copied: free them before the next gather
        if i + 1 < len(steps):
            pending = post(steps[i + 1])
        yield Gathered(step, *keys)
        del keys
