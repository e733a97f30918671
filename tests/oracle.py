"""The tests' float64 oracle: SPEC section 1 on dense matrices (streamkl.testing.dense_attn_kl,
which shares no code with the chunked reference), and its gradients by autograd."""

import math

import torch

from streamkl.testing import dense_attn_kl


def oracle(q1, k1, q2, k2, causal=False, scale1=None, scale2=None, cu_seqlens=None, grad=None):
    """(kl, (dq1, dk1, dq2, dk2)) in float64 for upstream gradient `grad` (None: no grads)."""
    leaves = [t.detach().double().requires_grad_(grad is not None) for t in (q1, k1, q2, k2)]
    kl = dense_attn_kl(*leaves, causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens)
    if grad is None:
        return kl.detach(), None
    grads = torch.autograd.grad(kl, leaves, grad.double())
    return kl.detach(), grads


def rounding_floor(q1, k1, q2, k2, g, eps):
    """Absolute gradient error that rounding at unit `eps` alone can leave, per gradient (dq1,
    dk1, dq2, dk2): dS carries an error of about eps * |S| times |g| P (the log-ratio and
    P = exp(S - LSE) are formed from logits of size |S|, P summing to 1 per row), which
    dq = scale dS k and dk = scale dS^T q spread at most as scale * eps * |S|max * max row norm
    * ||g||_1. Where the true gradient is itself that small (a one-hot row: the log-ratio equals
    KL at the argmax, so the exact dS1 there is a cancellation residue, ~1e-18 in one case
    hypothesis found), no method at that precision meets a bar relative to it
    (docs/triton.md, Numerics)."""
    slack = 16.0
    gsum = g.abs().sum().item()
    out = []
    for q, k in ((q1, k1), (q2, k2)):
        qn = q.detach().double().norm(dim=-1).max().item()
        kn = k.detach().double().norm(dim=-1).max().item()
        scale = 1 / math.sqrt(q.shape[-1])
        unit = slack * eps * (1.0 + scale * qn * kn) * scale * gsum
        out += [unit * kn, unit * qn]  # dq spreads over k rows, dk over q rows
    return out
