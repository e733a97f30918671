"""What is specific to the reference backend: its chunking over query rows. The contract it
shares with every backend is tests/test_backends.py's."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import streamkl
from streamkl.testing import make_inputs

from ._calls import reference


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("chunk", ["1", "3", "1000"])
def test_chunk_size_does_not_change_the_result(monkeypatch, chunk, causal, varlen):
    cu = torch.tensor([0, 4, 4, 11, 12], dtype=torch.int32) if varlen else None
    inputs = make_inputs(b=1, h=2, hk2=1, nq=12, nk=12, d1=8, d2=4, dtype=torch.float64, requires_grad=True)
    kw = dict(causal=causal, cu_seqlens=cu, backend="reference")
    whole = streamkl.attn_kl(*inputs, **kw)
    grads = torch.autograd.grad(whole.sum(), inputs)
    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", chunk)
    chunked = streamkl.attn_kl(*inputs, **kw)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    for got, ref in zip(torch.autograd.grad(chunked.sum(), inputs), grads):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any aten op produces. A dispatch mode
    sees a custom op as one call, so the backend's functions are called directly under it."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_never_allocates_nq_by_nk(monkeypatch, causal):
    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", "16")
    b, h, nq, nk = 1, 2, 512, 256
    q1, k1, q2, k2 = make_inputs(b=b, h=h, nq=nq, nk=nk, d1=8, d2=8)
    kw = dict(causal=causal, scale1=0.3, scale2=0.3)
    with LargestTensor() as mode:
        kl, lse1, lse2 = reference.forward(q1, k1, q2, k2, **kw)
        grad = torch.ones_like(kl)
        reference.backward(grad, q1, k1, q2, k2, kl, lse1, lse2, **kw, needs=(True,) * 4)
    # one chunk's logits, (B, H, 16, Nk), is the largest thing allowed; Nq x Nk would be 32x more
    assert mode.largest == b * h * 16 * nk
