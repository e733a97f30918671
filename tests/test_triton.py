"""The triton backend's kernels against the float64 dense oracle, called directly (no op layer).

Without a GPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1; when the session
did not set it, test_interpreter_suite re-runs this file in a subprocess that does) on CPU
tensors in float32 at tiny shapes with 16 x 16 tiles, so every case crosses tile boundaries, the
causal frontier and the ragged last tile. With a GPU the same cases
run compiled on CUDA, and the `gpu` grid adds bf16/fp16/fp32 at real tile sizes.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from streamkl.backends import triton as tb  # noqa: E402
from streamkl.backends.triton import _config  # noqa: E402
from streamkl.bench.timing import env_vars  # noqa: E402
from streamkl.testing import dense_attn_kl, make_inputs, rel_err  # noqa: E402

from .oracle import rounding_floor as oracle_rounding_floor  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Triton decorates its own library (tl.zeros, tl.sum, ...) when it is first imported, so the
# interpreter works only if TRITON_INTERPRET=1 was set before that, which a test module cannot
# guarantee. Without a GPU and without the variable, this module therefore re-runs itself in a
# subprocess that sets it (test_interpreter_suite) and skips its cases in this process, leaving
# the variable of the parent session untouched.
RERUN = not torch.cuda.is_available() and not INTERPRET


@pytest.fixture(autouse=True)
def _only_in_interpreter_process(request):
    if RERUN and request.node.name != "test_interpreter_suite":
        pytest.skip("runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite")


@pytest.mark.skipif(not RERUN, reason="this process already runs the kernels (GPU or interpreter)")
def test_interpreter_suite():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider"],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]


DEVICE = "cpu" if INTERPRET else "cuda"
ALL = (True, True, True, True)
SETTING1 = (False, False, True, True)  # teacher fixed: grads of q2, k2
SETTING2 = (True, True, False, False)  # target fixed: grads of q1, k1


def _scales(q1, q2):
    return 1 / math.sqrt(q1.shape[-1]), 1 / math.sqrt(q2.shape[-1])


def _oracle(q1, k1, q2, k2, causal, cu_seqlens, grad_seed=0):
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q1, k1, q2, k2)]
    cu = None if cu_seqlens is None else cu_seqlens.cpu()
    kl, lse1, lse2 = dense_attn_kl(*leaves, causal=causal, cu_seqlens=cu, return_lse=True)
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(grad_seed), dtype=torch.float64)
    grads = torch.autograd.grad(kl, leaves, g)
    return kl.detach(), lse1.detach(), lse2.detach(), g, grads


def _run(q1, k1, q2, k2, *, causal=False, cu_seqlens=None, max_seqlen=None, needs=ALL):
    s1, s2 = _scales(q1, q2)
    kw = dict(causal=causal, scale1=s1, scale2=s2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    kl, lse1, lse2 = tb.forward(q1, k1, q2, k2, **kw)
    return kl, lse1, lse2, kw


def _check(
    q1,
    k1,
    q2,
    k2,
    *,
    causal=False,
    cu_seqlens=None,
    max_seqlen=None,
    needs=ALL,
    kl_tol=None,
    grad_tol=None,
    rounding_floor=False,
):
    """Forward kl/lse and the needed grads against the oracle; returns the grads.
    rounding_floor: a gradient may also miss its relative bar by no more than
    tests.oracle.rounding_floor (for random problems, where hypothesis finds one-hot rows)."""
    dtype = q1.dtype
    kl_tol = kl_tol or {torch.float32: 1e-4}.get(dtype, 2e-3)
    grad_tol = grad_tol or {torch.float32: 1e-3}.get(dtype, 2e-2)
    assert tb.supports(q1, k1, q2, k2, cu_seqlens) is None
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    for t in (kl, lse1, lse2):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == q1.shape[:3]
    rkl, rl1, rl2, g, rgrads = _oracle(q1, k1, q2, k2, causal, cu_seqlens)
    kl, lse1, lse2 = (t.double().cpu() for t in (kl, lse1, lse2))
    assert torch.isfinite(kl).all()
    assert ((kl - rkl).abs() <= kl_tol * rkl.abs().clamp_min(1)).all(), (kl - rkl).abs().max()
    for got, ref in ((lse1, rl1), (lse2, rl2)):
        empty = torch.isinf(ref)
        assert torch.equal(torch.isneginf(got), empty), "rows seeing no key must have lse = -inf"
        assert ((got - ref)[~empty].abs() <= kl_tol * ref[~empty].abs().clamp_min(1)).all()
    assert (kl[torch.isinf(rl1)] == 0).all()
    grads = tb.backward(
        g.float().to(q1.device),
        q1,
        k1,
        q2,
        k2,
        *(t.float().to(q1.device) for t in (kl, lse1, lse2)),
        needs=needs,
        **kw,
    )
    floors = oracle_rounding_floor(q1, k1, q2, k2, g, 2.0**-23) if rounding_floor else [0.0] * 4
    for got, ref, need, inp, floor in zip(grads, rgrads, needs, (q1, k1, q2, k2), floors):
        if not need:
            assert got is None
            continue
        assert got.shape == inp.shape and got.dtype == inp.dtype and got.is_contiguous()
        assert torch.isfinite(got).all()
        err = rel_err(got.cpu(), ref)
        if floor and err > grad_tol:
            diff = (got.cpu().double() - ref).norm().item()
            assert diff <= grad_tol * ref.norm().item() + floor, f"grad error {diff:.3e} > floor {floor:.3e}"
            continue
        assert err <= grad_tol, f"grad rel err {err:.3e} > {grad_tol}"
    return grads


@pytest.fixture
def strategy(request, monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_BWD", request.param)
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "off")
    return request.param


# (b, h, hk1, hk2, nq, nk, d1, d2, causal, layout): GQA with different group sizes, D1 != D2
# (padded to the next power of two), Nq != Nk both ways, permuted strides.
CASES = [
    (1, 2, 2, 2, 40, 40, 16, 16, False, "bhnd"),
    (2, 4, 2, 1, 37, 45, 24, 32, False, "bnhd"),
    (1, 4, 1, 2, 45, 19, 32, 20, True, "bhnd"),
    (2, 4, 4, 2, 20, 45, 16, 24, True, "bnhd"),
    (1, 6, 3, 2, 33, 33, 8, 32, True, "bhnd"),
]


def _check_case(case):
    """Forward and all four gradients of one CASES entry against the oracle."""
    b, h, hk1, hk2, nq, nk, d1, d2, causal, layout = case
    q1, k1, q2, k2 = make_inputs(
        b=b,
        h=h,
        hk1=hk1,
        hk2=hk2,
        nq=nq,
        nk=nk,
        d1=d1,
        d2=d2,
        device=DEVICE,
        layout=layout,
        seed=nq * nk + d1,
    )
    _check(q1, k1, q2, k2, causal=causal)


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_against_oracle(case, strategy):
    _check_case(case)


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize(
    "needs",
    [SETTING1, SETTING2, (True, False, False, True), (False, True, True, False)],
    ids=["setting1", "setting2", "dq1-dk2", "dk1-dq2"],
)
def test_only_needed_grads(needs, strategy):
    q1, k1, q2, k2 = make_inputs(b=1, h=4, hk1=2, hk2=1, nq=30, nk=35, d1=16, d2=24, device=DEVICE, seed=5)
    _check(q1, k1, q2, k2, causal=True, needs=needs)


@pytest.mark.skipif(
    not INTERPRET,
    reason="fp32 kernels at interpreter tiles compile for minutes "
    "on a GPU; test_gpu_grid covers the layout the H200 table picks",
)
@pytest.mark.parametrize("qrows", [False, True], ids=["keys-x-queries", "queries-x-keys"])
@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize("case", CASES[1:4], ids=lambda c: "-".join(map(str, c)))
def test_key_major_tile_layouts(case, strategy, qrows):
    # Both layouts of the key-major kernel's tiles (Cfg.qrows), all four gradients: dk from dS
    # in registers or transposed through shared memory, fused dq the other way round.
    from streamkl.backends.triton import _launch

    b, h, hk1, hk2, nq, nk, d1, d2, causal, layout = case
    q1, k1, q2, k2 = make_inputs(
        b=b,
        h=h,
        hk1=hk1,
        hk2=hk2,
        nq=nq,
        nk=nk,
        d1=d1,
        d2=d2,
        device=DEVICE,
        layout=layout,
        seed=nq * nk + d1,
    )
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2, causal=causal)
    _, _, _, g, rgrads = _oracle(q1, k1, q2, k2, causal, None)
    cfg = _config.Cfg(16, 16, 4, 1, qrows=qrows)
    grads = _launch.backward(
        g.float().to(q1.device), q1, k1, q2, k2, kl, lse1, lse2, needs=ALL, cfgs=(None, cfg), **kw
    )
    for got, ref, inp in zip(grads, rgrads, (q1, k1, q2, k2)):
        assert got.shape == inp.shape and got.dtype == inp.dtype and got.is_contiguous()
        assert rel_err(got.cpu(), ref) <= 1e-3


@st.composite
def _random_problems(draw):
    """Any shape the kernels take: lengths that cross (or not) the 16-row interpreter tiles,
    head dims that are not powers of two, GQA with different group sizes, both layouts."""
    hk1 = draw(st.sampled_from([1, 2]))
    hk2 = draw(st.sampled_from([1, 2]))
    return dict(
        b=draw(st.integers(1, 2)),
        h=hk1 * hk2 * draw(st.sampled_from([1, 2])),
        hk1=hk1,
        hk2=hk2,
        nq=draw(st.integers(1, 40)),
        nk=draw(st.integers(1, 40)),
        d1=draw(st.integers(1, 40)),
        d2=draw(st.integers(1, 40)),
        layout=draw(st.sampled_from(["bhnd", "bnhd"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        std=draw(st.sampled_from([0.3, 1.0, 4.0])),
    )


@pytest.mark.skipif(
    not INTERPRET,
    reason="on a GPU each random head dim compiles new fp32 kernels "
    "(30-130 s each on the H200); test_gpu_grid covers the compiled kernels",
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _random_problems(),
    st.booleans(),
    st.sampled_from(["separate", "fused"]),
    st.sampled_from(["off", "auto", "3"]),
)
def test_random_problems_against_oracle(problem, causal, strategy, split):
    """Forward kl/lse and all four gradients on random problems, each backward strategy and
    split-K setting, against the float64 oracle (fp32 inputs: SPEC section 6's fp32 bars)."""
    q1, k1, q2, k2 = make_inputs(**problem, device=DEVICE)
    with env_vars({"STREAMKL_TRITON_BWD": strategy, "STREAMKL_TRITON_SPLIT_K": split}):
        _check(q1, k1, q2, k2, causal=causal, rounding_floor=True)


@pytest.mark.skipif(
    not INTERPRET,
    reason="on a GPU each random head dim compiles new fp32 kernels; "
    "test_gpu_varlen covers the compiled kernels",
)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _random_problems(),
    st.lists(st.integers(0, 20), min_size=1, max_size=4),
    st.integers(0, 5),
    st.booleans(),
    st.sampled_from(["separate", "fused"]),
)
def test_random_packed_sequences_against_oracle(problem, lengths, slack, causal, strategy):
    """Packed varlen: random sequence lengths (empty ones included) and a max_seqlen at or past
    the longest, forward and all four gradients against the float64 oracle."""
    total = sum(lengths)
    assume(total > 0)
    problem.update(b=1, nq=total, nk=total)
    q1, k1, q2, k2 = make_inputs(**problem, device=DEVICE)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    with env_vars({"STREAMKL_TRITON_BWD": strategy}):
        _check(
            q1, k1, q2, k2, causal=causal, cu_seqlens=cu, max_seqlen=max(lengths) + slack, rounding_floor=True
        )


def test_one_gemm_ablation_is_the_teacher_against_itself():
    # Cfg.ablate=2 (a timing variant, docs/triton.md) replaces S2 by S1: with equal scales that
    # is KL(P1 || P1) = 0 (up to a rounding, should the compiler contract t1 - t2 into an FMA on
    # a GPU), and both LSEs are the true LSE1.
    from streamkl.backends.triton import _launch

    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=40, nk=40, d1=16, d2=16, device=DEVICE, seed=5)
    kw = dict(causal=True, scale1=0.25, scale2=0.25, cu_seqlens=None, max_seqlen=None)
    _, lse1, _ = tb.forward(q1, k1, q2, k2, **kw)
    kl_a, lse1_a, lse2_a = _launch.forward(q1, k1, q2, k2, cfg=_config.Cfg(16, 16, 4, 1, ablate=2), **kw)
    assert kl_a.abs().max() <= 1e-6
    assert torch.equal(lse1_a, lse2_a)
    torch.testing.assert_close(lse1_a, lse1)


def test_no_grads_needed():
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=8, nk=8, d1=16, d2=16, device=DEVICE)
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2)
    assert (
        tb.backward(torch.ones_like(kl), q1, k1, q2, k2, kl, lse1, lse2, needs=(False,) * 4, **kw)
        == (None,) * 4
    )


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(causal, strategy):
    cu = torch.tensor([0, 5, 21, 22, 40], dtype=torch.int32, device=DEVICE)  # includes a 1-token sequence
    q1, k1, q2, k2 = make_inputs(
        b=1, h=4, hk1=2, hk2=1, nq=40, nk=40, d1=16, d2=24, device=DEVICE, layout="bnhd", seed=7
    )
    _check(q1, k1, q2, k2, causal=causal, cu_seqlens=cu, max_seqlen=18)


@pytest.mark.parametrize(
    "nq,nk,causal,splits",
    [(1, 48, False, "3"), (5, 47, True, "4"), (20, 40, False, "2"), (3, 48, True, "64")],
)
def test_split_k(nq, nk, causal, splits, monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", splits)
    q1, k1, q2, k2 = make_inputs(b=2, h=2, hk1=1, hk2=2, nq=nq, nk=nk, d1=16, d2=32, device=DEVICE, seed=nq)
    _check(q1, k1, q2, k2, causal=causal)
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "off")
    kl_split = _run(q1, k1, q2, k2, causal=causal)[0]
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", splits)
    assert torch.allclose(_run(q1, k1, q2, k2, causal=causal)[0], kl_split, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
def test_rows_that_see_nothing(strategy):
    # Causal with Nq > Nk: the first Nq - Nk rows see no key (kl 0, lse -inf, zero grads).
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=40, nk=12, d1=16, d2=16, device=DEVICE, seed=3)
    dq1, dk1, dq2, dk2 = _check(q1, k1, q2, k2, causal=True)
    kl = _run(q1, k1, q2, k2, causal=True)[0]
    assert (kl[..., :28] == 0).all()
    assert (dq1[..., :28, :] == 0).all() and (dq2[..., :28, :] == 0).all()


def test_no_keys_at_all():
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=5, nk=0, d1=16, d2=16, device=DEVICE)
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2)
    assert (kl == 0).all() and torch.isneginf(lse1).all() and torch.isneginf(lse2).all()
    grads = tb.backward(torch.ones_like(kl), q1, k1, q2, k2, kl, lse1, lse2, needs=ALL, **kw)
    assert all((t == 0).all() for t in grads)


def test_split_k_rows_that_see_nothing(monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "3")
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=20, nk=10, d1=16, d2=16, device=DEVICE, seed=4)
    _check(q1, k1, q2, k2, causal=True, needs=SETTING1)


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
def test_large_logits(strategy):
    # Logits of magnitude ~1e4 (q, k with std 50 at D = 16): one-hot rows, no NaN/inf anywhere.
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=24, nk=30, d1=16, d2=16, device=DEVICE, seed=9, std=50.0)
    assert (q1[0, 0] @ k1[0, 0].T / 4).abs().max() > 3e3
    _check(q1, k1, q2, k2, causal=True, needs=SETTING1)
    # Setting 2 at one-hot rows: the exact dS1 = g*P1*(log-ratio - KL) is ~1e-12 because the
    # log-ratio equals KL at the argmax; in fp32 (logits ~1e4, ulp ~1e-3) what remains is rounding,
    # finite and small next to the setting-1 gradients of the same inputs.
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2, causal=True)
    rkl, _, _, g, rgrads = _oracle(q1, k1, q2, k2, True, None)
    grads = tb.backward(g.float().to(q1.device), q1, k1, q2, k2, kl, lse1, lse2, needs=ALL, **kw)
    assert all(torch.isfinite(t).all() for t in grads)
    scale = min(rgrads[2].norm().item(), rgrads[3].norm().item())
    for got, ref in zip(grads[:2], rgrads[:2]):
        assert (got.cpu().double() - ref).norm().item() <= 1e-3 * scale


def test_supports_reasons(monkeypatch):
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=4, nk=4, d1=16, d2=16, device=DEVICE)
    assert tb.supports(q1, k1, q2, k2, None) is None
    assert "float64" in tb.supports(q1.double(), k1.double(), q2.double(), k2.double(), None)
    big = torch.zeros(1, 2, 4, 300, device=DEVICE)
    assert "256" in tb.supports(q1, k1, big, big[:, :2], None)
    cpu = [t.cpu() for t in (q1, k1, q2, k2)]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in tb.supports(*cpu, None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "not installed" in tb.supports(q1, k1, q2, k2, None)


def test_env_overrides(monkeypatch):
    from streamkl import _env

    monkeypatch.setenv("STREAMKL_TRITON_BWD", "sideways")
    with pytest.raises(ValueError, match="STREAMKL_TRITON_BWD"):
        _env.triton_bwd()
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "-2")
    with pytest.raises(ValueError, match="STREAMKL_TRITON_SPLIT_K"):
        _env.triton_split_k()
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "off")
    assert _env.triton_split_k() == 1
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "8")
    assert _env.triton_split_k() == 8


def test_split_rule():
    # A grid that fills the SMs is never split; a decode-sized one is, with >= MIN_TILES tiles a split.
    assert _config.split_count(132, 512, 132, None) == 1
    assert _config.split_count(128, 512, 132, None) == 1  # Nq=512 at H=32: measured no gain
    assert _config.split_count(64, 512, 132, None) == 2  # Nq=256: 2 splits measured best
    assert _config.split_count(32, 512, 132, None, block_m=16) == 8  # decode: 8 measured best
    s = _config.split_count(32, 512, 132, None)
    assert s >= 2 and 512 // s >= _config.MIN_TILES
    assert _config.split_count(32, 4, 132, None) == 1  # too few key tiles to share
    assert _config.split_count(4096, 512, 132, 6) == 6


def test_bwd_rule():
    from streamkl.backends.triton import _launch

    cq, ck = _config.bwd_cfgs(128, 128, torch.bfloat16, False, False)  # the H200 table
    assert (cq.block_m, ck.block_n) == (128, 64)
    one = (False, False, True, True)
    assert _launch.choose_bwd(1, 32, 256, 256, 1, 1, one, cq, ck, 132) == "fused"  # 128 + 64 programs
    assert _launch.choose_bwd(1, 32, 1024, 1024, 1, 1, one, cq, ck, 132) == "separate"  # 512 key programs
    assert _launch.choose_bwd(1, 32, 256, 32768, 1, 1, one, cq, ck, 132) == "separate"  # 64 dq programs
    assert _launch.choose_bwd(1, 32, 2048, 32768, 1, 1, one, cq, ck, 132) == "separate"
    assert _launch.choose_bwd(1, 32, 256, 256, 1, 1, (True,) * 4, cq, ck, 132) == "separate"
    # GQA: the key grid counts key-head groups; packed sequences count as the batch
    assert _launch.choose_bwd(1, 32, 512, 512, 4, 4, one, cq, ck, 132) == "fused"  # 64 + 128
    assert _launch.choose_bwd(8, 32, 256, 256, 1, 1, one, cq, ck, 132) == "separate"
    # Nq >> Nk: a small key grid, but the fp32 dq accumulator would grow with Nq: separate
    assert _launch.choose_bwd(1, 1, 1 << 20, 4096, 1, 1, one, cq, ck, 132) == "separate"


# ----------------------------------------------------------------------------------------------
# GPU grid: real tile sizes, 16-bit inputs, compiled kernels.

GPU_CASES = [
    # (b, h, hk1, hk2, nq, nk, d1, d2, causal, layout, std)
    (2, 8, 8, 8, 1, 4096, 128, 128, False, "bhnd", 1.0),  # decode: split-K auto
    (1, 8, 2, 4, 1, 3000, 64, 128, True, "bnhd", 1.0),
    (2, 4, 4, 4, 300, 300, 128, 128, True, "bhnd", 1.0),  # row 0 sees a single key
    (1, 8, 4, 2, 257, 1000, 64, 96, True, "bnhd", 1.0),  # Nq < Nk, D1 != D2, GQA g1 != g2
    (1, 4, 4, 1, 1000, 200, 128, 128, True, "bhnd", 1.0),  # Nq > Nk: 800 rows see nothing
    (2, 4, 2, 2, 513, 777, 256, 32, False, "bnhd", 1.0),
    (1, 4, 4, 4, 200, 300, 128, 128, True, "bhnd", 10.0),  # logits ~1e3-1e4
    (1, 4, 2, 2, 600, 500, 64, 40, True, "bnhd", 1.0),  # the D <= 64 configs; Nq > Nk
]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_grid(case, dtype, strategy, monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "auto")
    b, h, hk1, hk2, nq, nk, d1, d2, causal, layout, std = case
    q1, k1, q2, k2 = make_inputs(
        b=b,
        h=h,
        hk1=hk1,
        hk2=hk2,
        nq=nq,
        nk=nk,
        d1=d1,
        d2=d2,
        dtype=dtype,
        device="cuda",
        layout=layout,
        seed=nq + nk,
        std=std,
    )
    _check(q1, k1, q2, k2, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_varlen(dtype):
    cu = torch.tensor([0, 1, 300, 1024, 1500], dtype=torch.int32, device="cuda")
    q1, k1, q2, k2 = make_inputs(
        b=1,
        h=8,
        hk1=2,
        hk2=4,
        nq=1500,
        nk=1500,
        d1=128,
        d2=64,
        dtype=dtype,
        device="cuda",
        layout="bnhd",
        seed=11,
    )
    _check(q1, k1, q2, k2, causal=True, cu_seqlens=cu, max_seqlen=724)


@pytest.mark.parametrize("causal", [False, True])
def test_through_the_op(causal):
    """streamkl.attn_kl(backend="triton") eager and under torch.compile(fullgraph=True): the
    registered op reaches these kernels and matches the reference backend, forward and grads."""
    import streamkl

    inputs = make_inputs(
        b=1, h=4, hk1=2, hk2=1, nq=24, nk=40, d1=16, d2=24, device=DEVICE, layout="bnhd", seed=3
    )

    def run(backend, compiled=False):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]

        def loss(*t):
            return streamkl.attn_kl(*t, causal=causal, reduction="mean", backend=backend)

        fn = torch.compile(loss, fullgraph=True) if compiled else loss
        out = fn(*leaves)
        out.backward()
        return out.detach(), [t.grad for t in leaves]

    ref_out, ref_grads = run("reference")
    for compiled in (False, True):
        torch._dynamo.reset()
        out, grads = run("triton", compiled)
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        for g, r in zip(grads, ref_grads):
            assert rel_err(g.cpu(), r.cpu()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_through_the_op(causal):
    """The registered op on bf16 CUDA tensors at the H200 table's tiles, eager and under
    torch.compile(fullgraph=True): forward and all four gradients against the float64 oracle
    (test_through_the_op runs fp32 at interpreter sizes, which `-m gpu` leaves out)."""
    import streamkl
    from streamkl.testing import assert_kl_close, grad_tolerance

    inputs = make_inputs(
        b=2,
        h=8,
        hk1=4,
        hk2=2,
        nq=300,
        nk=520,
        d1=128,
        d2=64,
        dtype=torch.bfloat16,
        device="cuda",
        layout="bnhd",
        seed=21,
    )
    rkl, _, _, g, rgrads = _oracle(*inputs, causal, None, grad_seed=4)

    def kl_of(*t):
        return streamkl.attn_kl(*t, causal=causal, backend="triton")

    for compiled in (False, True):
        torch._dynamo.reset()
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        kl = (torch.compile(kl_of, fullgraph=True) if compiled else kl_of)(*leaves)
        assert kl.dtype == torch.float32 and kl.shape == inputs[0].shape[:3]
        assert_kl_close(kl.detach(), rkl, torch.bfloat16)
        kl.backward(g.to(device="cuda", dtype=kl.dtype))
        for leaf, ref in zip(leaves, rgrads):
            assert leaf.grad.dtype == torch.bfloat16 and leaf.grad.shape == leaf.shape
            assert rel_err(leaf.grad.cpu(), ref) <= grad_tolerance(torch.bfloat16)
