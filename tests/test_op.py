"""The op layer: one validation and at most one host read of cu_seqlens per call, the eager
path and the registered ops agree, no graph breaks, gradcheck in float64, backend selection,
CUDA graphs. What every backend must compute is tests/test_backends.py's."""

import math

import pytest
import torch

import streamkl
from streamkl import _checks
from streamkl._spec import AttnKLInputs
from streamkl.ops import attn_kl as _ops
from streamkl.testing import make_inputs

from .tolerance import Expected


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
    Expected(inputs).check_kl(streamkl.attn_kl(*inputs))


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


def test_a_forward_only_backend_borrows_the_named_backward(monkeypatch):
    """A backend with backward_backend = "<name>" runs its forward; the gradients come from that
    backend."""
    import types

    from streamkl import _dispatch

    reference = _dispatch.implementation("reference", "attn_kl")
    forwards, backwards = [], []
    forward_only = types.SimpleNamespace(
        op="attn_kl",
        backward_backend="reference",
        backward_declines=lambda spec, inputs: "no backward of its own",
        forward=_counted(forwards, reference.forward),
    )
    monkeypatch.setattr(_dispatch, "select", lambda *args, **kwargs: forward_only)
    monkeypatch.setattr(reference, "backward", _counted(backwards, reference.backward))
    inputs = make_inputs(h=2, nq=5, nk=7, dtype=torch.float64)
    q1, k1 = inputs[0], inputs[1]
    q2, k2 = (t.clone().requires_grad_() for t in inputs[2:])
    expected = Expected(inputs, causal=True)
    for compiled in (False, True):
        fn = (
            torch.compile(streamkl.attn_kl, fullgraph=True, backend="aot_eager")
            if compiled
            else streamkl.attn_kl
        )
        kl = fn(q1, k1, q2, k2, causal=True)
        dq2, dk2 = torch.autograd.grad(kl, (q2, k2), expected.grad)
        expected.check_kl(kl)
        expected.check_grads((None, None, dq2, dk2), inputs, needs=(False, False, True, True))
    assert len(forwards) == 2 and len(backwards) == 2


def _fails(*args, **kwargs):
    raise AssertionError("an autograd node was built")


def test_a_call_with_nothing_to_differentiate_builds_no_node(monkeypatch):
    q1, k1, q2, k2 = make_inputs(h=2, nq=6, nk=9, dtype=torch.float64)
    q2 = q2.clone().requires_grad_()
    with_grad = streamkl.attn_kl(q1, k1, q2, k2, causal=True, reduction="mean")
    assert with_grad.grad_fn is not None
    monkeypatch.setattr(_ops._AttnKL, "apply", _fails)
    with torch.no_grad():
        without = streamkl.attn_kl(q1, k1, q2, k2, causal=True, reduction="mean")
    plain = streamkl.attn_kl(q1, k1, q2.detach(), k2, causal=True, reduction="mean")
    for kl in (without, plain):
        assert kl.grad_fn is None and not kl.requires_grad
        assert torch.equal(kl, with_grad.detach())


def test_forward_mode_ad_is_refused_not_dropped():
    """No input requires grad, but a dual tensor carries a tangent: the call must not return a
    result without it (the op has no forward-mode derivative)."""
    import torch.autograd.forward_ad as fwAD

    q1, k1, q2, k2 = make_inputs(h=2, nq=6, nk=9, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(q2, torch.randn_like(q2))
        with pytest.raises(NotImplementedError, match="does not support forward-mode AD.*reverse-mode"):
            streamkl.attn_kl(q1, k1, dual, k2)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_torch_func_transforms_are_refused_by_name(transform):
    q1, k1, q2, k2 = make_inputs(h=2, nq=6, nk=9, dtype=torch.float64)
    if transform == "vmap":
        fn = torch.func.vmap(lambda q: streamkl.attn_kl(q, k1, q2, k2))
        arg = q1[None].expand(3, -1, -1, -1, -1)
    else:
        fn = torch.func.grad(lambda q: streamkl.attn_kl(q1, k1, q, k2, reduction="sum"))
        arg = q2
    with pytest.raises(NotImplementedError, match="torch.func transforms.*reverse-mode"):
        fn(arg)


@pytest.mark.parametrize("path", ["eager", "registered op"])
def test_double_backward_is_refused_by_name(path):
    """The gradients are differentiable once: asking for a second derivative raises a named
    error, never a silently wrong one. create_graph=True alone (e.g. for another term of the
    loss) is fine."""
    inputs = make_inputs(h=2, nq=6, nk=9, dtype=torch.float64, requires_grad=True)
    op = streamkl.attn_kl if path == "eager" else torch.ops.streamkl.attn_kl
    loss = op(*inputs, causal=True, reduction="sum")
    dq2 = torch.autograd.grad(loss, inputs[2], create_graph=True)[0]
    torch.testing.assert_close(
        dq2, torch.autograd.grad(op(*inputs, causal=True, reduction="sum"), inputs[2])[0]
    )
    with pytest.raises(NotImplementedError, match="differentiable once"):
        dq2.sum().backward()


def test_auto_passes_by_a_backend_where_it_declines(monkeypatch):
    """auto takes the first backend in order that supports the inputs and does not decline them
    in its auto_declines (the cuda backend declines nothing today: set here to decline decode
    shapes); a backend named explicitly runs what its auto_declines passes by."""
    from streamkl import _dispatch

    cuda, triton = (_dispatch.implementation(name, "attn_kl") for name in ("cuda", "triton"))
    monkeypatch.setattr(cuda, "supports", lambda *args, **kwargs: None)
    monkeypatch.setattr(triton, "supports", lambda *args, **kwargs: None)
    decode, prefill = make_inputs(h=2, nq=16, nk=64, d2=128), make_inputs(h=2, nq=17, nk=64, d2=128)
    for tensors in (decode, prefill):
        spec = _checks.attn_kl_spec(*tensors, causal=False, scale1=None, scale2=None)
        inputs = AttnKLInputs(*tensors)
        assert cuda.auto_declines(spec, inputs) is None and triton.auto_declines(spec, inputs) is None
        assert _dispatch.first_for_auto("attn_kl", spec, inputs) is cuda
    monkeypatch.setattr(cuda, "auto_declines", lambda spec, inputs: "slower" if spec.nq <= 16 else None)
    for tensors, auto in ((decode, triton), (prefill, cuda)):
        spec = _checks.attn_kl_spec(*tensors, causal=False, scale1=None, scale2=None)
        inputs = AttnKLInputs(*tensors)
        assert _dispatch.first_for_auto("attn_kl", spec, inputs) is auto
        assert _dispatch.select("attn_kl", spec, inputs, "cuda") is cuda


def _counted(calls, fn):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return counted


# --- the op boundary ------------------------------------------------------------------------


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_one_validation_per_eager_call(monkeypatch):
    checks = _count_calls(monkeypatch, _checks, "attn_kl_spec")
    inputs = make_inputs(h=4, hk2=2, nq=6, nk=7, d1=8, d2=4, requires_grad=True)
    streamkl.attn_kl(*inputs, causal=True, reduction="sum").backward()
    assert len(checks) == 1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cu_seqlens_is_read_once_per_tensor(monkeypatch, compiled):
    """The offsets are read on the host (a device sync) the first time a cu_seqlens tensor is
    seen; the backward and later calls with the same, unchanged tensor do not read them."""
    reads = _count_calls(monkeypatch, _checks, "_read_cu_seqlens")
    torch._dynamo.reset()
    cu = torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32)
    inputs = make_inputs(h=2, nq=10, nk=10, d1=8, d2=8, dtype=torch.float64, requires_grad=True)

    def loss(*t, max_seqlen=None):
        return streamkl.attn_kl(*t, causal=True, cu_seqlens=cu, max_seqlen=max_seqlen, reduction="sum")

    fn = torch.compile(loss, fullgraph=True) if compiled else loss
    first = fn(*inputs)
    first.backward()
    assert len(reads) == 1
    fn(*inputs).backward()
    fn(*inputs, max_seqlen=6).backward()
    assert len(reads) == 1
    cu[1] = 2  # changed in place: read again
    fn(*inputs).backward()
    assert len(reads) == 2
    with pytest.raises(ValueError, match="max_seqlen=4 is shorter than the longest sequence"):
        fn(*inputs, max_seqlen=4)


def test_cu_seqlens_made_in_inference_mode():
    """An inference tensor keeps no version counter: its offsets are read on every call."""
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    inputs = make_inputs(h=2, nq=10, nk=10, d1=8, d2=8, dtype=torch.float64)
    first = streamkl.attn_kl(*inputs, causal=True, cu_seqlens=cu)
    with torch.inference_mode():
        cu[1] = 6
        second = streamkl.attn_kl(*inputs, causal=True, cu_seqlens=cu)
    Expected(inputs, causal=True, cu_seqlens=cu).check_kl(second)
    assert not torch.equal(first, second)


def test_cu_seqlens_made_in_inference_mode_trains():
    """Offsets built under inference_mode (a data loader's) serve a training step eagerly: the op
    holds them for the backward instead of saving them (docs/contract.md, Packed sequences)."""
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    inputs = make_inputs(h=2, nq=10, nk=10, d1=8, d2=8, dtype=torch.float64, requires_grad=True)
    expected = Expected(inputs, causal=True, cu_seqlens=cu)
    kl = streamkl.attn_kl(*inputs, causal=True, cu_seqlens=cu)
    expected.check_kl(kl)
    expected.check_grads(torch.autograd.grad(kl, inputs, expected.grad), inputs)


def test_eager_path_and_registered_ops_agree():
    """The eager fast path (autograd.Function calling the backend) and the registered
    attn_kl_fwd / attn_kl_bwd ops compute the same values and gradients."""
    inputs = make_inputs(h=4, hk1=2, nq=9, nk=11, d1=8, d2=4, dtype=torch.float64, requires_grad=True)
    g = torch.randn(1, 4, 9, dtype=torch.float64)
    kl = streamkl.attn_kl(*inputs, causal=True)
    grads = torch.autograd.grad(kl, inputs, g)
    kl_op = _ops.attn_kl_fwd(*inputs, True, 1 / math.sqrt(8), 1 / math.sqrt(4))[0]
    grads_op = torch.autograd.grad(kl_op, inputs, g)
    torch.testing.assert_close(kl_op, kl, rtol=0, atol=0)
    for a, b in zip(grads_op, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _TwoLayers(torch.nn.Module):
    """Distillation of two attention layers' maps, as a training step calls the op."""

    def __init__(self, device, d):
        super().__init__()
        self.proj = torch.nn.ModuleList(torch.nn.Linear(d, d, device=device) for _ in range(2))

    def forward(self, q1, k1, q2, k2, cu_seqlens=None, max_seqlen=None):
        kw = dict(causal=True, reduction="mean", cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return sum(streamkl.attn_kl(q1, k1, p(q2), k2, **kw) for p in self.proj)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_cuda_graphs_under_reduce_overhead(varlen, dtype):
    """torch.compile(mode="reduce-overhead") captures the op in CUDA graphs: no host sync and no
    allocation breaks capture, and replays give eager's loss and gradients. auto takes triton for
    float32 and, on sm_90, the cuda forward for bfloat16."""
    torch._dynamo.reset()
    device = "cuda"
    cu = torch.tensor([0, 100, 100, 230, 256], dtype=torch.int32, device=device) if varlen else None
    model = _TwoLayers(device, 64).to(dtype)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for i in range(4):
        inputs = make_inputs(h=4, hk1=2, nq=256, nk=256, d1=64, d2=64, dtype=dtype, device=device, seed=i)
        q1, k1, q2, k2 = inputs
        q2.requires_grad_()
        kw = dict(cu_seqlens=cu, max_seqlen=130 if varlen else None)
        loss = step(q1, k1, q2, k2, **kw)
        grads = torch.autograd.grad(loss, [q2, *model.parameters()])
        loss_e = model(q1, k1, q2, k2, **kw)
        grads_e = torch.autograd.grad(loss_e, [q2, *model.parameters()])
        torch.testing.assert_close(loss, loss_e)
        for a, b in zip(grads, grads_e):
            torch.testing.assert_close(a, b)
