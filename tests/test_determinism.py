"""torch.use_deterministic_algorithms(True) on every backend (docs/contract.md, Determinism).

attn_kl, triton (the cuda backend's backward too): under deterministic mode the backward runs
the separate strategy, whatever STREAMKL_TRITON_BWD=auto would pick, and a forced `fused` (dq by
float32 atomics) raises, or warns and runs under warn_only. indexer_kl, triton: dki comes from
the key-major pass (no atomics) in dense mode; sparse mode with dki needed raises, or warns under
warn_only. Each check is two runs compared bitwise, plus which path ran, read off the launcher
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

from streamkl.backends.triton import _launch  # noqa: E402
from streamkl.testing import make_inputs  # noqa: E402

from ._calls import reference as rb  # noqa: E402
from ._calls import triton as tb  # noqa: E402

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
