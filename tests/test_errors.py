"""Every invalid call raises ValueError/TypeError naming the argument or the environment
variable, before any kernel runs (docs/contract.md, Errors): the reference is never reached."""

import pytest
import torch

import streamkl
from streamkl.testing import make_inputs


@pytest.fixture
def no_backend_runs(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a backend ran on invalid input")

    import streamkl.reference.attn_kl as chunked

    monkeypatch.setattr(chunked, "_forward_dense_rows", boom)


def _inputs(**kw):
    base = dict(b=2, h=4, nq=6, nk=5, d1=8, d2=4, hk1=2, hk2=1)
    base.update(kw)
    return list(make_inputs(**base))


def _replace(inputs, index, tensor):
    inputs = list(inputs)
    inputs[index] = tensor
    return inputs


CASES = {
    "q1 not 4-D": (lambda x: _replace(x, 0, x[0][0]), {}, ValueError, "q1 must be 4-D"),
    "k2 not a tensor": (lambda x: _replace(x, 3, [1.0]), {}, TypeError, "k2 must be a torch.Tensor"),
    "int dtype": (lambda x: _replace(x, 1, x[1].to(torch.int32)), {}, TypeError, "k1 has dtype"),
    "pair dtype": (lambda x: _replace(x, 2, x[2].double()), {}, TypeError, "q2 and k2 must share a dtype"),
    "head dim": (
        lambda x: _replace(x, 1, torch.randn(2, 2, 5, 7)),
        {},
        ValueError,
        "q1 and k1 must share the head dim",
    ),
    "batch": (lambda x: _replace(x, 3, torch.randn(3, 1, 5, 4)), {}, ValueError, "k2 has batch 3"),
    "query heads": (
        lambda x: _replace(x, 2, torch.randn(2, 2, 6, 4)),
        {},
        ValueError,
        r"q2 must have \(B, H, Nq\)",
    ),
    "query length": (
        lambda x: _replace(x, 2, torch.randn(2, 4, 7, 4)),
        {},
        ValueError,
        r"q2 must have \(B, H, Nq\)",
    ),
    "key length": (lambda x: _replace(x, 3, torch.randn(2, 1, 9, 4)), {}, ValueError, "k2 has 9 keys"),
    "gqa divisibility": (lambda x: _replace(x, 1, torch.randn(2, 3, 5, 8)), {}, ValueError, "k1 has 3 heads"),
    "reduction": (lambda x: x, dict(reduction="avg"), ValueError, "reduction must be one of"),
    "scale type": (lambda x: x, dict(scale1="big"), TypeError, "scale1 must be a float"),
    "scale finite": (lambda x: x, dict(scale2=float("nan")), ValueError, "scale2 must be finite"),
    "max_seqlen alone": (lambda x: x, dict(max_seqlen=4), ValueError, "max_seqlen is only"),
    "backend name": (lambda x: x, dict(backend="fastest"), ValueError, "backend='fastest'"),
    "backend type": (lambda x: x, dict(backend=3), TypeError, "backend must be a str"),
    "causal string": (lambda x: x, dict(causal="yes"), TypeError, "causal must be a bool"),
    "causal int": (lambda x: x, dict(causal=1), TypeError, "causal must be a bool"),
    "scale bool": (lambda x: x, dict(scale1=True), TypeError, "scale1 must be a float"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named(case, no_backend_runs):
    edit, kwargs, exc, message = CASES[case]
    with pytest.raises(exc, match=message):
        streamkl.attn_kl(*edit(_inputs()), **kwargs)


def test_mixed_devices(no_backend_runs):
    inputs = _inputs()
    inputs[1] = inputs[1].to("meta")
    with pytest.raises(ValueError, match="must be on one device"):
        streamkl.attn_kl(*inputs)


def _packed(total=10):
    return _inputs(b=1, nq=total, nk=total)


VARLEN_CASES = {
    "not int32": (torch.tensor([0, 4, 10]), {}, TypeError, "cu_seqlens must be int32"),
    "not 1-D": (torch.tensor([[0, 10]], dtype=torch.int32), {}, ValueError, "cu_seqlens must be 1-D"),
    "too short": (torch.tensor([0], dtype=torch.int32), {}, ValueError, "at least 2 entries"),
    "not starting at 0": (torch.tensor([1, 4, 10], dtype=torch.int32), {}, ValueError, "must start at 0"),
    "decreasing": (torch.tensor([0, 6, 4, 10], dtype=torch.int32), {}, ValueError, "non-decreasing"),
    "short of the total": (
        torch.tensor([0, 4, 8], dtype=torch.int32),
        {},
        ValueError,
        "must end at the total length 10",
    ),
    "past the total": (
        torch.tensor([0, 4, 12], dtype=torch.int32),
        {},
        ValueError,
        "must end at the total length 10",
    ),
    "max_seqlen too small": (
        torch.tensor([0, 4, 10], dtype=torch.int32),
        dict(max_seqlen=5),
        ValueError,
        "max_seqlen=5 is shorter",
    ),
    "max_seqlen type": (
        torch.tensor([0, 4, 10], dtype=torch.int32),
        dict(max_seqlen=-1),
        ValueError,
        "max_seqlen must be a non-negative int",
    ),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_bad_cu_seqlens_is_named(case, no_backend_runs):
    cu_seqlens, kwargs, exc, message = VARLEN_CASES[case]
    with pytest.raises(exc, match=message):
        streamkl.attn_kl(*_packed(), cu_seqlens=cu_seqlens, **kwargs)


def test_packed_needs_batch_one(no_backend_runs):
    with pytest.raises(ValueError, match="need batch 1"):
        streamkl.attn_kl(*_inputs(nq=5), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))


def test_packed_needs_equal_lengths(no_backend_runs):
    with pytest.raises(ValueError, match="Nq must equal Nk"):
        streamkl.attn_kl(*_inputs(b=1), cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


def test_unknown_env_backend(monkeypatch, no_backend_runs):
    monkeypatch.setenv("STREAMKL_BACKEND", "gpu")
    with pytest.raises(ValueError, match="STREAMKL_BACKEND='gpu'.*auto, cuda, triton, reference"):
        streamkl.attn_kl(*_inputs())


def test_non_finite_inputs_give_non_finite_rows_not_a_crash():
    q1, k1, q2, k2 = _inputs()
    q1[0, 0, 2] = float("nan")
    k2[1, 0, 3] = float("inf")
    out = streamkl.attn_kl(q1, k1, q2, k2)
    assert not torch.isfinite(out[0, 0, 2])
    assert torch.isfinite(out[0, 1:]).all()


ENV_CASES = {
    "STREAMKL_BACKEND": ("fastest", "STREAMKL_BACKEND='fastest' is not a backend"),
    "STREAMKL_REFERENCE_CHUNK": ("abc", "STREAMKL_REFERENCE_CHUNK must be a positive integer"),
    "STREAMKL_TRITON_BWD": ("bogus", "STREAMKL_TRITON_BWD must be auto, fused or separate"),
    "STREAMKL_TRITON_SPLIT_K": ("-2", "STREAMKL_TRITON_SPLIT_K must be auto, off or a positive"),
}


@pytest.mark.parametrize("variable", list(ENV_CASES))
def test_bad_environment_is_named_whatever_backend_runs(monkeypatch, no_backend_runs, variable):
    """A bad value fails the call even when the backend that runs never reads the variable."""
    value, message = ENV_CASES[variable]
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        streamkl.attn_kl(*_inputs(), backend=None if variable == "STREAMKL_BACKEND" else "reference")


def test_the_registered_op_validates_too(no_backend_runs):
    inputs = _inputs()
    with pytest.raises(ValueError, match="q1 must be 4-D"):
        torch.ops.streamkl.attn_kl(inputs[0][0], *inputs[1:])
    with pytest.raises(ValueError, match="k2 has 9 keys"):
        torch.ops.streamkl.attn_kl_fwd(*_replace(inputs, 3, torch.randn(2, 1, 9, 4)), False, 1.0, 1.0)
