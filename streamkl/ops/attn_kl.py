"""attn_kl, the op: torch.library registration (schemas, fakes, autograd) and the eager fast path.

    streamkl::attn_kl_fwd  -> (kl, lse1, lse2)      the fused forward (differentiable in kl)
    streamkl::attn_kl_bwd  -> (dq1, dk1, dq2, dk2)  recompute backward; an unneeded gradient
                                                    comes back as an empty tensor
    streamkl::attn_kl      the public op: forward + reduction (CompositeImplicitAutograd, so a
                           compiled graph holds the two ops above and the reduction)

Every path builds the call's spec once (streamkl._checks.attn_kl_spec) and hands (spec, inputs)
to the backend. An eager call with plain tensors skips the dispatcher: an autograd.Function calls
the backend directly, the same functions the ops call. A traced call validates at trace time
(the fake) and resolves the backend name there (STREAMKL_BACKEND is read when the graph is
built); the registered ops then take the name, so the backward reads no backend name from the
environment (the cuda backend's STREAMKL_CUDA_BWD is the one variable it reads then).
Fakes depend only on shapes and dtypes, so a compiled graph is valid whatever backend runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks, _dispatch, _env
from .._spec import AttnKLInputs, AttnKLSpec, AttnKLStats
from ._common import (
    needs_grad,
    on_device,
    once_differentiable,
    out_dtype,
    plain,
    refuse_unsupported_autograd,
)

OP = "attn_kl"


def _forward(impl, spec: AttnKLSpec, inputs: AttnKLInputs) -> AttnKLStats:
    with on_device(inputs.q1):
        kl, lse1, lse2 = impl.forward(spec, inputs)
    dtype = out_dtype(inputs.q1, inputs.q2)
    if kl.dtype == lse1.dtype == lse2.dtype == dtype:  # the usual case: no dispatch for a no-op .to
        return AttnKLStats(kl, lse1, lse2)
    return AttnKLStats(kl.to(dtype), lse1.to(dtype), lse2.to(dtype))


def _backward(impl, spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: Tensor):
    grad_kl = grad_kl.to(stats.kl.dtype).contiguous()
    with on_device(inputs.q1), torch.no_grad():
        return _dispatch.backward_of(impl, spec, inputs).backward(spec, inputs, stats, grad_kl)


def _reduce(kl: Tensor, reduction: str, rows: int) -> Tensor:
    """reduction="mean" divides by `rows`, the rows that see a key (at least 1: a call where no
    row sees a key gives 0, the KL of an empty row)."""
    if reduction == "none":
        return kl
    total = kl.sum()
    return total if reduction == "sum" else total / rows


# --- the registered ops (torch.compile, torch.export, opcheck) ----------------------------------


@torch.library.custom_op("streamkl::attn_kl_fwd", mutates_args=())
def attn_kl_fwd(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    causal: bool,
    scale1: float,
    scale2: float,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call)
    _env.check_all()
    inputs = AttnKLInputs(q1, k1, q2, k2, cu_seqlens)
    return _forward(_dispatch.select(OP, spec, inputs, backend), spec, inputs)


@attn_kl_fwd.register_fake
def _(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None, backend=None):
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call, read_offsets=False)
    shape = (spec.batch, spec.heads, spec.nq)
    return tuple(q1.new_empty(shape, dtype=out_dtype(q1, q2)) for _ in range(3))


@torch.library.custom_op("streamkl::attn_kl_bwd", mutates_args=())
def attn_kl_bwd(
    grad_kl: Tensor,
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    kl: Tensor,
    lse1: Tensor,
    lse2: Tensor,
    causal: bool,
    scale1: float,
    scale2: float,
    cu_seqlens: Tensor | None,
    max_seqlen: int | None,
    needs: list[bool],
    backend: str | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # Takes what attn_kl_fwd saved, validated then; packed offsets come from the forward's cache.
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    spec = _checks.attn_kl_spec_of_saved(q1, k1, q2, k2, **call).with_needs(needs)
    inputs = AttnKLInputs(q1, k1, q2, k2, cu_seqlens)
    impl = _dispatch.select(OP, spec, inputs, backend)
    grads = _backward(impl, spec, inputs, AttnKLStats(kl, lse1, lse2), grad_kl)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, inputs))


@attn_kl_bwd.register_fake
def _(
    grad_kl,
    q1,
    k1,
    q2,
    k2,
    kl,
    lse1,
    lse2,
    causal,
    scale1,
    scale2,
    cu_seqlens,
    max_seqlen,
    needs,
    backend=None,
):
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((q1, k1, q2, k2), needs))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen, backend = inputs
    ctx.save_for_backward(q1, k1, q2, k2, *output)
    # Held, not saved: an int tensor needs no version check, and one made under inference_mode
    # cannot be saved for backward.
    ctx.cu_seqlens = cu_seqlens
    ctx.call = (causal, scale1, scale2, max_seqlen, backend)
    ctx.mark_non_differentiable(output[1], output[2])  # internal outputs: only kl carries a gradient


def _op_backward(ctx, grad_kl, grad_lse1, grad_lse2):
    q1, k1, q2, k2, kl, lse1, lse2 = ctx.saved_tensors
    causal, scale1, scale2, max_seqlen, backend = ctx.call
    needs = list(ctx.needs_input_grad[:4])
    saved = (q1, k1, q2, k2, kl, lse1, lse2, causal, scale1, scale2, ctx.cu_seqlens, max_seqlen)
    grads = attn_kl_bwd(grad_kl, *saved, needs, backend)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None)


def _refuse_double_backward(ctx, *grads):
    raise NotImplementedError(
        "streamkl.attn_kl is differentiable once: its gradients are not differentiable "
        "(double backward through create_graph=True is not supported)"
    )


attn_kl_fwd.register_autograd(_op_backward, setup_context=_setup_context)
attn_kl_bwd.register_autograd(_refuse_double_backward, setup_context=lambda ctx, inputs, output: None)


# --- the eager fast path --------------------------------------------------------------------


class _AttnKL(torch.autograd.Function):
    """attn_kl_fwd / attn_kl_bwd and the reduction without the dispatcher, for validated eager
    calls: one autograd node per call, whatever the reduction."""

    @staticmethod
    def forward(ctx, impl, spec, reduction, rows, q1, k1, q2, k2, cu_seqlens):
        inputs = AttnKLInputs(q1, k1, q2, k2, cu_seqlens)
        stats = _forward(impl, spec, inputs)
        ctx.save_for_backward(q1, k1, q2, k2, *stats)
        ctx.cu_seqlens = cu_seqlens  # held, not saved (see _setup_context)
        ctx.call = (impl, spec, reduction, rows)
        return _reduce(stats.kl, reduction, rows)

    @staticmethod
    def backward(ctx, grad):
        q1, k1, q2, k2, kl, lse1, lse2 = ctx.saved_tensors
        impl, spec, reduction, rows = ctx.call
        if reduction != "none":  # every row's KL enters the sum once
            grad = (grad / rows if reduction == "mean" else grad).expand(kl.shape)
        spec = spec.with_needs(ctx.needs_input_grad[4:8])
        inputs = AttnKLInputs(q1, k1, q2, k2, ctx.cu_seqlens)
        grads = _backward(impl, spec, inputs, AttnKLStats(kl, lse1, lse2), grad)
        return (None, None, None, None, *once_differentiable(OP, tuple(grads), grad, q1, k1, q2, k2), None)


def attn_kl(
    q1, k1, q2, k2, *, causal=False, scale1=None, scale2=None, reduction="none", cu_seqlens=None,
    max_seqlen=None, backend=None,
):  # fmt: skip
    """The public op's body (docstring in streamkl/api.py)."""
    _checks.check_reduction(reduction)
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    if plain(q1, k1, q2, k2, cu_seqlens):  # vmap's and forward AD's tensors are plain too
        refuse_unsupported_autograd(OP, q1, k1, q2, k2)
        spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call)
        _env.check_all()
        inputs = AttnKLInputs(q1, k1, q2, k2, cu_seqlens)
        impl = _dispatch.select(OP, spec, inputs, backend)
        rows = max(spec.visible_rows(), 1) if reduction == "mean" else 1
        if needs_grad(q1, k1, q2, k2):
            return _AttnKL.apply(impl, spec, reduction, rows, *inputs)
        return _reduce(_forward(impl, spec, inputs).kl, reduction, rows)  # nothing to differentiate
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, **call, read_offsets=False)
    name = _dispatch.check_name(backend)
    rows = max(spec.visible_rows(), 1) if reduction == "mean" else 1
    kl, _, _ = attn_kl_fwd(q1, k1, q2, k2, causal, spec.scale1, spec.scale2, cu_seqlens, max_seqlen, name)
    return _reduce(kl, reduction, rows)


_lib = torch.library.Library("streamkl", "FRAGMENT")
_lib.define(
    "attn_kl(Tensor q1, Tensor k1, Tensor q2, Tensor k2, *, bool causal=False, "
    "float? scale1=None, float? scale2=None, str reduction='none', Tensor? cu_seqlens=None, "
    "int? max_seqlen=None, str? backend=None) -> Tensor"
)
_lib.impl("attn_kl", attn_kl, "CompositeImplicitAutograd")
