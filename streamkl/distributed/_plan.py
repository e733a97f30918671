"""The plan of a context-parallel call, for any op whose per-row state over disjoint key sets
merges exactly (attn_kl's (kl, lse1, lse2); docs/distributed.md, Merge):

    Context          the group, this rank's place in it, the layout, how keys travel
    head_steps       runs of query heads and the key heads they read (GQA), bounding the keys
                     held at once
    key_blocks       the blocks of keys this rank's queries meet, in sequence order
    plan             the single-process calls that cover local query chunks against one block
                     (causal prefixes, docs/distributed.md, Causal)
    run_forward      every call of every block, handed to the op's block runner
    run_backward     the same, routing each call's key gradients home (reduce-scatter or ring)
    merge_into       attn_kl's merge of partial (kl, lse1, lse2)

An op plugs in a block runner: given a head step, a call and the key blocks, it runs its
backend on the call's rows and key prefix. Key tensors are (B, H_kv, N_local, D) with the
sequence on dim 2; query-side tensors are the runner's own business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import TAG_DK, all_gather, p2p, reduce_scatter, ring
from ._layout import chunks_of, chunks_per_rank, owners


class Context(NamedTuple):
    """Where a call runs: its group, this rank's place in it, the layout, how keys travel."""

    group: object
    world: int
    rank: int
    layout: str
    comm: str

    @property
    def local_chunks(self) -> tuple[int, ...]:
        return chunks_of(self.layout, self.rank, self.world)


def context(group, layout: str, comm: str) -> Context:
    return Context(group, dist.get_world_size(group), dist.get_rank(group), layout, comm)


class Call(NamedTuple):
    """One single-process call: local query rows against the first `keys` keys of a key block,
    causal or not (bottom-right aligned, docs/contract.md, Causal alignment)."""

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
    """A run of query heads, and for each key tensor the key heads they read (GQA)."""

    q: slice
    k: tuple[slice, ...]


def head_steps(heads: int, key_heads: Sequence[int], per_step: int) -> list[HeadStep]:
    """Runs of `per_step` query heads (a multiple of every GQA group size, so every key head
    belongs to one run) and, for each key tensor of `key_heads` heads, the key heads they read."""
    groups = [heads // hk for hk in key_heads]
    steps = []
    for start in range(0, heads, per_step):
        stop = min(start + per_step, heads)
        steps.append(HeadStep(slice(start, stop), tuple(slice(start // g, stop // g) for g in groups)))
    return steps


# A block runner: (head step, call, the step's key blocks) -> None (forward: it merges the call's
# partial state itself), or the call's gradient of key tensor i for each i asked (backward).
ForwardBlock = Callable[[HeadStep, Call, list[Tensor]], None]
BackwardBlock = Callable[[HeadStep, Call, list[Tensor]], dict[int, Tensor]]


def key_blocks(
    ctx: Context, keys: Sequence[Tensor], steps
) -> Iterator[tuple[HeadStep, tuple[int, ...], list]]:
    """(head step, global chunks the block holds, each key tensor's block) for every block of
    keys this rank's queries meet: the whole sequence once per head step (all-gather), or each
    rank's shard in turn (ring). A block holds the step's key heads only."""
    if ctx.comm == "allgather":
        every_chunk = tuple(range(ctx.world * chunks_per_rank(ctx.layout)))
        for step, blocks in _gathered_steps(ctx, keys, steps):
            yield step, every_chunk, blocks
        return
    for step in steps:
        shards = [k[:, heads] for k, heads in zip(keys, step.k)]
        for source, blocks in ring(shards, ctx.group, ctx.rank, ctx.world):
            yield step, chunks_of(ctx.layout, source, ctx.world), blocks


def _gathered_steps(ctx: Context, keys: Sequence[Tensor], steps) -> Iterator[tuple[HeadStep, list[Tensor]]]:
    """For each head step, every key tensor's step heads over the whole sequence, in order.

    The gather of the next step is posted before the current one is handed out, so it travels
    while the caller computes (docs/distributed.md, All-gather)."""
    owner = owners(ctx.layout, ctx.world)
    chunk = keys[0].shape[2] // chunks_per_rank(ctx.layout)

    def post(step):
        return [
            all_gather(k[:, heads], ctx.group, ctx.world, async_op=True) for k, heads in zip(keys, step.k)
        ]

    def in_sequence_order(work, out):
        if work is not None:
            work.wait()
        return torch.cat([out[rank, :, :, slot * chunk : (slot + 1) * chunk] for rank, slot in owner], 2)

    pending = post(steps[0])
    for i, step in enumerate(steps):
        blocks = [in_sequence_order(work, out) for work, out in pending]
        pending = None  # the gathered shards are copied: free them before the next gather
        if i + 1 < len(steps):
            pending = post(steps[i + 1])
        yield step, blocks
        del blocks


def run_forward(ctx: Context, keys: Sequence[Tensor], steps, causal: bool, block: ForwardBlock) -> None:
    """Hands every call of every key block to `block`, head step by head step."""
    chunk = keys[0].shape[2] // chunks_per_rank(ctx.layout)
    for step, key_chunks, blocks in key_blocks(ctx, keys, steps):
        for call in plan(ctx.local_chunks, key_chunks, chunk, causal):
            block(step, call, blocks)


def run_backward(
    ctx: Context,
    keys: Sequence[Tensor],
    steps,
    causal: bool,
    key_grads: dict[int, Tensor],
    block: BackwardBlock,
) -> None:
    """Runs `block` on every call of every key block and adds into key_grads[i] (the shape of
    keys[i], float32 or float64) the gradient of this rank's keys summed over every rank's rows:
    by a reduce-scatter per head step (all-gather) or a second ring one hop behind the keys
    (ring). The runner adds its query-side gradients itself."""
    if ctx.comm == "allgather":
        _backward_allgather(ctx, keys, steps, causal, key_grads, block)
    else:
        _backward_ring(ctx, keys, steps, causal, key_grads, block)


def _backward_allgather(ctx: Context, keys, steps, causal, key_grads, block) -> None:
    n = keys[0].shape[2]
    chunk = n // chunks_per_rank(ctx.layout)
    owner = owners(ctx.layout, ctx.world)
    in_flight = []  # the previous head step's reduce-scatters: two steps' dk buffers live at most
    for step, key_chunks, blocks in key_blocks(ctx, keys, steps):
        # the dk partials of every rank's keys, stored by owner: (world, B, Hk, N_local, D), so that
        # one reduce-scatter hands each owner the sum over all ranks
        by_owner = {
            i: grad.new_zeros((ctx.world, blocks[i].shape[0], blocks[i].shape[1], n, blocks[i].shape[3]))
            for i, grad in key_grads.items()
        }
        for call in plan(ctx.local_chunks, key_chunks, chunk, causal):
            parts = block(step, call, blocks)
            for i, buffer in by_owner.items():
                for c in range(call.keys // chunk):
                    rank, slot = owner[key_chunks[c]]
                    buffer[rank, :, :, slot * chunk : (slot + 1) * chunk] += parts[i][
                        :, :, c * chunk : (c + 1) * chunk
                    ]
        _finish_reduce_scatters(in_flight, key_grads)
        # the buffer stays referenced until its reduce-scatter is waited on
        in_flight = [
            (reduce_scatter(buffer, ctx.group, ctx.world), i, step.k[i], buffer)
            for i, buffer in by_owner.items()
        ]
        del by_owner
    _finish_reduce_scatters(in_flight, key_grads)


def _finish_reduce_scatters(in_flight, key_grads) -> None:
    for (request, out), i, heads, _ in in_flight:
        if request is not None:
            request.wait()
        key_grads[i][:, heads] += out


def _backward_ring(ctx: Context, keys, steps, causal, key_grads, block) -> None:
    chunk = keys[0].shape[2] // chunks_per_rank(ctx.layout)
    wanted = list(key_grads)
    for step in steps:
        requests, sent, arriving = [], [], []
        for _, key_chunks, blocks in key_blocks(ctx, keys, [step]):
            partial = [
                torch.zeros(blocks[i].shape, dtype=key_grads[i].dtype, device=blocks[i].device)
                for i in wanted
            ]
            for call in plan(ctx.local_chunks, key_chunks, chunk, causal):
                parts = block(step, call, blocks)
                for buffer, i in zip(partial, wanted):
                    buffer[:, :, : call.keys] += parts[i]
            # the dk partials of this block's keys travel one hop behind the keys: add what the
            # previous rank sent for this block, pass the sum on (docs/distributed.md, Ring)
            for request in requests:
                request.wait()
            for buffer, arrived in zip(partial, arriving):
                buffer += arrived
            if ctx.world == 1:
                arriving = partial
                continue
            sent, arriving = partial, [torch.empty_like(buffer) for buffer in partial]
            requests = p2p(sent, arriving, ctx.group, ctx.rank, ctx.world, TAG_DK)
        for request in requests:
            request.wait()
        del sent
        # after `world` hops the partials of this rank's own keys are home, summed over all ranks
        for arrived, i in zip(arriving, wanted):
            key_grads[i][:, step.k[i]] += arrived


def merge_into(kl, lse1, lse2, part_kl, part_lse1, part_lse2) -> None:
    """attn_kl's merge, in place: the state over the union of two disjoint key sets
    (docs/distributed.md, Merge).

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
