"""The attention-call baseline of the benchmarks (benchmarks/sdpa_trick.py) computes the KL and
the teacher-fixed gradients it claims to, against the float64 oracle (CPU flash kernel)."""

import pytest
import torch

from benchmarks import sdpa_trick
from streamkl.testing import make_inputs

from .tolerance import Expected


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 1)], ids=["mha", "gqa"])
def test_kl_and_student_gradients(causal, heads):
    h, hk1, hk2 = heads
    inputs = make_inputs(b=2, h=h, hk1=hk1, hk2=hk2, nq=33, nk=33, d1=16, d2=16, seed=3)
    s1, s2 = 0.25, 0.3
    assert sdpa_trick.unsupported(*inputs, causal, "flash") is None
    kw = dict(causal=causal, scale1=s1, scale2=s2, backend="flash")
    kl = sdpa_trick.kl(*inputs, **kw)
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(1))
    expected = Expected(inputs, causal=causal, scale1=s1, scale2=s2, grad=g.double())
    err = (kl.double() - expected.kl).abs().max().item()
    assert err <= 1e-4, err  # fp32 attention kernels: the cancellation of four O(|S|) terms
    kl_step, dq2, dk2 = sdpa_trick.train(*inputs, g, **kw)
    torch.testing.assert_close(kl_step, kl)
    for got, ref in ((dq2, expected.grads[2]), (dk2, expected.grads[3])):
        assert got.shape == ref.shape
        assert ((got.double() - ref).norm() / ref.norm()).item() <= 1e-4


def test_limits_are_stated():
    q1, k1, q2, k2 = make_inputs(nq=5, nk=7, d1=16, d2=8)
    assert "Nq == Nk" in sdpa_trick.unsupported(q1, k1, q2, k2, True, "flash")
    assert "D1 == D2" in sdpa_trick.unsupported(q1, k1, q2, k2, False, "flash")
    assert "CUDA" in sdpa_trick.unsupported(q1, k1, q1, k1, False, "cudnn")
