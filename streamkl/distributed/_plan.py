"""The plan of a context-parallel call, for any op whose per-row state over disjoint key sets
merges exactly (attn_kl's (kl, lse1, lse2); docs/distributed.md, Merge):

    Context          the group, this rank's place in it, how keys travel, every rank's runs of
                     positions and the packed documents; the calls of each key block, planned
                     once per call
    head_steps       runs of query heads and the key heads they read (GQA), bounding the keys
                     held at once
    key_blocks       the blocks of keys this rank's queries meet: the whole sequence in position
                     order (all-gather) or each rank's shard (ring)
    plan_runs        the single-process calls that cover the local query runs against one
                     block's key runs inside documents (docs/distributed.md, Causal); plan, the
                     same for whole chunks
    run_forward      every call of every block, handed to the op's block runner
    run_backward     the same, routing each call's key gradients home (reduce-scatter or ring)
    merge_into       attn_kl's merge of partial (kl, lse1, lse2)

An op plugs in a block runner: given a head step, a call and the key blocks cut to the call's
keys, it runs its backend on the call's rows and those keys. Key tensors are (B, H_kv, N_local, D) with the
sequence on dim 2; query-side tensors are the runner's own business.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import TAG_DK, all_gather, p2p, reduce_scatter, ring
from ._layout import Runs, SeqIndex, layout_runs, runs_of_runs


class Context:
    """Where a call runs: its group, this rank's place in it, how keys travel, and where every
    token is: each rank's runs of positions (the layout, resolved) and the packed documents'
    offsets (None: one sequence). Runs left None are the named layout's over equal shards,
    resolved at the first use from the key length. The calls of each key block are planned once
    per context, so a forward and its backward share them."""

    def __init__(self, group, world, rank, layout, comm, runs_by_rank=None, offsets=None):
        self.group, self.world, self.rank = group, world, rank
        self.layout, self.comm = layout, comm
        self.runs_by_rank = runs_by_rank
        self.offsets = None if offsets is None else tuple(offsets)
        self._index = None
        self._calls: dict[tuple, list[Call]] = {}

    def resolve(self, n_local: int) -> None:
        if self.runs_by_rank is None:
            self.runs_by_rank = layout_runs(self.layout, [n_local] * self.world, self.offsets)

    @property
    def lengths(self) -> list[int]:
        return [sum(n for _, n in runs) for runs in self.runs_by_rank]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def index(self) -> SeqIndex:
        if self._index is None:
            self._index = SeqIndex(self.runs_by_rank)
        return self._index

    def calls(self, source: int | None, causal: bool) -> list[Call]:
        """The calls of this rank's queries against the keys of rank `source`'s shard, or of the
        whole sequence in position order (None)."""
        calls = self._calls.get((source, causal))
        if calls is None:
            keys = ((0, self.total),) if source is None else self.runs_by_rank[source]
            calls = plan_runs(self.runs_by_rank[self.rank], keys, causal, self.offsets)
            self._calls[(source, causal)] = calls
        return calls


def context(group, layout: str, comm: str, runs_by_rank=None, offsets=None) -> Context:
    return Context(
        group, dist.get_world_size(group), dist.get_rank(group), layout, comm, runs_by_rank, offsets
    )


class Call(NamedTuple):
    """One single-process call: local query rows against `keys` keys of a key block starting at
    `key_start`, causal or not (bottom-right aligned, docs/contract.md, Causal alignment). Block
    runners receive the key block already cut to these keys."""

    rows: slice
    keys: int
    causal: bool
    key_start: int = 0


def plan(query_chunks, key_chunks, chunk: int, causal: bool) -> list[Call]:
    """The calls that cover local query chunks `query_chunks` against a key block holding
    global chunks `key_chunks` (both in storage order, `chunk` tokens each): plan_runs on the
    chunks' runs."""
    queries = runs_of_runs([(c * chunk, chunk) for c in query_chunks])
    keys = tuple((c * chunk, chunk) for c in key_chunks)
    return plan_runs(queries, keys, causal, None)


def _segments(runs: Runs, offsets) -> list[tuple[int, int, int, int]]:
    """(storage offset, first position, length, its document's start) of each piece of `runs`
    within one document, in storage order."""
    out, stored = [], 0
    for start, length in runs:
        p, stop = start, start + length
        while p < stop:
            if offsets is None:
                doc_start, doc_end = 0, stop
            else:
                d = bisect.bisect_right(offsets, p) - 1
                doc_start, doc_end = offsets[d], offsets[d + 1]
            q = min(stop, doc_end)
            out.append((stored + p - start, p, q - p, doc_start))
            p = q
        stored += length
    return out


@functools.lru_cache(maxsize=512)
def plan_runs(query_runs: Runs, key_runs: Runs, causal: bool, offsets: tuple | None) -> list[Call]:
    """The calls that cover the local queries (stored as `query_runs`) against a key block
    (stored as `key_runs`), inside the documents of `offsets` (None: one sequence).

    A row at position p sees the keys of its document at positions <= p (causal) or all of them.
    For a query piece [a, a+L) and a key piece [b, c) of one document (c cut to a+L when causal):
    rows at p >= c see the whole key piece (a non-causal call); rows at b <= p < c see a growing
    prefix, which is one causal call from row max(a, b) against all of [b, c): bottom-right
    alignment puts its diagonal at p = c - 1 (docs/distributed.md, Causal). Neighbouring calls
    then merge where one call says the same: (a) the same keys, non-causal, adjacent rows;
    (b) the same rows, adjacent keys, the first non-causal and the second non-causal or causal
    with at least as many keys as rows; (c) adjacent rows, both causal, from the same key, the
    second's diagonal one key past the first's last key. Zigzag's own shard is one call by
    (b) then (c). Cached: every layer of a model plans the same runs."""
    by_doc: dict[int, list] = {}
    for piece in _segments(key_runs, offsets):
        by_doc.setdefault(piece[3], []).append(piece)
    calls = []
    for row0, a, n, doc in _segments(query_runs, offsets):
        for key0, b, m, _ in by_doc.get(doc, ()):
            c = min(b + m, a + n) if causal else b + m
            if c <= b:
                continue
            if not causal:
                calls.append(Call(slice(row0, row0 + n), m, False, key0))
                continue
            first = max(a, b)
            if c > first:
                calls.append(Call(slice(row0 + first - a, row0 + c - a), c - b, True, key0))
            if a + n > max(a, c):
                calls.append(Call(slice(row0 + max(a, c) - a, row0 + n), c - b, False, key0))
    calls.sort(key=lambda call: (call.rows.start, call.rows.stop, call.key_start))
    merged: list[Call] = []
    for call in calls:
        joined = _join(merged[-1], call) if merged else None
        while joined is not None:
            merged[-1] = joined
            call = merged.pop()
            joined = _join(merged[-1], call) if merged else None
        merged.append(call)
    return merged


def _join(first: Call, second: Call) -> Call | None:
    """One call equal to `first` then `second`, or None (rules of plan_runs)."""
    rows = second.rows.stop - second.rows.start
    if first.rows == second.rows:
        if not first.causal and first.key_start + first.keys == second.key_start:
            if not second.causal or second.keys >= rows:
                return Call(first.rows, first.keys + second.keys, second.causal, first.key_start)
        return None
    if first.rows.stop != second.rows.start or first.key_start != second.key_start:
        return None
    both = slice(first.rows.start, second.rows.stop)
    if not first.causal and not second.causal and first.keys == second.keys:
        return Call(both, first.keys, False, first.key_start)
    if first.causal and second.causal and second.keys - rows == first.keys:
        return Call(both, second.keys, True, first.key_start)
    return None


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


def key_blocks(ctx: Context, keys: Sequence[Tensor], steps) -> Iterator[tuple[HeadStep, int | None, list]]:
    """(head step, the block's source, each key tensor's block) for every block of keys this
    rank's queries meet: the whole sequence in position order once per head step (all-gather,
    source None), or each rank's shard in turn (ring, source: that rank). A block holds the
    step's key heads only."""
    ctx.resolve(keys[0].shape[2])
    if ctx.comm == "allgather":
        for step, blocks in _gathered_steps(ctx, keys, steps):
            yield step, None, blocks
        return
    for step in steps:
        shards = [k[:, heads] for k, heads in zip(keys, step.k)]
        for source, blocks in ring(shards, ctx.group, ctx.rank, ctx.world, ctx.lengths):
            yield step, source, blocks


def _padded(t: Tensor, length: int) -> Tensor:
    """`t` (B, H, n, D) zero-padded to `length` tokens: all-gathers move equal sizes."""
    if t.shape[2] == length:
        return t
    out = t.new_zeros((t.shape[0], t.shape[1], length, t.shape[3]))
    out[:, :, : t.shape[2]] = t
    return out


def _gathered_steps(ctx: Context, keys: Sequence[Tensor], steps) -> Iterator[tuple[HeadStep, list[Tensor]]]:
    """For each head step, every key tensor's step heads over the whole sequence, in position
    order. Shards of different lengths travel padded to the longest.

    The gather of the next step is posted before the current one is handed out, so it travels
    while the caller computes (docs/distributed.md, All-gather)."""
    longest = max(ctx.lengths)
    pieces = list(ctx.index.pieces_in(0, ctx.total))

    def post(step):
        return [
            all_gather(_padded(k[:, heads], longest), ctx.group, ctx.world, async_op=True)
            for k, heads in zip(keys, step.k)
        ]

    def in_sequence_order(work, out):
        if work is not None:
            work.wait()
        if not pieces:
            return out[0, :, :, :0]
        return torch.cat([out[rank, :, :, at : at + n] for _, n, rank, at in pieces], 2)

    pending = post(steps[0])
    for i, step in enumerate(steps):
        blocks = [in_sequence_order(work, out) for work, out in pending]
        pending = None  # the gathered shards are copied: free them before the next gather
        if i + 1 < len(steps):
            pending = post(steps[i + 1])
        yield step, blocks
        del blocks


def _keys_of(call: Call, blocks: list[Tensor]) -> list[Tensor]:
    return [b[:, :, call.key_start : call.key_start + call.keys] for b in blocks]


def run_forward(ctx: Context, keys: Sequence[Tensor], steps, causal: bool, block: ForwardBlock) -> None:
    """Hands every call of every key block to `block`, head step by head step."""
    for step, source, blocks in key_blocks(ctx, keys, steps):
        for call in ctx.calls(source, causal):
            block(step, call, _keys_of(call, blocks))


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
    in_flight = []  # the previous head step's reduce-scatters: two steps' dk buffers live at most
    n_local = keys[0].shape[2]
    for step, _, blocks in key_blocks(ctx, keys, steps):
        longest = max(ctx.lengths)
        # the dk partials of every rank's keys, stored by owner: (world, B, Hk, longest, D), so
        # that one reduce-scatter hands each owner the sum over all ranks
        by_owner = {
            i: grad.new_zeros(
                (ctx.world, blocks[i].shape[0], blocks[i].shape[1], longest, blocks[i].shape[3])
            )
            for i, grad in key_grads.items()
        }
        for call in ctx.calls(None, causal):
            parts = block(step, call, _keys_of(call, blocks))
            for i, buffer in by_owner.items():
                for position, n, rank, at in ctx.index.pieces_in(call.key_start, call.key_start + call.keys):
                    first = position - call.key_start
                    buffer[rank, :, :, at : at + n] += parts[i][:, :, first : first + n]
        _finish_reduce_scatters(in_flight, key_grads, n_local)
        # the buffer stays referenced until its reduce-scatter is waited on
        in_flight = [
            (reduce_scatter(buffer, ctx.group, ctx.world), i, step.k[i], buffer)
            for i, buffer in by_owner.items()
        ]
        del by_owner
    _finish_reduce_scatters(in_flight, key_grads, n_local)


def _finish_reduce_scatters(in_flight, key_grads, n_local: int) -> None:
    for (request, out), i, heads, _ in in_flight:
        if request is not None:
            request.wait()
        key_grads[i][:, heads] += out[:, :, :n_local]


def _backward_ring(ctx: Context, keys, steps, causal, key_grads, block) -> None:
    wanted = list(key_grads)
    for step in steps:
        requests, sent, arriving = [], [], []
        hop = 0
        for _, source, blocks in key_blocks(ctx, keys, [step]):
            partial = [
                torch.zeros(blocks[i].shape, dtype=key_grads[i].dtype, device=blocks[i].device)
                for i in wanted
            ]
            for call in ctx.calls(source, causal):
                parts = block(step, call, _keys_of(call, blocks))
                for buffer, i in zip(partial, wanted):
                    buffer[:, :, call.key_start : call.key_start + call.keys] += parts[i]
            # the dk partials of this block's keys travel one hop behind the keys: add what the
            # previous rank sent for this block, pass the sum on (docs/distributed.md, Ring)
            for request in requests:
                request.wait()
            for buffer, arrived in zip(partial, arriving):
                buffer += arrived
            hop += 1
            if ctx.world == 1:
                arriving = partial
                continue
            # what arrives next is the previous rank's partial for the next block: its source's length
            length = ctx.lengths[(ctx.rank - hop) % ctx.world]
            sent = partial
            arriving = [b.new_empty((*b.shape[:2], length, b.shape[3])) for b in partial]
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
