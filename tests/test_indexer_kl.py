"""streamkl.indexer_kl (docs/indexer.md): the oracle against Megatron's formula, the reference
backend against the oracle by the rule of tests/tolerance.py (dense and sparse, causal and not,
MQA/GQA/MHA teachers, lse given or computed, packed sequences, float64/float32/bfloat16),
gradcheck, properties, the op's registration (opcheck, torch.compile) and its named errors.

The behaviour every backend shares (packed sequences, rows that see no key, empty problems,
reductions and the fused training step, extreme logits, repeated indices, the protocol's
contract) runs on each `target`: the reference on CPU, triton under its interpreter on CPU in
float32 (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), and both on CUDA with the
`gpu` marker. tests/test_triton_indexer.py holds triton's own grid."""

from __future__ import annotations

import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import streamkl
from streamkl import _checks, _dispatch
from streamkl._spec import IndexerKLInputs
from streamkl.reference import indexer_kl as reference
from streamkl.testing import cpu_peak_bytes

from .indexer_oracle import (
    MEGATRON_EPS,
    Expected,
    admitted_mask,
    dense_indexer_kl,
    make_indexer_inputs,
    megatron_indexer_kl,
    random_topk,
)
from .tolerance import FLOOR, RATIO, _with_rms

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEACHERS = {"mqa": 1, "gqa": 2, "mha": 4}  # key heads of a 4-head teacher


def _targets():
    """(backend, device) pairs that run indexer_kl here, probed through the backends' supports:
    triton on CPU only under the interpreter (float32), anything on CUDA with the gpu marker."""
    out = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device, name in itertools.product(devices, _dispatch.BACKENDS):
        q, k, qi, ki, w = make_indexer_inputs(h=2, nq=4, nk=4, device=device)
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=None)
        if _dispatch.why_not(name, "indexer_kl", spec, IndexerKLInputs(q, k, qi, ki, w)) is None:
            marks = [pytest.mark.gpu] if device == "cuda" else []
            out.append(pytest.param((name, device), id=f"{name}-{device}", marks=marks))
    return out


@pytest.fixture(params=_targets())
def target(request):
    return request.param


def _on(target, inputs):
    """Inputs on the target's device; float64 as float32 where the backend does not run it."""
    name, device = target
    narrow = name != "reference"
    return tuple(
        t.to(device=device, dtype=torch.float32 if narrow and t.dtype == torch.float64 else t.dtype)
        for t in inputs
    )


def _run(inputs, needs=(True, True, True), grad=None, backend="reference", **call):
    """KL per row through the public op and the requested student gradients."""
    q, k, qi, ki, w = inputs
    leaves = [t.detach().requires_grad_(need) for t, need in zip((qi, ki, w), needs)]
    kl = streamkl.indexer_kl(q, k, *leaves, reduction="none", backend=backend, **call)
    assert kl.is_contiguous() and kl.shape == (q.shape[0], q.shape[2])
    if not any(needs):
        return kl, (None,) * 3
    g = grad if grad is not None else torch.randn(kl.shape, generator=torch.Generator().manual_seed(7))
    wanted = [t for t, need in zip(leaves, needs) if need]
    got = iter(torch.autograd.grad(kl, wanted, g.to(device=kl.device, dtype=kl.dtype)))
    return kl, tuple(next(got) if need else None for need in needs)


def _check(inputs, needs=(True, True, True), backend="reference", **call):
    kl, grads = _run(inputs, needs, backend=backend, **call)
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(7)).to(kl.dtype).double()
    expected = Expected(inputs, grad=g, **call)
    expected.check_kl(kl)
    expected.check_grads(grads, inputs, needs)
    return kl, grads


def _given_lse(inputs, dtype, **call):
    """The teacher's per-head LSE over the admitted keys, as an attention forward returns it."""
    q, k, qi, ki, w = (t.detach().cpu() for t in inputs)
    call = {key: v.cpu() if isinstance(v, torch.Tensor) else v for key, v in call.items()}
    lse = dense_indexer_kl(q, k, qi, ki, w, **call)[1]
    return lse.to(device=inputs[0].device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)


def _check_step(inputs, reduction, backend, **call):
    """The fused training step (reduction "sum"/"mean" with gradients needed) through the public
    op against the oracle: the loss, and the gradients of the loss by the rule (the oracle's with
    every row's upstream gradient 1, or 1 / the rows that see a key)."""
    q, k, qi, ki, w = inputs
    leaves = [t.detach().requires_grad_() for t in (qi, ki, w)]
    loss = streamkl.indexer_kl(q, k, *leaves, reduction=reduction, backend=backend, **call)
    grads = torch.autograd.grad(loss, leaves)
    b, nq = q.shape[0], q.shape[2]
    seen = admitted_mask(b, nq, k.shape[2], call.get("causal", True), _cpu(call.get("topk")),
                         _cpu(call.get("cu_seqlens"))).any(-1)  # fmt: skip
    weight = 1.0 if reduction == "sum" else 1.0 / max(int(seen.sum()), 1)
    expected = Expected(inputs, grad=torch.full((b, nq), weight, dtype=torch.float64), **call)
    # the loss is a sum of rows: its bar is the sum of the rows' bars
    row_bars = RATIO * _with_rms(expected.dense_kl_err)
    row_bars = row_bars + FLOOR * expected.eps * (1.0 + expected.magnitude) * expected.spread
    err = abs(loss.item() - expected.kl.sum().item() * weight)
    assert err <= row_bars.sum().item() * weight + 1e-12, (err, row_bars.sum().item() * weight)
    expected.check_grads(grads, inputs)
    return loss, grads


def _cpu(t):
    return None if t is None else t.cpu()


# --- the oracle -------------------------------------------------------------------------------


@pytest.mark.parametrize("teacher", ["mqa", "mha"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_oracle_is_megatrons_formula_without_its_epsilon(teacher, sparse):
    """Megatron's reference adds eps = 1e-10 inside both logarithms; with t the target and i the
    student's softmax its KL is the oracle's plus sum_j t_j log(1 + eps/t_j) - t_j log(1 + eps/i_j),
    which the test computes apart: the two agree to float64 rounding once that is accounted for."""
    q, k, qi, ki, w = make_indexer_inputs(b=2, h=4, hk=TEACHERS[teacher], nq=16, nk=16, dtype=torch.float64,
                                          seed=11, std=1.5)  # fmt: skip
    topk = None
    if sparse:  # every row's set holds key 0, as a causal indexer's top-k does: no row is empty
        topk = random_topk(2, 16, 16, 6, seed=3, pad=0.0)
        topk[..., 0] = 0
    scale = 0.3
    exact = dense_indexer_kl(q, k, qi, ki, w, topk=topk, scale=scale)[0]
    megatron, t, i = megatron_indexer_kl(q, k, qi, ki, w, topk=topk, scale=scale)
    effect = torch.where(t > 0, t * (torch.log1p(MEGATRON_EPS / t) - torch.log1p(MEGATRON_EPS / i)), 0.0)
    effect = effect.sum(-1)
    assert effect.abs().max() > 0
    torch.testing.assert_close(megatron - exact, effect, rtol=0, atol=1e-14)
    torch.testing.assert_close(megatron, exact, rtol=0, atol=effect.abs().max().item() + 1e-14)


# --- the reference backend against the oracle ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize("teacher", list(TEACHERS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_reference_matches_the_oracle(sparse, causal, teacher, lse, dtype):
    """KL and all three gradients, Sq != Sk, odd sizes; MQA passes 3-D keys, GQA (B, S, H, D)
    storage, MHA Megatron's [S, B, H, D] storage."""
    layout = {"mqa": "bhnd", "gqa": "bnhd", "mha": "sbhd"}[teacher]
    inputs = make_indexer_inputs(b=2, h=4, hk=TEACHERS[teacher], g=3, nq=11, nk=13, d=12, di=6, dtype=dtype,
                                 layout=layout, seed=len(teacher) + 2 * sparse + causal)  # fmt: skip
    if teacher == "mqa":
        inputs = (inputs[0], inputs[1][:, 0], inputs[2], inputs[3][:, 0], inputs[4])
    call = dict(causal=causal, topk=random_topk(2, 11, 13, 5, seed=4) if sparse else None)
    if lse:
        call["lse"] = _given_lse(inputs, dtype, **call)
    _check(inputs, **call)


def test_the_rule_scales_a_real_dense_error():
    """The rule's reference error is real: dense float32 differs from float64, so a result as
    accurate as the oracle rounded to float32 passes and one 100x worse than dense float32 fails."""
    inputs = make_indexer_inputs(b=1, h=4, nq=16, nk=16, dtype=torch.float32, seed=3)
    expected = Expected(inputs, causal=False)
    assert expected.dense_kl_err.max() > 0
    expected.check_kl(expected.kl.float())
    worse = expected.kl + 100 * (expected.dense_kl_err.max() + 1e-5) * (1 + expected.magnitude)
    with pytest.raises(AssertionError, match="worst row"):
        expected.check_kl(worse)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_sequences(target, causal, sparse):
    """A row sees only its own sequence's keys (empty and one-token sequences included); topk
    holds positions on the packed axis, and entries in another sequence are not admitted."""
    device = target[1]
    cu = torch.tensor([0, 5, 5, 12, 13, 20], dtype=torch.int32, device=device)
    inputs = make_indexer_inputs(b=1, h=4, hk=2, nq=20, nk=20, dtype=torch.float32, layout="bnhd", seed=5,
                                 device=device)  # fmt: skip
    topk = random_topk(1, 20, 20, 8, seed=6).to(device) if sparse else None
    for max_seqlen in (None, 9):
        _check(inputs, backend=target[0], causal=causal, topk=topk, cu_seqlens=cu, max_seqlen=max_seqlen)


def test_backend_functions_keep_their_contract(target):
    """The module is the protocol (streamkl/_backend.py): (kl, lse, lse2, mass) float32, fresh and
    contiguous, against the oracle's statistics; rows that see no key: kl 0, lse2 -inf, mass 0;
    unneeded gradients None, needed ones in their input's shape and dtype, contiguous;
    forward_with_grads: the same statistics, and the gradients of the sum of the rows (dki in
    float32)."""
    name, device = target
    impl = _dispatch.implementation(name, "indexer_kl")
    assert impl.op == "indexer_kl" and impl.backward_backend is None
    assert name != "reference" or impl is reference
    dtype = torch.float32 if name == "triton" and device == "cpu" else torch.bfloat16
    q, k, qi, ki, w = inputs = make_indexer_inputs(b=2, h=4, hk=1, nq=10, nk=6, dtype=dtype, device=device,
                                                   w_dtype=torch.float32, layout="bnhd")  # fmt: skip
    topk = random_topk(2, 10, 6, 4, seed=1).to(device)
    for lse in (None, _given_lse(inputs, torch.bfloat16, topk=topk)):
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=lse, topk=topk, causal=True, scale=0.25)
        call_inputs = IndexerKLInputs(q, k, qi, ki, w, lse, topk)
        assert impl.supports(spec, call_inputs) is None and impl.auto_declines(spec, call_inputs) is None
        stats = impl.forward(spec, call_inputs)
        for t, shape in zip(stats, [(2, 10), (2, 4, 10), (2, 10), (2, 10)]):
            assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
            assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for x in inputs)
        assert (stats.kl[:, :4] == 0).all() and torch.isneginf(stats.lse2[:, :4]).all()
        Expected(inputs, lse=lse, topk=topk, causal=True, scale=0.25).check_stats(stats)
        needs = spec.with_needs((False, True, True))
        grads = impl.backward(needs, call_inputs, stats, torch.ones(2, 10, device=device))
        assert grads[0] is None
        for got, t in zip(grads[1:], (ki, w)):
            assert got.shape == t.shape and got.dtype == t.dtype and got.is_contiguous()
        fused_stats, fused = impl.forward_with_grads(needs, call_inputs, "sum")
        for a, b in zip(fused_stats, stats):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert fused.dqi is None and fused.dki.dtype == torch.float32 and fused.dw.dtype == w.dtype
        torch.testing.assert_close(fused.dki.to(ki.dtype), grads.dki, rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(fused.dw, grads.dw, rtol=2e-2, atol=1e-3)


def test_rows_that_see_no_key(target):
    """Causal with Sq > Sk (the first rows see nothing), a row whose topk is all padding, and a
    row whose topk holds only keys the causal mask hides: exactly 0, zero gradient rows, no NaN;
    mean divides by the rows that see a key, and so does the fused step's gradient."""
    name, device = target
    q, k, qi, ki, w = inputs = make_indexer_inputs(b=1, h=2, nq=9, nk=6, dtype=torch.float32, seed=2,
                                                   device=device)  # fmt: skip
    topk = random_topk(1, 9, 6, 3, seed=2, pad=0.0)
    topk[0, 5] = -1  # row 5 sees keys 0..2, but its set is empty
    topk[0, 6] = torch.tensor([4, 5, -1])  # row 6 sees keys 0..3: its set is hidden
    for sparse in (False, True):
        call = dict(causal=True, topk=topk.to(device) if sparse else None)
        kl, (dqi, dki, dw) = _check(inputs, backend=name, **call)
        empty = ~admitted_mask(1, 9, 6, True, topk if sparse else None).any(-1)[0].to(device)
        assert empty[:3].all() and empty[5:7].all() == sparse and not empty[7:].any()
        assert (kl[0, empty] == 0).all() and (kl[0, ~empty] >= 0).all()
        assert (dqi[0, :, empty] == 0).all() and (dw[0, :, empty] == 0).all()
        mean, (dqi, _, dw) = _check_step(inputs, "mean", name, **call)
        torch.testing.assert_close(mean, kl.sum() / (~empty).sum())
        assert (dqi[0, :, empty] == 0).all() and (dw[0, :, empty] == 0).all()


@pytest.mark.parametrize("shape", [(0, 5, 4), (1, 0, 4), (1, 5, 0)], ids=["B=0", "Sq=0", "Sk=0"])
def test_empty_problems(target, shape):
    """B = 0 or Sq = 0: empty results; Sk = 0: every row sees nothing (KL 0, zero gradients), in
    the recompute backward and in the fused step."""
    name, device = target
    b, nq, nk = shape
    inputs = make_indexer_inputs(b=b, h=2, nq=nq, nk=nk, dtype=torch.float32, device=device)
    for topk in (None, random_topk(b, nq, nk, 3, seed=0).to(device)):
        kl, grads = _run(inputs, causal=False, topk=topk, backend=name)
        assert kl.shape == (b, nq) and (kl == 0).all()
        for g, t in zip(grads, inputs[2:]):
            assert g.shape == t.shape and (g == 0).all()
        leaves = [t.detach().requires_grad_() for t in inputs[2:]]
        loss = streamkl.indexer_kl(*inputs[:2], *leaves, topk=topk, backend=name)
        assert loss.item() == 0.0
        assert all(
            g.shape == t.shape and (g == 0).all() for g, t in zip(torch.autograd.grad(loss, leaves), leaves)
        )


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reductions(target, reduction):
    """sum: over all rows; mean: over the rows that see a key. Their gradients (the fused step's)
    are those of the per-row KL (the recompute backward's) weighted alike."""
    name, device = target
    q, k, qi, ki, w = make_indexer_inputs(b=2, h=2, nq=9, nk=6, seed=4, requires_grad=True, device=device)
    rows = streamkl.indexer_kl(q, k, qi, ki, w, causal=True, reduction="none", backend=name)
    out = streamkl.indexer_kl(q, k, qi, ki, w, causal=True, reduction=reduction, backend=name)
    assert out.shape == () and out.dtype == rows.dtype
    seen = 2 * 6  # causal with Sq > Sk: 3 rows of each batch see nothing
    expected = rows.sum() if reduction == "sum" else rows.sum() / seen
    torch.testing.assert_close(out, expected)
    for got, want in zip(torch.autograd.grad(out, (qi, ki, w)), torch.autograd.grad(expected, (qi, ki, w))):
        torch.testing.assert_close(got, want)


def test_extreme_logits(target):
    """Teacher logits ~1e3 and index scores ~1e2: one-hot rows, nothing non-finite, within the rule."""
    name, device = target
    inputs = make_indexer_inputs(b=1, h=4, hk=1, nq=16, nk=20, dtype=torch.float32, seed=9, std=12.0,
                                 device=device)  # fmt: skip
    _check(inputs, backend=name, causal=True, topk=random_topk(1, 16, 20, 6, seed=9).to(device))
    _check(inputs, backend=name, causal=True, scale=1.0)


@pytest.mark.parametrize(
    "case",
    [
        "dense-lse-computed", "sparse-lse-given", "dense-lse-over-other-keys", "sparse-dense-lse",
        "dense-lse-slightly-off", "dense-lse-one-row-off",
    ],
)  # fmt: skip
def test_training_step_matches_the_oracle(target, case):
    """The fused step (reduction "mean" with gradients): with the lse computed or given over the
    admitted keys (T = 1), and with a given lse over other keys (T != 1: the dense LSE in sparse
    mode, a shifted LSE, one shifted by 1e-3 everywhere, one row's alone, which leaves the
    other row of a two-row program right), which the step corrects for."""
    name, device = target
    inputs = make_indexer_inputs(b=2, h=4, hk=2, g=3, nq=11, nk=13, d=12, di=6, seed=21, layout="bnhd",
                                 device=device)  # fmt: skip
    sparse = case.startswith("sparse")
    call = dict(causal=True, topk=random_topk(2, 11, 13, 5, seed=21).to(device) if sparse else None)
    if case == "sparse-lse-given":
        call["lse"] = _given_lse(inputs, torch.float32, **call)
    elif case == "dense-lse-over-other-keys":
        call["lse"] = _given_lse(inputs, torch.float32, **call) + 0.3
    elif case == "sparse-dense-lse":
        call["lse"] = _given_lse(inputs, torch.float32, causal=True)
    elif case == "dense-lse-slightly-off":
        call["lse"] = _given_lse(inputs, torch.float32, **call) + 1e-3
    elif case == "dense-lse-one-row-off":
        call["lse"] = _given_lse(inputs, torch.float32, **call)
        call["lse"][1, :, 6] += 0.5
    _check_step(inputs, "mean", name, **call)


def test_float16_step_keeps_a_means_gradients_for_the_loss_scale(target):
    """float16 with a loss scale (GradScaler's 65536) over many rows: the fused step's mean
    gradients, 1 / rows of each row's, are held wider than float16 until the scale brings them
    back, so the scaled gradients match float64's to float16's rounding, not its subnormals."""
    name, device = target
    if name == "triton" and device == "cpu":
        pytest.skip("the interpreter runs float16 tl.dot too slowly at these rows")
    rows = 2048  # with w ~ 0.01, a row's mean gradient sits in float16's subnormals (~1e-6)
    q, k, qi, ki, w = make_indexer_inputs(b=1, h=2, hk=1, g=2, nq=rows, nk=rows, d=8, di=4, seed=9,
                                          dtype=torch.float16, device=device)  # fmt: skip
    w = w * 0.01
    leaves = [t.detach().requires_grad_() for t in (qi, ki, w)]
    (streamkl.indexer_kl(q, k, *leaves, backend=name) * 65536.0).backward()
    wide = [t.detach().double().requires_grad_() for t in (qi, ki, w)]
    (streamkl.indexer_kl(q.double(), k.double(), *wide, backend="reference") * 65536.0).backward()
    for got, want in zip(leaves, wide):
        err = (got.grad.double() - want.grad).norm() / want.grad.norm()
        assert err < 1e-2, err


def test_mixed_dtypes():
    """Teacher and indexer in different dtypes, w in its own: the result is float32."""
    q, k, _, _, _ = make_indexer_inputs(h=2, nq=9, nk=11, dtype=torch.bfloat16, seed=6)
    _, _, qi, ki, w = make_indexer_inputs(
        h=2, nq=9, nk=11, dtype=torch.float32, w_dtype=torch.bfloat16, seed=6
    )
    kl, _ = _check((q, k, qi, ki, w), causal=True)
    assert kl.dtype == torch.float32


# --- gradients, semantics ------------------------------------------------------------------------


@pytest.mark.parametrize("lse", [False, True], ids=["lse-computed", "lse-given"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gradcheck_float64(sparse, lse):
    q, k, qi, ki, w = make_indexer_inputs(b=2, h=4, hk=2, g=2, nq=6, nk=7, d=5, di=4, dtype=torch.float64,
                                          seed=13, requires_grad=True)  # fmt: skip
    call = dict(causal=True, topk=random_topk(2, 6, 7, 4, seed=13) if sparse else None)
    if lse:
        call["lse"] = _given_lse((q, k, qi, ki, w), torch.float64, **call) + 0.1  # mass T != 1

    def loss(a, b, c):
        return streamkl.indexer_kl(q, k, a, b, c, reduction="none", **call)

    assert torch.autograd.gradcheck(loss, (qi, ki, w))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_gradcheck_of_the_training_step(reduction):
    """The fused step's gradients (formed in the forward, scaled in the backward) by gradcheck,
    with a given lse that leaves T != 1."""
    q, k, qi, ki, w = make_indexer_inputs(b=2, h=4, hk=2, g=2, nq=6, nk=7, d=5, di=4, dtype=torch.float64,
                                          seed=17, requires_grad=True)  # fmt: skip
    call = dict(causal=True, topk=random_topk(2, 6, 7, 4, seed=17))
    call["lse"] = _given_lse((q, k, qi, ki, w), torch.float64, **call) - 0.2

    def loss(a, b, c):
        return streamkl.indexer_kl(q, k, a, b, c, reduction=reduction, **call)

    assert torch.autograd.gradcheck(loss, (qi, ki, w))


def test_the_step_hands_its_gradients_on_without_a_copy(monkeypatch):
    """An eager training step's gradients are the tensors the backend formed, scaled in place: qi's
    gradient is dqi's own storage, so a step holds one qi-sized gradient, not two."""
    formed = {}
    real = reference.forward_with_grads

    def recording(spec, inputs, reduction):
        stats, grads = real(spec, inputs, reduction)
        formed["dqi"] = grads[0].data_ptr()
        return stats, grads

    monkeypatch.setattr(reference, "forward_with_grads", recording)
    q, k, qi, ki, w = make_indexer_inputs(b=1, h=4, g=3, nq=9, nk=9, d=8, di=4, seed=3)
    qi.requires_grad_(), ki.requires_grad_(), w.requires_grad_()
    (2.5 * streamkl.indexer_kl(q, k, qi, ki, w, backend="reference")).backward()
    assert qi.grad.data_ptr() == formed["dqi"]
    expected = torch.autograd.grad(2.5 * streamkl.indexer_kl(q, k, qi, ki, w, reduction="none").mean(), qi)[0]
    torch.testing.assert_close(qi.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_second_backward_through_the_step_recomputes(reduction):
    """retain_graph=True: the first backward hands the formed gradients on; a second one through
    the same graph, with another upstream gradient, recomputes them (the unfused backward) and
    agrees with a fresh step's."""
    q, k, qi, ki, w = make_indexer_inputs(b=2, h=4, hk=2, g=3, nq=7, nk=9, d=8, di=4, dtype=torch.float64,
                                          seed=5)  # fmt: skip
    call = dict(causal=True, topk=random_topk(2, 7, 9, 4, seed=5))
    leaves = [t.requires_grad_() for t in (qi, ki, w)]
    loss = streamkl.indexer_kl(q, k, *leaves, reduction=reduction, **call)
    first = torch.autograd.grad(loss, leaves, torch.tensor(1.5, dtype=loss.dtype), retain_graph=True)
    second = torch.autograd.grad(loss, leaves, torch.tensor(-3.0, dtype=loss.dtype))
    fresh = torch.autograd.grad(streamkl.indexer_kl(q, k, *leaves, reduction=reduction, **call), leaves)
    for a, b, c in zip(first, second, fresh):
        torch.testing.assert_close(a, 1.5 * c, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(b, -3.0 * c, rtol=1e-10, atol=1e-13)


def test_the_teacher_gets_no_gradient():
    q, k, qi, ki, w = make_indexer_inputs(h=2, nq=5, nk=5, requires_grad=True)
    q.requires_grad_(), k.requires_grad_()
    streamkl.indexer_kl(q, k, qi, ki, w).backward()
    assert q.grad is None and k.grad is None
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (qi, ki, w))


def test_dense_lse_in_sparse_mode_weights_heads_by_their_mass():
    """docs/indexer.md, Sparse mode: a dense LSE makes the target sum_h m_h softmax_h^S / sum_h m_h
    with m_h head h's dense probability mass inside S_t, not the mean of the renormalized heads."""
    q, k, qi, ki, w = inputs = make_indexer_inputs(b=1, h=4, hk=4, nq=8, nk=8, dtype=torch.float64, seed=3)
    topk = random_topk(1, 8, 8, 3, seed=3, pad=0.0)
    dense_lse = _given_lse(inputs, torch.float64, causal=True)
    got = streamkl.indexer_kl(*inputs, lse=dense_lse, topk=topk, reduction="none")
    adm = admitted_mask(1, 8, 8, True, topk)
    s = (q @ k.mT / math.sqrt(q.shape[-1])).masked_fill(~adm[:, None], -math.inf)
    mass = (s - dense_lse[..., None]).exp().sum(-1, keepdim=True)  # (B, H, Sq, 1)
    target = (mass * s.softmax(-1)).sum(1) / mass.sum(1)
    scores = torch.einsum("bgr,bgrj->brj", w, (qi @ ki.mT).relu()).masked_fill(~adm, -math.inf)
    expected = torch.where(adm, torch.xlogy(target, target) - target * scores.log_softmax(-1), 0.0).sum(-1)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    renormalized = streamkl.indexer_kl(*inputs, topk=topk, reduction="none")
    assert (got - renormalized).abs().max() > 1e-3


def test_a_repeated_index_counts_once(target):
    """S_t is a set: repeating an index changes nothing."""
    name, device = target
    inputs = _on(target, make_indexer_inputs(h=2, nq=6, nk=6, dtype=torch.float64, seed=8))
    topk = random_topk(1, 6, 6, 3, seed=8, pad=0.0).to(device)
    repeated = torch.cat([topk, topk[..., :2]], -1)
    once = streamkl.indexer_kl(*inputs, topk=topk, reduction="none", backend=name)
    torch.testing.assert_close(
        streamkl.indexer_kl(*inputs, topk=repeated, reduction="none", backend=name), once
    )


def test_chunk_size_does_not_change_the_result(monkeypatch):
    inputs = make_indexer_inputs(
        b=2, h=4, hk=1, nq=13, nk=17, dtype=torch.float64, seed=12, requires_grad=True
    )
    topk = random_topk(2, 13, 17, 7, seed=12)
    results = []
    for chunk in (None, "1", "5"):
        if chunk is not None:
            monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", chunk)
        kl = streamkl.indexer_kl(*inputs, topk=topk, reduction="none")
        results.append((kl, *torch.autograd.grad(kl.sum(), inputs[2:])))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_memory_is_a_chunk_of_rows_not_the_dense_matrices(monkeypatch):
    """The backend functions (a dispatch mode sees a custom op as one call) allocate, beyond
    inputs, statistics and gradients, one chunk of rows' temporaries (module docstring) and a few
    key-sized buffers: far less than one (B, H, Sq, Sk) matrix."""
    b, h, g, n, d = 1, 8, 4, 256, 8
    dense_bytes = b * h * n * n * 4
    monkeypatch.setenv("STREAMKL_REFERENCE_CHUNK", "16")
    kept = {}

    def run():
        q, k, qi, ki, w = (t.clone() for t in make_indexer_inputs(b=b, h=h, g=g, nq=n, nk=n, d=d, di=d))
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=0.3)
        inputs = IndexerKLInputs(q, k, qi, ki, w)
        stats = reference.forward(spec, inputs)
        grad = torch.ones_like(stats.kl)
        grads = reference.backward(spec.with_needs((True,) * 3), inputs, stats, grad)
        kept["bytes"] = sum(t.untyped_storage().nbytes() for t in (q, k, qi, ki, w, *stats, grad, *grads))

    extra = cpu_peak_bytes(run) - kept["bytes"]
    chunk_bytes = b * (max(h, g) + reference._LIVE_CHUNK_TEMPS) * 16 * n * 4
    key_sized = n * d * 4  # casts of a row chunk or key, the mask rows
    assert 0 < extra <= chunk_bytes + 4 * key_sized < dense_bytes / 8


# --- properties -----------------------------------------------------------------------------


@st.composite
def problems(draw):
    hk = draw(st.sampled_from([1, 2]))
    nq, nk = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    problem = dict(
        b=draw(st.integers(1, 2)), h=hk * draw(st.sampled_from([1, 2])), hk=hk, g=draw(st.integers(1, 3)),
        nq=nq, nk=nk, d=draw(st.integers(1, 12)), di=draw(st.integers(1, 8)),
        layout=draw(st.sampled_from(["bhnd", "bnhd", "sbhd"])), seed=draw(st.integers(0, 2**31 - 1)),
        std=draw(st.sampled_from([0.3, 1.0, 3.0])), dtype=torch.float64,
    )  # fmt: skip
    width = draw(st.one_of(st.none(), st.integers(0, nk + 2)))
    topk = None if width is None else random_topk(problem["b"], nq, nk, width, seed=problem["seed"])
    return problem, dict(causal=draw(st.booleans()), topk=topk)


@PROPERTY
@given(problems())
def test_kl_is_non_negative(problem_and_call):
    problem, call = problem_and_call
    assert (streamkl.indexer_kl(*make_indexer_inputs(**problem), reduction="none", **call) >= -1e-12).all()


@PROPERTY
@given(problems())
def test_kl_is_zero_when_the_student_is_the_teachers_mixture(problem_and_call):
    """With ki_j the j-th unit vector, one indexer head of weight 1 and qi_j = log p_j + C (C
    making every entry positive), I_j = log p_j + C: softmax(I) = p over the admitted keys."""
    problem, call = problem_and_call
    q, k, _, _, _ = make_indexer_inputs(**problem)
    b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    kl, lse, _, mass = dense_indexer_kl(q, k, *make_indexer_inputs(**problem)[2:], **call)
    adm = admitted_mask(b, nq, nk, call["causal"], call["topk"])
    s = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).mT) / math.sqrt(q.shape[-1])
    log_p = torch.logsumexp(
        (s - lse.nan_to_num(neginf=0.0)[..., None]).masked_fill(~adm[:, None], -math.inf), 1
    )
    log_p = torch.where(adm, log_p, 0.0)
    qi = (log_p - log_p.amin(-1, keepdim=True) + 1.0)[:, None]  # (B, 1, Sq, Sk): Di = Sk
    ki = torch.eye(nk, dtype=torch.float64).expand(b, 1, nk, nk)
    w = torch.ones(b, 1, nq, dtype=torch.float64)
    got = streamkl.indexer_kl(q, k, qi, ki, w, reduction="none", **call)
    assert got.abs().max() <= 1e-12


@PROPERTY
@given(problems(), st.floats(0.1, 50.0))
def test_a_constant_added_to_a_rows_scores_changes_nothing(problem_and_call, c):
    """An extra indexer head reading a key dimension that is 1 for every key adds w c to all of
    a row's scores: KL, dqi and dw of the original heads and dki's original dimensions do not
    move, and the extra head's weight gets a zero gradient (its scores are constant)."""
    problem, call = problem_and_call
    q, k, qi, ki, w = make_indexer_inputs(**problem)
    b, g, nq, di = qi.shape
    nk = ki.shape[2]
    gen = torch.Generator().manual_seed(problem["seed"])
    shift = (torch.rand(b, 1, nq, generator=gen, dtype=torch.float64) + 0.5) * c
    heads = torch.cat([qi, torch.zeros(b, g, nq, 1, dtype=qi.dtype)], -1)
    extra = torch.cat([torch.zeros(b, 1, nq, di, dtype=qi.dtype), shift[..., None]], -1)
    qi2 = torch.cat([heads, extra], 1)
    ki2 = torch.cat([ki, torch.ones(b, 1, nk, 1, dtype=ki.dtype)], -1)
    w2 = torch.cat([w, torch.ones(b, 1, nq, dtype=w.dtype)], 1)
    base = [t.detach().requires_grad_() for t in (qi, ki, w)]
    shifted = [t.detach().requires_grad_() for t in (qi2, ki2, w2)]
    kl = streamkl.indexer_kl(q, k, *base, reduction="none", **call)
    kl2 = streamkl.indexer_kl(q, k, *shifted, reduction="none", **call)
    torch.testing.assert_close(kl2, kl, rtol=1e-10, atol=1e-10)
    gr = torch.randn(kl.shape, generator=gen, dtype=torch.float64)
    dqi, dki, dw = torch.autograd.grad(kl, base, gr)
    dqi2, dki2, dw2 = torch.autograd.grad(kl2, shifted, gr)
    for got, want in ((dqi2[:, :g, :, :di], dqi), (dw2[:, :g], dw), (dki2[..., :di], dki)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dw2[:, g], torch.zeros_like(dw2[:, g]), rtol=0, atol=1e-9)


# --- the op: registration, compile, dispatch, errors -------------------------------------------


def test_opcheck():
    """torch.library.opcheck of the public op and of the forward/backward ops: schema, fakes,
    autograd registration, AOT dispatch; permuted strides, topk, lse, packed sequences."""
    q, k, qi, ki, w = make_indexer_inputs(b=1, h=4, hk=2, nq=8, nk=8, layout="bnhd", requires_grad=True)
    topk = random_topk(1, 8, 8, 3, seed=1)
    lse = _given_lse((q, k, qi, ki, w), torch.float32)
    for kwargs in (dict(), dict(causal=False, scale=0.5, reduction="none", topk=topk, lse=lse)):
        torch.library.opcheck(torch.ops.streamkl.indexer_kl.default, (q, k, qi, ki, w), kwargs)
    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    plain = [t.detach() for t in (q, k, qi, ki, w)]
    for lse_in, sparse, varlen in itertools.product((None, lse), (None, topk), (None, cu)):
        args = (*plain, lse_in, sparse, True, 0.3, varlen, None, "reference")
        torch.library.opcheck(torch.ops.streamkl.indexer_kl_fwd.default, args)
        kl, lse_h, lse2, mass = torch.ops.streamkl.indexer_kl_fwd(*args)
        for needs in ([True] * 3, [False, True, False]):
            bwd = (torch.randn_like(kl), *plain, sparse, kl, lse_h, lse2, mass, True, 0.3, lse_in is not None,
                   varlen, None, needs, "reference")  # fmt: skip
            torch.library.opcheck(torch.ops.streamkl.indexer_kl_bwd.default, bwd)
    for reduction, needs in (("sum", [True, True, True]), ("mean", [True, False, True])):
        step = (q, k, qi, ki, w, lse, topk, True, 0.3, None, None, reduction, needs, "reference")
        torch.library.opcheck(torch.ops.streamkl.indexer_kl_step.default, step)


class Indexer(torch.nn.Module):
    """How a training step calls the op: the indexer's projections, then the loss."""

    def __init__(self, g, di, reduction):
        super().__init__()
        self.g, self.di, self.reduction = g, di, reduction
        self.proj = torch.nn.Linear(16, g * di)
        self.weights = torch.nn.Linear(16, g)

    def forward(self, x, q, k, ki, topk, cu_seqlens):
        b, n, _ = x.shape
        qi = self.proj(x).view(b, n, self.g, self.di).transpose(1, 2)
        w = self.weights(x).transpose(1, 2)
        return streamkl.indexer_kl(
            q, k, qi, ki, w, topk=topk, cu_seqlens=cu_seqlens, reduction=self.reduction
        )


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_compile_fullgraph_matches_eager(reduction, varlen):
    """torch.compile(fullgraph=True) of a model calling the op: no graph break, the same loss and
    the same gradients (model weights and ki) as eager."""
    cu = torch.tensor([0, 4, 10], dtype=torch.int32) if varlen else None
    q, k, _, ki, _ = make_indexer_inputs(b=1, h=4, hk=1, nq=10, nk=10, di=8, seed=3)
    ki.requires_grad_()
    x = torch.randn(1, 10, 16, generator=torch.Generator().manual_seed(3))
    topk = random_topk(1, 10, 10, 4, seed=3)
    model = Indexer(3, 8, reduction)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True) if compiled else model
        out = fn(x, q, k, ki, topk, cu)
        results.append((out, torch.autograd.grad(out.sum(), (ki, model.proj.weight, model.weights.weight))))
    (out_e, grads_e), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_e)
    for g_c, g_e in zip(grads_c, grads_e):
        torch.testing.assert_close(g_c, g_e)


def test_auto_passes_by_backends_that_cannot_run_the_call_and_named_ones_say_why(monkeypatch):
    """auto takes the reference for CPU tensors; first_for_auto passes by the cuda backend (it runs
    CUDA tensors only, 16-bit, with the teacher's lse) to triton where it runs the call (CUDA, or
    here its interpreter), else the reference; naming cuda raises saying why, and triton says why
    it cannot run float64."""
    q, k, qi, ki, w = inputs = make_indexer_inputs(h=2, nq=5, nk=5)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=None)
    call = IndexerKLInputs(*inputs)
    assert _dispatch.select("indexer_kl", spec, call, "auto") is reference
    reasons = _dispatch.available("indexer_kl", spec, call)
    assert reasons["reference"] is None and reasons["cuda"] == "the cuda backend runs CUDA tensors only"
    triton_impl = _dispatch.implementation("triton", "indexer_kl")
    picked = _dispatch.first_for_auto("indexer_kl", spec, call)
    assert picked is (triton_impl if reasons["triton"] is None else reference)
    with pytest.raises(ValueError, match="backend .cuda. cannot run these inputs: the cuda backend runs"):
        streamkl.indexer_kl(*inputs, backend="cuda")
    wide = make_indexer_inputs(h=2, nq=5, nk=5, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend 'triton' cannot run these inputs: .*float64"):
        streamkl.indexer_kl(*wide, backend="triton")
    monkeypatch.setenv("STREAMKL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="runs CUDA tensors only"):
        streamkl.indexer_kl(*inputs)


def test_double_backward_and_forward_ad_are_refused_by_name():
    inputs = make_indexer_inputs(h=2, nq=5, nk=5, dtype=torch.float64, requires_grad=True)
    loss = streamkl.indexer_kl(*inputs)
    (dqi,) = torch.autograd.grad(loss, inputs[2], create_graph=True)
    with pytest.raises(NotImplementedError, match="differentiable once"):
        dqi.sum().backward()
    with pytest.raises(NotImplementedError, match="torch.func"):
        torch.func.grad(lambda qi: streamkl.indexer_kl(inputs[0], inputs[1], qi, *inputs[3:]))(
            inputs[2].detach()
        )


def _replace(inputs, index, tensor):
    inputs = list(inputs)
    inputs[index] = tensor
    return inputs


def _base():
    return make_indexer_inputs(b=2, h=4, hk=2, g=3, nq=6, nk=5, d=8, di=4)


ERRORS = {
    "q not 4-D": (lambda x: _replace(x, 0, x[0][0]), {}, ValueError, r"q must be 4-D \(B, H, Sq, D\)"),
    "k 5-D": (lambda x: _replace(x, 1, x[1][None]), {}, ValueError, "k must be 4-D .* or 3-D"),
    "ki not a tensor": (lambda x: _replace(x, 3, [1.0]), {}, TypeError, "ki must be a torch.Tensor"),
    "w 2-D": (lambda x: _replace(x, 4, x[4][0]), {}, ValueError, r"w must be 3-D \(B, G, Sq\)"),
    "int dtype": (lambda x: _replace(x, 2, x[2].int()), {}, TypeError, "qi has dtype torch.int32"),
    "teacher dtypes": (lambda x: _replace(x, 1, x[1].double()), {}, TypeError, "q and k must share a dtype"),
    "indexer dtypes": (lambda x: _replace(x, 3, x[3].half()), {}, TypeError, "qi and ki must share a dtype"),
    "teacher head dim": (
        lambda x: _replace(x, 1, torch.randn(2, 2, 5, 7)),
        {},
        ValueError,
        "q and k must share the head dim",
    ),
    "indexer head dim": (
        lambda x: _replace(x, 3, torch.randn(2, 1, 5, 3)),
        {},
        ValueError,
        "qi and ki must share the head dim",
    ),
    "devices": (lambda x: _replace(x, 1, x[1].to("meta")), {}, ValueError, "must be on one device"),
    "topk device": (
        lambda x: x,
        dict(topk=torch.zeros(2, 6, 3, dtype=torch.long, device="meta")),
        ValueError,
        "topk is on meta",
    ),
    "lse device": (lambda x: x, dict(lse=torch.zeros(2, 4, 6, device="meta")), ValueError, "lse is on meta"),
    "batch": (lambda x: _replace(x, 3, torch.randn(3, 1, 5, 4)), {}, ValueError, "ki has batch 3"),
    "no teacher heads": (lambda x: _replace(x, 0, torch.randn(2, 0, 6, 8)), {}, ValueError, "q has 0 heads"),
    "gqa divisibility": (lambda x: _replace(x, 1, torch.randn(2, 3, 5, 8)), {}, ValueError, "k has 3 heads"),
    "qi rows": (lambda x: _replace(x, 2, torch.randn(2, 3, 7, 4)), {}, ValueError, "qi has 7 query rows"),
    "no indexer heads": (
        lambda x: _replace(x, 2, torch.randn(2, 0, 6, 4)),
        {},
        ValueError,
        "qi has 0 indexer heads",
    ),
    "ki heads": (lambda x: _replace(x, 3, torch.randn(2, 2, 5, 4)), {}, ValueError, "ki must have one head"),
    "ki keys": (lambda x: _replace(x, 3, torch.randn(2, 1, 6, 4)), {}, ValueError, "ki has 6 keys"),
    "w shape": (lambda x: _replace(x, 4, torch.randn(2, 2, 6)), {}, ValueError, r"w must be \(B, G, Sq\)"),
    "lse type": (lambda x: x, dict(lse=[0.0]), TypeError, "lse must be a torch.Tensor"),
    "lse dtype": (
        lambda x: x,
        dict(lse=torch.zeros(2, 4, 6, dtype=torch.bfloat16)),
        TypeError,
        "lse has dtype",
    ),
    "lse shape": (lambda x: x, dict(lse=torch.zeros(2, 2, 6)), ValueError, r"lse must be \(B, H, Sq\)"),
    "topk dtype": (lambda x: x, dict(topk=torch.zeros(2, 6, 3)), TypeError, "topk has dtype torch.float32"),
    "topk shape": (
        lambda x: x,
        dict(topk=torch.zeros(2, 5, 3, dtype=torch.long)),
        ValueError,
        r"topk must be \(B, Sq, K\)",
    ),
    "topk past Sk": (
        lambda x: x,
        dict(topk=torch.full((2, 6, 3), 5)),
        ValueError,
        r"topk holds the index 5; expected key indices in \[0, 5\)",
    ),
    "topk below -1": (
        lambda x: x,
        dict(topk=torch.full((2, 6, 3), -2)),
        ValueError,
        "topk holds the index -2",
    ),
    "causal int": (lambda x: x, dict(causal=1), TypeError, "causal must be a bool"),
    "scale type": (lambda x: x, dict(scale="big"), TypeError, "scale must be a float"),
    "scale finite": (lambda x: x, dict(scale=math.inf), ValueError, "scale must be finite"),
    "reduction": (lambda x: x, dict(reduction="avg"), ValueError, "reduction must be one of"),
    "max_seqlen alone": (lambda x: x, dict(max_seqlen=4), ValueError, "max_seqlen is only"),
    "packed batch": (
        lambda x: x,
        dict(cu_seqlens=torch.tensor([0, 6], dtype=torch.int32)),
        ValueError,
        "need batch 1",
    ),
    "backend name": (lambda x: x, dict(backend="fastest"), ValueError, "backend='fastest'"),
}


@pytest.fixture
def no_backend_runs(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a backend ran on invalid input")

    monkeypatch.setattr(reference, "_forward_rows", boom)


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_named(case, no_backend_runs):
    edit, kwargs, exc, message = ERRORS[case]
    with pytest.raises(exc, match=message):
        streamkl.indexer_kl(*edit(_base()), **kwargs)


def test_the_registered_op_validates_values_too(no_backend_runs):
    """Traced calls check metadata only; the registered forward reads topk when it runs."""
    q, k, qi, ki, w = _base()
    bad = torch.full((2, 6, 3), 9)
    with pytest.raises(ValueError, match="topk holds the index 9"):
        torch.ops.streamkl.indexer_kl_fwd(q, k, qi, ki, w, None, bad, True, 0.3)
    with pytest.raises(ValueError, match="topk holds the index 9"):
        torch.ops.streamkl.indexer_kl(q, k, qi, ki, w, topk=bad)


def test_a_given_lse_that_leaves_no_target_mass(target):
    """A given lse far above the true one makes p underflow to 0 on its rows: no target, so KL 0
    and a zero gradient there (the oracle's value), never NaN; the other rows are untouched. The
    fused step, which assumed T = 1 there, corrects those rows."""
    name, device = target
    inputs = _on(target, make_indexer_inputs(b=1, h=2, nq=6, nk=6, dtype=torch.float64, seed=5))
    lse = _given_lse(inputs, inputs[0].dtype, causal=True)
    lse[:, :, 2] += 1000.0
    kl, (dqi, dki, dw) = _check(inputs, backend=name, causal=True, lse=lse)
    assert kl[0, 2] == 0 and (dqi[0, :, 2] == 0).all() and (dw[0, :, 2] == 0).all()
    _, (dqi, _, dw) = _check_step(inputs, "sum", name, causal=True, lse=lse)
    assert (dqi[0, :, 2] == 0).all() and (dw[0, :, 2] == 0).all()


def test_the_example_trains_an_indexer():
    """examples/train_indexer.py at a tiny size: both stages' loss falls."""
    script = Path(__file__).resolve().parents[1] / "examples" / "train_indexer.py"
    args = ["--steps", "10", "--seq", "32", "--topk", "8", "--heads", "4"]
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, check=True
    ).stdout
    stages = re.findall(r"^(dense|sparse): ([0-9.]+) -> ([0-9.]+)$", out, flags=re.M)
    assert [s[0] for s in stages] == ["dense", "sparse"], out
    assert all(float(last) < float(first) for _, first, last in stages), out


def test_every_backend_with_the_op_implements_its_protocol():
    from streamkl import _dispatch
    from streamkl._backend import IndexerKLBackend

    for name in _dispatch.BACKENDS:
        impl = _dispatch.implementation(name, "indexer_kl")
        assert impl is None or (isinstance(impl, IndexerKLBackend) and impl.op == "indexer_kl")
    assert _dispatch.implementation("reference", "indexer_kl") is not None
