"""Hypothesis properties of the op on CPU (the default backend: the reference). Agreement with
the float64 oracle on random problems, for every backend, is tests/test_backends.py's."""

import math
import os

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import streamkl
from streamkl.testing import make_inputs

from .tolerance import Expected

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@st.composite
def problems(draw, dtype=None):
    hk1 = draw(st.sampled_from([1, 2]))
    hk2 = draw(st.sampled_from([1, 2]))
    h = hk1 * hk2 * draw(st.sampled_from([1, 2]))
    return dict(
        b=draw(st.integers(1, 2)),
        h=h,
        hk1=hk1,
        hk2=hk2,
        nq=draw(st.integers(1, 24)),
        nk=draw(st.integers(1, 24)),
        d1=draw(st.integers(1, 20)),
        d2=draw(st.integers(1, 20)),
        dtype=dtype or draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16])),
        layout=draw(st.sampled_from(["bhnd", "bnhd"])),
        seed=draw(st.integers(0, 2**31)),
        std=draw(st.sampled_from([0.1, 1.0, 3.0])),
    )


@given(problems(torch.float64), st.booleans())
def test_kl_is_non_negative(problem, causal):
    assert (streamkl.attn_kl(*make_inputs(**problem), causal=causal) >= -1e-12).all()


@given(problems(torch.float32), st.booleans())
def test_kl_of_a_distribution_with_itself_is_zero(problem, causal):
    problem.update(d2=problem["d1"], hk2=problem["hk1"])
    q1, k1, _, _ = make_inputs(**problem)
    assert streamkl.attn_kl(q1, k1, q1, k1, causal=causal).abs().max() <= 1e-5


@given(problems(torch.float64), st.booleans(), st.integers(1, 30))
def test_chunk_size_does_not_change_the_result(problem, causal, chunk):
    inputs = make_inputs(**problem)
    whole = streamkl.attn_kl(*inputs, causal=causal)
    os.environ["STREAMKL_REFERENCE_CHUNK"] = str(chunk)
    try:
        chunked = streamkl.attn_kl(*inputs, causal=causal)
    finally:
        del os.environ["STREAMKL_REFERENCE_CHUNK"]
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


@given(problems(torch.float64), st.booleans())
def test_uniform_student_gives_log_n_minus_entropy(problem, causal):
    """q2 = 0 makes P2 uniform over the n visible keys: KL = log n - H(P1)."""
    q1, k1, q2, k2 = make_inputs(**problem)
    kl = streamkl.attn_kl(q1, k1, torch.zeros_like(q2), k2, causal=causal)
    nq, nk = q1.shape[2], k1.shape[2]
    visible = torch.arange(nq)[:, None] + (nk - nq) >= torch.arange(nk)[None, :]
    if not causal:
        visible = torch.ones_like(visible)
    s1 = q1 @ k1.repeat_interleave(q1.shape[1] // k1.shape[1], 1).transpose(-1, -2)
    s1 = (s1 / math.sqrt(q1.shape[-1])).masked_fill(~visible, -math.inf)
    logp1 = torch.log_softmax(s1, -1)
    entropy = -(logp1.exp() * logp1.masked_fill(~visible, 0)).sum(-1)
    n = visible.sum(-1).double()
    expected = torch.where(n > 0, n.clamp_min(1).log() - entropy, 0.0)
    torch.testing.assert_close(kl, expected.nan_to_num(0.0), rtol=1e-9, atol=1e-9)


# A near one-hot row at |S| ~ 1e3, where a forward that took log P as S - LSE in one step (rounded
# at |LSE|) gave a KL whose error put the teacher's gradient past its bound.
ONE_HOT_AT_1E3 = dict(b=1, h=2, hk1=2, hk2=1, nq=7, nk=8, d1=8, d2=9, dtype=torch.float32, layout="bnhd",
                      seed=2_147_483_647, std=0.1)  # fmt: skip


@given(problems(torch.float32), st.booleans(), st.sampled_from([1e2, 1e3, 1e4]))
@example(ONE_HOT_AT_1E3, False, 1e3)
def test_no_nan_at_extreme_logits(problem, causal, magnitude):
    """Logits up to `magnitude` (scale chosen so the largest |S| reaches it): finite KL and
    gradients, and still the oracle's value."""
    inputs = make_inputs(**problem, requires_grad=True)
    q1, k1, q2, k2 = inputs
    s1 = magnitude / (q1 @ k1.repeat_interleave(q1.shape[1] // k1.shape[1], 1).mT).abs().amax()
    s2 = magnitude / (q2 @ k2.repeat_interleave(q2.shape[1] // k2.shape[1], 1).mT).abs().amax()
    s1, s2 = s1.item(), s2.item()
    kl = streamkl.attn_kl(*inputs, causal=causal, scale1=s1, scale2=s2)
    assert torch.isfinite(kl).all()
    expected = Expected(inputs, causal=causal, scale1=s1, scale2=s2, grad=torch.ones(kl.shape))
    expected.check_kl(kl)
    kl.sum().backward()
    expected.check_grads([t.grad for t in inputs], inputs)


@st.composite
def dense_metadata(draw):
    """Shapes and dtypes of the four inputs: a valid call, then often one size, rank or dtype
    changed, so both sides of every rule come up."""
    hk1, hk2 = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    h = hk1 * hk2 * draw(st.sampled_from([1, 2]))
    b, nq, nk = (draw(st.integers(0, 3)) for _ in range(3))
    d1, d2 = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    shapes = [[b, h, nq, d1], [b, hk1, nk, d1], [b, h, nq, d2], [b, hk2, nk, d2]]
    pair = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    dtype1, dtype2 = draw(st.sampled_from(pair)), draw(st.sampled_from(pair))
    dtypes = [dtype1, dtype1, dtype2, dtype2]
    change = draw(st.sampled_from(["none", "size", "rank", "dtype"]))
    which = draw(st.integers(0, 3))
    if change == "size":
        dim = draw(st.integers(0, 3))
        shapes[which][dim] = draw(st.integers(0, 5))
    elif change == "rank":
        shapes[which] = shapes[which][: draw(st.sampled_from([2, 3]))] or [1]
        if draw(st.booleans()):
            shapes[which] = [*shapes[which], 1, 1]
    elif change == "dtype":
        dtypes[which] = draw(st.sampled_from([*pair, torch.int32]))
    return shapes, dtypes


@given(dense_metadata())
def test_one_pass_check_agrees_with_the_rule_by_rule_walk(metadata):
    """The one-pass check of a dense call accepts exactly what every rule accepts, with the same
    sizes; where a rule is broken it defers, and the walk names it."""
    from streamkl import _checks

    shapes, dtypes = metadata
    tensors = [torch.empty(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes)]
    fast = _checks._valid_dense(*tensors)
    try:
        walked = _checks._check_each_rule(*tensors, None, None)
    except (TypeError, ValueError):
        assert fast is None
    else:
        assert fast == walked
