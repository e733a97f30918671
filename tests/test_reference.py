"""The reference backend against the float64 dense oracle over the contract's feature grid."""

import pytest
import torch

import streamkl
from streamkl.testing import assert_kl_close, grad_tolerance, make_inputs, rel_err

from .oracle import oracle

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [(17, 17), (9, 23), (23, 9), (1, 16)]  # (Nq, Nk): square, decode-like, Nq > Nk
HEADS = [(4, 4, 4), (4, 2, 1), (4, 1, 2)]  # (H, H_kv1, H_kv2): MHA, GQA+MQA, mixed groups
DIMS = [(16, 16), (16, 8)]  # (D1, D2)


def _check(q1, k1, q2, k2, dtype, **kw):
    out = streamkl.attn_kl(q1, k1, q2, k2, backend="reference", **kw)
    assert out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref, ref_grads = oracle(
        q1,
        k1,
        q2,
        k2,
        causal=kw.get("causal", False),
        scale1=kw.get("scale1"),
        scale2=kw.get("scale2"),
        cu_seqlens=kw.get("cu_seqlens"),
        grad=grad,
    )
    assert_kl_close(out.detach(), ref, dtype)
    grads = torch.autograd.grad(out, (q1, k1, q2, k2), grad.to(out.dtype))
    for name, g, g_ref, t in zip(("dq1", "dk1", "dq2", "dk2"), grads, ref_grads, (q1, k1, q2, k2)):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_err(g, g_ref) <= grad_tolerance(dtype), name


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_oracle(dtype, causal, lengths, heads, dims, layout):
    (nq, nk), (h, hk1, hk2), (d1, d2) = lengths, heads, dims
    inputs = make_inputs(
        b=2,
        h=h,
        nq=nq,
        nk=nk,
        d1=d1,
        d2=d2,
        hk1=hk1,
        hk2=hk2,
        dtype=dtype,
        layout=layout,
        requires_grad=True,
        seed=nq * 31 + nk,
    )
    _check(*inputs, dtype, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_packed_sequences(dtype, causal):
    cu_seqlens = torch.tensor([0, 5, 5, 12, 13, 20], dtype=torch.int32)  # one empty, one single
    inputs = make_inputs(
        b=1, h=4, nq=20, nk=20, d1=16, d2=8, hk1=2, hk2=4, dtype=dtype, requires_grad=True, layout="bnhd"
    )
    _check(*inputs, dtype, causal=causal, cu_seqlens=cu_seqlens)
    _check(*inputs, dtype, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=7)


def test_explicit_scales():
    inputs = make_inputs(h=2, nq=11, nk=13, d1=8, d2=16, dtype=torch.float64, requires_grad=True)
    _check(*inputs, torch.float64, causal=True, scale1=0.7, scale2=-1.3)


@pytest.mark.parametrize("chunk", ["1", "3", "1000"])
def test_chunk_size(monkeypatch, chunk):
    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", chunk)
    inputs = make_inputs(h=2, nq=10, nk=12, d1=8, d2=8, dtype=torch.float64, requires_grad=True)
    _check(*inputs, torch.float64, causal=True)


def test_rows_that_see_no_key():
    """Causal with Nq > Nk: the first Nq - Nk rows see nothing: KL 0, zero gradient. Row 7
    sees a single key, so both distributions are the same point mass: KL 0 as well."""
    q1, k1, q2, k2 = make_inputs(h=2, nq=12, nk=5, dtype=torch.float32, requires_grad=True)
    out = streamkl.attn_kl(q1, k1, q2, k2, causal=True)
    assert (out[:, :, :8] == 0).all() and (out[:, :, 8:] > 0).all()
    out.sum().backward()
    assert (q1.grad[:, :, :7] == 0).all() and (q2.grad[:, :, :7] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q1, k1, q2, k2))


def test_no_keys_at_all():
    q1, k1, q2, k2 = make_inputs(h=2, nq=4, nk=0, dtype=torch.float32, requires_grad=True)
    out = streamkl.attn_kl(q1, k1, q2, k2)
    assert out.shape == (1, 2, 4) and (out == 0).all()
    assert streamkl.attn_kl(q1, k1, q2, k2, reduction="mean").item() == 0.0
    out.sum().backward()
    assert (q1.grad == 0).all() and k1.grad.shape == k1.shape


@pytest.mark.parametrize("causal", [False, True])
def test_reductions(causal):
    q1, k1, q2, k2 = make_inputs(b=2, h=2, nq=9, nk=6, dtype=torch.float64)
    rows = oracle(q1, k1, q2, k2, causal=causal)[0]
    visible = 2 * 2 * (6 if causal else 9)  # causal with Nq > Nk: 3 rows per head see nothing
    total = streamkl.attn_kl(q1, k1, q2, k2, causal=causal, reduction="sum")
    mean = streamkl.attn_kl(q1, k1, q2, k2, causal=causal, reduction="mean")
    assert total.shape == () and mean.shape == ()
    torch.testing.assert_close(total, rows.sum())
    torch.testing.assert_close(mean, rows.sum() / visible)


@pytest.mark.parametrize("setting", ["teacher_fixed", "target_fixed", "both"])
def test_only_requested_gradients(setting):
    q1, k1, q2, k2 = make_inputs(h=2, nq=8, nk=8, dtype=torch.float64)
    wants = {
        "teacher_fixed": (False, False, True, True),
        "target_fixed": (True, True, False, False),
        "both": (True,) * 4,
    }[setting]
    for t, want in zip((q1, k1, q2, k2), wants):
        t.requires_grad_(want)
    streamkl.attn_kl(q1, k1, q2, k2, reduction="sum").backward()
    assert [t.grad is not None for t in (q1, k1, q2, k2)] == list(wants)


def test_output_is_fresh():
    q1, k1, q2, k2 = make_inputs(h=2, nq=8, nk=8)
    out = streamkl.attn_kl(q1, k1, q2, k2)
    assert out._base is None and out.is_contiguous()
    assert all(out.data_ptr() != t.data_ptr() for t in (q1, k1, q2, k2))
