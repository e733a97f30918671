"""indexer_kl on the cuda backend (kernels/indexer_kl.cu): every instantiation compiles for sm_90a
within budget (CPU: NVRTC needs no GPU); which calls `supports` leaves to triton, each with its
reason; and, on an sm_90 GPU (marked gpu), the forward, the recompute backward and the fused step
against the float64 oracle by the rule of tests/test_indexer_kl.py, at DeepSeek-V3.2-like shapes
scaled down (H up to 128 heads on the 576-wide MQA key, G up to 64 indexer heads of up to 128):
dense and top-k sparse (random sets with padding and keys the mask hides, gathered), key tiles
that end inside a tile, Sq != Sk both ways (rows that see no key), padded heads and head dims,
the (B, S, H, D) and [S, B, H, D] layouts read in place, w in float32, and the step's correction
pass on rows whose given lse leaves T != 1; without a given lse, the teacher's LSE the kernel
forms."""

from __future__ import annotations

import pytest
import torch

import streamkl
from streamkl import _checks, _dispatch
from streamkl._spec import IndexerKLInputs

from .indexer_oracle import make_indexer_inputs, random_topk
from .test_indexer_kl import _check, _check_step, _given_lse

pytest.importorskip("cuda.core")

from streamkl.backends.cuda import _indexer, _jit  # noqa: E402

from .test_cuda import gpu, sm90  # noqa: E402


def _build_id(c):
    passes = {tuple(v.values()): k for k, v in _indexer.PASSES.items()}
    name = passes[(c["STATS"], c["WRITE_KL"], c["GRADS"], c["REDO"])]
    flags = "".join(f"-{flag.lower()}" for flag in ("SPARSE", "TLSE") if c[flag])
    return f"{name}-{'fp16' if c['KL_FP16'] else 'bf16'}{flags}"


@pytest.mark.parametrize("consts", _indexer.shipped_instantiations(), ids=_build_id)
def test_kernels_compile_within_budget(consts):
    """No spill, no stack, no serialized wgmma, within __launch_bounds__(384, 1)'s registers, and
    the largest layout (D = 576) within an sm_90 CTA's shared memory."""
    build = _indexer.build(consts)
    assert build.registers <= (65536 // _indexer.THREADS) // 8 * 8, build.log
    assert build.spill_bytes == 0 and build.stack_bytes == 0, build.log
    assert "serialized" not in build.log and "warning" not in build.log.lower(), build.log
    assert _indexer.smem_bytes(_indexer.MAX_D) <= 232448
    assert _jit.ARCH == "sm_90a"


def _spec_of(inputs, **call):
    q, k, qi, ki, w = inputs
    return _checks.indexer_kl_spec(q, k, qi, ki, w, **call)


def test_supports_names_what_it_leaves_to_triton():
    """The kernel's own limits, asked of CPU tensors (no GPU needed): each call it cannot run gets
    a reason naming what, and the shapes it runs get None."""

    def reason(dtype=torch.bfloat16, w_dtype=None, lse=True, topk=None, **shape):
        problem = dict(b=1, h=16, hk=1, g=8, nq=8, nk=8, d=64, di=64) | shape
        inputs = make_indexer_inputs(dtype=dtype, w_dtype=w_dtype, **problem)
        given = torch.zeros(problem["b"], problem["h"], problem["nq"]) if lse else None
        spec = _spec_of(inputs, lse=given, topk=topk, causal=True, scale=None)
        return _indexer.supports(spec, IndexerKLInputs(*inputs, given, topk))

    assert reason() is None and reason(w_dtype=torch.float32) is None and reason(h=128, g=64, d=576) is None
    assert "16-bit dtype" in reason(dtype=torch.float32)
    assert reason(lse=False) is None
    assert "MQA teacher" in reason(hk=2)
    assert "up to 128 teacher" in reason(h=256)
    assert "64 indexer" in reason(g=65)
    assert "head dims up to 576" in reason(d=640)
    assert "Di=130" in reason(di=130)
    assert reason(topk=torch.zeros(1, 8, 4, dtype=torch.int64)) is None
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "atomics" in reason()
    finally:
        torch.use_deterministic_algorithms(previous)
    inputs = make_indexer_inputs(h=2, nq=4, nk=4, dtype=torch.bfloat16)
    spec = _spec_of(inputs, lse=torch.zeros(1, 2, 4), topk=None, causal=True, scale=None)
    impl = _dispatch.implementation("cuda", "indexer_kl")
    assert impl.supports(spec, IndexerKLInputs(*inputs)) == "the cuda backend runs CUDA tensors only"
    # auto passes it by below 64 teacher heads (it pads them to 128), and takes it from there
    assert "pads them to 128" in impl.auto_declines(spec, IndexerKLInputs(*inputs))
    wide = make_indexer_inputs(h=64, nq=4, nk=4, dtype=torch.bfloat16)
    wide_spec = _spec_of(wide, lse=None, topk=None, causal=True, scale=None)
    assert impl.auto_declines(wide_spec, IndexerKLInputs(*wide)) is None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("nq, nk", [(7, 11), (11, 7), (5, 0)])
def test_row_weight_counts_the_rows_the_oracle_does(nq, nk, causal):
    """The fused step's "mean" weight, known before the launch (from the shapes, or from the key
    sets on the device), is 1 / the rows whose student LSE the oracle finds finite."""
    from streamkl._indexer_host import key_sets
    from streamkl._spec import reduced_row_weight

    from .indexer_oracle import admitted_mask

    inputs = make_indexer_inputs(b=2, h=2, g=3, nq=nq, nk=nk, d=8, di=4)
    for topk in (None, random_topk(2, nq, nk, 4, seed=nq + nk)):
        spec = _spec_of(inputs, lse=None, topk=topk, causal=causal, scale=None)
        seen = admitted_mask(2, nq, nk, causal, topk, None).any(-1)
        lse2 = torch.where(seen, 0.0, float("-inf"))
        want = reduced_row_weight(lse2, "mean").item()
        got = _indexer.row_weight(spec, "mean", None if topk is None else key_sets(topk))
        assert float(got) == pytest.approx(want, rel=1e-6)
        assert _indexer.row_weight(spec, "sum", None) == 1.0


CASES = [
    # (h, d, g, di, nq, nk, causal, layout, top-k width: 0 dense)
    (128, 576, 64, 128, 300, 337, True, "bnhd", 0),  # the MQA training shape, Sq < Sk
    (128, 576, 64, 128, 200, 150, True, "bhnd", 0),  # Sq > Sk: the first 50 rows see no key
    (64, 576, 32, 96, 190, 190, False, "sbhd", 0),  # padded heads and indexer dims, no mask
    (16, 192, 8, 64, 130, 257, True, "bnhd", 0),  # a 192-wide key, few heads
    (100, 520, 64, 128, 65, 65, True, "bhnd", 0),  # D and H not multiples of 64 or 128
    (128, 576, 64, 128, 300, 337, True, "bnhd", 200),  # sparse: sets of 200 gathered keys
    (64, 520, 16, 96, 150, 120, True, "sbhd", 64),  # sparse, Sq > Sk, D not a multiple of 64
    (32, 576, 64, 128, 96, 300, False, "bhnd", 130),  # sparse, no mask, sets past a tile
]


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_against_oracle(case, dtype):
    """Forward, recompute backward (reduction "none") and the fused step ("mean", then "sum" with
    w in float32) against the float64 oracle by the rule."""
    h, d, g, di, nq, nk, causal, layout, width = case
    inputs = make_indexer_inputs(b=2, h=h, hk=1, g=g, nq=nq, nk=nk, d=d, di=di, dtype=dtype, device="cuda",
                                 layout=layout, seed=nq + h)  # fmt: skip
    topk = random_topk(2, nq, nk, width, seed=h).to("cuda") if width else None
    call = dict(causal=causal, scale=192**-0.5, topk=topk)
    call["lse"] = _given_lse(inputs, torch.float32, **call)
    _check(inputs, backend="cuda", **call)
    _check_step(inputs, "mean", "cuda", **call)
    wide = make_indexer_inputs(b=1, h=h, hk=1, g=g, nq=nq, nk=nk, d=d, di=di, dtype=dtype, device="cuda",
                               layout=layout, seed=nq + h + 1, w_dtype=torch.float32)  # fmt: skip
    call["topk"] = None if topk is None else topk[:1]
    call["lse"] = _given_lse(wide, torch.float32, causal=causal, scale=call["scale"], topk=call["topk"])
    _check_step(wide, "sum", "cuda", **call)


@gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[i] for i in (0, 1, 5, 6)], ids=lambda c: "-".join(map(str, c)))
def test_computed_lse_against_oracle(case, dtype):
    """Without a given lse the kernel forms the teacher's per-head LSE over each row's admitted
    keys first (TLSE) and returns it: the forward, the recompute backward and the fused step
    against the oracle (which checks the returned lse, -inf on rows that see no key)."""
    h, d, g, di, nq, nk, causal, layout, width = case
    inputs = make_indexer_inputs(b=2, h=h, hk=1, g=g, nq=nq, nk=nk, d=d, di=di, dtype=dtype, device="cuda",
                                 layout=layout, seed=nq + h + 2)  # fmt: skip
    topk = random_topk(2, nq, nk, width, seed=h + 1).to("cuda") if width else None
    call = dict(causal=causal, scale=192**-0.5, topk=topk)
    _check(inputs, backend="cuda", **call)
    _check_step(inputs, "mean", "cuda", **call)


@gpu
@sm90
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_step_corrects_rows_whose_given_lse_is_not_the_admitted_keys(sparse):
    """A given lse that is not over the admitted keys (here the unmasked dense one under the
    causal mask, some heads' shifted; in sparse mode also not over the key set) leaves T != 1 on
    every row: the correction pass makes the fused step's gradients those of the op's definition,
    and auto takes the cuda backend."""
    inputs = make_indexer_inputs(b=1, h=64, hk=1, g=16, nq=96, nk=160, d=576, di=128, dtype=torch.bfloat16,
                                 device="cuda", seed=5)  # fmt: skip
    topk = random_topk(1, 96, 160, 80, seed=6).to("cuda") if sparse else None
    lse = _given_lse(inputs, torch.float32, causal=False)
    lse[:, :3] += 0.7
    spec = _spec_of(inputs, lse=lse, topk=topk, causal=True, scale=None)
    picked = _dispatch.select("indexer_kl", spec, IndexerKLInputs(*inputs, lse, topk), "auto")
    assert picked is _dispatch.implementation("cuda", "indexer_kl")
    _check_step(inputs, "mean", "cuda", lse=lse, causal=True, topk=topk)
    _check(inputs, backend="cuda", lse=lse, causal=True, topk=topk)


@gpu
@sm90
def test_compiled_step_and_partial_needs():
    """Under torch.compile(fullgraph=True) the step matches eager; gradients to qi alone and to w
    alone match the full call's."""
    inputs = make_indexer_inputs(b=1, h=64, hk=1, g=32, nq=128, nk=128, d=576, di=128, dtype=torch.bfloat16,
                                 device="cuda", seed=9)  # fmt: skip
    q, k, qi, ki, w = inputs
    lse = _given_lse(inputs, torch.float32, causal=True)

    def step(fn, needs):
        leaves = [t.detach().requires_grad_(need) for t, need in zip((qi, ki, w), needs)]
        loss = fn(q, k, *leaves, lse=lse, backend="cuda")
        grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
        return loss, grads

    loss, grads = step(streamkl.indexer_kl, (True, True, True))
    loss_c, grads_c = step(torch.compile(streamkl.indexer_kl, fullgraph=True), (True, True, True))
    torch.testing.assert_close(loss_c, loss)
    for a, b in zip(grads_c, grads):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(step(streamkl.indexer_kl, (True, False, False))[1][0], grads[0])
    torch.testing.assert_close(step(streamkl.indexer_kl, (False, False, True))[1][0], grads[2])
