"""indexer_kl with context parallelism (docs/distributed.md, indexer_kl): validation of a call,
its block runners on the plan, and its torch.library registration.

    check                            one rank's checks of a call, agreed across the group, and
                                     the call's plan Context (attn_kl's: layouts, positions,
                                     documents and their checks are _validate's and _plan's)
    run_forward / run_backward       the block runners (_plan.run_forward / run_backward, the
                                     all-gather form): each block is one call of the backend
                                     selected for the whole call on a run of local query rows
                                     and the run of keys they admit
    streamkl::cp_indexer_kl_fwd      -> (kl, lse, lse2, mass) of the local rows
    streamkl::cp_indexer_kl_bwd      -> (dqi, dki, dw) of the local shards

The key-side tensors (the teacher's k, the indexer's ki) are gathered once, in sequence order;
the query-side ones (q, qi, w, lse, topk) stay local. Under the all-gather plan every local row
is in exactly one call, against every key it admits (its document's, up to itself when causal),
so each block's statistics are the row's final ones and nothing is merged (docs/distributed.md,
indexer_kl). The backward gathers the keys again, writes dqi and dw of the local rows, and hands
dki home by one reduce-scatter.

A call is validated once (its spec built by streamkl._checks.indexer_kl_spec from the local
shards, topk's values checked against the whole sequence once every rank's length is known, the
backend selected, all agreed across ranks); every block reuses that spec and backend. The eager
path runs the runners through an autograd.Function; a traced call (torch.compile) goes through
the custom ops, whose forward runs the cross-rank checks at run time, as
streamkl.distributed.attn_kl does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .. import _checks, _dispatch, _env
from .._spec import IndexerKLInputs, IndexerKLSpec, IndexerKLStats
from ..ops._common import on_device, once_differentiable, refuse_unsupported_autograd
from ..ops.indexer_kl import _one_head, _out_dtype
from . import _plan, _validate
from ._comm import group_by_name, resolve_group
from ._ops import _traced, from_bhsd, in_bhsd, refuse_dtensors, sum_over_ranks
from ._plan import Call, Context, HeadStep

OP = "indexer_kl"
WHAT = "streamkl.distributed.indexer_kl"

# The key tensors the plan moves, in this order: the teacher's k, the indexer's ki.
KEY_INDEX_KI = 1

# Each input's sequence axis in its canonical (bhsd) form: shards may differ along it only.
SEQUENCE_DIM = {"q": 2, "k": 2, "qi": 2, "ki": 2, "w": 2, "lse": 2, "topk": 1}

# Each input's canonical axes under qkv_format (_ops.to_bhsd): a tensor has the format's
# axes minus those it lacks (w and lse have no D, topk and a headless key no H).
AXES = {
    "q": ("bhsd",),
    "k": ("bhsd", "bsd"),
    "qi": ("bhsd",),
    "ki": ("bhsd", "bsd"),
    "w": ("bhs",),
    "lse": ("bhs",),
    "topk": ("bsd",),
}


class Options(NamedTuple):
    """The context-parallel options of a call, as its caller passed them (the fields
    _validate.local_layout reads as attn_kl's). layout None: the positions' layout, or "zigzag"
    without positions."""

    layout: str | None
    reduction: str
    backend: str | None
    requires_grad: tuple[bool, bool, bool]  # qi, ki, w
    positions: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None


class Checked(NamedTuple):
    """A validated call: its spec (of the local shards), the backend that runs every block: its
    name (STREAMKL_BACKEND resolved) and, where the call runs now rather than being traced, its
    implementation."""

    spec: IndexerKLSpec
    backend: str
    impl: object | None


def _topk_range(topk: Tensor) -> tuple[int, int] | None:
    """(lowest, highest) entry of this rank's topk (one host read), None when it is empty; an
    entry below -1 raises here. The highest is checked against the whole sequence's length once
    every rank's is known (_check_topk_positions)."""
    if topk.numel() == 0:
        return None
    low, high = torch.stack(torch.aminmax(topk)).tolist()
    if low < -1:
        raise ValueError(
            f"topk holds the index {low}; topk holds key positions in the whole sequence, or -1 for padding"
        )
    return low, high


def _check_topk_positions(shares: list, total: int) -> None:
    """Every rank's topk entries are positions in the whole sequence, [0, N) (N: the tokens of
    all shards) or -1: the same on every rank, from what every rank shared."""
    for rank, share in enumerate(shares):
        if share["topk"] is not None and share["topk"][1] >= total:
            raise ValueError(
                f"{WHAT}: rank {rank} of the group: topk holds the index {share['topk'][1]}; topk holds "
                f"key positions in the whole sequence, [0, {total}) (the tokens of all shards), or -1 "
                "for padding"
            )


def _shape_but_sequence(t: Tensor | None, dim: int):
    """A tensor's shape with its sequence axis left out of the comparison across ranks."""
    if t is None:
        return None
    return tuple(t.shape[:dim]) + ("N_local",) + tuple(t.shape[dim + 1 :])


def check_indexer_kl(group, spec: IndexerKLSpec, inputs: IndexerKLInputs, options: Options, *, run: bool):
    """Everything one rank can check alone of a call whose spec streamkl._checks built (metadata
    only); raises ValueError/TypeError naming the argument. Returns ((Checked, the layout's name,
    the documents' offsets), the metadata every rank must share, what this rank shares: its
    length, runs and topk's range), as _validate.check_attn_kl does. `run`: real tensors about
    to run, so positions, cu_seqlens and topk's values are read (one host sync each) and the
    backend is selected, once for every block (a block is a slice of the local call)."""
    _checks.check_reduction(options.reduction)
    _validate.check_same_tokens(spec.nq, spec.nk)
    device = inputs.q.device
    layout, runs, offsets, layout_meta = _validate.local_layout(options, spec.batch, spec.nq, device, run=run)
    name = _dispatch.check_name(options.backend)
    impl, topk_range = None, None
    if run:
        if inputs.topk is not None:
            topk_range = _topk_range(inputs.topk)
        _env.check_all()
        impl = _dispatch.select(OP, spec, inputs, name)  # a named backend that cannot run raises
        _validate.check_group_device(group, device.type)
    tensors = dict(zip(("q", "k", "qi", "ki", "w", "lse", "topk"), inputs))
    meta = {
        # shapes but the sequence axis: shards may differ in length where the layout allows
        **{f"{arg} shape": _shape_but_sequence(t, SEQUENCE_DIM[arg]) for arg, t in tensors.items()},
        "dtypes": tuple(None if t is None else str(t.dtype) for t in tensors.values()),
        "device type": device.type,
        "causal": spec.causal,
        "scale": spec.scale,
        "reduction": options.reduction,
        "backend": name,
        "requires_grad": tuple(options.requires_grad),
        **layout_meta,
    }
    share = {"length": spec.nq, "runs": runs, "topk": topk_range}
    return (Checked(spec, name, impl), layout, offsets), meta, share


def check(group, stored: dict, qkv_format, causal, scale, options: Options, *, run: bool):
    """Validates a call on its inputs as stored (`stored`: q, k, qi, ki, w, lse, topk by name, laid
    out as `qkv_format`): with `run` (real tensors about to run) on every rank, agreed across the
    group, selecting the backend and resolving every rank's runs of positions: returns ((Checked,
    the inputs in the canonical order, keys of one head as (B, 1, N, D)), the call's plan
    Context); else (traced) this rank's checks that need no communication: ((Checked, views),
    None). As attn_kl's check, the views are made among the agreed checks."""

    def local():
        q, k, qi, ki, w, lse, topk = views = in_bhsd(stored, qkv_format, AXES)
        views[1] = k = _one_head(k)
        views[3] = ki = _one_head(ki)
        refuse_unsupported_autograd("distributed.indexer_kl", q, k, qi, ki, w, lse)
        call = dict(lse=lse, topk=topk, causal=causal, scale=scale)
        # read_values=False: topk holds positions in the whole sequence, checked after the exchange
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call, read_values=False)
        inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk)
        (checked, layout, offsets), meta, share = check_indexer_kl(group, spec, inputs, options, run=run)
        return ((checked, views), layout, offsets), {**meta, "qkv_format": qkv_format}, share

    if not run:
        return local()[0][0], None
    checked, ctx, shares = _validate.agree_on_layout(group, local, WHAT, "allgather")
    _check_topk_positions(shares, ctx.total)
    return checked, ctx


# --- the block runners ----------------------------------------------------------------------------


def _step(spec: IndexerKLSpec) -> HeadStep:
    """One pass over the keys with every head: the teacher's mixture sums over all H heads, so a
    row's statistics need them together; every key head of k and the one head of ki travel."""
    return HeadStep(slice(0, spec.heads), (slice(0, spec.heads_kv), slice(0, 1)))


def _block_spec(spec: IndexerKLSpec, call: Call) -> IndexerKLSpec:
    """The spec of one block: the call's rows and key prefix, its causality."""
    return spec._replace(nq=call.rows.stop - call.rows.start, nk=call.keys, causal=call.causal)


def _block_topk(topk: Tensor | None, call: Call, total_keys: int) -> Tensor | None:
    """The call's rows of topk as indices into the call's keys: a sequence position minus the
    first key's (the gathered block is the whole sequence in position order). A position outside
    the call's keys is one these rows do not admit (the causal mask hides it, or it lies in
    another document), so it becomes padding (-1) and no backend reads outside the block."""
    if topk is None:
        return None
    rows = topk[:, call.rows]
    start = call.key_start
    if start == 0 and call.keys == total_keys:
        return rows
    local = rows - start
    return torch.where((rows >= 0) & (local < call.keys) & (local >= 0), local, -1)


def _block_inputs(inputs: IndexerKLInputs, lse: Tensor | None, call: Call, keys: list[Tensor], total: int):
    q, _, qi, _, w, _, topk, _ = inputs
    rows = (slice(None), slice(None), call.rows)
    # the runner gets the key block whole or already cut to the call's keys: [:keys] is the
    # call's run either way (its first key is the block's first)
    key, key_i = (t[:, :, : call.keys] for t in keys)
    lse_rows = None if lse is None else lse[rows]
    return IndexerKLInputs(q[rows], key, qi[rows], key_i, w[rows], lse_rows, _block_topk(topk, call, total))


def run_forward(checked: Checked, ctx: Context, inputs: IndexerKLInputs) -> IndexerKLStats:
    """The local rows' (kl, lse, lse2, mass) over the whole sequence. Each local row is in one
    call of the all-gather plan, against all the keys it admits (a run of its document), so the
    call's statistics are the row's: written, not merged."""
    spec, backend = checked.spec, checked.impl
    q, k, qi, ki, w, lse, _, _ = inputs
    dtype = _out_dtype(q, qi, w)
    kl = torch.zeros(spec.batch, spec.nq, dtype=dtype, device=q.device)
    lse2 = torch.full_like(kl, -math.inf)
    mass = torch.zeros_like(kl)
    if lse is not None:
        teacher_lse = lse.to(dtype=dtype, copy=True).contiguous()
    else:
        teacher_lse = torch.full((spec.batch, spec.heads, spec.nq), -math.inf, dtype=dtype, device=q.device)
    stats = IndexerKLStats(kl, teacher_lse, lse2, mass)
    ctx.resolve(spec.nq)
    # the same on every rank, so no one communicates; a rank with no rows still takes part
    if spec.batch == 0 or ctx.total == 0:
        return stats
    total = ctx.total
    written = [0]  # where the rows written so far end: the plan hands calls out by first row

    def block(step: HeadStep, call: Call, keys: list[Tensor]) -> None:
        # a row in two calls would need its partial states merged, not the second written over
        # the first: fail loudly should a plan ever split a row's keys
        if call.rows.start < written[0]:
            raise RuntimeError(f"{WHAT}: the plan puts rows {call.rows} in a second call")
        written[0] = call.rows.stop
        part = backend.forward(_block_spec(spec, call), _block_inputs(inputs, lse, call, keys, total))
        for out, got in zip(stats, part):
            out[..., call.rows] = got

    with on_device(q):
        _plan.run_forward(ctx, (k, ki), [_step(spec)], spec.causal, block)
    return stats


def run_backward(
    checked: Checked, ctx: Context, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl: Tensor
) -> tuple[Tensor | None, ...]:
    """(dqi, dki, dw) of this rank's shards for the gradients checked.spec.needs asks for (None
    for the others), accumulated in the statistics' dtype: dqi and dw from this rank's rows, dki
    summed over every rank's rows and reduce-scattered to its owner (_plan.run_backward)."""
    spec = checked.spec
    q, k, qi, ki, w, _, _, _ = inputs
    dtype = stats.kl.dtype
    students = (qi, ki, w)
    grads = [
        torch.zeros(t.shape, dtype=dtype, device=t.device) if need else None
        for t, need in zip(students, spec.needs)
    ]
    ctx.resolve(spec.nq)
    # a rank with no rows still takes part: the others' keys pass through it, its keys' gradients come home
    if spec.batch > 0 and ctx.total > 0 and any(spec.needs):
        backend = _dispatch.backward_of(checked.impl, spec, inputs)
        grad_kl = grad_kl.to(dtype)
        lse = stats.lse if spec.given_lse else None
        total = ctx.total
        key_grads = {KEY_INDEX_KI: grads[1]} if spec.needs[1] else {}

        def block(step: HeadStep, call: Call, keys: list[Tensor]) -> dict[int, Tensor]:
            part = IndexerKLStats(*(t[..., call.rows].contiguous() for t in stats))
            dqi, dki, dw = backend.backward(
                _block_spec(spec, call),
                _block_inputs(inputs, lse, call, keys, total),
                part,
                grad_kl[:, call.rows].contiguous(),
            )
            for grad, part_grad in ((grads[0], dqi), (grads[2], dw)):
                if grad is not None:
                    grad[:, :, call.rows] += part_grad
            return {KEY_INDEX_KI: dki} if key_grads else {}

        with on_device(q), torch.no_grad():
            _plan.run_backward(ctx, (k, ki), [_step(spec)], spec.causal, key_grads, block)
    return tuple(g.to(t.dtype) if g is not None else None for g, t in zip(grads, students))


# --- the registered ops (torch.compile) ----------------------------------------------------------


@torch.library.custom_op("streamkl::cp_indexer_kl_fwd", mutates_args=())
def cp_indexer_kl_fwd(
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    lse: Tensor | None,
    topk: Tensor | None,
    positions: Tensor | None,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    group_name: str,
    layout: str | None,
    causal: bool,
    scale: float,
    backend: str,
    requires_grad: list[bool],
    reduction: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The local rows' (kl, lse, lse2, mass) over the whole sequence. A traced call's Python
    wrapper ran at trace time, so the cross-rank checks run here, on every call."""
    group = group_by_name(group_name)
    options = Options(layout, reduction, backend, tuple(requires_grad), positions, cu_seqlens, max_seqlen)
    stored = dict(q=q, k=k, qi=qi, ki=ki, w=w, lse=lse, topk=topk)
    (checked, _), ctx = check(group, stored, "bhsd", causal, scale, options, run=True)
    return tuple(run_forward(checked, ctx, IndexerKLInputs(q, k, qi, ki, w, lse, topk)))


@cp_indexer_kl_fwd.register_fake
def _(q, k, qi, ki, w, lse, topk, *options):
    dtype = _out_dtype(q, qi, w)
    rows = q.new_empty((q.shape[0], q.shape[2]), dtype=dtype)
    per_head = q.new_empty(q.shape[:3], dtype=dtype)
    return rows, per_head, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("streamkl::cp_indexer_kl_bwd", mutates_args=())
def cp_indexer_kl_bwd(
    grad_kl: Tensor,
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    topk: Tensor | None,
    kl: Tensor,
    lse: Tensor,
    lse2: Tensor,
    mass: Tensor,
    positions: Tensor | None,
    cu_seqlens: Tensor | None,
    group_name: str,
    layout: str | None,
    causal: bool,
    scale: float,
    lse_given: bool,
    backend: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dqi, dki, dw) of this rank's shards; an unneeded gradient is an empty tensor. Takes what
    cp_indexer_kl_fwd validated: the spec is read off the shapes, the backend selected once; the
    ranks' runs of positions are exchanged again (the forward's context is not kept across the
    graph)."""
    group = group_by_name(group_name)
    call = dict(causal=causal, scale=scale, cu_seqlens=None, max_seqlen=None)
    spec = _checks.indexer_kl_spec_of_saved(q, k, qi, ki, w, lse_given=lse_given, topk=topk, **call)
    spec = spec.with_needs(needs)
    inputs = IndexerKLInputs(q, k, qi, ki, w, lse if lse_given else None, topk)
    checked = Checked(spec, backend, _dispatch.select(OP, spec, inputs, backend))
    stats = IndexerKLStats(kl, lse, lse2, mass)
    ctx = _validate.context_of_saved(group, layout, positions, cu_seqlens, q.shape[2], "allgather", WHAT)
    grads = run_backward(checked, ctx, inputs, stats, grad_kl)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (qi, ki, w)))


@cp_indexer_kl_bwd.register_fake
def _(grad_kl, q, k, qi, ki, w, topk, kl, lse, lse2, mass, *options):
    needs = options[-1]
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((qi, ki, w), needs))


def _setup_context(ctx, inputs, output):
    q, k, qi, ki, w, lse, topk, positions, cu_seqlens, _, *options = inputs
    group_name, layout, causal, scale, backend = options[:5]
    ctx.save_for_backward(q, k, qi, ki, w, topk, *output)
    ctx.index_tensors = (positions, cu_seqlens)  # held, not saved: as attn_kl's
    ctx.options = (group_name, layout, causal, scale, lse is not None, backend)
    ctx.mark_non_differentiable(*output[1:])  # only kl carries a gradient


def _op_backward(ctx, grad_kl, *_):
    q, k, qi, ki, w, topk, kl, lse, lse2, mass = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[2:5])
    saved = (q, k, qi, ki, w, topk, kl, lse, lse2, mass, *ctx.index_tensors, *ctx.options)
    grads = cp_indexer_kl_bwd(grad_kl, *saved, needs)
    return (None, None, *(g if need else None for g, need in zip(grads, needs))) + (None,) * 12


cp_indexer_kl_fwd.register_autograd(_op_backward, setup_context=_setup_context)


# --- the eager path ---------------------------------------------------------------------------


class _IndexerKL(torch.autograd.Function):
    """run_forward / run_backward for a validated eager call: one node, the checked spec and
    backend reused by the backward. Returns (kl, lse2); lse2 counts the rows of a mean."""

    @staticmethod
    def forward(ctx, checked, cp, q, k, qi, ki, w, lse, topk):
        stats = run_forward(checked, cp, IndexerKLInputs(q, k, qi, ki, w, lse, topk))
        ctx.save_for_backward(q, k, qi, ki, w, topk, *stats)
        ctx.call = (checked, cp)
        ctx.mark_non_differentiable(stats.lse2)
        return stats.kl, stats.lse2

    @staticmethod
    def backward(ctx, grad_kl, _):
        q, k, qi, ki, w, topk, *stats = ctx.saved_tensors
        stats = IndexerKLStats(*stats)
        checked, cp = ctx.call
        checked = checked._replace(spec=checked.spec.with_needs(ctx.needs_input_grad[4:7]))
        lse = stats.lse if checked.spec.given_lse else None
        grads = run_backward(checked, cp, IndexerKLInputs(q, k, qi, ki, w, lse, topk), stats, grad_kl)
        return (None,) * 4 + (*once_differentiable("distributed.indexer_kl", grads), None, None)


def _reduce(kl: Tensor, lse2: Tensor, reduction: str, group, traced: bool) -> Tensor:
    """The local rows' KL, or the sequence's sum / mean: one all-reduce of (the local sum, the
    local rows that see a key), so every rank returns the same value; "mean" divides by the rows
    of the whole sequence that see a key (at least 1), as the single-process op does. The
    gradient reaches this rank's rows only: every rank's backward starts from the same global
    value, and dki's sum over ranks happens in the backward itself."""
    if reduction == "none":
        return kl
    local_sum = kl.sum()
    seen = torch.isneginf(lse2).logical_not_().sum()
    # float64 on the wire: the count stays exact past 2^24 rows
    both = torch.stack([local_sum.detach().double(), seen.double()])
    both = sum_over_ranks(both, group, traced)
    total = both[0].to(kl.dtype) + (local_sum - local_sum.detach())
    if reduction == "sum":
        return total
    return total / both[1].clamp_min(1).to(kl.dtype)


def indexer_kl(
    q, k, qi, ki, w, *, group, lse, scale, causal, topk, layout, positions, reduction, cu_seqlens, max_seqlen,
    qkv_format, backend,
):  # fmt: skip
    """The public call's body (docstring in streamkl/distributed/__init__.py)."""
    stored = dict(q=q, k=k, qi=qi, ki=ki, w=w, lse=lse, topk=topk)
    refuse_dtensors({**stored, "positions": positions, "cu_seqlens": cu_seqlens}, WHAT)
    group = resolve_group(group)
    requires_grad = tuple(
        torch.is_grad_enabled() and isinstance(t, Tensor) and t.requires_grad for t in (qi, ki, w)
    )
    options = Options(layout, reduction, backend, requires_grad, positions, cu_seqlens, max_seqlen)
    call = (group, stored, qkv_format, causal, scale, options)
    traced = _traced(*stored.values())
    if traced:
        # checks that need no communication run at trace time; the cross-rank ones inside the op
        (checked, views), _ = check(*call, run=False)
        kl, _, lse2, _ = cp_indexer_kl_fwd(
            *views, positions, cu_seqlens, max_seqlen, group.group_name, layout, causal, checked.spec.scale,
            checked.backend, list(requires_grad), reduction,
        )  # fmt: skip
    else:
        (checked, views), cp = check(*call, run=True)
        if any(requires_grad):
            kl, lse2 = _IndexerKL.apply(checked, cp, *views)
        else:
            stats = run_forward(checked, cp, IndexerKLInputs(*views))
            kl, lse2 = stats.kl, stats.lse2
    if reduction == "none":
        return from_bhsd(kl, qkv_format, "bs")
    return _reduce(kl, lse2, reduction, group, traced)
