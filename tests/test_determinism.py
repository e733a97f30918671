"""torch.use_deterministic_algorithms(True) on every backend (docs/contract.md, Determinism).

attn_kl, triton (the cuda backend's backward too): under deterministic mode the backward runs
the separate strategy, whatever STREAMKL_TRITON_BWD=auto would pick, and a forced `fused` (dq by
float32 atomics) raises, or warns and runs under warn_only. indexer_kl, triton: dki comes from
_indexer_dki's pass (no atomics): key-major in dense mode, row shares added by index_add_ in
sparse mode. Each check is two runs compared bitwise, plus which path ran, read off the launcher
(the plan it used, or the pass it called), never off timing.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py) on tiny float32
shapes; the `gpu` cases repeat the bitwise checks compiled, at realistic sizes, where atomics
do reorder.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

import streamkl  # noqa: E402
from streamkl.backends.triton import _indexer_dki, _launch  # noqa: E402
from streamkl.testing import make_inputs  # noqa: E402

from ._calls import reference as rb  # noqa: E402
from ._calls import triton as tb  # noqa: E402
from .indexer_oracle import make_indexer_inputs, random_topk  # noqa: E402
from .test_indexer_kl import _given_lse  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cpu" if INTERPRET else "cuda"
SETTING1 = (False, False, True, True)  # teacher fixed: grads of q2, k2
SETTING2 = (True, True, False, False)  # target fixed: grads of q1, k1


@contextlib.contextmanager
def deterministic(mode: bool = True, warn_only: bool = False):
    """torch.use_deterministic_algorithms(mode, warn_only=...) inside the block, restored after."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.fixture
def plans(monkeypatch):
    """The BwdPlan of every triton attn_kl backward run while the test runs."""
    seen = []
    plan = _launch.bwd_plan

    def spy(*args):
        seen.append(plan(*args))
        return seen[-1]

    monkeypatch.setattr(_launch, "bwd_plan", spy)
    return seen


def _attn_backward(backend, needs, n=20, seed=3):
    """(dq1, dk1, dq2, dk2) of one small GQA problem, a random upstream gradient."""
    q1, k1, q2, k2 = make_inputs(b=1, h=2, hk1=1, hk2=2, nq=n, nk=n, d1=16, d2=16, device=DEVICE, seed=seed)
    kw = dict(causal=True, scale1=0.25, scale2=0.25)
    kl, lse1, lse2 = backend.forward(q1, k1, q2, k2, **kw)
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(seed)).to(kl.device)
    return backend.backward(g, q1, k1, q2, k2, kl, lse1, lse2, needs=needs, **kw)


BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16}
BITS[torch.bfloat16] = torch.int16


def _same_bits(a, b):
    """Each pair of tensors equal bit for bit (-0.0 against 0.0, or two NaNs, would tell)."""
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x.view(BITS[x.dtype]), y.view(BITS[y.dtype]))


@pytest.mark.parametrize("strategy", ["auto", "separate"])
@pytest.mark.parametrize("needs", [SETTING1, SETTING2], ids=["setting1", "setting2"])
def test_attn_kl_triton_backward_is_separate_and_repeatable(strategy, needs, plans, monkeypatch):
    """One dq and its dk on a one-wave grid: auto takes fused there, deterministic mode separate;
    two runs give the same bits."""
    monkeypatch.setenv("STREAMKL_TRITON_BWD", strategy)
    if strategy == "auto":
        _attn_backward(tb, needs)
        assert plans[-1].fused  # what deterministic mode overrides
    with deterministic():
        first = _attn_backward(tb, needs)
        assert not plans[-1].fused and plans[-1].dq_grid is not None
        second = _attn_backward(tb, needs)
    _same_bits(first, second)


def test_attn_kl_forced_fused_raises_under_deterministic_mode(monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_BWD", "fused")
    match = r"STREAMKL_TRITON_BWD=fused.*use_deterministic_algorithms"
    with deterministic(), pytest.raises(RuntimeError, match=match):
        _attn_backward(tb, SETTING1)


def test_attn_kl_forced_fused_warns_under_warn_only(monkeypatch, plans):
    monkeypatch.setenv("STREAMKL_TRITON_BWD", "fused")
    with deterministic(warn_only=True), pytest.warns(UserWarning, match="STREAMKL_TRITON_BWD=fused"):
        _attn_backward(tb, SETTING1)
    assert plans[-1].fused  # warned, and ran what the user forced


def test_attn_kl_forced_fused_without_a_fused_launch_runs_quietly(monkeypatch, plans):
    """fused needs a dq and a dk: with dq alone there is nothing to refuse."""
    monkeypatch.setenv("STREAMKL_TRITON_BWD", "fused")
    with deterministic(), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _attn_backward(tb, (False, False, True, False))
    assert not plans[-1].fused


def test_attn_kl_reference_is_repeatable_under_deterministic_mode():
    with deterministic():
        _same_bits(_attn_backward(rb, (True,) * 4), _attn_backward(rb, (True,) * 4))


@pytest.fixture
def key_major(monkeypatch):
    """How many times the triton indexer_kl ran its key-major dki pass while the test runs."""
    calls = []
    dki_pass = _indexer_dki.dki_pass

    def spy(*args):
        calls.append(args[1])
        return dki_pass(*args)

    monkeypatch.setattr(_indexer_dki, "dki_pass", spy)
    return calls


def _indexer_grads(backend, reduction="mean", lse=False, topk=False, cu_seqlens=None, ki_grad=True, **shape):
    """(dqi, dki, dw) of one small call through the public op (G = 3 padded to 8, Sq < Sk);
    reduction "none" weighs each row, so the recompute backward runs."""
    dims = dict(b=1, h=2, hk=1, g=3, nq=10, nk=13, d=16, di=6)
    dims.update(shape)
    inputs = make_indexer_inputs(**dims, device=DEVICE, seed=5)
    q, k, qi, ki, w = inputs
    call = dict(causal=True, cu_seqlens=cu_seqlens)
    if topk:
        call["topk"] = random_topk(dims["b"], dims["nq"], dims["nk"], 7, seed=2).to(q.device)
    if lse:
        call["lse"] = _given_lse(inputs, torch.float32, **call)
    students = [t.clone().requires_grad_(need) for t, need in zip((qi, ki, w), (True, ki_grad, True))]
    loss = streamkl.indexer_kl(q, k, *students, reduction=reduction, backend=backend, **call)
    if reduction == "none":
        loss = (loss * torch.linspace(0.5, 1.5, loss.numel(), device=loss.device).view_as(loss)).sum()
    loss.backward()
    return tuple(t.grad for t in students)


# (reduction, lse given, packed, sparse): the fused step with and without its correction, the
# recompute backward on packed sequences; sparse mode's row chunks in the fused step and packed.
INDEXER_CASES = [
    ("mean", False, False, False),
    ("sum", True, False, False),
    ("none", False, True, False),
    ("mean", True, False, True),
    ("none", False, True, True),
]


def _indexer_id(case):
    reduction, lse, packed, sparse = case
    names = ("lse" if lse else "nolse", "packed" if packed else "batch", "sparse" if sparse else "dense")
    return "-".join((reduction, *names))


@pytest.mark.parametrize("case", INDEXER_CASES, ids=_indexer_id)
def test_indexer_kl_triton_dki_is_deterministic_and_repeatable(case, key_major, monkeypatch):
    """dki from _indexer_dki's pass (dense: key-major; sparse: rows in chunks of 3 here, so
    chunks end mid-batch and mid-sequence, added by index_add_), bitwise the same on two runs,
    and the atomics' dki to rounding (the other gradients are the main pass's either way)."""
    reduction, lse, packed, sparse = case
    monkeypatch.setattr(_indexer_dki, "PART_BYTES", 3 * 7 * 6 * 4)  # 3 rows of 7 top-k entries, Di = 6
    call = dict(reduction=reduction, lse=lse, topk=sparse)
    if packed:
        call.update(nq=13, cu_seqlens=torch.tensor([0, 5, 6, 13], dtype=torch.int32, device=DEVICE))
    atomics = _indexer_grads("triton", **call)
    assert not key_major
    with deterministic():
        first = _indexer_grads("triton", **call)
        assert len(key_major) == 1
        second = _indexer_grads("triton", **call)
    _same_bits(first, second)
    for got, want in zip(first, atomics):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_indexer_kl_triton_without_dki_runs_the_main_pass_alone(key_major):
    """Only dki has atomics: with a frozen ki deterministic mode changes nothing."""
    with deterministic():
        _indexer_grads("triton", topk=True, ki_grad=False)
    assert not key_major


def test_indexer_kl_reference_is_repeatable_under_deterministic_mode():
    with deterministic():
        _same_bits(_indexer_grads("reference", topk=True), _indexer_grads("reference", topk=True))


GPU_ATTN = dict(b=1, h=32, nq=256, nk=256, d1=128, d2=128, dtype=torch.bfloat16, device="cuda")


def _op_grads(backend, seed=0):
    """(dq2, dk2) of a sum-reduced attn_kl through the public op at a realistic one-wave size
    (B = 1, H = 32, N = 256, D = 128, bf16, the teacher frozen): where auto takes the fused
    backward outside deterministic mode."""
    q1, k1, q2, k2 = make_inputs(**GPU_ATTN, seed=seed)
    q2, k2 = q2.requires_grad_(), k2.requires_grad_()
    streamkl.attn_kl(q1, k1, q2, k2, causal=True, reduction="sum", backend=backend).backward()
    return q2.grad, k2.grad


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_attn_kl_backward_is_repeatable(backend, plans):
    if backend == "cuda":
        q1, k1, q2, k2 = make_inputs(**GPU_ATTN)
        why = streamkl.available_backends(q1, k1, q2, k2)["cuda"]
        if why is not None:
            pytest.skip(f"the cuda backend does not run here: {why}")
    _op_grads(backend)
    assert plans[-1].fused  # what deterministic mode overrides
    with deterministic():
        first = _op_grads(backend)
        assert not plans[-1].fused
        runs = [_op_grads(backend) for _ in range(3)]
    for again in runs:
        _same_bits(first, again)


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gpu_indexer_kl_dki_is_repeatable(reduction, sparse, key_major, monkeypatch):
    """DeepSeek-V3.2-like shapes scaled down (64 teacher heads on one 576-wide key, G = 16 indexer
    heads of 128, 2K tokens, bf16, causal; sparse: top-512, in chunks of 300 rows): dki bitwise
    the same over runs, near the atomics'."""
    monkeypatch.setattr(_indexer_dki, "PART_BYTES", 300 * 512 * 128 * 4)
    shape = dict(b=1, h=64, hk=1, g=16, nq=2048, nk=2048, d=576, di=128)
    inputs = make_indexer_inputs(**shape, dtype=torch.bfloat16, device="cuda", seed=1)
    q, k, qi, ki, w = inputs
    topk = random_topk(1, 2048, 2048, 512, seed=3, pad=0.0).cuda() if sparse else None

    def grads():
        students = [t.clone().requires_grad_() for t in (qi, ki, w)]
        loss = streamkl.indexer_kl(q, k, *students, topk=topk, reduction=reduction, backend="triton")
        (loss.float().sum() if reduction == "none" else loss).backward()
        return tuple(t.grad for t in students)

    atomics = grads()
    with deterministic():
        first = grads()
        assert key_major
        runs = [grads() for _ in range(3)]
    for again in runs:
        _same_bits(first, again)
    torch.testing.assert_close(
        first[1].float(), atomics[1].float(), rtol=2e-2, atol=2e-2 * atomics[1].abs().max().item()
    )
