"""The op: torch.library registration (schemas, fakes, autograd) and the eager fast path.

    streamkl::attn_kl_fwd  -> (kl, lse1, lse2)      the fused forward (differentiable in kl)
    streamkl::attn_kl_bwd  -> (dq1, dk1, dq2, dk2)  recompute backward; an unneeded gradient
                                                    comes back as an empty tensor
    streamkl::attn_kl      the public op: forward + reduction (CompositeImplicitAutograd, so a
                           compiled graph holds the two ops above and the reduction)

Fakes depend only on shapes and dtypes, so a compiled graph is valid whatever backend runs.
Each call is validated once: by `attn_kl` before it runs anything eagerly, and, when traced, by
the ops themselves (fake at trace time, real at run time). An eager call with plain tensors
skips the dispatcher: an autograd.Function calls the backend directly, the same functions the
ops call, so the two paths compute the same thing.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.autograd import forward_ad

from . import _checks, _dispatch, _env


def out_dtype(*tensors: Tensor) -> torch.dtype:
    """The dtype of the statistics and the result: float64 when an input is, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _on_device(t: Tensor):
    """The inputs' GPU as the current device while a backend launches: kernels run on the current
    one, whatever device the tensors are on."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _forward(module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen):
    with _on_device(q1):
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
    dtype = out_dtype(q1, q2)
    if kl.dtype == lse1.dtype == lse2.dtype == dtype:  # the usual case: no dispatch for a no-op .to
        return kl, lse1, lse2
    return kl.to(dtype), lse1.to(dtype), lse2.to(dtype)


def _backward(
    module, grad_kl, q1, k1, q2, k2, kl, lse1, lse2, causal, scale1, scale2, cu_seqlens, max_seqlen, needs
):
    grad_kl = grad_kl.to(torch.float64 if kl.dtype == torch.float64 else torch.float32).contiguous()
    with _on_device(q1):
        return _dispatch.backward_of(module).backward(
            grad_kl,
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
    problem = _checks.check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    _env.check_all()
    max_seqlen = _checks.resolve_max_seqlen(cu_seqlens, max_seqlen, problem.nq)
    module = _dispatch.select(q1, k1, q2, k2, cu_seqlens, backend)
    return _forward(module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen)


@attn_kl_fwd.register_fake
def _(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None, backend=None):
    problem = _checks.check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    shape = (problem.batch, problem.heads, problem.nq)
    dtype = out_dtype(q1, q2)
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
    # Takes what attn_kl_fwd saved: validated then; offsets already read stay cached.
    max_seqlen = _checks.resolve_max_seqlen(cu_seqlens, max_seqlen, q1.shape[2])
    module = _dispatch.select(q1, k1, q2, k2, cu_seqlens, backend)
    grads = _backward(
        module, grad_kl, q1, k1, q2, k2, kl, lse1, lse2, causal, scale1, scale2, cu_seqlens, max_seqlen, needs
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


def _op_backward(ctx, grad_kl, grad_lse1, grad_lse2):
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


attn_kl_fwd.register_autograd(_op_backward, setup_context=_setup_context)


# --- the eager fast path --------------------------------------------------------------------


class _AttnKL(torch.autograd.Function):
    """attn_kl_fwd / attn_kl_bwd and the reduction without the dispatcher, for validated eager
    calls: one autograd node per call, whatever the reduction."""

    @staticmethod
    def forward(ctx, module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen, reduction, rows):
        kl, lse1, lse2 = _forward(module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen)
        ctx.save_for_backward(q1, k1, q2, k2, kl, lse1, lse2, cu_seqlens)
        ctx.args = (module, causal, scale1, scale2, max_seqlen, reduction, rows)
        return _reduce(kl, reduction, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q1, k1, q2, k2, kl, lse1, lse2, cu_seqlens = ctx.saved_tensors
        module, causal, scale1, scale2, max_seqlen, reduction, rows = ctx.args
        if reduction != "none":  # every row's KL enters the sum once
            grad = (grad / rows if reduction == "mean" else grad).expand(kl.shape)
        needs = ctx.needs_input_grad[1:5]
        grads = _backward(
            module,
            grad,
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
        )
        return (None, *grads, None, None, None, None, None, None, None)


def _reduce(kl: Tensor, reduction: str, rows: int) -> Tensor:
    """reduction="mean" divides by `rows`, the rows that see a key (at least 1: a call where no
    row sees a key gives 0, the KL of an empty row)."""
    if reduction == "none":
        return kl
    total = kl.sum()
    return total if reduction == "sum" else total / rows


def _differentiable(*tensors) -> bool:
    """Whether the call needs an autograd node: grad mode with an input that requires grad, or
    forward-mode AD or a torch.func transform in progress (the node raises there, as it should,
    instead of returning a result without its tangent)."""
    return (
        (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        or forward_ad._current_level >= 0
        or torch._C._are_functorch_transforms_active()
    )


def _plain(*tensors) -> bool:
    """True when nothing traces or intercepts the call: exact torch.Tensor inputs, no compile,
    no dispatch mode (opcheck, FakeTensorMode, make_fx). Only then is the fast path taken."""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) is Tensor for t in tensors if t is not None)
        and torch._C._len_torch_dispatch_stack() == 0
    )


def attn_kl(
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
    """The public op's body (docstring in streamkl/api.py)."""
    problem, scale1, scale2 = _checks.check_call(
        q1,
        k1,
        q2,
        k2,
        causal=causal,
        scale1=scale1,
        scale2=scale2,
        reduction=reduction,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )
    rows = max(_checks.visible_rows(problem, causal, cu_seqlens is not None), 1) if reduction == "mean" else 1
    if _plain(q1, k1, q2, k2, cu_seqlens):
        _env.check_all()
        max_seqlen = _checks.resolve_max_seqlen(cu_seqlens, max_seqlen, problem.nq)
        module = _dispatch.select(q1, k1, q2, k2, cu_seqlens, backend)
        if _differentiable(q1, k1, q2, k2):
            args = (module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen, reduction, rows)
            return _AttnKL.apply(*args)
        kl, _, _ = _forward(module, q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen)
        return _reduce(kl, reduction, rows)  # nothing to differentiate: no autograd node
    _dispatch.check_name(backend)
    kl, _, _ = attn_kl_fwd(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens, max_seqlen, backend)
    return _reduce(kl, reduction, rows)


_lib = torch.library.Library("streamkl", "FRAGMENT")
_lib.define(
    "attn_kl(Tensor q1, Tensor k1, Tensor q2, Tensor k2, *, bool causal=False, "
    "float? scale1=None, float? scale2=None, str reduction='none', Tensor? cu_seqlens=None, "
    "int? max_seqlen=None, str? backend=None) -> Tensor"
)
_lib.impl("attn_kl", attn_kl, "CompositeImplicitAutograd")
