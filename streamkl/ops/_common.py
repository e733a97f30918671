"""What every op's module shares: the eager fast path's conditions, device and dtype rules, and
the refusal of autograd modes the ops do not implement."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.autograd import forward_ad


def out_dtype(a: Tensor, b: Tensor) -> torch.dtype:
    """The dtype of statistics and results: float64 when an input is, else float32."""
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def on_device(t: Tensor):
    """The inputs' GPU as the current device while a backend launches: kernels run on the current
    one, whatever device the tensors are on."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def plain(*tensors) -> bool:
    """True when nothing traces or intercepts the call: exact torch.Tensor inputs, no compile,
    no dispatch mode (opcheck, FakeTensorMode, make_fx). Only then is the eager fast path taken."""
    return (
        not torch.compiler.is_compiling()
        and all(type(t) is Tensor for t in tensors if t is not None)
        and torch._C._len_torch_dispatch_stack() == 0
    )


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def refuse_unsupported_autograd(op: str, *tensors) -> None:
    """Forward-mode AD and torch.func transforms (vmap, grad, jacrev...) are not implemented: say
    so, and what is, instead of failing deep inside torch. Costs two C calls on a plain call."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"streamkl.{op} does not support torch.func transforms (vmap, grad, jacrev, jvp); it "
            "supports reverse-mode autograd (loss.backward(), torch.autograd.grad) and torch.compile. "
            "For a batch, stack it into the batch or head axis instead of vmap."
        )
    if forward_ad._current_level >= 0 and any(
        forward_ad.unpack_dual(t).tangent is not None for t in tensors if t is not None
    ):
        raise NotImplementedError(
            f"streamkl.{op} does not support forward-mode AD (dual tensors); it supports "
            "reverse-mode autograd (loss.backward(), torch.autograd.grad)"
        )


class _NotTwiceDifferentiable(torch.autograd.Function):
    """Passes gradients through; differentiating them raises a named error."""

    @staticmethod
    def forward(ctx, op, n, *grads_then_anchors):
        ctx.op = op
        return tuple(g.view_as(g) for g in grads_then_anchors[:n])

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(
            f"streamkl.{ctx.op} is differentiable once: its gradients are not differentiable "
            "(double backward through create_graph=True is not supported)"
        )


def once_differentiable(op: str, grads: tuple, *anchors: Tensor) -> tuple:
    """A backward's results as they are or, where it ran with create_graph=True (grad mode on),
    tied to `anchors` (what the backward read: the incoming gradient, the inputs) through a node
    that raises a named error when differentiated, instead of a wrong answer. The backward
    itself computes under torch.no_grad()."""
    tied = [a for a in anchors if a is not None and a.requires_grad]
    if not torch.is_grad_enabled() or not tied:
        return grads
    present = [g for g in grads if g is not None]
    marked = iter(_NotTwiceDifferentiable.apply(op, len(present), *present, *tied))
    return tuple(None if g is None else next(marked) for g in grads)
