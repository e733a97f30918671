"""What is specific to the triton backend of indexer_kl: its grid against the float64 oracle (the
forward, the recompute backward and the fused training step), its tiles and the top-k set it
gathers from. The behaviour every backend shares runs in tests/test_indexer_kl.py.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py) on CPU tensors in
float32, at 16-wide tiles: the cases cross key tiles, head-dim chunks, head chunks and padding
heads, and cover each pair of (teacher, dense/sparse, causal, lse given) once; a few random
problems (packed, any lengths and head dims) look between them. With a GPU the
`gpu` cases run the compiled kernels in bfloat16 and float16 at DeepSeek-V3.2-like shapes scaled
down (H = 16..128 teacher heads, the 576-wide MQA key or 192-wide MHA keys, G = 8..64 indexer
heads of 128), by the same rule.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

import streamkl  # noqa: E402
from streamkl import _checks  # noqa: E402
from streamkl._spec import IndexerKLSpec  # noqa: E402

from .indexer_oracle import Expected, make_indexer_inputs, random_topk  # noqa: E402
from .test_indexer_kl import _check, _check_step, _given_lse  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="needs a GPU or TRITON_INTERPRET=1"
)
DEVICE = "cpu" if INTERPRET else "cuda"


def _call(inputs, *, sparse, causal, lse, width, seed, cu_seqlens=None):
    q = inputs[0]
    b, nq, nk = q.shape[0], q.shape[2], inputs[1].shape[-2]
    call = dict(causal=causal, cu_seqlens=cu_seqlens)
    call["topk"] = random_topk(b, nq, nk, width, seed=seed).to(q.device) if sparse else None
    if lse:
        call["lse"] = _given_lse(inputs, torch.float32, **call)
    return call


# (teacher key heads of 4, sparse, causal, lse given): each pair of values once, every teacher
# with both values of each other axis.
PAIRWISE = [
    (1, False, True, False),
    (1, True, False, True),
    (2, False, False, True),
    (2, True, True, False),
    (4, False, True, True),
    (4, True, False, False),
]


def _case_id(case):
    hk, sparse, causal, lse = case
    mode = "sparse" if sparse else "dense"
    return f"hk{hk}-{mode}-{'causal' if causal else 'full'}-{'lse' if lse else 'nolse'}"


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's float32 grid; test_gpu_* cover the GPU")
@pytest.mark.parametrize("case", PAIRWISE, ids=_case_id)
def test_against_oracle(case):
    """Forward (KL and statistics), the recompute backward and the fused step, Sq != Sk, head
    dims that are not powers of two (24: two 16-wide chunks; 6), G = 3 (padded to 8)."""
    hk, sparse, causal, lse = case
    inputs = make_indexer_inputs(b=2, h=4, hk=hk, g=3, nq=11, nk=19, d=24, di=6, device=DEVICE, layout="bnhd",
                                 seed=hk + 2 * sparse + 4 * causal)  # fmt: skip
    call = _call(inputs, sparse=sparse, causal=causal, lse=lse, width=7, seed=hk)
    _check(inputs, backend="triton", **call)
    _check_step(inputs, "mean", "triton", **call)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's float32 grid; test_gpu_* cover the GPU")
def test_head_chunks_and_statistics():
    """16 MQA heads: two chunks of 8 at the interpreter's tiles (dense: 2 rows x 8 heads), the
    statistics the forward returns against the oracle's."""
    from streamkl._spec import IndexerKLInputs
    from streamkl.backends.triton import indexer_kl as impl

    q, k, qi, ki, w = inputs = make_indexer_inputs(b=1, h=16, hk=1, g=5, nq=9, nk=21, d=40, di=16,
                                                   device=DEVICE, seed=4)  # fmt: skip
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=0.2)
    stats = impl.forward(spec, IndexerKLInputs(q, k, qi, ki, w))
    Expected(inputs, causal=True, scale=0.2).check_stats(stats)
    _check(inputs, backend="triton", causal=True, scale=0.2)


def test_key_sets_are_sorted_and_deduplicated():
    from streamkl._indexer_host import key_sets

    topk = torch.tensor([[[5, -1, 2, 5, 0, 2, -1]]])
    got = key_sets(topk)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [[[-1, -1, 0, 2, -1, 5, -1]]]
    # sorted a chunk of rows at a time: the same sets whatever the chunk
    from streamkl import _indexer_host

    many = torch.randint(-1, 9, (2, 37, 6))
    whole = key_sets(many)
    _indexer_host.KEY_SET_CHUNK_BYTES, saved = 16 * 2 * 6 * 5, _indexer_host.KEY_SET_CHUNK_BYTES  # 5 rows
    try:
        assert torch.equal(key_sets(many), whole)
    finally:
        _indexer_host.KEY_SET_CHUNK_BYTES = saved


def _spec(h, hk, g, d, di, sparse=False, n=4096):
    return IndexerKLSpec(1, h, hk, g, n, n, d, di, True, 192**-0.5, 2048 if sparse else 0, sparse, False, 1,
                         None, False)  # fmt: skip


def test_tiles_stack_heads_as_the_gemm_rows():
    """DeepSeek-V3.2 on a GPU: programs of one row stack its 128 MQA heads (one chunk) and its 64
    indexer heads as the GEMMs' rows, dense or sparse, in one warpgroup with three stages; an MHA
    teacher's program holds 2 rows and its chunk is one head padded to 8 (2 rows x 8 >= 16, tl.dot's
    least M)."""
    from streamkl.backends.triton._indexer_launch import indexer_cfg, plan

    for sparse in (False, True):
        cfg = indexer_cfg(_spec(128, 1, 64, 576, 128, sparse=sparse), torch.bfloat16, False)
        tiles = (cfg.bm, cfg.hb, cfg.gp, cfg.bd, cfg.bn, cfg.num_warps, cfg.num_stages)
        assert tiles == (1, 128, 64, 64, 64, 4, 3)
    mha = indexer_cfg(_spec(128, 128, 8, 192, 128), torch.bfloat16, False)
    assert (mha.bm, mha.hb, mha.gp) == (2, 8, 8)
    p = plan(_spec(128, 1, 64, 576, 128), torch.bfloat16, torch.bfloat16, False)
    assert p.grid == (4096, 1) and p.scalars[5:7] == (1, 1)  # 1 chunk a group, 1 in all


def test_supports_reasons(monkeypatch):
    from streamkl._spec import IndexerKLInputs
    from streamkl.backends.triton import indexer_kl as impl

    def reason(device=DEVICE, **kw):
        q, k, qi, ki, w = make_indexer_inputs(**{"h": 2, "nq": 4, "nk": 4, "device": device, **kw})
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=None)
        return impl.supports(spec, IndexerKLInputs(q, k, qi, ki, w))

    assert reason() is None
    assert "float64" in reason(dtype=torch.float64)
    assert "float64" in reason(w_dtype=torch.float64)
    assert "576" in reason(d=640)
    assert "128" in reason(di=256)
    assert "64 indexer heads" in reason(g=65)
    if INTERPRET:
        assert "bfloat16" in reason(dtype=torch.bfloat16)  # the interpreter refuses it
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "CUDA" in reason(device="cpu")


# ----------------------------------------------------------------------------------------------
# GPU: compiled kernels, 16-bit inputs, DeepSeek-V3.2-like shapes scaled down.

GPU_CASES = [
    # (h, hk, d, g, n, sparse, causal, lse given, packed)
    (128, 1, 576, 64, 300, False, True, False, False),  # the MQA training shape: lse computed
    (128, 1, 576, 64, 300, False, True, True, False),  # lse given (the attention forward's)
    (64, 1, 576, 32, 257, True, True, True, False),  # sparse, the sparse attention's lse
    (128, 1, 576, 64, 320, True, True, False, False),
    (16, 16, 192, 8, 200, False, True, False, False),  # MHA: a 192-wide key per head
    (32, 32, 192, 16, 160, True, False, True, False),
    (16, 4, 192, 64, 240, False, False, False, False),  # GQA
    (64, 1, 576, 64, 300, False, True, False, True),  # packed
    (32, 1, 576, 8, 300, True, True, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_against_oracle(case, dtype):
    """Forward, recompute backward (reduction "none") and the fused step (reduction "mean")
    against the float64 oracle by the rule, 16-bit inputs at the GPU tiles."""
    h, hk, d, g, n, sparse, causal, lse, packed = case
    cu = torch.tensor([0, 1, n // 3, n // 3, n], dtype=torch.int32, device="cuda") if packed else None
    b, nk = (1, n) if packed else (2, n + 37)  # Sq != Sk unless packed
    inputs = make_indexer_inputs(b=b, h=h, hk=hk, g=g, nq=n, nk=nk, d=d, di=128, dtype=dtype, device="cuda",
                                 layout="bnhd", seed=n + h)  # fmt: skip
    call = _call(inputs, sparse=sparse, causal=causal, lse=lse, width=64, seed=h, cu_seqlens=cu)
    call["scale"] = 192**-0.5
    _check(inputs, backend="triton", **call)
    _check_step(inputs, "mean", "triton", **call)


@pytest.mark.gpu
def test_gpu_the_step_is_one_teacher_pass(monkeypatch):
    """The training step with a given lse launches the main pass once with the gradients (T = 1)
    and the correction pass (whose programs exit where T = 1), and its backward launches
    nothing."""
    from streamkl.backends.triton import _indexer_launch

    inputs = make_indexer_inputs(b=1, h=16, hk=1, g=8, nq=128, nk=128, d=576, di=128, dtype=torch.bfloat16,
                                 device="cuda", seed=1, requires_grad=True)  # fmt: skip
    lse = _given_lse(inputs, torch.float32, causal=True)
    launches = []
    real = _indexer_launch._launch

    def counted(kernel, grid, args, consts):
        launches.append(
            (
                kernel.__name__ if hasattr(kernel, "__name__") else str(kernel),
                consts.get("GRADS"),
                consts.get("REDO"),
            )  # fmt: skip
        )
        return real(kernel, grid, args, consts)

    monkeypatch.setattr(_indexer_launch, "_launch", counted)
    loss = streamkl.indexer_kl(*inputs, lse=lse, backend="triton")
    loss.backward()
    grads = [launch[2] for launch in launches if launch[1]]  # main passes with gradients
    assert grads == [False, True], launches  # the step, then the correction (rows with T != 1)


@pytest.mark.gpu
def test_gpu_large_logits_and_long_rows():
    """Teacher logits ~1e2 over 2K keys, sparse sets of 512: the fused step stays finite and
    within the rule."""
    for sparse, dtype in itertools.product((False, True), (torch.bfloat16,)):
        inputs = make_indexer_inputs(b=1, h=32, hk=1, g=16, nq=64, nk=2048, d=576, di=128, dtype=dtype,
                                     device="cuda", seed=3, std=3.0)  # fmt: skip
        call = _call(inputs, sparse=sparse, causal=True, lse=False, width=512, seed=3)
        _check_step(inputs, "sum", "triton", **call)


@st.composite
def _random_problems(draw):
    """Any shape the kernels take: lengths across the 16-row tiles (1 included), head dims that
    are not powers of two, MQA/GQA/MHA, layouts, dense or sparse, packed or not."""
    hk = draw(st.sampled_from([1, 2, 4]))
    packed = draw(st.booleans())
    nq = draw(st.integers(1, 24))
    nk = nq if packed else draw(st.integers(1, 24))
    problem = dict(
        b=1 if packed else draw(st.integers(1, 2)), h=hk * draw(st.sampled_from([1, 2])), hk=hk,
        g=draw(st.integers(1, 9)), nq=nq, nk=nk, d=draw(st.integers(1, 40)), di=draw(st.integers(1, 20)),
        layout=draw(st.sampled_from(["bhnd", "bnhd", "sbhd"])), seed=draw(st.integers(0, 2**31 - 1)),
        std=draw(st.sampled_from([0.3, 1.0, 3.0])), device=DEVICE,
    )  # fmt: skip
    cut = sorted(draw(st.lists(st.integers(0, nq), max_size=3)))
    cu = torch.tensor([0, *cut, nq], dtype=torch.int32, device=DEVICE) if packed else None
    width = draw(st.one_of(st.none(), st.integers(0, nk + 2)))
    options = dict(causal=draw(st.booleans()), lse=draw(st.booleans()), cu_seqlens=cu, width=width)
    return problem, options


@pytest.mark.skipif(
    not INTERPRET, reason="random head dims compile new kernels on a GPU; the GPU grid covers it"
)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_random_problems(), st.sampled_from(["none", "sum"]))
def test_random_problems_against_oracle(problem_and_options, reduction):
    """Random problems through the op: per-row KL and the recompute backward, or the fused step."""
    problem, options = problem_and_options
    inputs = make_indexer_inputs(**problem)
    width = options.pop("width")
    sparse = width is not None
    call = _call(inputs, sparse=sparse, width=width or 0, seed=problem["seed"], **options)
    if reduction == "none":
        _check(inputs, backend="triton", **call)
    else:
        _check_step(inputs, reduction, "triton", **call)
