"""The cuda backend's forward (streamkl/backends/cuda): every shipped kernel instantiation
compiles for sm_90a within its register and shared-memory budget with no spills (CPU: NVRTC
needs no GPU); which inputs `supports` admits; and, on an sm_90 GPU (marked gpu), the kernel
against the float64 oracle at tile edges, on strided and transposed views read in place, at
extreme logits, through the op with the triton backward behind it, and the lagged running max
on the cases where it must take its exact side.

The op-level contract (reductions, empty rows, gradients, opcheck, torch.compile) is
tests/test_backends.py's, which runs on this backend wherever its `supports` admits the inputs.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import streamkl
from streamkl import _checks, _dispatch
from streamkl._spec import AttnKLInputs, AttnKLStats
from streamkl.testing import make_inputs

from .tolerance import Expected

pytest.importorskip("cuda.core")

from streamkl.backends.cuda import _bwd, _jit, _launch  # noqa: E402
from streamkl.backends.cuda import attn_kl as backend  # noqa: E402


def _on_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


gpu = pytest.mark.gpu
sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm_90 GPU")


# ---- CPU: the builds ----


def _build_id(c):
    decode = "-decode" if c["DECODE"] else ""
    return f"{'fp16' if c['KL_FP16'] else 'bf16'}-d{c['D1P']}x{c['D2P']}-s{c['STAGES']}{decode}"


@pytest.mark.parametrize("consts", _launch.shipped_instantiations(), ids=_build_id)
def test_shipped_kernels_compile_within_budget(consts):
    """Each instantiation compiles once (the disk cache keeps it for the next run); both entry
    points within the launch's register budget, no spill, no stack, no serialized wgmma."""
    build = _launch.build(consts)
    budget = min(255, (65536 // _launch.THREADS) // 8 * 8)  # what __launch_bounds__(THREADS, 1) allows
    assert build.registers <= budget, build.log
    assert build.spill_bytes == 0 and build.stack_bytes == 0, build.log
    combine = _jit._resources(build.log, _launch.COMBINE)
    assert combine["spill_stores"] == combine["spill_loads"] == combine["stack"] == 0, build.log
    assert "serialized" not in build.log and "warning" not in build.log.lower(), build.log
    assert _launch.smem_bytes(consts) <= _launch.SMEM_LIMIT


def _bwd_id(c):
    return f"{'fp16' if c['KL_FP16'] else 'bf16'}-d{c['D1P']}x{c['D2P']}-s{c['QSTAGES']}"


@pytest.mark.parametrize("consts", _bwd.shipped_instantiations(), ids=_bwd_id)
def test_backward_kernels_compile_within_budget(consts):
    """Every backward instantiation compiles for sm_90a within the launch's register budget, with
    no spill, no stack and no serialized wgmma, in the shared memory its launch asks for."""
    build = _bwd.build(consts)
    assert build.registers <= min(255, (65536 // _bwd.THREADS) // 8 * 8), build.log
    assert build.spill_bytes == 0 and build.stack_bytes == 0, build.log
    assert "serialized" not in build.log and "warning" not in build.log.lower(), build.log
    assert _bwd.smem_bytes(consts) <= _launch.SMEM_LIMIT


def test_backward_declines_what_it_does_not_run(monkeypatch):
    """The cuda backward runs by default (STREAMKL_CUDA_BWD=triton turns it off), one side's
    gradients a call (any of q2, k2: setting 1; any of q1, k1: setting 2) on dense inputs whose
    other side's GQA group is a multiple of the differentiated side's; the rest goes to triton's
    (backward_of)."""
    q = torch.empty(1, 4, 8, 64, dtype=torch.bfloat16)
    spec, inputs = _spec((q, q, q, q))
    monkeypatch.delenv("STREAMKL_CUDA_BWD", raising=False)
    assert backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs) is None
    monkeypatch.setenv("STREAMKL_CUDA_BWD", "triton")
    assert "STREAMKL_CUDA_BWD=triton" in backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs)
    monkeypatch.setenv("STREAMKL_CUDA_BWD", "fast")
    with pytest.raises(ValueError, match="STREAMKL_CUDA_BWD"):
        backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs)
    monkeypatch.setenv("STREAMKL_CUDA_BWD", "cuda")
    k2 = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16)
    spec, inputs = _spec((q, q, q, k2))  # g1 = 1, g2 = 2
    assert "teacher's GQA group" in backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs)
    assert backend.backward_declines(spec.with_needs(_bwd.SETTING2), inputs) is None
    spec, inputs = _spec((q, k2, q, q))  # g1 = 2, g2 = 1
    assert backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs) is None
    assert "student's GQA group" in backend.backward_declines(spec.with_needs(_bwd.SETTING2), inputs)
    spec, inputs = _spec((q, k2, q, k2))
    triton = _dispatch.implementation("triton", "attn_kl")
    one_side = (_bwd.SETTING1, _bwd.SETTING2, (False, False, True, False), (False, True, False, False))
    both_sides = ((True,) * 4, (True, False, True, False), (False, True, False, True))
    for needs in one_side + both_sides:  # both sides at 8 query rows: one launch each
        assert backend.backward_declines(spec.with_needs(needs), inputs) is None
        assert _dispatch.backward_of(backend, spec.with_needs(needs), inputs) is backend
    assert _bwd.sides((False,) * 4) == () and _bwd.sides((True,) * 4) == (1, 2)
    long_q = torch.empty(1, 4, 65, 64, dtype=torch.bfloat16)
    spec_65, inputs_65 = _spec((long_q, k2, long_q, k2))
    for needs in both_sides:
        assert "both sides" in backend.backward_declines(spec_65.with_needs(needs), inputs_65)
        assert _dispatch.backward_of(backend, spec_65.with_needs(needs), inputs_65) is triton
    for needs in one_side:
        assert backend.backward_declines(spec_65.with_needs(needs), inputs_65) is None
    odd = torch.empty(1, 4, 8, 63, dtype=torch.bfloat16)
    spec_odd, inputs_odd = _spec((q, q, odd, odd))
    assert "(D2)" in backend.backward_declines(spec_odd.with_needs(_bwd.SETTING1), inputs_odd)
    assert backend.backward_declines(spec_odd.with_needs(_bwd.SETTING2), inputs_odd) is None
    spec_odd, inputs_odd = _spec((odd, odd, q, q))
    assert "(D1)" in backend.backward_declines(spec_odd.with_needs(_bwd.SETTING2), inputs_odd)
    packed = torch.empty(1, 4, 16, 64, dtype=torch.bfloat16)
    spec_p, inputs_p = _spec(
        (packed,) * 4, cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32), max_seqlen=11
    )
    assert "packed" in backend.backward_declines(spec_p.with_needs(_bwd.SETTING1), inputs_p)
    none = torch.empty(1, 0, 8, 64, dtype=torch.bfloat16)  # no query head: asked without dividing by H
    spec_0, inputs_0 = _spec((none, q[:, :1], none, q[:, :1]))
    assert backend.backward_declines(spec_0.with_needs(_bwd.SETTING1), inputs_0) is None
    # a direct call of what it declines is refused by name, before any launch (no GPU here)
    with pytest.raises(NotImplementedError, match="both sides"):
        backend.backward(spec_65.with_needs((True,) * 4), inputs_65, None, None)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert "deterministic" in backend.backward_declines(spec.with_needs(_bwd.SETTING1), inputs)


def test_backward_launch_plan(monkeypatch):
    """One CTA per key tile above 64 query rows; at 64 or fewer about one CTA per SM for the key
    heads of the differentiated side (never more CTAs than key tiles, at least one a head), with
    the two-K-stage build."""
    monkeypatch.setattr(_bwd, "_sm_count", lambda index: 132)
    q = torch.empty(2, 32, 64, 64, dtype=torch.bfloat16)
    k1 = torch.empty(2, 4, 32768, 64, dtype=torch.bfloat16)
    k2 = torch.empty(2, 8, 32768, 64, dtype=torch.bfloat16)
    spec, _ = _spec((q, k1, q, k2))
    assert _bwd.launch_plan(spec, 1, 0) == (2, (8, 8, 2))  # 132 // 16 CTAs a key head of the student
    assert _bwd.launch_plan(spec, 2, 0) == (2, (16, 4, 2))
    spec, _ = _spec((q[:, :, :1], k1[:, :, :300], q[:, :, :1], k2[:, :, :300]))
    assert _bwd.launch_plan(spec, 1, 0) == (2, (3, 8, 2))  # 3 key tiles
    q_wide, k_wide = torch.empty(2, 256, 1, 64, dtype=torch.bfloat16), torch.empty(2, 256, 300, 64)
    spec, _ = _spec((q_wide, k_wide.bfloat16(), q_wide, k_wide.bfloat16()))
    assert _bwd.launch_plan(spec, 1, 0) == (2, (1, 256, 2))  # more key heads x batch than SMs
    long_q = torch.empty(2, 32, 65, 64, dtype=torch.bfloat16)
    spec, _ = _spec((long_q, k1, long_q, k2))
    assert _bwd.launch_plan(spec, 1, 0) == (1, (256, 8, 2))


def test_every_supported_head_dim_has_a_shipped_kernel():
    shipped = {(c["D1P"], c["D2P"], c["KL_FP16"]) for c in _launch.shipped_instantiations()}
    for d1 in range(1, _launch.MAX_D + 1):
        for d2 in (1, 64, 65, 128):
            for fp16 in (0, 1):
                assert (_launch.padded_dim(d1), _launch.padded_dim(d2), fp16) in shipped


def test_tma_layout_rules():
    """The strides TMA addresses in place: (B, N, H, D) transposed views and fused QKV slices
    yes; a base off 16 bytes, a strided last dim or rows of 3 elements no."""
    q = torch.empty(2, 40, 3, 4, 64, dtype=torch.bfloat16)  # (B, N, qkv, H, D)
    assert _launch.tma_reason(q[:, :, 0].transpose(1, 2), "q1") is None
    assert _launch.tma_reason(torch.empty(1, 2, 9, 16, dtype=torch.float16), "q1") is None
    assert "16-byte" in _launch.tma_reason(
        torch.empty(1000, dtype=torch.bfloat16)[3:515].view(1, 2, 16, 16), "k1"
    )
    assert "last dim" in _launch.tma_reason(torch.empty(1, 2, 16, 64, dtype=torch.bfloat16).mT, "k1")
    assert "strides" in _launch.tma_reason(torch.empty(1, 2, 16, 3, dtype=torch.bfloat16), "q2")
    assert _launch.tma_reason(torch.empty(1, 1, 1, 3, dtype=torch.bfloat16), "q2") is None  # one row


def test_tma_rules_answer_each_tensor_not_its_shape():
    """The rules' cache (the op asks them every call) keys on alignment, strides and element size
    as well as the shape, and names the tensor asked about."""
    buf = torch.empty(4096, dtype=torch.bfloat16)
    base = -buf.data_ptr() // 2 % 8  # elements to a 16-byte boundary
    aligned = buf[base : base + 2048].view(1, 2, 16, 64)
    shifted = buf[base + 1 : base + 2049].view(1, 2, 16, 64)  # the same shape and strides, off by 2 bytes
    assert _launch.tma_reason(aligned, "q1") is None
    assert _launch.tma_reason(shifted, "k2").startswith("k2 does not start on a 16-byte boundary")
    assert _launch.tma_reason(shifted, "q1").startswith("q1 ")
    # the same shape and strides in elements: 8-byte rows in bf16, 16-byte rows in float32
    rows_of_4 = [torch.empty(1, 2, 16, 4, dtype=dtype) for dtype in (torch.bfloat16, torch.float32)]
    assert "strides (128, 64, 4, 1)" in _launch.tma_reason(rows_of_4[0], "q2")
    assert _launch.tma_reason(rows_of_4[1], "q2") is None


def test_split_k_fills_the_sms_only_where_the_row_tiles_do_not():
    sms = 132
    for tile in (64, 128):
        # decode: 32 heads, one row tile each, 32K keys -> split
        assert _launch.splits_for(32, 32768 // tile, 1, sms, tile) > 1
        # 8K x 8K over 32 heads in 128-row tiles (2048 CTAs) and a full wave stay unsplit
        assert _launch.splits_for(2048, 8192 // tile, 1, sms, tile) == 1
        assert _launch.splits_for(132, 131072 // tile, 1, sms, tile) == 1
        # causal: 4K-16K over 32 heads in 192-row tiles stay unsplit (the longest start first and
        # the short ones fill the last wave); causal decode rows see nearly every key -> split
        for n in (4096, 8192, 16384):
            assert _launch.splits_for(-(-n // 192) * 32, n // tile, 1, sms, tile, (n, n, 192)) == 1
        assert _launch.splits_for(32, 32768 // tile, 1, sms, tile, (64, 32768, 192)) > 1
        # a causal grid of alike CTAs (one row tile per head, every row seeing nearly every key)
        # splits as the unmasked one: 5 ways at 32 heads would make 160 CTAs, a second wave for 28
        for nq, nk in ((1, 32768), (16, 32768), (64, 131072)):
            unmasked = _launch.splits_for(32, nk // tile, 1, sms, tile)
            assert _launch.splits_for(32, nk // tile, 1, sms, tile, (nq, nk, 192)) == unmasked == 4
        for heads, nq, nk in itertools.product((1, 8, 100), (1, 192), (4096, 131072)):
            causal = _launch.splits_for(heads, nk // tile, 1, sms, tile, (nq, nk, 192))
            assert causal == _launch.splits_for(heads, nk // tile, 1, sms, tile)
        # two row tiles a head of nearly the same length (256 rows): 64 CTAs, split as if alike
        assert _launch.splits_for(64, 32768 // tile, 1, sms, tile, (256, 32768, 192)) == 2
        grids = [(1, 1, 1), (1, 7, 1), (3, 10_000, 1), (40_000, 2, 40_000), (2, 4096, 65535)]
        for ctas, tiles, batch in grids:
            for causal in (None, (ctas * 64, tiles * tile, 64), (1, tiles * tile, 64)):
                s = _launch.splits_for(ctas, tiles, batch, sms, tile, causal)
                assert 1 <= s <= max(1, tiles * tile // _launch.MIN_KEYS_PER_SPLIT) and batch * s <= 65535


def test_tail_splits_only_a_partial_last_wave():
    sms = 132
    # 4K and 8K over 32 heads in 192-row tiles: 704 and 1376 row tiles, the last 44 and 56 split
    # as many ways as one wave holds; 16K's last wave (112 of 132) has no room for a split
    assert _launch.tail_for(704, 64, sms) == (660, 3)
    assert _launch.tail_for(1376, 128, sms) == (1320, 2)
    assert _launch.tail_for(2752, 256, sms) == (0, 0)
    for units in (100, 132, 264):  # one wave or less, a full last wave
        assert _launch.tail_for(units, 64, sms) == (0, 0)
    assert _launch.tail_for(704, 3, sms) == (0, 0)  # fewer than two key tiles a split
    assert _launch.tail_for(150, 16, sms) == (132, 6)  # 7 ways would leave the last share empty
    for units, key_tiles in itertools.product(range(133, 2000, 7), (4, 16, 17, 64)):
        t0, s = _launch.tail_for(units, key_tiles, sms)
        if s:  # within one wave, every split's contiguous share of key tiles non-empty
            per = -(-key_tiles // s)
            assert t0 == units - units % sms and 2 <= s and (units - t0) * s <= sms
            assert (s - 1) * per < key_tiles


def _spec(inputs, causal=False, scale1=None, scale2=None, cu_seqlens=None, max_seqlen=None):
    call = dict(causal=causal, scale1=scale1, scale2=scale2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    return _checks.attn_kl_spec(*inputs, **call), AttnKLInputs(*inputs, cu_seqlens)


def test_supports_refuses_what_it_cannot_run_on_cpu():
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    assert "CUDA tensors" in backend.supports(*_spec((q, q, q, q)))
    assert backend.backward_backend == "triton"


# ---- GPU: the kernel against the oracle ----


def _forward(inputs, causal, scale1=None, scale2=None, cu_seqlens=None, max_seqlen=None):
    return backend.forward(*_spec(inputs, causal, scale1, scale2, cu_seqlens, max_seqlen))


def _check(inputs, causal, **scales):
    assert backend.supports(*_spec(inputs, causal, **scales)) is None
    kl, lse1, lse2 = _forward(inputs, causal, **scales)
    torch.cuda.synchronize()
    expected = Expected(inputs, causal=causal, **scales)
    expected.check_kl(kl)
    expected.check_lse(lse1, lse2)
    return kl


def _poisoned_forward(inputs, causal, s1, s2, cu_seqlens=None, max_seqlen=None):
    """The launch into memory that held NaN: the caching allocator hands the three freed
    (B, H, Nq) float32 blocks back to the launch's outputs, so a row the kernel does not write
    stays NaN."""
    poison = [torch.full(inputs[0].shape[:3], float("nan"), device="cuda") for _ in range(3)]
    del poison
    return _forward(inputs, causal, s1, s2, cu_seqlens, max_seqlen)


def _check_poisoned(inputs, causal, s1, s2):
    """The shipped launch into poisoned outputs, against the float64 oracle: every row is
    written, and written right."""
    kl, lse1, lse2 = _poisoned_forward(inputs, causal, s1, s2)
    torch.cuda.synchronize()
    expected = Expected(inputs, causal=causal, scale1=s1, scale2=s2)
    expected.check_kl(kl)
    expected.check_lse(lse1, lse2)


@pytest.fixture
def schedule(monkeypatch):
    """Sets the causal head group and the split count the launch plans with (the plan cache is
    cleared around it)."""

    def use(hgroup, splits):
        monkeypatch.setattr(_launch, "CAUSAL_HEAD_GROUP", hgroup)
        monkeypatch.setattr(_launch, "splits_for", lambda *args, **kwargs: splits)
        _launch._plan.cache_clear()

    yield use
    _launch._plan.cache_clear()


# (nq, nk): below one tile, one tile, a key past it, ragged, Nq != Nk both ways.
EDGES = [(1, 1), (5, 7), (64, 64), (65, 63), (127, 129), (128, 128), (129, 257), (200, 77), (77, 300)]


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", EDGES)
def test_tile_edges(nq, nk, causal):
    for dtype in (torch.bfloat16, torch.float16):
        inputs = make_inputs(b=2, h=4, hk1=2, hk2=1, nq=nq, nk=nk, d1=128, d2=64, dtype=dtype, device="cuda",
                             seed=nq * 7 + nk)  # fmt: skip
        _check(inputs, causal)


@gpu
@sm90
@pytest.mark.parametrize("hgroup", [1, 5, 8, 12])
def test_every_head_group_order_covers_the_grid(hgroup, schedule):
    """The grid's order in groups of heads (kernels/schedule.cuh), a last group smaller than the
    others included: every row of every head is written, and written right, with and without
    split-K."""
    inputs = make_inputs(b=2, h=12, hk1=4, hk2=3, nq=700, nk=900, d1=128, d2=64, dtype=torch.bfloat16,
                         device="cuda", seed=hgroup)  # fmt: skip
    s1, s2 = 1 / math.sqrt(128), 1 / math.sqrt(64)
    for splits in (1, 3):
        schedule(hgroup, splits)
        _check_poisoned(inputs, True, s1, s2)


# (nq, nk, hk1, hk2): few query rows against many keys, where split-K runs (one row tile per head,
# a handful of heads), with ragged ends, one idle consumer warpgroup (nq <= 64) or none.
DECODE = [(1, 4099, 4, 4), (3, 1000, 2, 1), (64, 2048, 4, 2), (65, 3333, 1, 4), (200, 5000, 4, 4)]


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk,hk1,hk2", DECODE)
def test_split_k_decode_shapes(nq, nk, hk1, hk2, causal):
    h = 4
    bm, bn = _launch.BM, _launch.BN
    assert _launch.splits_for(-(-nq // bm) * h, -(-nk // bn), 1, _launch._sm_count(0), bn) > 1
    for dtype, std in ((torch.bfloat16, 1.0), (torch.float16, 3.0)):
        inputs = make_inputs(h=h, hk1=hk1, hk2=hk2, nq=nq, nk=nk, d1=128, d2=64, dtype=dtype, device="cuda",
                             seed=nq + nk, std=std)  # fmt: skip
        s1, s2 = 1 / math.sqrt(128), 1 / math.sqrt(64)
        _check_poisoned(inputs, causal, s1, s2)


@gpu
@sm90
@pytest.mark.parametrize("h", [32, 4])
@pytest.mark.parametrize("d", [128, 64])
def test_decode_long_key_loops_repeated(h, d):
    """One query row against 32K keys: every CTA streams a long share of key tiles through the ring,
    where out-of-order TMA completions reach a stage's barrier (kernels/params.cuh, DECODE);
    launched again and again into poisoned outputs, each launch against the float64 oracle."""
    inputs = make_inputs(h=h, nq=1, nk=32768, d1=d, d2=d, dtype=torch.bfloat16, device="cuda", seed=h + d)
    s = 1 / math.sqrt(d)
    expected = Expected(inputs, causal=False, scale1=s, scale2=s)
    for _ in range(10):
        kl, lse1, lse2 = _poisoned_forward(inputs, False, s, s)
        torch.cuda.synchronize()
        expected.check_kl(kl)
        expected.check_lse(lse1, lse2)


@gpu
@sm90
@pytest.mark.parametrize("b,h,hk1,hk2,nq,nk,d1,d2", [(1, 32, 32, 32, 1000, 1000, 128, 128),
                                                    (2, 16, 4, 8, 1000, 700, 128, 64),
                                                    (1, 24, 24, 3, 1100, 2001, 64, 64),
                                                    (1, 25, 25, 25, 1100, 1024, 64, 64)])  # fmt: skip
def test_tail_split_grids(b, h, hk1, hk2, nq, nk, d1, d2):
    """Unmasked grids of more than one wave whose last partial wave is split (TAIL): every row of
    the split row tiles and of the others written, and written right, over batches and GQA."""
    units = b * h * -(-nq // _launch.BM)
    assert _launch.tail_for(units, -(-nk // _launch.BN), _launch._sm_count(0))[1] >= 2
    for dtype in (torch.bfloat16, torch.float16):
        inputs = make_inputs(b=b, h=h, hk1=hk1, hk2=hk2, nq=nq, nk=nk, d1=d1, d2=d2, dtype=dtype,
                             device="cuda", layout="bnhd", seed=units + nk)  # fmt: skip
        _check_poisoned(inputs, False, 1 / math.sqrt(d1), 1 / math.sqrt(d2))


# Packed sequence lengths: empty ones, one row, tile edges and ragged ends, next to long ones
# (a few heads: the long sequences' row tiles are split-K's) and many short ones.
PACKED = [[0, 130, 1, 300, 64, 0, 257, 128], [4000, 3, 129, 2500], [17] * 40 + [1000]]


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", PACKED, ids=lambda ls: f"{len(ls)}seqs-max{max(ls)}")
def test_packed_sequences(lengths, causal):
    """cu_seqlens through the kernel against the float64 oracle, into poisoned outputs: every
    row of every sequence written, no key of a neighbouring sequence seen; a max_seqlen above
    the longest one only adds row tiles that exit."""
    import itertools

    total = sum(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    for dtype, d1, d2, hk2, extra in ((torch.bfloat16, 128, 64, 1, 0), (torch.float16, 64, 128, 2, 200)):
        inputs = make_inputs(h=2, hk1=2, hk2=hk2, nq=total, nk=total, d1=d1, d2=d2, dtype=dtype,
                             device="cuda", layout="bnhd", seed=total + d1)  # fmt: skip
        s1, s2 = 1 / math.sqrt(d1), 0.1
        assert backend.supports(*_spec(inputs, causal, s1, s2, cu)) is None
        kl, lse1, lse2 = _poisoned_forward(inputs, causal, s1, s2, cu, max(lengths) + extra)
        torch.cuda.synchronize()
        expected = Expected(inputs, causal=causal, scale1=s1, scale2=s2, cu_seqlens=cu)
        expected.check_kl(kl)
        expected.check_lse(lse1, lse2)


@gpu
@sm90
@pytest.mark.parametrize("d1,d2", [(64, 64), (64, 128), (128, 64), (128, 128), (16, 40), (96, 8), (120, 72)])
def test_head_dims(d1, d2):
    inputs = make_inputs(h=2, nq=150, nk=190, d1=d1, d2=d2, dtype=torch.bfloat16, device="cuda", seed=d1 + d2)
    for causal in (False, True):
        _check(inputs, causal, scale1=0.11, scale2=-0.07)  # a negative scale flips max and min


@gpu
@sm90
def test_transposed_and_sliced_views_are_read_in_place():
    """(B, N, H, D) storage passed as .transpose(1, 2) and the q, k slices of a fused QKV
    projection: no copy (the tensor maps address the views' own memory)."""
    qkv1 = torch.randn(2, 300, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    qkv2 = torch.randn(2, 300, 3, 4, 64, device="cuda", dtype=torch.bfloat16)
    inputs = (qkv1[:, :, 0].transpose(1, 2), qkv1[:, :, 1].transpose(1, 2),
              qkv2[:, :, 0].transpose(1, 2), qkv2[:, :, 2].transpose(1, 2))  # fmt: skip
    before = torch.cuda.memory_allocated()
    kl, _, _ = _forward(inputs, True)
    assert torch.cuda.memory_allocated() - before <= 3 * kl.numel() * 4 + 3 * 512  # the outputs only
    _check(inputs, True)
    _check(inputs, False)


@gpu
@sm90
def test_poisoned_outputs_are_overwritten_and_rows_that_see_nothing_are_empty():
    inputs = make_inputs(h=2, nq=300, nk=100, d1=64, d2=64, dtype=torch.bfloat16, device="cuda", seed=1)
    torch.cuda.empty_cache()
    for _ in range(2):  # the caching allocator hands back memory holding the previous results
        poison = torch.full((3, 2, 300), float("nan"), device="cuda")
        del poison
        kl, lse1, lse2 = _forward(inputs, True)
        assert torch.isfinite(kl).all()
        assert (kl[:, :, :200] == 0).all() and torch.isneginf(lse1[:, :, :200]).all()
        assert torch.isfinite(lse2[:, :, 200:]).all()
    _check(inputs, True)


@gpu
@sm90
@pytest.mark.parametrize("std", [10.0, 50.0])
def test_extreme_logits_stay_finite(std):
    """|S| up to ~1e4 at D = 128: one-hot rows on both sides, no NaN or inf, within the rule."""
    inputs = make_inputs(
        h=2, nq=130, nk=260, d1=128, d2=128, dtype=torch.bfloat16, device="cuda", seed=4, std=std
    )
    s = inputs[0][0, 0].double() @ inputs[1][0, 0].double().T / math.sqrt(128)
    assert s.abs().max() > (300 if std < 20 else 8e3)
    for causal in (False, True):
        kl = _check(inputs, causal)
        assert torch.isfinite(kl).all()


def _late_and_growing_keys(inputs):
    """k1 with its last 5 keys 40x larger (a jump of thousands in exp2 units in the last tile)
    and k2 growing from 0.2x to 3x along the keys (the row max rises over many tiles)."""
    q1, k1, q2, k2 = inputs
    k1 = k1.clone()
    k1[:, :, -5:] *= 40
    grow = torch.linspace(0.2, 3.0, k2.shape[2], device=k2.device, dtype=torch.float32)
    return q1, k1, q2, (k2.float() * grow[:, None]).to(k2.dtype)


# (h, hk1, hk2, nq, nk, d1, d2, dtype, std, scale1, scale2, late): extreme logits (|S| ~ 1e4),
# ragged causal with rows that see nothing, GQA, D1 != D2, a negative scale, late and growing maxima.
LAG_CASES = [
    (2, 2, 2, 130, 700, 128, 128, torch.bfloat16, 50.0, None, None, False),
    (4, 2, 1, 300, 777, 128, 64, torch.bfloat16, 1.0, None, None, False),
    (4, 1, 2, 515, 260, 64, 128, torch.float16, 3.0, 0.11, -0.07, False),
    (2, 2, 2, 200, 600, 96, 40, torch.bfloat16, 2.0, None, None, True),
    (2, 2, 1, 40, 3000, 128, 128, torch.bfloat16, 50.0, None, None, False),  # split-K
    (2, 1, 2, 9, 2500, 64, 128, torch.float16, 2.0, None, None, True),  # split-K
]


@gpu
@sm90
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", LAG_CASES, ids=lambda c: f"h{c[0]}-{c[3]}x{c[4]}-d{c[5]}x{c[6]}-std{c[8]}")
def test_lagged_max_matches_the_oracle(case, causal):
    """The lagged running max (kernels/online_kl.cuh) against the float64 oracle where it must take
    its exact side: extreme logits, late and growing maxima; outputs poisoned first."""
    h, hk1, hk2, nq, nk, d1, d2, dtype, std, scale1, scale2, late = case
    inputs = make_inputs(h=h, hk1=hk1, hk2=hk2, nq=nq, nk=nk, d1=d1, d2=d2, dtype=dtype, device="cuda",
                         seed=nq + nk, std=std)  # fmt: skip
    if late:
        inputs = _late_and_growing_keys(inputs)
    s1 = 1 / math.sqrt(d1) if scale1 is None else scale1
    s2 = 1 / math.sqrt(d2) if scale2 is None else scale2
    _check_poisoned(inputs, causal, s1, s2)


@gpu
@sm90
def test_op_runs_the_triton_backward_behind_the_cuda_forward():
    inputs = make_inputs(h=4, hk2=2, nq=96, nk=160, d1=64, d2=128, dtype=torch.bfloat16, device="cuda",
                         layout="bnhd", seed=3, requires_grad=True)  # fmt: skip
    kl = streamkl.attn_kl(*inputs, causal=True, backend="cuda")
    grads = torch.autograd.grad(kl.sum(), inputs)
    ref = streamkl.attn_kl(*inputs, causal=True, backend="triton")
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    torch.testing.assert_close(kl, ref, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)


@gpu
@sm90
def test_side_stream_and_no_host_sync():
    inputs = make_inputs(h=2, nq=256, nk=256, d1=128, d2=128, dtype=torch.bfloat16, device="cuda", seed=8)
    want, _, _ = _forward(inputs, False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda.set_sync_debug_mode("error")  # any host sync in the launch path raises
        try:
            got, _, _ = _forward(inputs, False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---- GPU: the backward (kernels/kl_bwd.cu, settings 1 and 2) against the oracle ----


@pytest.fixture
def cuda_backward(monkeypatch):
    """The cuda backend's own backward where it runs the call: the default (STREAMKL_CUDA_BWD
    unset; conftest clears it for every test, and this states it for these)."""
    monkeypatch.delenv("STREAMKL_CUDA_BWD", raising=False)


SETTINGS = pytest.mark.parametrize("needs", [_bwd.SETTING1, _bwd.SETTING2], ids=["setting1", "setting2"])


def _groups(needs, fine: int, coarse: int) -> dict:
    """Key head counts with the differentiated side's GQA group a divisor of the other's: its
    side gets `fine` key heads, the other `coarse`."""
    return dict(hk1=coarse, hk2=fine) if needs == _bwd.SETTING1 else dict(hk1=fine, hk2=coarse)


def _check_backward(inputs, causal, needs, scale1=None, scale2=None):
    spec, call = _spec(inputs, causal, scale1, scale2)
    spec = spec.with_needs(needs)
    assert _dispatch.backward_of(backend, spec, call) is backend
    stats = AttnKLStats(*backend.forward(spec, call))
    g = torch.randn(stats.kl.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = backend.backward(spec, call, stats, g.float().cuda())
    torch.cuda.synchronize()
    expected = Expected(inputs, causal=causal, scale1=scale1, scale2=scale2, grad=g)
    expected.check_grads(grads, inputs, needs=needs)


@gpu
@sm90
@SETTINGS
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq,nk", EDGES)
def test_backward_tile_edges(nq, nk, causal, needs, cuda_backward):
    """Query and key counts around the backward's tiles (64 rows, 128 keys), both alignments of
    the causal frontier, an MQA group on the other side over a GQA group on the differentiated
    one, D1 != D2."""
    for dtype in (torch.bfloat16, torch.float16):
        inputs = make_inputs(b=2, h=4, **_groups(needs, 2, 1), nq=nq, nk=nk, d1=128, d2=64, dtype=dtype,
                             device="cuda", seed=nq * 5 + nk)  # fmt: skip
        _check_backward(inputs, causal, needs)


@gpu
@sm90
@SETTINGS
@pytest.mark.parametrize("d1,d2", [(64, 64), (128, 128), (40, 72), (96, 128), (128, 8), (8, 128)])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_backward_head_dims_and_layouts(d1, d2, layout, needs, cuda_backward):
    """Head dims padded to 64 or 128 (TMA's zero fill), read in place from (B, N, H, D) views."""
    for causal in (False, True):
        inputs = make_inputs(b=1, h=3, nq=300, nk=260, d1=d1, d2=d2, dtype=torch.bfloat16, device="cuda",
                             layout=layout, seed=d1 + d2)  # fmt: skip
        _check_backward(inputs, causal, needs, scale1=0.11, scale2=-0.07)


@gpu
@sm90
@SETTINGS
def test_backward_teacher_and_student_groups(needs, cuda_backward):
    """The other side's key head shared by two key heads of the differentiated side (its index
    hk * g_own / g_other takes values other than 0 and hk), both masks, bf16 and fp16."""
    for dtype in (torch.bfloat16, torch.float16):
        inputs = make_inputs(b=2, h=8, **_groups(needs, 4, 2), nq=200, nk=333, d1=64, d2=128, dtype=dtype,
                             device="cuda", seed=8)  # fmt: skip
        for causal in (False, True):
            _check_backward(inputs, causal, needs)


@gpu
@sm90
@SETTINGS
@pytest.mark.parametrize("nq,nk", [(1, 4096), (16, 8192), (64, 1000), (65, 1000)])
def test_backward_decode_shapes(nq, nk, needs, cuda_backward):
    """At 64 query rows or fewer the launch walks several key tiles a CTA (32 key heads x batch
    over the SMs: 8, 16 and 2 tiles a CTA here, and the last CTA of a head fewer); at 65 one tile
    a CTA with two query tiles."""
    inputs = make_inputs(b=2, h=16, hk1=16, hk2=16, nq=nq, nk=nk, d1=128, d2=128, dtype=torch.bfloat16,
                         device="cuda", seed=nq)  # fmt: skip
    for causal in (False, True):
        _check_backward(inputs, causal, needs)


@gpu
@sm90
def test_backward_one_gradient_of_a_pair(cuda_backward):
    """A call asking for one gradient of a side's pair runs that side's kernel and returns only
    what it asked for (the other slot None, as the op's fake has it)."""
    inputs = make_inputs(b=1, h=4, hk1=2, hk2=2, nq=130, nk=300, d1=64, d2=128, dtype=torch.bfloat16,
                         device="cuda", seed=3)  # fmt: skip
    for needs in ((False, False, True, False), (False, False, False, True), (True, False, False, False),
                  (False, True, False, False)):  # fmt: skip
        _check_backward(inputs, True, needs)


@gpu
@sm90
@pytest.mark.parametrize("nq,nk", [(1, 4096), (64, 1000), (33, 200)])
def test_backward_both_sides_at_decode_shapes(nq, nk, cuda_backward):
    """Both sides' gradients at 64 query rows or fewer: one launch a side, on one set of
    statistics."""
    for dtype in (torch.bfloat16, torch.float16):
        inputs = make_inputs(b=2, h=4, hk1=2, hk2=2, nq=nq, nk=nk, d1=64, d2=128, dtype=dtype, device="cuda",
                             seed=nq)  # fmt: skip
        for causal in (False, True):
            _check_backward(inputs, causal, (True,) * 4)
        _check_backward(inputs, True, (True, False, False, True))


@gpu
@sm90
@SETTINGS
def test_op_runs_the_cuda_backward_for_one_side(needs, cuda_backward, monkeypatch):
    """Through the op, eager and compiled, by default: gradients to one side's (q, k) take the cuda
    backward (each call launches it once) and match the float64 oracle."""
    inputs = make_inputs(b=1, h=4, hk2=2, hk1=2, nq=333, nk=500, d1=64, d2=128, dtype=torch.bfloat16,
                         device="cuda", layout="bnhd", seed=4)  # fmt: skip
    launches = []
    real = _bwd.backward
    monkeypatch.setattr(_bwd, "backward", lambda *args: launches.append(1) or real(*args))
    g = torch.randn(1, 4, 333, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    expected = Expected(inputs, causal=True, grad=g)
    for fn in (streamkl.attn_kl, torch.compile(streamkl.attn_kl, fullgraph=True)):
        args = [t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
        kl = fn(*args, causal=True, backend="cuda")
        before = len(launches)
        leaves = [t for t in args if t.requires_grad]
        grads = iter(torch.autograd.grad(kl, leaves, g.to(device="cuda", dtype=kl.dtype)))
        assert len(launches) == before + 1
        expected.check_grads([next(grads) if need else None for need in needs], inputs, needs=needs)
