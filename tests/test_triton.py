"""What is specific to the triton backend: its backward strategies (separate, fused), split-K,
the key-major kernel's two tile layouts, its selection rules, and the real tile sizes on a GPU.
The contract it shares with every backend is tests/test_backends.py's.

The kernels are called directly (no op layer), checked by the rule of tests/tolerance.py. Without
a GPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on CPU
tensors in float32 at 16 x 16 tiles, so every case crosses tile boundaries, the causal frontier
and the ragged last tile; with a GPU the same cases run compiled, and the `gpu` grid adds
bf16/fp16/fp32 at the tile sizes the tables pick.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from streamkl._spec import AttnKLSpec  # noqa: E402
from streamkl.backends.triton import _config  # noqa: E402
from streamkl.testing import make_inputs  # noqa: E402

from ._calls import triton as tb  # noqa: E402
from .tolerance import Expected  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cpu" if INTERPRET else "cuda"
ALL = (True, True, True, True)
SETTING1 = (False, False, True, True)  # teacher fixed: grads of q2, k2
SETTING2 = (True, True, False, False)  # target fixed: grads of q1, k1


def _scales(q1, q2):
    return 1 / math.sqrt(q1.shape[-1]), 1 / math.sqrt(q2.shape[-1])


def _run(q1, k1, q2, k2, *, causal=False, cu_seqlens=None, max_seqlen=None, needs=ALL):
    s1, s2 = _scales(q1, q2)
    kw = dict(causal=causal, scale1=s1, scale2=s2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    kl, lse1, lse2 = tb.forward(q1, k1, q2, k2, **kw)
    return kl, lse1, lse2, kw


def _check(q1, k1, q2, k2, *, causal=False, cu_seqlens=None, max_seqlen=None, needs=ALL):
    """Forward kl/lse and the needed grads against the oracle, by the rule; returns the grads."""
    assert tb.supports(q1, k1, q2, k2, cu_seqlens) is None
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    for t in (kl, lse1, lse2):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == q1.shape[:3]
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = Expected((q1, k1, q2, k2), causal=causal, cu_seqlens=cu_seqlens, grad=g.float().double())
    expected.check_kl(kl)
    expected.check_lse(lse1, lse2)
    grads = tb.backward(g.float().to(q1.device), q1, k1, q2, k2, kl, lse1, lse2, needs=needs, **kw)
    for got in grads:
        assert got is None or got.is_contiguous()
    expected.check_grads(grads, (q1, k1, q2, k2), needs)
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


def _case_inputs(case):
    """(q1, k1, q2, k2) of one CASES entry and its causal flag."""
    b, h, hk1, hk2, nq, nk, d1, d2, causal, layout = case
    inputs = make_inputs(
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
    return inputs, causal


def _check_case(case):
    """Forward and all four gradients of one CASES entry against the oracle."""
    (q1, k1, q2, k2), causal = _case_inputs(case)
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
    "on a GPU; test_gpu_grid covers the layouts the H200 table picks",
)
@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
@pytest.mark.parametrize("case", CASES[1:4], ids=lambda c: "-".join(map(str, c)))
def test_other_key_major_tile_layout(case, strategy, monkeypatch):
    # The key-major kernel's tiles in the layout (Cfg.qrows) the interpreter's table does not
    # pick, all four gradients (the other layout runs in every test above): between them, dk
    # from dS in registers and transposed through shared memory, fused dq the other way round.
    from streamkl.backends.triton import _launch

    (q1, k1, q2, k2), causal = _case_inputs(case)
    kl, lse1, lse2, kw = _run(q1, k1, q2, k2, causal=causal)
    g = torch.randn(kl.shape, generator=torch.Generator().manual_seed(0))
    other = _config.Cfg(16, 16, 4, 1, qrows=not _config.INTERPRET_BWD_K_CFG.qrows)
    _launch.bwd_plan.cache_clear()  # plans are cached per call spec: rebuild them with this layout
    monkeypatch.setattr(_config, "INTERPRET_BWD_K_CFG", other)
    try:
        grads = tb.backward(g.to(q1.device), q1, k1, q2, k2, kl, lse1, lse2, needs=ALL, **kw)
    finally:
        _launch.bwd_plan.cache_clear()
    Expected((q1, k1, q2, k2), causal=causal, grad=g.double()).check_grads(grads, (q1, k1, q2, k2))


@contextlib.contextmanager
def _environment(**values):
    """Sets environment variables for one hypothesis example (function-scoped fixtures are not
    reset between examples)."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
# Each example runs the interpreter for seconds; the explicit grids above hold every axis, so a
# dozen random problems look for what falls between them.
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    _random_problems(),
    st.booleans(),
    st.sampled_from(["separate", "fused"]),
    st.sampled_from(["off", "auto", "3"]),
)
def test_random_problems_against_oracle(problem, causal, strategy, split):
    """Forward kl/lse and all four gradients on random problems, each backward strategy and
    split-K setting, against the float64 oracle by the rule of tests/tolerance.py."""
    q1, k1, q2, k2 = make_inputs(**problem, device=DEVICE)
    with _environment(STREAMKL_TRITON_BWD=strategy, STREAMKL_TRITON_SPLIT_K=split):
        _check(q1, k1, q2, k2, causal=causal)


@pytest.mark.skipif(
    not INTERPRET,
    reason="on a GPU each random head dim compiles new fp32 kernels; "
    "test_gpu_varlen covers the compiled kernels",
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    with _environment(STREAMKL_TRITON_BWD=strategy):
        _check(q1, k1, q2, k2, causal=causal, cu_seqlens=cu, max_seqlen=max(lengths) + slack)


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
    """The forward and the separate backward's dq launch split over the keys (the fused
    backward has no dq launch: the split setting reaches its forward alone, the same as here):
    all four gradients against the oracle, the KL equal to the unsplit one."""
    monkeypatch.setenv("STREAMKL_TRITON_BWD", "separate")
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", splits)
    q1, k1, q2, k2 = make_inputs(b=2, h=2, hk1=1, hk2=2, nq=nq, nk=nk, d1=16, d2=32, device=DEVICE, seed=nq)
    _check(q1, k1, q2, k2, causal=causal)
    kl_split = _run(q1, k1, q2, k2, causal=causal)[0]
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "off")
    kl_unsplit = _run(q1, k1, q2, k2, causal=causal)[0]
    assert torch.allclose(kl_split, kl_unsplit, rtol=1e-5, atol=1e-6)


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


def test_backward_splits_dq_only_for_few_query_rows():
    """The separate backward's dq launch follows the forward's split rule: decode-like grids (32
    heads of 16 rows against 128K keys) split the keys, a full grid (8K rows) does not; forced
    counts win; packed sequences never split."""
    from streamkl.backends.triton import _launch

    def plan(rows, nk, heads=32, varlen=False, forced=None):
        # D = 128; varlen: one packed sequence of `rows` tokens (queries and keys)
        nk = rows if varlen else nk
        packed = rows if varlen else None
        spec = AttnKLSpec(1, heads, heads, heads, rows, nk, 128, 128, False, 1.0, 1.0, 1, packed, varlen,
                          (False, False, True, True))  # fmt: skip
        return _launch.bwd_plan(spec, torch.bfloat16, torch.device(DEVICE), "separate", forced)

    decode = plan(16, 131072)
    split_len = decode.dq_scalars[-3]  # the dq kernel's keys per split
    assert decode.dq_splits > 1 and decode.dq_grid[0] == decode.dq_splits
    assert split_len * decode.dq_splits >= 131072 > split_len * (decode.dq_splits - 1)
    assert plan(8192, 8192).dq_splits == 1
    assert plan(256, 65536, heads=1).dq_splits > 1 and plan(256, 65536, heads=1, varlen=True).dq_splits == 1
    assert plan(16, 131072, forced=1).dq_splits == 1 and plan(8192, 8192, forced=3).dq_splits == 3


def test_split_k_rows_that_see_nothing(monkeypatch):
    monkeypatch.setenv("STREAMKL_TRITON_BWD", "separate")
    monkeypatch.setenv("STREAMKL_TRITON_SPLIT_K", "3")
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=20, nk=10, d1=16, d2=16, device=DEVICE, seed=4)
    _check(q1, k1, q2, k2, causal=True, needs=SETTING1)


@pytest.mark.parametrize("strategy", ["separate", "fused"], indirect=True)
def test_large_logits(strategy):
    # Logits of magnitude ~1e4 (q, k with std 50 at D = 16): one-hot rows, no NaN/inf anywhere;
    # the target-fixed gradients there are cancellation residues, which the rule's floor covers.
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=24, nk=30, d1=16, d2=16, device=DEVICE, seed=9, std=50.0)
    assert (q1[0, 0] @ k1[0, 0].T / 4).abs().max() > 3e3
    _check(q1, k1, q2, k2, causal=True, needs=ALL)


def test_supports_reasons(monkeypatch):
    q1, k1, q2, k2 = make_inputs(b=1, h=2, nq=4, nk=4, d1=16, d2=16, device=DEVICE)
    assert tb.supports(q1, k1, q2, k2, None) is None
    assert "float64" in tb.supports(q1.double(), k1.double(), q2.double(), k2.double(), None)
    mixed = tb.supports(q1, k1, q2.double().float().to(torch.bfloat16), k2.to(torch.bfloat16), None)
    assert "one dtype" in mixed
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


@pytest.mark.gpu
def test_gpu_launch_cache_skips_binding_and_computes_the_same(monkeypatch):
    """A launch seen before goes straight to the compiled kernel and gives bit-equal results;
    inputs of another alignment bind (and specialize) again and still pass the rule."""
    from streamkl.backends.triton import _launch

    monkeypatch.setattr(_launch, "_SEEN", {})
    binds = []
    for kernel in (
        _launch._fwd_kernel,
        _launch._merge_kernel,
        _launch._bwd_dk_kernel,
        _launch._bwd_dq_kernel,
    ):
        run = kernel.run

        def counted(*args, run=run, **kwargs):
            binds.append(1)
            return run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted, raising=False)
    shape = dict(b=1, h=4, hk1=2, hk2=1, nq=300, nk=300, d1=128, d2=64, dtype=torch.bfloat16, device="cuda")
    inputs = make_inputs(**shape, layout="bhnd", seed=3)  # contiguous: a shifted copy keeps the strides
    first = _check(*inputs, causal=True)
    bound = len(binds)
    assert bound >= 2
    again = _check(*inputs, causal=True)
    assert len(binds) == bound, "a launch seen before bound its arguments again"
    for a, b in zip(first, again):
        assert torch.equal(a, b)

    def off_by_8_bytes(t):
        buf = torch.empty(t.numel() + 4, dtype=t.dtype, device=t.device)[4:].view(t.shape)
        return buf.copy_(t)

    shifted = tuple(off_by_8_bytes(t) for t in inputs)
    assert all(t.data_ptr() % 16 == 8 and t.stride() == u.stride() for t, u in zip(shifted, inputs))
    _check(*shifted, causal=True)
    assert len(binds) > bound


@pytest.mark.gpu
def test_gpu_launch_hooks_see_launches_already_seen(monkeypatch):
    """With a Triton launch hook set (its profilers), a launch seen before goes through Triton,
    so the hook runs for it."""
    import triton

    from streamkl.backends.triton import _launch

    monkeypatch.setattr(_launch, "_SEEN", {})
    inputs = make_inputs(b=1, h=2, nq=64, nk=64, d1=64, d2=64, dtype=torch.bfloat16, device="cuda")
    _run(*inputs)
    seen = []
    hooks = triton.knobs.runtime.launch_enter_hook
    hook = seen.append
    hooks.add(hook)
    try:
        _run(*inputs)
    finally:
        hooks.remove(hook)
    assert seen, "the launch hook did not run"
