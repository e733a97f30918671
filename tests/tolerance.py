"""The float64 oracle and the one tolerance rule every backend is held to (docs/contract.md,
Numerics).

A backend's error against the float64 oracle, per row, may be at most RATIO times the error of
the same computation done densely in PyTorch on the same inputs, plus a floor:

    |err_row| <= RATIO * (dense_err_row + rms(dense_err)) + floor_row

  * "the same computation": the dense formula at the precision the method accumulates in
    (16-bit and float32 inputs in float32 with true float32 products, float64 in float64), its
    gradients by autograd, rounded to the input dtype as the backends round theirs;
  * per row: each (b, h, i) of KL, each row (one query or key vector) of each gradient; the
    root mean square of the dense errors over the rows keeps a row where the dense rounding
    happened to cancel from setting a bar no method meets (at logits ~1e3 the KL's rounding
    grows with the logits squared, and two summation orders differ by 10x on single rows);
  * the floor: FLOOR units of rounding of the compute dtype, scaled by what the row's error is
    made of (for KL, the size M the row's logits are rounded at times KL's sensitivity to
    them; for a gradient row, M times the size of the terms dq = scale dS k and dk = scale
    dS^T q sum), so rows whose dense error happens to be ~0 and gradients that are
    cancellation residues (one-hot rows) have a bar too;
  * for 16-bit inputs a gradient row may also carry what rounding dS to the input dtype before
    its two products does (the fused backward's tensor-core operands, as in FlashAttention):
    eps of that dtype times the row's sum of |scale| |dS_ij| |k_j| (dk: |dS_ij| |q_i| over i),
    which matters where those terms cancel (two keys with nearly equal k).
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
    """(kl, lse1, lse2, grads) of the dense formula computed in `dtype`, grads by autograd."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in inputs]
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    kl, lse1, lse2 = dense_attn_kl(
        *leaves, causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu, dtype=dtype, return_lse=True
    )
    grads = torch.autograd.grad(kl, leaves, grad.to(dtype), allow_unused=True)
    return kl.detach(), lse1.detach(), lse2.detach(), grads


def _row_scales(inputs, causal, scale1, scale2, cu_seqlens, grad):
    """What the bars scale with, from float64 logits:
    - per (b, h, i): M, the size the row's logits are rounded at (max over the keys it sees of
      |scale1| |q1_i| |k1_j| + |scale2| |q2_i| |k2_j|: a dot product's rounding scales with the
      norms, not with its value), and how much KL moves per unit of logit error: dKL/dS1_j =
      P1_j (r_j - KL) with r_j the log-ratio, dKL/dS2_j = P2_j - P1_j, so at most
      2 + sum_j P1_j |r_j - KL| (which grows with the logits at one-hot rows). 0 for empty rows;
    - per gradient row (dq1, dk1, dq2, dk2), eps of its pair's dtype (0 unless 16-bit) times the
      size of its terms: |scale| sum_j |dS_ij| |k_j| for dq, |scale| sum_i |dS_ij| |q_i| for dk
      (over the query heads of the key head's group), dS = g dKL/dS."""
    x = [t.detach().cpu().double() for t in inputs]
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    mask = visible_mask(x[0].shape[-2], x[1].shape[-2], causal, cu_seqlens=cu)
    size, logp = 0.0, []
    for q, k, scale in ((x[0], x[1], scale1), (x[2], x[3], scale2)):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        size = size + q.norm(dim=-1, keepdim=True) @ k.norm(dim=-1, keepdim=True).mT * abs(scale)
        s = (q @ k.mT * scale).masked_fill(~mask, -math.inf)
        logp.append(torch.where(mask, s.log_softmax(-1), 0.0).nan_to_num(0.0))
    p1, p2 = (torch.where(mask, lp.exp(), 0.0) for lp in logp)
    ratio = logp[0] - logp[1]
    kl = (p1 * ratio).sum(-1, keepdim=True)
    spread = torch.where(mask.any(-1), 2.0 + (p1 * (ratio - kl).abs()).sum(-1), 0.0)
    size = size.masked_fill(~mask, 0.0)
    size = size.amax(-1) if size.shape[-1] else size.new_zeros(size.shape[:-1])
    g = grad.double()[..., None]
    rounding = []
    for (q, k, scale, inp), ds in zip(((x[0], x[1], scale1, inputs[0]), (x[2], x[3], scale2, inputs[2])),
                                      (g * p1 * (ratio - kl), g * (p2 - p1))):  # fmt: skip
        eps = torch.finfo(inp.dtype).eps if inp.dtype in (torch.float16, torch.bfloat16) else 0.0
        groups = q.shape[1] // k.shape[1]
        ds = ds.abs() * abs(scale) * eps
        dq = ds @ k.norm(dim=-1).repeat_interleave(groups, 1)[..., None]
        dk = (ds * q.norm(dim=-1)[..., None]).sum(-2)
        rounding += [dq[..., 0], dk.unflatten(1, (k.shape[1], groups)).sum(2)]
    return size, spread, rounding


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
        self.kl, self.lse1, self.lse2, self.grads = _dense(inputs, torch.float64, *args)
        self.dtype = compute_dtype(*inputs)
        self.eps = torch.finfo(self.dtype).eps
        dense_kl, dense_lse1, dense_lse2, dense_grads = _dense(inputs, self.dtype, *args)
        self.dense_kl_err = (dense_kl.double() - self.kl).abs()
        self.dense_lse_err = [
            (d.double() - r).abs().nan_to_num(0.0)
            for d, r in ((dense_lse1, self.lse1), (dense_lse2, self.lse2))
        ]
        self.dense_grad_err = [
            _row_norm(d.to(t.dtype).double() - r) for d, r, t in zip(dense_grads, self.grads, inputs)
        ]
        self.magnitude, self.spread, self.ds_rounding = _row_scales(
            inputs, causal, self.scale1, self.scale2, cu_seqlens, self.grad
        )
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
        floor = FLOOR * self.eps * (1.0 + self.magnitude) * self.spread
        bound = RATIO * _with_rms(self.dense_kl_err) + floor
        _report(what, err, bound)

    def check_lse(self, lse1, lse2):
        """-inf exactly on the rows that see nothing; elsewhere the rule, with a floor of the
        rounding of logits of size M (LSE moves by at most max |dS|)."""
        for name, got, ref, dense_err in zip(
            ("lse1", "lse2"), (lse1, lse2), (self.lse1, self.lse2), self.dense_lse_err
        ):
            got = got.detach().cpu().double()
            empty = torch.isneginf(ref)
            assert torch.equal(torch.isneginf(got), empty), f"{name}: -inf exactly on rows that see no key"
            err = (got - ref)[~empty].abs()
            bound = RATIO * _with_rms(dense_err[~empty]) + FLOOR * self.eps * (1.0 + self.magnitude[~empty])
            _report(name, err, bound)

    def check_grads(self, grads, inputs, needs=(True,) * 4):
        names = ("dq1", "dk1", "dq2", "dk2")
        for name, got, ref, dense_err, floor, rounding, inp, need in zip(
            names, grads, self.grads, self.dense_grad_err, self.grad_floor, self.ds_rounding, inputs, needs
        ):
            if not need:
                assert got is None, f"{name} was not requested"
                continue
            assert got.shape == inp.shape and got.dtype == inp.dtype, (name, got.shape, got.dtype)
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all(), f"{name}: non-finite values"
            _report(name, _row_norm(got - ref), RATIO * _with_rms(dense_err) + floor + rounding)


def _with_rms(err):
    return err + err.square().mean().sqrt() if err.numel() else err


def _largest(t) -> float:
    return t.max().item() if t.numel() else 0.0


def _row_norm(t):
    return t.norm(dim=-1)


def _report(what, err, bound):
    if err.numel() == 0:
        return
    worst = torch.where(err == 0, 0.0, err / bound).max().item()  # 0/0: an exact empty row
    assert worst <= 1.0, (
        f"{what}: worst row at {worst:.2f}x its bound (max error {err.max().item():.3e}; "
        f"rule: {RATIO:g}x (the dense error of the same computation + its rms) + {FLOOR:g} roundings)"
    )
