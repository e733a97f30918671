"""torch.library registration: schemas, fake functions and autograd, torch-only.

    streamkl::attn_kl_fwd  -> (kl, lse1, lse2)      the fused forward (differentiable in kl)
    streamkl::attn_kl_bwd  -> (dq1, dk1, dq2, dk2)  recompute backward; an unneeded gradient
                                                    comes back as an empty tensor
    streamkl::attn_kl      the public op: forward + reduction (CompositeImplicitAutograd, so a
                           compiled graph holds the two ops above and the reduction)

Fakes depend only on shapes and dtypes, so a compiled graph is valid whatever backend runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks, _dispatch


def _out_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _resolve_varlen(cu_seqlens, max_seqlen, nq):
    """Value checks of cu_seqlens (one host sync) and the longest sequence."""
    if cu_seqlens is None:
        return None
    longest = _checks.check_cu_seqlens_values(cu_seqlens, nq)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is shorter than the longest sequence in "
            f"cu_seqlens ({longest}); nothing is truncated, so pass at least {longest}"
        )
    return longest if max_seqlen is None else max_seqlen


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
    problem = _checks.check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    max_seqlen = _resolve_varlen(cu_seqlens, max_seqlen, problem.nq)
    module = _dispatch.select(q1, k1, q2, k2, cu_seqlens, backend)
    kl, lse1, lse2 = module.forward(
        q1,
        k1,
        q2,
        k2,
        causal=causal,
        scale1=scale1,
        scale2=scale2,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    dtype = _out_dtype(q1, q2)
    return kl.to(dtype), lse1.to(dtype), lse2.to(dtype)


@attn_kl_fwd.register_fake
def _(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None, backend=None):
    problem = _checks.check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    shape = (problem.batch, problem.heads, problem.nq)
    dtype = _out_dtype(q1, q2)
    return tuple(q1.new_empty(shape, dtype=dtype) for _ in range(3))


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
    problem = _checks.check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    max_seqlen = _resolve_varlen(cu_seqlens, max_seqlen, problem.nq)
    module = _dispatch.select(q1, k1, q2, k2, cu_seqlens, backend)
    grads = module.backward(
        grad_kl.float().contiguous() if kl.dtype != torch.float64 else grad_kl.contiguous(),
        q1,
        k1,
        q2,
        k2,
        kl,
        lse1,
        lse2,
        causal=causal,
        scale1=scale1,
        scale2=scale2,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        needs=tuple(needs),
    )
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (q1, k1, q2, k2)))


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
    kl, lse1, lse2 = output
    ctx.save_for_backward(q1, k1, q2, k2, kl, lse1, lse2, cu_seqlens)
    ctx.args = (causal, scale1, scale2, max_seqlen, backend)
    ctx.mark_non_differentiable(lse1, lse2)  # internal outputs: only kl carries a gradient


def _backward(ctx, grad_kl, grad_lse1, grad_lse2):
    q1, k1, q2, k2, kl, lse1, lse2, cu_seqlens = ctx.saved_tensors
    causal, scale1, scale2, max_seqlen, backend = ctx.args
    needs = list(ctx.needs_input_grad[:4])
    grads = attn_kl_bwd(
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
        backend,
    )
    grads = tuple(g if need else None for g, need in zip(grads, needs))
    return (*grads, None, None, None, None, None, None)


attn_kl_fwd.register_autograd(_backward, setup_context=_setup_context)


_lib = torch.library.Library("streamkl", "FRAGMENT")
_lib.define(
    "attn_kl(Tensor q1, Tensor k1, Tensor q2, Tensor k2, *, bool causal=False, "
    "float? scale1=None, float? scale2=None, str reduction='none', Tensor? cu_seqlens=None, "
    "int? max_seqlen=None, str? backend=None) -> Tensor"
)


def _attn_kl(
    q1,
    k1,
    q2,
    k2,
    *,
    causal=False,
    scale1=None,
    scale2=None,
    reduction="none",
    cu_seqlens=None,
    max_seqlen=None,
    backend=None,
):
    problem, scale1, scale2 = _checks.check_call(
        q1,
        k1,
        q2,
        k2,
        scale1=scale1,
        scale2=scale2,
        reduction=reduction,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    kl, _, _ = attn_kl_fwd(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen, backend)
    if reduction == "none":
        return kl
    total = kl.sum()
    if reduction == "sum":
        return total
    # mean over rows that see a key; none at all gives 0, the KL of an empty row
    return total / max(_checks.visible_rows(problem, causal, cu_seqlens is not None), 1)


_lib.impl("attn_kl", _attn_kl, "CompositeImplicitAutograd")
