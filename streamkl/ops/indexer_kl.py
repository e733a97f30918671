"""indexer_kl, the op: torch.library registration (schemas, fakes, autograd) and the eager fast path.

    streamkl::indexer_kl_fwd  -> (kl, lse, lse2, mass)  the forward (differentiable in kl)
    streamkl::indexer_kl_bwd  -> (dqi, dki, dw)         recompute backward; an unneeded gradient
                                                        comes back as an empty tensor
    streamkl::indexer_kl_step -> (loss, dqi, dki, dw)
                              the training step of a reduced loss ("sum"/"mean" with a gradient
                              needed): the backend's forward_with_grads, the loss's gradients
                              formed while the teacher streams (docs/indexer.md, "One teacher
                              pass per training step"); differentiable in loss, its backward
                              (streamkl::indexer_kl_step_bwd) only scales them by the upstream
                              gradient
    streamkl::indexer_kl      the public op: the step, or forward + reduction
                              (CompositeImplicitAutograd, so a compiled graph holds the ops above
                              and the reduction)

As streamkl/ops/attn_kl.py: every path builds the call's spec once
(streamkl._checks.indexer_kl_spec) and hands (spec, inputs) to the backend; an eager call with
plain tensors skips the dispatcher through one autograd.Function; a traced call validates
metadata at trace time, and the registered forward validates topk's values and the packed
offsets when it runs. The teacher (q, k, lse) and topk receive no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks, _dispatch, _env
from .._spec import IndexerKLInputs, IndexerKLSpec, IndexerKLStats, reduced_row_weight
from ._common import needs_grad, on_device, once_differentiable, plain, refuse_unsupported_autograd

OP = "indexer_kl"


def _out_dtype(q: Tensor, qi: Tensor, w: Tensor) -> torch.dtype:
    """float64 when the teacher, the indexer or its weights are, else float32."""
    return torch.float64 if torch.float64 in (q.dtype, qi.dtype, w.dtype) else torch.float32


def _one_head(t):
    """A 3-D key (B, Sk, D) as the one-head (B, 1, Sk, D) view; anything else as it is."""
    return t.unsqueeze(1) if isinstance(t, Tensor) and t.dim() == 3 else t


def _forward(impl, spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
    with on_device(inputs.q):
        stats = impl.forward(spec, inputs)
    dtype = _out_dtype(inputs.q, inputs.qi, inputs.w)
    if all(t.dtype == dtype for t in stats):  # the usual case: no dispatch for a no-op .to
        return IndexerKLStats(*stats)
    return IndexerKLStats(*(t.to(dtype) for t in stats))


def _backward(impl, spec: IndexerKLSpec, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl: Tensor):
    grad_kl = grad_kl.to(stats.kl.dtype).contiguous()
    with on_device(inputs.q), torch.no_grad():
        return _dispatch.backward_of(impl, spec, inputs).backward(spec, inputs, stats, grad_kl)


def _reduce(kl: Tensor, reduction: str, lse2: Tensor) -> Tensor:
    if reduction == "none":
        return kl
    return kl.sum() * reduced_row_weight(lse2, reduction)


def _step(impl, spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str):
    """(loss, stats, (dqi, dki, dw)): the reduced loss, the forward's statistics and the backend's
    gradients of the loss."""
    with on_device(inputs.q):
        stats, grads = impl.forward_with_grads(spec, inputs, reduction)
    loss = _reduce(stats.kl, reduction, stats.lse2)
    return loss.to(_out_dtype(inputs.q, inputs.qi, inputs.w)), stats, grads


def _scaled_in_place(grads, scale: Tensor, students) -> list:
    """_scaled, writing each gradient that is in its input's dtype over itself (the same rounding):
    the fused step's dqi is as large as qi, and a scaled copy would double it at the step's peak."""
    out = []
    with torch.no_grad():
        for d, t in zip(grads, students):
            if d is not None and d.dtype == t.dtype:
                d = d.mul_(scale.to(torch.promote_types(d.dtype, torch.float32)))
            elif d is not None:
                d = _scaled((d,), scale, (t,))[0]
            out.append(d)
    return out


def _scaled(grads, scale: Tensor, students) -> list:
    """Each gradient of the loss times `scale` (the upstream gradient), in its input's dtype: a
    16-bit gradient is multiplied in its dtype (one rounding, none for a scale of 1); None stays
    None."""
    return [
        None if d is None else (d * scale.to(torch.promote_types(d.dtype, torch.float32))).to(t.dtype)
        for d, t in zip(grads, students)
    ]


# --- the registered ops (torch.compile, torch.export, opcheck) ----------------------------------


@torch.library.custom_op("streamkl::indexer_kl_fwd", mutates_args=())
def indexer_kl_fwd(
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    lse: Tensor | None,
    topk: Tensor | None,
    causal: bool,
    scale: float,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    call = dict(lse=lse, topk=topk, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call)
    _env.check_all()
    inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, cu_seqlens)
    return tuple(_forward(_dispatch.select(OP, spec, inputs, backend), spec, inputs))


@indexer_kl_fwd.register_fake
def _(q, k, qi, ki, w, lse, topk, causal, scale, cu_seqlens=None, max_seqlen=None, backend=None):
    call = dict(lse=lse, topk=topk, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call, read_values=False)
    dtype = _out_dtype(q, qi, w)
    rows = q.new_empty((spec.batch, spec.nq), dtype=dtype)
    per_head = q.new_empty((spec.batch, spec.heads, spec.nq), dtype=dtype)
    return rows, per_head, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("streamkl::indexer_kl_bwd", mutates_args=())
def indexer_kl_bwd(
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
    causal: bool,
    scale: float,
    lse_given: bool,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    needs: list[bool],
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    # Takes what indexer_kl_fwd saved, validated then; packed offsets come from the forward's cache.
    call = dict(causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.indexer_kl_spec_of_saved(q, k, qi, ki, w, lse_given=lse_given, topk=topk, **call)
    spec = spec.with_needs(needs)
    inputs = IndexerKLInputs(q, k, qi, ki, w, lse if lse_given else None, topk, cu_seqlens)
    impl = _dispatch.select(OP, spec, inputs, backend)
    grads = _backward(impl, spec, inputs, IndexerKLStats(kl, lse, lse2, mass), grad_kl)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (qi, ki, w)))


@indexer_kl_bwd.register_fake
def _(
    grad_kl, q, k, qi, ki, w, topk, kl, lse, lse2, mass, causal, scale, lse_given, cu_seqlens, max_seqlen,
    needs, backend=None,
):  # fmt: skip
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((qi, ki, w), needs))


def _setup_context(ctx, inputs, output):
    q, k, qi, ki, w, lse, topk, causal, scale, cu_seqlens, max_seqlen, backend = inputs
    ctx.save_for_backward(q, k, qi, ki, w, topk, *output)
    ctx.cu_seqlens = cu_seqlens  # held, not saved: as attn_kl (inference-mode offsets)
    ctx.call = (causal, scale, lse is not None, max_seqlen, backend)
    ctx.mark_non_differentiable(*output[1:])  # internal outputs: only kl carries a gradient


def _op_backward(ctx, grad_kl, *_):
    q, k, qi, ki, w, topk, kl, lse, lse2, mass = ctx.saved_tensors
    causal, scale, lse_given, max_seqlen, backend = ctx.call
    needs = list(ctx.needs_input_grad[2:5])
    saved = (q, k, qi, ki, w, topk, kl, lse, lse2, mass, causal, scale, lse_given, ctx.cu_seqlens, max_seqlen)
    grads = indexer_kl_bwd(grad_kl, *saved, needs, backend)
    return (None, None, *(g if need else None for g, need in zip(grads, needs)), *(None,) * 7)


def _refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        "streamkl.indexer_kl is differentiable once: its gradients are not differentiable "
        "(double backward through create_graph=True is not supported)"
    )


indexer_kl_fwd.register_autograd(_op_backward, setup_context=_setup_context)
indexer_kl_bwd.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("streamkl::indexer_kl_step", mutates_args=())
def indexer_kl_step(
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    lse: Tensor | None,
    topk: Tensor | None,
    causal: bool,
    scale: float,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    reduction: str,
    needs: list[bool],
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    call = dict(lse=lse, topk=topk, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call).with_needs(needs)
    _env.check_all()
    inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, cu_seqlens)
    loss, _, grads = _step(_dispatch.select(OP, spec, inputs, backend), spec, inputs, reduction)
    return loss, *(g if g is not None else t.new_empty(0) for g, t in zip(grads, (qi, ki, w)))


@indexer_kl_step.register_fake
def _(q, k, qi, ki, w, lse, topk, causal, scale, cu_seqlens, max_seqlen, reduction, needs, backend=None):
    call = dict(lse=lse, topk=topk, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    _checks.indexer_kl_spec(q, k, qi, ki, w, **call, read_values=False)
    dtype = _out_dtype(q, qi, w)
    loss = q.new_empty((), dtype=dtype)
    dtypes = (qi.dtype, dtype, w.dtype)  # dki: a sum over rows, in the statistics' dtype
    grads = (
        t.new_empty(t.shape if need else (0,), dtype=d) for t, d, need in zip((qi, ki, w), dtypes, needs)
    )
    return loss, *grads


@torch.library.custom_op("streamkl::indexer_kl_step_bwd", mutates_args=())
def indexer_kl_step_bwd(
    grad_loss: Tensor, dqi: Tensor, dki: Tensor, dw: Tensor, qi: Tensor, ki: Tensor, w: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    # The step's gradients of the loss times grad_loss, in the dtypes of qi, ki, w (read for
    # their dtypes only); an empty (unneeded) one stays empty.
    return tuple(_scaled((dqi, dki, dw), grad_loss, (qi, ki, w)))


@indexer_kl_step_bwd.register_fake
def _(grad_loss, dqi, dki, dw, qi, ki, w):
    return tuple(d.new_empty(d.shape, dtype=t.dtype) for d, t in zip((dqi, dki, dw), (qi, ki, w)))


def _setup_step(ctx, inputs, output):
    qi, ki, w = inputs[2:5]
    ctx.save_for_backward(*output[1:], qi, ki, w)
    ctx.formed = tuple(inputs[12])  # the gradients the step formed (needs)
    ctx.mark_non_differentiable(*output[1:])  # the gradients are internal outputs


def _step_backward(ctx, grad_loss, *_):
    dqi, dki, dw, qi, ki, w = ctx.saved_tensors
    grads = indexer_kl_step_bwd(grad_loss, dqi, dki, dw, qi, ki, w)
    needs = [need and formed for need, formed in zip(ctx.needs_input_grad[2:5], ctx.formed)]
    return (None, None, *(g if need else None for g, need in zip(grads, needs)), *(None,) * 9)


indexer_kl_step.register_autograd(_step_backward, setup_context=_setup_step)
indexer_kl_step_bwd.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)


# --- the eager fast path --------------------------------------------------------------------


class _IndexerKL(torch.autograd.Function):
    """indexer_kl_fwd / indexer_kl_bwd and the reduction without the dispatcher, for validated
    eager calls: one autograd node per call, whatever the reduction."""

    @staticmethod
    def forward(ctx, impl, spec, reduction, q, k, qi, ki, w, lse, topk, cu_seqlens):
        inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, cu_seqlens)
        stats = _forward(impl, spec, inputs)
        ctx.save_for_backward(q, k, qi, ki, w, lse, topk, *stats)
        ctx.cu_seqlens = cu_seqlens  # held, not saved (see _setup_context)
        ctx.call = (impl, spec, reduction)
        return _reduce(stats.kl, reduction, stats.lse2)

    @staticmethod
    def backward(ctx, grad):
        grads = _recomputed(ctx, grad)
        qi, ki, w = ctx.saved_tensors[2:5]
        tied = once_differentiable(OP, tuple(grads), grad, qi, ki, w)
        return (None,) * 5 + (*tied, None, None, None)


def _recomputed(ctx, grad: Tensor):
    """The backward of _IndexerKL and _IndexerKLStep (which save the same tensors and call):
    the backend's recompute backward for the upstream gradient `grad`."""
    q, k, qi, ki, w, lse, topk, *stats = ctx.saved_tensors
    stats = IndexerKLStats(*stats)
    impl, spec, reduction = ctx.call
    if reduction != "none":  # every row's KL enters the sum once
        grad = (grad * reduced_row_weight(stats.lse2, reduction)).expand(stats.kl.shape)
    spec = spec.with_needs(ctx.needs_input_grad[5:8])
    inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, ctx.cu_seqlens)
    return _backward(impl, spec, inputs, stats, grad)


class _IndexerKLStep(torch.autograd.Function):
    """indexer_kl_step without the dispatcher, for validated eager calls of a reduced loss that
    needs a gradient: the backend forms the loss's gradients in the forward; the backward scales
    them by the upstream gradient in place and hands them to autograd, so the step holds one copy
    of each. A second backward through the same graph (retain_graph=True) finds them handed on and
    recomputes them with the backend's backward, as the unfused op does."""

    @staticmethod
    def forward(ctx, impl, spec, reduction, q, k, qi, ki, w, lse, topk, cu_seqlens):
        spec = spec.with_needs(ctx.needs_input_grad[5:8])
        inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, cu_seqlens)
        loss, stats, grads = _step(impl, spec, inputs, reduction)
        ctx.save_for_backward(q, k, qi, ki, w, lse, topk, *stats)
        ctx.cu_seqlens = cu_seqlens  # held, not saved (see _setup_context)
        ctx.call = (impl, spec, reduction)
        ctx.grads = list(grads)  # not saved tensors: the backward hands them on, once
        return loss

    @staticmethod
    def backward(ctx, grad):
        qi, ki, w = ctx.saved_tensors[2:5]
        if ctx.grads is not None:
            grads, ctx.grads = ctx.grads, None
            grads = _scaled_in_place(grads, grad, (qi, ki, w))
        else:
            grads = _recomputed(ctx, grad)
        tied = once_differentiable(OP, tuple(grads), grad, qi, ki, w)
        return (None,) * 5 + (*tied, None, None, None)


def indexer_kl(
    q, k, qi, ki, w, *, lse=None, scale=None, causal=True, topk=None, cu_seqlens=None, max_seqlen=None,
    reduction="mean", backend=None,
):  # fmt: skip
    """The public op's body (docstring in streamkl/api.py)."""
    _checks.check_reduction(reduction)
    k, ki = _one_head(k), _one_head(ki)
    call = dict(lse=lse, topk=topk, causal=causal, scale=scale, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    if plain(q, k, qi, ki, w, lse, topk, cu_seqlens):  # vmap's and forward AD's tensors are plain too
        refuse_unsupported_autograd(OP, q, k, qi, ki, w, lse)
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call)
        _env.check_all()
        inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk, cu_seqlens)
        impl = _dispatch.select(OP, spec, inputs, backend)
        if needs_grad(qi, ki, w):
            if reduction != "none":  # every row's gradient is one scalar: the fused step
                return _IndexerKLStep.apply(impl, spec, reduction, *inputs)
            return _IndexerKL.apply(impl, spec, reduction, *inputs)
        stats = _forward(impl, spec, inputs)  # nothing to differentiate
        return _reduce(stats.kl, reduction, stats.lse2)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, **call, read_values=False)
    name = _dispatch.check_name(backend)
    if reduction != "none" and needs_grad(qi, ki, w):
        needs = [t.requires_grad for t in (qi, ki, w)]
        options = (causal, spec.scale, cu_seqlens, max_seqlen, reduction, needs, name)
        return indexer_kl_step(q, k, qi, ki, w, lse, topk, *options)[0]
    kl, _, lse2, _ = indexer_kl_fwd(
        q, k, qi, ki, w, lse, topk, causal, spec.scale, cu_seqlens, max_seqlen, name
    )
    return _reduce(kl, reduction, lse2)


_lib = torch.library.Library("streamkl", "FRAGMENT")
_lib.define(
    "indexer_kl(Tensor q, Tensor k, Tensor qi, Tensor ki, Tensor w, *, Tensor? lse=None, "
    "float? scale=None, bool causal=True, Tensor? topk=None, Tensor? cu_seqlens=None, "
    "int? max_seqlen=None, str reduction='mean', str? backend=None) -> Tensor"
)
_lib.impl("indexer_kl", indexer_kl, "CompositeImplicitAutograd")
