"""The reference backend's working set (docs/contract.md, Memory) and its empty shapes.

A forward+backward with the default chunk allocates, beyond its inputs, outputs and gradients,
no more than the two dense (B, H, Nq, Nk) matrices of the compute dtype, and its chunk's
temporaries stay within chunked._CHUNK_BYTES. Besides the chunk there are O((Nq + Nk) * D)
buffers (casts of q and k, float32 dk accumulators for 16-bit inputs), so the shapes here keep
D below N, where the dense matrices are the larger term. The backend functions are called
directly: a dispatch mode sees a custom op as one call.
"""

import pytest
import torch

from streamkl.reference import attn_kl as chunked
from streamkl.testing import cpu_peak_bytes, make_inputs

from ._calls import reference


def _storage_bytes(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _extra_bytes(inputs, causal):
    """Peak bytes a forward+backward allocates beyond its inputs, outputs, grad_kl and gradients."""
    kept = {}

    def run():
        # Copies made under the tracker: it counts a view of a tensor allocated outside it as a
        # fresh allocation of that tensor's whole storage.
        q1, k1, q2, k2 = (t.clone() for t in inputs)
        kw = dict(causal=causal, scale1=q1.shape[-1] ** -0.5, scale2=q2.shape[-1] ** -0.5)
        out = reference.forward(q1, k1, q2, k2, **kw)
        grad = torch.ones_like(out[0])
        grads = reference.backward(grad, q1, k1, q2, k2, *out, **kw, needs=(True,) * 4)
        kept["bytes"] = _storage_bytes((q1, k1, q2, k2, *out, grad, *grads))

    return cpu_peak_bytes(run) - kept["bytes"]


def _dense_bytes(b, h, nq, nk, dtype):
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return 2 * b * h * nq * nk * torch.finfo(compute).bits // 8


SHAPES = [  # (B, H, Hk, Nq, Nk, D, dtype, layout)
    (1, 2, 2, 16, 16, 8, torch.float32, "bhnd"),
    (1, 2, 2, 64, 64, 16, torch.float32, "bhnd"),
    (2, 4, 2, 33, 70, 16, torch.float32, "bhnd"),  # GQA, decode-like
    (2, 4, 1, 70, 33, 16, torch.float32, "bnhd"),  # MQA, Nq > Nk: causal rows that see nothing
    (1, 2, 2, 64, 64, 16, torch.float64, "bhnd"),
    (1, 4, 2, 128, 128, 16, torch.bfloat16, "bhnd"),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_working_set_within_two_dense_matrices(shape, causal):
    b, h, hk, nq, nk, d, dtype, layout = shape
    inputs = make_inputs(b=b, h=h, nq=nq, nk=nk, d1=d, d2=d, hk1=hk, hk2=hk, dtype=dtype, layout=layout)
    assert 0 < _extra_bytes(inputs, causal) <= _dense_bytes(b, h, nq, nk, dtype)


def test_working_set_of_the_reported_shape():
    """B=1, H=8, N=1024, D=64 float32: the two dense matrices are 64 MiB."""
    inputs = make_inputs(b=1, h=8, nq=1024, nk=1024, d1=64, d2=64)
    assert _extra_bytes(inputs, causal=False) <= _dense_bytes(1, 8, 1024, 1024, torch.float32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_working_set_within_the_cap(monkeypatch, dtype, causal):
    """Where the dense matrices (2 MiB here) exceed the cap, the cap bounds the chunk. float32
    inputs leave nothing else; bfloat16 ones add the float32 dk accumulators and a cast of k."""
    cap = 1 << 20
    monkeypatch.setattr(chunked, "_CHUNK_BYTES", cap)
    b, h, n, d = 1, 4, 256, 16
    assert _dense_bytes(b, h, n, n, torch.float32) > cap
    assert chunked._chunk_rows(b, h, n, n, torch.float32, d) < n
    inputs = make_inputs(b=b, h=h, nq=n, nk=n, d1=d, d2=d, dtype=dtype)
    key = b * h * n * d * 4  # one key tensor in float32
    held = 0 if dtype == torch.float32 else 3 * key
    assert _extra_bytes(inputs, causal) <= cap + held


def test_default_cap_rows():
    """Long context: the default chunk holds its temporaries within _CHUNK_BYTES, one row at least."""
    b, h, nq, nk, d = 1, 32, 1 << 20, 1 << 17, 128
    rows = chunked._chunk_rows(b, h, nq, nk, torch.float32, d)
    assert 1 <= rows < nq
    assert rows * b * h * (chunked._LIVE_CHUNK_TEMPS * nk + d) * 4 <= chunked._CHUNK_BYTES
    assert chunked._chunk_rows(1, 32, 4, 1 << 22, torch.float32, d) == 1


def test_chunk_variable_overrides(monkeypatch):
    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", "1000")
    assert chunked._chunk_rows(1, 8, 4096, 4096, torch.float32, 64) == 1000
    assert chunked._chunk_rows(1, 8, 10, 4096, torch.float32, 64) == 10


# --- empty shapes ------------------------------------------------------------------------------


def _forward_backward(inputs, causal):
    q1, k1, q2, k2 = inputs
    kw = dict(causal=causal, scale1=0.3, scale2=0.4)
    kl, lse1, lse2 = reference.forward(q1, k1, q2, k2, **kw)
    grads = reference.backward(torch.ones_like(kl), q1, k1, q2, k2, kl, lse1, lse2, **kw)
    return (kl, lse1, lse2), grads


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_empty_batch(dtype, causal):
    inputs = make_inputs(b=0, h=4, nq=8, nk=6, d1=16, d2=8, hk1=2, hk2=1, dtype=dtype)
    (kl, lse1, lse2), grads = _forward_backward(inputs, causal)
    for t in (kl, lse1, lse2):
        assert t.shape == (0, 4, 8) and t.dtype == torch.float32
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_query_rows(dtype, causal):
    inputs = make_inputs(b=2, h=4, nq=0, nk=6, d1=16, d2=8, hk1=2, hk2=1, dtype=dtype)
    (kl, lse1, lse2), grads = _forward_backward(inputs, causal)
    for t in (kl, lse1, lse2):
        assert t.shape == (2, 4, 0) and t.dtype == torch.float32
    for g, t in zip(grads, inputs):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert (g == 0).all()  # no row, so no key receives any gradient


def test_no_query_rows_packed():
    inputs = make_inputs(b=1, h=2, nq=0, nk=0, d1=8, d2=8)
    q1, k1, q2, k2 = inputs
    kw = dict(causal=True, scale1=0.3, scale2=0.4, cu_seqlens=torch.tensor([0, 0], dtype=torch.int32))
    kl, lse1, lse2 = reference.forward(*inputs, **kw)
    assert kl.shape == (1, 2, 0) and lse1.shape == lse2.shape == (1, 2, 0)
    grads = reference.backward(torch.ones_like(kl), *inputs, kl, lse1, lse2, **kw)
    assert [g.shape for g in grads] == [t.shape for t in inputs]
