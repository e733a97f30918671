"""attn_kl with context parallelism, the op: validation of a call, the block runners, and its
torch.library registration.

    run_forward / run_backward    attn_kl's block runners on the plan (_plan.run_forward /
                                  run_backward): each block is one call of the backend selected
                                  for the whole call, backend.forward(block spec, block inputs)
    streamkl::cp_attn_kl_fwd      -> (kl, lse1, lse2) of the local rows over the whole sequence
    streamkl::cp_attn_kl_bwd      -> (dq1, dk1, dq2, dk2) of the local shards
    streamkl::cp_sum              the all-reduce of a traced reduction (eager: sum_over_ranks)

A call is validated once (its spec built by streamkl._checks.attn_kl_spec, then the
context-parallel checks and the backend selection, agreed across ranks) and every block reuses
that spec and backend. An eager call with plain tensors runs the runners through an
autograd.Function; a traced call (torch.compile) checks what needs no communication at trace time
and goes through the custom ops, whose forward runs the cross-rank checks at run time. The ops'
fake functions make torch.compile trace a model that calls attn_kl (docs/distributed.md,
torch.compile).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks, _dispatch
from .._spec import AttnKLInputs, AttnKLSpec, AttnKLStats
from ..ops._common import on_device, once_differentiable, out_dtype, refuse_unsupported_autograd
from . import _plan, _validate
from ._comm import group_by_name, resolve_group
from ._plan import Call, Context, HeadStep

OP = "attn_kl"
WHAT = "streamkl.distributed.attn_kl"


def _block_spec(spec: AttnKLSpec, step: HeadStep, call: Call) -> AttnKLSpec:
    """The spec of one block: the step's heads, the call's rows and key prefix."""
    heads = step.q.stop - step.q.start
    return spec._replace(
        heads=heads,
        heads_kv1=heads // spec.group1,
        heads_kv2=heads // spec.group2,
        nq=call.rows.stop - call.rows.start,
        nk=call.keys,
        causal=call.causal,
    )


def _steps(checked: _validate.Checked) -> list[HeadStep]:
    spec = checked.spec
    return _plan.head_steps(spec.heads, (spec.heads_kv1, spec.heads_kv2), checked.heads_per_step)


def run_forward(checked: _validate.Checked, ctx: Context, inputs: AttnKLInputs) -> AttnKLStats:
    """The local rows' (kl, lse1, lse2) over the whole sequence: each block's partial state
    merged into the running one (docs/distributed.md, Merge)."""
    spec, backend = checked.spec, checked.impl
    q1, k1, q2, k2, _ = inputs
    kl = torch.zeros(spec.batch, spec.heads, spec.nq, dtype=out_dtype(q1, q2), device=q1.device)
    lse1 = torch.full_like(kl, -math.inf)
    lse2 = torch.full_like(kl, -math.inf)
    ctx.resolve(spec.nq)
    if spec.batch * spec.heads == 0 or ctx.total == 0:  # the same on every rank: no one communicates
        return AttnKLStats(kl, lse1, lse2)

    def block(step: HeadStep, call: Call, keys: list[Tensor]) -> None:
        rows = (slice(None), step.q, call.rows)
        key1, key2 = (k[:, :, : call.keys] for k in keys)
        part = backend.forward(_block_spec(spec, step, call), AttnKLInputs(q1[rows], key1, q2[rows], key2))
        _plan.merge_into(kl[rows], lse1[rows], lse2[rows], *part)

    with on_device(q1):
        _plan.run_forward(ctx, (k1, k2), _steps(checked), spec.causal, block)
    return AttnKLStats(kl, lse1, lse2)


def run_backward(
    checked: _validate.Checked, ctx: Context, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: Tensor
) -> tuple[Tensor | None, ...]:
    """(dq1, dk1, dq2, dk2) of this rank's shards for the gradients checked.spec.needs asks
    for (None for the others), accumulated in the statistics' dtype: dq from this rank's rows
    only, dk summed over every rank's rows (_plan.run_backward)."""
    spec = checked.spec
    q1, k1, q2, k2, _ = inputs
    dtype = stats.kl.dtype
    grads = [
        torch.zeros(t.shape, dtype=dtype, device=t.device) if need else None
        for t, need in zip(inputs, spec.needs)
    ]
    ctx.resolve(spec.nq)
    # a rank with no rows still takes part: the others' keys pass through it, its keys' gradients come home
    if spec.batch * spec.heads > 0 and ctx.total > 0 and any(spec.needs):
        backend = _dispatch.backward_of(checked.impl, spec, inputs)
        grad_kl = grad_kl.to(dtype)
        key_grads = {i: grads[2 * i + 1] for i in (0, 1) if spec.needs[2 * i + 1]}

        def block(step: HeadStep, call: Call, keys: list[Tensor]) -> dict[int, Tensor]:
            rows = (slice(None), step.q, call.rows)
            key1, key2 = (k[:, :, : call.keys] for k in keys)
            part = AttnKLStats(*(t[rows].contiguous() for t in stats))
            dq1, dk1, dq2, dk2 = backend.backward(
                _block_spec(spec, step, call),
                AttnKLInputs(q1[rows], key1, q2[rows], key2),
                part,
                grad_kl[rows].contiguous(),
            )
            for grad, part_grad in ((grads[0], dq1), (grads[2], dq2)):
                if grad is not None:
                    grad[rows] += part_grad
            return {i: (dk1, dk2)[i] for i in key_grads}

        with on_device(q1), torch.no_grad():
            _plan.run_backward(ctx, (k1, k2), _steps(checked), spec.causal, key_grads, block)
    return tuple(g.to(t.dtype) if g is not None else None for g, t in zip(grads, inputs))


def check(group, stored: dict, qkv_format, causal, scale1, scale2, options, *, run: bool):
    """Validates a call on its inputs as stored (`stored`: q1, k1, q2, k2 by name, laid out as
    `qkv_format`): with `run` (real tensors about to run) on every rank, agreed across the group,
    selecting the backend and resolving every rank's runs of positions: returns ((Checked, the
    inputs as (B, H, N, D) views), the call's plan Context); else (traced) this rank's checks
    that need no communication: ((Checked, views), None). The views are made among the agreed
    checks, so a tensor that does not fit the format raises on every rank."""

    def local():
        q1, k1, q2, k2 = views = in_bhsd(stored, qkv_format)
        refuse_unsupported_autograd("distributed.attn_kl", q1, k1, q2, k2)
        spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2)
        inputs = AttnKLInputs(q1, k1, q2, k2)
        (checked, layout, offsets), meta, share = _validate.check_attn_kl(
            group, spec, inputs, options, run=run
        )
        return ((checked, views), layout, offsets), {**meta, "qkv_format": qkv_format}, share

    if not run:
        return local()[0][0], None
    checked, ctx, _ = _validate.agree_on_layout(group, local, WHAT, options.comm)
    return checked, ctx


# --- the registered ops (torch.compile) ----------------------------------------------------------


@torch.library.custom_op("streamkl::cp_attn_kl_fwd", mutates_args=())
def cp_attn_kl_fwd(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    positions: Tensor | None,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    group_name: str,
    layout: str | None,
    comm: str,
    causal: bool,
    scale1: float,
    scale2: float,
    heads_per_step: int,
    backend: str,
    requires_grad: list[bool],
    reduction: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The local rows' (kl, lse1, lse2) over the whole sequence. A traced call's Python wrapper
    ran at trace time, so the cross-rank checks run here, on every call."""
    group = group_by_name(group_name)
    options = _validate.Options(
        layout, comm, heads_per_step, reduction, backend, tuple(requires_grad), positions, cu_seqlens,
        max_seqlen,
    )  # fmt: skip
    stored = dict(q1=q1, k1=k1, q2=q2, k2=k2)
    (checked, _), ctx = check(group, stored, "bhsd", causal, scale1, scale2, options, run=True)
    return tuple(run_forward(checked, ctx, AttnKLInputs(q1, k1, q2, k2)))


@cp_attn_kl_fwd.register_fake
def _(q1, k1, q2, k2, *options):
    dtype = out_dtype(q1, q2)
    return tuple(q1.new_empty(q1.shape[:3], dtype=dtype) for _ in range(3))


@torch.library.custom_op("streamkl::cp_attn_kl_bwd", mutates_args=())
def cp_attn_kl_bwd(
    grad_kl: Tensor,
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    kl: Tensor,
    lse1: Tensor,
    lse2: Tensor,
    positions: Tensor | None,
    cu_seqlens: Tensor | None,
    group_name: str,
    layout: str | None,
    comm: str,
    causal: bool,
    scale1: float,
    scale2: float,
    heads_per_step: int,
    backend: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq1, dk1, dq2, dk2) of this rank's shards; an unneeded gradient is an empty tensor. Takes
    what cp_attn_kl_fwd validated: the spec is read off the shapes, the backend selected once;
    the ranks' runs of positions are exchanged again (the forward's context is not kept across
    the graph)."""
    group = group_by_name(group_name)
    inputs = AttnKLInputs(q1, k1, q2, k2)
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=None, max_seqlen=None)
    spec = _checks.attn_kl_spec_of_saved(q1, k1, q2, k2, **call).with_needs(needs)
    impl = _dispatch.select(OP, spec, inputs, backend)
    checked = _validate.Checked(spec, heads_per_step, backend, impl)
    stats = AttnKLStats(kl, lse1, lse2)
    ctx = _validate.context_of_saved(group, layout, positions, cu_seqlens, q1.shape[2], comm, WHAT)
    grads = run_backward(checked, ctx, inputs, stats, grad_kl)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, inputs))


@cp_attn_kl_bwd.register_fake
def _(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *options):
    needs = options[-1]
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((q1, k1, q2, k2), needs))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, positions, cu_seqlens, _, *options = inputs
    kl, lse1, lse2 = output
    ctx.save_for_backward(q1, k1, q2, k2, kl, lse1, lse2)
    ctx.index_tensors = (positions, cu_seqlens)
    ctx.options = options[:8]  # group_name .. backend
    ctx.mark_non_differentiable(lse1, lse2)


def _op_backward(ctx, grad_kl, grad_lse1, grad_lse2):
    q1, k1, q2, k2, kl, lse1, lse2 = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    grads = cp_attn_kl_bwd(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *ctx.index_tensors, *ctx.options, needs)
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 13


cp_attn_kl_fwd.register_autograd(_op_backward, setup_context=_setup_context)


@torch.library.custom_op("streamkl::cp_sum", mutates_args=())
def cp_sum(x: Tensor, group_name: str) -> Tensor:
    """The sum of `x` over the ranks of the group (an all-reduce), the same on every rank."""
    out = x.clone()
    group = group_by_name(group_name)
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(out, group=group)
    return out


@cp_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def sum_over_ranks(x: Tensor, group, traced: bool) -> Tensor:
    """The sum of `x` over the ranks of the group, the same on every rank. A traced call
    all-reduces inside cp_sum, an op the compiler treats as opaque; an eager one directly, without
    the dispatcher, as the rest of the eager path (a custom op's first eager call imports
    torch._dynamo: about 3 s a process). Eager, `x` is summed in place."""
    if traced:
        return cp_sum(x, group.group_name)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


# --- the eager path ---------------------------------------------------------------------------


class _AttnKL(torch.autograd.Function):
    """run_forward / run_backward for a validated eager call: one node, the checked spec and
    backend reused by the backward."""

    @staticmethod
    def forward(ctx, checked, cp, q1, k1, q2, k2):
        stats = run_forward(checked, cp, AttnKLInputs(q1, k1, q2, k2))
        ctx.save_for_backward(q1, k1, q2, k2, *stats)
        ctx.call = (checked, cp)
        ctx.mark_non_differentiable(stats.lse1, stats.lse2)
        return stats.kl

    @staticmethod
    def backward(ctx, grad_kl):
        q1, k1, q2, k2, kl, lse1, lse2 = ctx.saved_tensors
        checked, cp = ctx.call
        checked = checked._replace(spec=checked.spec.with_needs(ctx.needs_input_grad[2:6]))
        grads = run_backward(checked, cp, AttnKLInputs(q1, k1, q2, k2), AttnKLStats(kl, lse1, lse2), grad_kl)
        return (None, None, *once_differentiable("distributed.attn_kl", grads))


def _traced(*tensors) -> bool:
    """True when the call is being traced or intercepted (torch.compile, a dispatch mode, a
    tensor subclass): then the custom ops run it. Non-tensor arguments count as plain, so that
    their errors are agreed across ranks."""
    return (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or any(isinstance(t, Tensor) and type(t) is not Tensor for t in tensors)
    )


QKV_FORMATS = ("bhsd", "bshd", "sbhd", "thd")


def refuse_dtensors(tensors: dict, what: str) -> None:
    """A DTensor input raises TypeError naming it and what to pass instead (its local shard and,
    unless laid out as `layout`, its tokens' positions): on the rank that passes it, as no
    exchange is possible."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        return
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            raise TypeError(
                f"{name} is a DTensor; {what} takes this rank's shard as a "
                f"plain tensor: pass {name}.to_local() and, unless the shards are laid out as "
                "`layout`, the positions of the local tokens (positions=, e.g. from "
                "streamkl.distributed.shard_and_positions)"
            )


def in_bhsd(stored: dict, qkv_format, axes: dict | None = None) -> list:
    """The tensors of `stored` (by name, laid out as `qkv_format`) as to_bhsd's views, in that
    order; axes[name]: that tensor's canonical axes (default "bhsd"). Raises ValueError naming
    the format or the tensor that does not fit it."""
    if not isinstance(qkv_format, str) or qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    axes = axes or {}
    return [to_bhsd(name, t, qkv_format, axes.get(name, ("bhsd",))) for name, t in stored.items()]


def _stored_axes(axes: str, qkv_format: str) -> str:
    """The axes of a tensor with canonical axes `axes` (a subsequence of "bhsd") as `qkv_format`
    stores it: the format's letters it has, in the format's order ("thd": no b, t for s)."""
    return "".join(a for a in qkv_format.replace("t", "s") if a in axes)


def to_bhsd(name: str, t, qkv_format: str, axes=("bhsd",)) -> Tensor:
    """`t` stored as `qkv_format` says, as a view in the canonical order: the format's letters
    the tensor has, in "bhsd"'s order. `axes`: the canonical axes `t` may have, told apart by
    their count (indexer_kl's keys: "bhsd" or, headless, "bsd"); a tensor has the format's axes
    minus those it lacks (attn_kl's KL "bhs": (B, N, H) under "bshd"). "thd" stores packed
    tokens of one batch entry, B = 1. Nothing is copied."""
    if qkv_format == "bhsd" or not isinstance(t, Tensor):
        return t  # the canonical order; the spec's checks name a wrong shape or type
    thd = qkv_format == "thd"
    by_dims = {len(a) - thd: a for a in axes}
    if t.dim() not in by_dims:
        wanted = " or ".join(f"{len(a) - thd}-D ({_stored_axes(a, qkv_format)})" for a in axes)
        raise ValueError(
            f"{name} must be {wanted} under qkv_format={qkv_format!r}, got shape {tuple(t.shape)}"
        )
    canonical = by_dims[t.dim()]
    stored = _stored_axes(canonical, qkv_format)
    if thd:
        t, stored = t.unsqueeze(0), "b" + stored
    return t.permute([stored.index(a) for a in canonical])


def from_bhsd(t: Tensor, qkv_format: str, axes: str) -> Tensor:
    """An output with canonical axes `axes`, as `qkv_format` lays it out (to_bhsd's inverse)."""
    if qkv_format == "bhsd":
        return t
    stored = _stored_axes(axes, qkv_format)
    if qkv_format == "thd":
        stored = "b" + stored
    t = t.permute([axes.index(a) for a in stored])
    return t[0] if qkv_format == "thd" else t


def attn_kl(
    q1, k1, q2, k2, *, group, causal, layout, positions, comm, scale1, scale2, reduction, heads_per_step,
    cu_seqlens, max_seqlen, qkv_format, backend,
):  # fmt: skip
    """The public call's body (docstring in streamkl/distributed/__init__.py)."""
    stored = {"q1": q1, "k1": k1, "q2": q2, "k2": k2}
    refuse_dtensors({**stored, "positions": positions, "cu_seqlens": cu_seqlens}, WHAT)
    group = resolve_group(group)
    requires_grad = tuple(
        torch.is_grad_enabled() and isinstance(t, Tensor) and t.requires_grad for t in (q1, k1, q2, k2)
    )
    options = _validate.Options(
        layout, comm, heads_per_step, reduction, backend, requires_grad, positions, cu_seqlens, max_seqlen
    )
    call = (group, stored, qkv_format, causal, scale1, scale2, options)
    traced = _traced(q1, k1, q2, k2)
    if traced:
        # checks that need no communication run at trace time; the cross-rank ones inside the op
        (checked, views), _ = check(*call, run=False)
        spec = checked.spec
        kl, _, _ = cp_attn_kl_fwd(
            *views, positions, cu_seqlens, max_seqlen, group.group_name, layout, comm, causal,
            spec.scale1, spec.scale2, checked.heads_per_step, checked.backend, list(requires_grad), reduction,
        )  # fmt: skip
    else:
        (checked, views), cp = check(*call, run=True)
        if any(requires_grad):
            kl = _AttnKL.apply(checked, cp, *views)
        else:
            kl = run_forward(checked, cp, AttnKLInputs(*views)).kl
    if reduction == "none":
        return from_bhsd(kl, qkv_format, "bhs")
    local_sum = kl.sum()
    # the global sum and row count in one all-reduce, bit-identical on every rank; the sum's
    # gradient reaches this rank's rows only, since every rank's backward starts from the same
    # global loss (docs/distributed.md, Reductions)
    local = torch.stack([local_sum.detach().double(), local_sum.new_tensor(kl.numel(), dtype=torch.float64)])
    summed = sum_over_ranks(local, group, traced)
    total = summed[0].to(kl.dtype) + (local_sum - local_sum.detach())
    if reduction == "sum":
        return total
    # every row sees a key: its own (causal), its document's, or the whole sequence
    return total / summed[1].clamp(min=1).to(kl.dtype)
