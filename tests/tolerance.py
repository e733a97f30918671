"""The float64 oracle and the one tolerance rule every backend is held to (docs/contract.md,
Numerics).

A backend's error against the float64 oracle, per row, may be at most RATIO times the error of
the same computation done densely in PyTorch on the same inputs, plus a floor:

  * "the same computation": the dense formula at the precision the method accumulates in
    (16-bit and float32 inputs in float32 with true float32 products, float64 in float64), its
    gradients by autograd, rounded to the input dtype as the backends round theirs;
  * per row: each (b, h, i) of KL, each row (one query or key vector) of each gradient;
  * the floor: FLOOR units of rounding of the compute dtype, scaled by what the row's error is
    made of (the logits' magnitude M for KL; for a gradient row, M times the size of the terms
    dq = scale dS k and dk = scale dS^T q sum), so rows whose dense error happens to be ~0 and
    gradients that are cancellation residues (one-hot rows) have a bar too.
"""

from __future__ import annotations

import math

import torch

from streamkl.testing import dense_attn_kl, visible_mask

RATIO = 4.0
FLOOR = 8.0


def compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _dense(inputs, dtype, causal, scale1, scale2, cu_seqlens, grad):
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in inputs]
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    kl = dense_attn_kl(*leaves, causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu, dtype=dtype)
    grads = torch.autograd.grad(kl, leaves, grad.to(dtype), allow_unused=True)
    return kl.detach(), grads


def _row_magnitude(q1, k1, q2, k2, causal, scale1, scale2, cu_seqlens):
    """Per (b, h, i): the largest |S1| + |S2| over the keys the row sees (0 for empty rows)."""
    q1, k1, q2, k2 = (t.detach().cpu().double() for t in (q1, k1, q2, k2))
    s1 = q1 @ k1.repeat_interleave(q1.shape[1] // k1.shape[1], 1).mT * scale1
    s2 = q2 @ k2.repeat_interleave(q2.shape[1] // k2.shape[1], 1).mT * scale2
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    mask = visible_mask(s1.shape[-2], s1.shape[-1], causal, cu_seqlens=cu)
    m = (s1.abs() + s2.abs()).masked_fill(~mask, 0.0)
    return m.amax(-1) if m.shape[-1] else m.new_zeros(m.shape[:-1])


class Expected:
    """The oracle's KL and gradients for one problem and upstream gradient, and the bars."""

    def __init__(
        self, inputs, *, causal=False, scale1=None, scale2=None, cu_seqlens=None, max_seqlen=None, grad=None
    ):
        q1, k1, q2, k2 = inputs
        self.scale1 = 1 / math.sqrt(q1.shape[-1]) if scale1 is None else scale1
        self.scale2 = 1 / math.sqrt(q2.shape[-1]) if scale2 is None else scale2
        shape = (*q1.shape[:3],)
        if grad is None:
            grad = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        self.grad = grad.double()
        args = (causal, self.scale1, self.scale2, cu_seqlens, self.grad)
        self.kl, self.grads = _dense(inputs, torch.float64, *args)
        self.dtype = compute_dtype(*inputs)
        self.eps = torch.finfo(self.dtype).eps
        dense_kl, dense_grads = _dense(inputs, self.dtype, *args)
        self.dense_kl_err = (dense_kl.double() - self.kl).abs()
        self.dense_grad_err = [
            _row_norm(d.to(t.dtype).double() - r) for d, r, t in zip(dense_grads, self.grads, inputs)
        ]
        self.magnitude = _row_magnitude(*inputs, causal, self.scale1, self.scale2, cu_seqlens)
        m = 1.0 + _largest(self.magnitude)
        gmax = _largest(self.grad.abs())
        gsum = self.grad.abs().sum().item()
        self.grad_floor = []
        for q, k, scale in ((q1, k1, self.scale1), (q2, k2, self.scale2)):
            qn, kn = (_largest(_row_norm(t.detach().cpu().double())) for t in (q, k))
            unit = FLOOR * self.eps * m * abs(scale)
            self.grad_floor += [unit * gmax * kn, unit * gsum * qn]  # dq: one row's dS; dk: all rows

    def check_kl(self, kl, what="kl"):
        kl = kl.detach().cpu().double()
        assert kl.shape == self.kl.shape, (what, kl.shape, self.kl.shape)
        assert torch.isfinite(kl).all(), f"{what}: non-finite values"
        err = (kl - self.kl).abs()
        bound = RATIO * self.dense_kl_err + FLOOR * self.eps * (1.0 + self.magnitude)
        _report(what, err, bound)

    def check_grads(self, grads, inputs, needs=(True,) * 4):
        names = ("dq1", "dk1", "dq2", "dk2")
        for name, got, ref, dense_err, floor, inp, need in zip(
            names, grads, self.grads, self.dense_grad_err, self.grad_floor, inputs, needs
        ):
            if not need:
                assert got is None, f"{name} was not requested"
                continue
            assert got.shape == inp.shape and got.dtype == inp.dtype, (name, got.shape, got.dtype)
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all(), f"{name}: non-finite values"
            _report(name, _row_norm(got - ref), RATIO * dense_err + floor)


def _largest(t) -> float:
    return t.max().item() if t.numel() else 0.0


def _row_norm(t):
    return t.norm(dim=-1)


def _report(what, err, bound):
    if err.numel() == 0:
        return
    worst = (err / bound).max().item()
    assert worst <= 1.0, (
        f"{what}: worst row at {worst:.2f}x its bound (max error {err.max().item():.3e}; "
        f"rule: {RATIO:g}x the dense error of the same computation + {FLOOR:g} roundings)"
    )
