"""The tests' float64 oracle: SPEC section 1 on dense matrices (streamkl.testing.dense_attn_kl,
which shares no code with the chunked reference), and its gradients by autograd."""

import torch

from streamkl.testing import dense_attn_kl


def oracle(q1, k1, q2, k2, causal=False, scale1=None, scale2=None, cu_seqlens=None, grad=None):
    """(kl, (dq1, dk1, dq2, dk2)) in float64 for upstream gradient `grad` (None: no grads)."""
    leaves = [t.detach().double().requires_grad_(grad is not None) for t in (q1, k1, q2, k2)]
    kl = dense_attn_kl(*leaves, causal=causal, scale1=scale1, scale2=scale2,
                       cu_seqlens=cu_seqlens)
    if grad is None:
        return kl.detach(), None
    grads = torch.autograd.grad(kl, leaves, grad.double())
    return kl.detach(), grads
