"""The registered op: opcheck, torch.compile, gradcheck, dispatch and memory."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import streamkl
from streamkl.testing import make_inputs

from .oracle import oracle


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(causal=False),
        dict(causal=True, scale1=0.5, scale2=0.25),
        dict(causal=True, reduction="mean"),
        dict(causal=False, reduction="sum"),
    ],
    ids=str,
)
def test_opcheck_public_op(layout, kwargs):
    inputs = make_inputs(h=4, nq=7, nk=9, d1=8, d2=4, hk1=2, hk2=1, layout=layout, requires_grad=True)
    torch.library.opcheck(torch.ops.streamkl.attn_kl.default, inputs, kwargs)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("varlen", [False, True])
def test_opcheck_forward_and_backward_ops(layout, varlen):
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32) if varlen else None
    q1, k1, q2, k2 = make_inputs(h=4, nq=8, nk=8, d1=8, d2=4, hk1=2, layout=layout, requires_grad=True)
    torch.library.opcheck(
        torch.ops.streamkl.attn_kl_fwd.default, (q1, k1, q2, k2, True, 0.3, 0.2, cu, None, None)
    )
    kl, lse1, lse2 = torch.ops.streamkl.attn_kl_fwd(q1, k1, q2, k2, True, 0.3, 0.2, cu)
    grad = torch.randn_like(kl)
    q1, k1, q2, k2, kl, lse1, lse2 = (t.detach() for t in (q1, k1, q2, k2, kl, lse1, lse2))
    for needs in ([True] * 4, [False, False, True, True], [True, True, False, False]):
        args = (grad, q1, k1, q2, k2, kl, lse1, lse2, True, 0.3, 0.2, cu, None, needs, None)
        torch.library.opcheck(torch.ops.streamkl.attn_kl_bwd.default, args)


class Distill(torch.nn.Module):
    """A module that calls the op the way a training loop does: projections, then the loss."""

    def __init__(self, causal, reduction):
        super().__init__()
        self.causal, self.reduction = causal, reduction
        self.proj = torch.nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, q1, k1, q2, k2, cu_seqlens=None):
        return streamkl.attn_kl(
            q1, k1, self.proj(q2), k2, causal=self.causal, reduction=self.reduction, cu_seqlens=cu_seqlens
        )


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("reduction", ["none", "mean"])
@pytest.mark.parametrize("causal", [False, True])
def test_compile_fullgraph_matches_eager(causal, reduction, varlen):
    torch._dynamo.reset()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32) if varlen else None
    inputs = make_inputs(
        h=4, nq=10, nk=10, d1=8, d2=8, hk2=2, dtype=torch.float64, requires_grad=True, layout="bnhd"
    )
    model = Distill(causal, reduction)
    results = []
    for fn in (model, torch.compile(model, fullgraph=True)):
        out = fn(*inputs, cu_seqlens=cu)
        grads = torch.autograd.grad(out.sum(), (*inputs, model.proj.weight))
        results.append((out, grads))
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)


def test_compile_has_no_graph_breaks():
    torch._dynamo.reset()
    inputs = make_inputs(h=2, nq=6, nk=6, d1=8, d2=8, dtype=torch.float64, requires_grad=True)
    explain = torch._dynamo.explain(Distill(True, "sum"))(*inputs)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


@pytest.mark.parametrize("case", ["plain", "causal_gqa", "varlen", "nq_gt_nk_causal"])
def test_gradcheck_float64(case):
    cu = None
    if case == "plain":
        inputs = make_inputs(h=2, nq=4, nk=5, d1=3, d2=2, dtype=torch.float64, requires_grad=True)
        kw = dict()
    elif case == "causal_gqa":
        inputs = make_inputs(
            h=4, nq=4, nk=6, d1=3, d2=2, hk1=2, hk2=1, dtype=torch.float64, requires_grad=True, layout="bnhd"
        )
        kw = dict(causal=True, scale1=0.9)
    elif case == "varlen":
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        inputs = make_inputs(h=2, nq=5, nk=5, d1=3, d2=3, hk1=1, dtype=torch.float64, requires_grad=True)
        kw = dict(causal=True, cu_seqlens=cu)
    else:
        inputs = make_inputs(h=2, nq=6, nk=3, d1=2, d2=3, dtype=torch.float64, requires_grad=True)
        kw = dict(causal=True, reduction="mean")
    assert torch.autograd.gradcheck(lambda *t: streamkl.attn_kl(*t, **kw), inputs)


@pytest.mark.gpu
def test_matches_oracle_on_cuda_tensors_with_reference():
    inputs = make_inputs(h=2, nq=9, nk=9, dtype=torch.float32, device="cuda")
    out = streamkl.attn_kl(*inputs, backend="reference")
    torch.testing.assert_close(out.cpu().double(), oracle(*inputs)[0].cpu(), atol=1e-4, rtol=1e-4)


# --- backend selection ----------------------------------------------------------------------


def test_env_is_read_at_call_time(monkeypatch):
    inputs = make_inputs(h=2, nq=4, nk=4)
    monkeypatch.setenv("STREAMKL_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="STREAMKL_BACKEND.*reference"):
        streamkl.attn_kl(*inputs)
    monkeypatch.setenv("STREAMKL_BACKEND", "reference")
    assert streamkl.attn_kl(*inputs).shape == (1, 2, 4)


def test_auto_never_fails_where_reference_runs(monkeypatch):
    monkeypatch.setenv("STREAMKL_BACKEND", "auto")
    inputs = make_inputs(h=2, nq=4, nk=4, dtype=torch.float64)
    torch.testing.assert_close(streamkl.attn_kl(*inputs), oracle(*inputs)[0])


def test_named_backend_that_cannot_run_says_why_and_who_can(monkeypatch):
    inputs = make_inputs(h=2, nq=4, nk=4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot run.*Backends that can: .*reference"):
        streamkl.attn_kl(*inputs, backend="cuda")
    monkeypatch.setenv("STREAMKL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="backend 'cuda' cannot run"):
        streamkl.attn_kl(*inputs)
    with pytest.raises(ValueError, match="backend 'triton' cannot run"):
        streamkl.attn_kl(*inputs, backend="triton")  # float64 is the reference's alone


def test_unknown_backend_argument_lists_valid_ones():
    with pytest.raises(ValueError, match="auto, cuda, triton, reference"):
        streamkl.attn_kl(*make_inputs(h=2, nq=4, nk=4), backend="fast")


def test_available_backends_reports_reasons():
    table = streamkl.available_backends(*make_inputs(h=2, nq=4, nk=4, dtype=torch.float64))
    assert table["reference"] is None
    assert isinstance(table["cuda"], str) and isinstance(table["triton"], str)


# --- memory ---------------------------------------------------------------------------------


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
def test_reference_never_allocates_nq_by_nk(monkeypatch, causal):
    from streamkl import reference

    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", "16")
    b, h, nq, nk = 1, 2, 512, 256
    q1, k1, q2, k2 = make_inputs(b=b, h=h, nq=nq, nk=nk, d1=8, d2=8)
    kw = dict(causal=causal, scale1=0.3, scale2=0.3)
    with LargestTensor() as mode:
        kl, lse1, lse2 = reference.forward(q1, k1, q2, k2, **kw)
        grad = torch.ones_like(kl)
        reference.backward(grad, q1, k1, q2, k2, kl, lse1, lse2, **kw, needs=(True,) * 4)
    # one chunk's logits, (B, H, 16, Nk), is the largest thing allowed; Nq x Nk would be 32x more
    assert mode.largest == b * h * 16 * nk  # the chunk logits were seen, nothing larger
    assert mode.largest < b * h * nq * nk // 8


def test_default_chunk_bounds_memory():
    from streamkl.reference.chunked import _CHUNK_BYTES, _chunk_rows

    rows = _chunk_rows(1, 32, 1 << 20, 1 << 17, torch.float32)
    assert rows * 32 * (1 << 17) * 4 <= _CHUNK_BYTES and rows >= 1
