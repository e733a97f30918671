"""indexer_kl's launchers: the plan read off the spec (one place), outputs allocated, every stride
passed (no input copied; topk is deduplicated into a sorted int32 copy).

    forward             pass 1 (LSE2, and the teacher's LSE when not given), main pass (KL, T)
    backward            main pass with a = g [T > 0], b = g / T: the recompute backward
    forward_with_grads  pass 1, main pass writing KL, T and the reduced loss's gradients with
                        a = b = each row's weight (T = 1), then, with a given lse, the main pass
                        again on the rows whose T is not 1 (docs/indexer.md, "One teacher pass
                        per training step")
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton

from ..._indexer_host import backward_coefs, correction_coefs, empty_stats, grad_outputs, key_sets
from ..._indexer_host import empty as _empty
from ..._spec import IndexerKLGrads, IndexerKLInputs, IndexerKLSpec, IndexerKLStats, reduced_row_weight
from . import _indexer_dki
from ._config import pow2_dim
from ._indexer_lse import _indexer_lse_kernel
from ._indexer_main import _indexer_main_kernel
from ._launch import LOG2E, PLAN_CACHE_SIZE, _launch


class IndexerCfg(NamedTuple):
    """Tiles of both passes: BM query rows a program, BN keys a tile, the teacher's head dim BD
    at a time, HB teacher heads a chunk, GP indexer heads (G padded); BM * HB and BM * GP are at
    least 16 (tl.dot's smallest M)."""

    bm: int
    bn: int
    bd: int
    hb: int
    gp: int
    num_warps: int
    num_stages: int


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def indexer_cfg(spec: IndexerKLSpec, dtype: torch.dtype, interpret: bool) -> IndexerCfg:
    """Where 16 or more teacher heads share a key head (MLA's absorbed MQA), a program holds one
    query row and all of its heads up to 128: one [128, BD] x [BD, 64] GEMM per step, the student
    G x 1 rows; one warpgroup (4 warps) and three stages, so two programs share an SM and hide
    each other's loop starts (lab/notes/indexer_log.md: 2.3x the forward and 2.7x the training
    step of the two-warpgroup, 32-key, one-stage tiles at 4K, and about as much in sparse mode).
    Sparse rows gather their own keys, so they always hold one row. Otherwise (MHA, small
    groups) a program holds two rows, so the student's GEMM is 2 x G rows, with 8 warps and 32
    keys (at 64 its main pass spills at sm_90) and three stages. Under the interpreter the tiles
    are 16 wide, so the CPU tests cross key tiles, head-dim chunks and head chunks."""
    wide = spec.group >= 16
    bm = 1 if spec.sparse or wide else 2
    least = 16 // bm
    if interpret:
        bn, bd, heads, warps, stages = 16, 16, 4, 4, 1
    elif dtype == torch.float32:
        bn, bd, heads, warps, stages = 32, 32, 32, 8, 1
    elif wide or spec.sparse:
        bn, bd, heads, warps, stages = 64, 64, 128, 4, 3
    else:
        bn, bd, heads, warps, stages = 32, 64, 64, 8, 3
    hb = max(min(_pow2(spec.group), heads), least)
    gp = max(_pow2(spec.index_heads), least)
    bd = min(bd, pow2_dim(spec.d))
    return IndexerCfg(bm, bn, bd, hb, gp, warps, stages)


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: true fp32 products (tf32 off: docs/contract.md, Numerics)
    return "ieee" if dtype == torch.float32 else "tf32"


class IndexerPlan(NamedTuple):
    grid: tuple[int, int]
    consts: dict  # the constexprs and launch options both kernels share
    scalars: tuple  # H, NQ, NK, G, GROUP, CPG, N_CHUNKS, TOPK_W, c_log2
    variants: dict  # flags -> consts with them (_variant)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def plan(spec: IndexerKLSpec, q_dtype: torch.dtype, qi_dtype: torch.dtype, interpret: bool) -> IndexerPlan:
    """Both passes' launch for a call of `spec` with at least one row and one key."""
    cfg = indexer_cfg(spec, q_dtype, interpret)
    cpg = triton.cdiv(spec.group, cfg.hb)
    consts = dict(
        D=spec.d,
        DI=spec.di,
        DIP=pow2_dim(spec.di),
        BD=cfg.bd,
        BM=cfg.bm,
        BN=cfg.bn,
        HB=cfg.hb,
        GP=cfg.gp,
        CAUSAL=spec.causal,
        VARLEN=spec.packed,
        SPARSE=spec.sparse,
        PREC_T=_prec(q_dtype),
        PREC_S=_prec(qi_dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    z = spec.num_seqs if spec.packed else spec.batch
    scalars = (
        spec.heads,
        spec.nq,
        spec.nk,
        spec.index_heads,
        spec.group,
        cpg,
        spec.heads_kv * cpg,
        spec.topk_width,
        spec.scale * LOG2E,
    )
    return IndexerPlan((triton.cdiv(spec.seq_q, cfg.bm), z), consts, scalars, {})


def _variant(base: IndexerPlan, **flags) -> dict:
    """The plan's constexprs with one kernel's flags, one dict per flag set kept in the plan (the
    launch cache keys on the dict's identity)."""
    key = tuple(sorted(flags.items()))
    found = base.variants.get(key)
    if found is None:
        found = base.variants[key] = dict(base.consts, **flags)
    return found


def _plan_of(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerPlan:
    interpret = inputs.q.device.type != "cuda"  # CPU tensors run only under the interpreter
    return plan(spec.with_needs((False,) * 3), inputs.q.dtype, inputs.qi.dtype, interpret)


def _strides(inputs: IndexerKLInputs) -> tuple:
    q, k, qi, ki, w = inputs[:5]
    return (*q.stride(), *k.stride(), *qi.stride(), ki.stride(0), ki.stride(2), ki.stride(3), *w.stride())


class _Call(NamedTuple):
    plan: IndexerPlan
    lead: tuple  # Q, K, QI, KI, W, TOPK, CU
    strides: tuple


def _call(spec: IndexerKLSpec, inputs: IndexerKLInputs, placeholder: torch.Tensor) -> _Call:
    topk = key_sets(inputs.topk) if spec.sparse else placeholder
    cu = inputs.cu_seqlens if spec.packed else placeholder
    lead = (inputs.q, inputs.k, inputs.qi, inputs.ki, inputs.w, topk, cu)
    return _Call(_plan_of(spec, inputs), lead, _strides(inputs))


def _stats_pass(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, call: _Call
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 1: (lse, lse2), float32 contiguous: the given lse (a copy) or the one computed."""
    dev = inputs.q.device
    lse2 = torch.empty((spec.batch, spec.nq), device=dev, dtype=torch.float32)
    if inputs.lse is not None:
        lse = inputs.lse.to(dtype=torch.float32, copy=True).contiguous()
    else:
        lse = torch.empty((spec.batch, spec.heads, spec.nq), device=dev, dtype=torch.float32)
    consts = _variant(call.plan, TEACHER_LSE=inputs.lse is None)
    args = (*call.lead, lse, lse2, *call.strides, *call.plan.scalars)
    _launch(_indexer_lse_kernel, call.plan.grid, args, consts)
    return lse, lse2


def _main_pass(call: _Call, spec, stats, coefs, outputs, write_kl, grads, delta=None):
    """The main pass; `delta` (the correction's REDO): dki's coefficients, the difference from
    the first pass's, while dqi and dw are formed anew from `coefs`."""
    lse, lse2, kl, mass = stats
    coef_a, coef_b = (c.contiguous() for c in coefs) if grads else (kl, kl)
    dcoefs = (coef_a, coef_b) if delta is None else tuple(c.contiguous() for c in delta)
    dqi, dki, dw = outputs
    needs = (dqi is not None, dki is not None, dw is not None)
    out = tuple(t if t is not None else kl for t in (dqi, dki, dw))  # placeholders are never written
    need_dqi, need_dki, need_dw = needs
    consts = _variant(
        call.plan, WRITE_KL=write_kl, GRADS=grads, REDO=delta is not None, NEED_DQI=need_dqi,
        NEED_DKI=need_dki, NEED_DW=need_dw,
    )  # fmt: skip
    tensors = (*call.lead, lse, lse2, coef_a, coef_b, *dcoefs, kl, mass, *out)
    args = (*tensors, *call.strides, *call.plan.scalars, 1.0 / spec.heads)
    _launch(_indexer_main_kernel, call.plan.grid, args, consts)


def forward(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
    """The backend's forward (streamkl/_backend.py): (kl, lse, lse2, mass), float32."""
    if _empty(spec):
        return empty_stats(spec, inputs)
    kl = torch.empty((spec.batch, spec.nq), device=inputs.q.device, dtype=torch.float32)
    mass = torch.empty_like(kl)
    call = _call(spec, inputs, kl)
    lse, lse2 = _stats_pass(spec, inputs, call)
    _main_pass(call, spec, (lse, lse2, kl, mass), (kl, kl), (None,) * 3, True, False)
    return IndexerKLStats(kl, lse, lse2, mass)


def backward(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl: torch.Tensor
) -> IndexerKLGrads:
    """The backend's backward: the main pass again, dI = g (softmax(I) [T > 0] - p / T)."""
    dqi, dki, dw = grad_outputs(spec, inputs)
    if _empty(spec) or not any(spec.needs):
        return IndexerKLGrads(dqi, None if dki is None else dki.to(inputs.ki.dtype), dw)
    kl, lse, lse2, mass = (t.to(torch.float32).contiguous() for t in stats)
    coef_a, coef_b = backward_coefs(mass, grad_kl)
    call = _call(spec, inputs, kl)
    by_key = _indexer_dki.by_key(spec)  # deterministic mode: dki from _indexer_dki, no atomics
    if not by_key or dqi is not None or dw is not None:
        main = (dqi, None if by_key else dki, dw)
        _main_pass(call, spec, (lse, lse2, kl, mass), (coef_a, coef_b), main, False, True)
    if by_key:
        _indexer_dki.dki_pass(call, spec, lse, lse2, (coef_a, coef_b), dki)
    return IndexerKLGrads(dqi, None if dki is None else dki.to(inputs.ki.dtype), dw)


def forward_with_grads(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str
) -> tuple[IndexerKLStats, IndexerKLGrads]:
    """The statistics and the reduced loss's gradients (streamkl/_backend.py), the teacher
    streamed once: dI = w_r (q - p) with w_r every row's weight in the loss (the rows that see a
    key known after pass 1) is exact where T = 1, which holds (to rounding) when this call
    computes lse. With a given lse, a correction pass runs on the rows where T differs from 1 by
    more than _indexer_host.MASS_TOLERANCE, or that have no target mass: it forms their dqi
    and dw anew with dI = w_r (q [T > 0] - p / T) and adds to dki the difference, -w_r q or
    -w_r (1/T - 1) p; its programs whose rows need nothing exit at once. dqi and dw are written
    once per pass in their inputs' dtypes (float32 for float16: grad_outputs), so each element
    is rounded once."""
    dqi, dki, dw = grad_outputs(spec, inputs, held=True)
    if _empty(spec):
        return empty_stats(spec, inputs), IndexerKLGrads(dqi, dki, dw)
    kl = torch.empty((spec.batch, spec.nq), device=inputs.q.device, dtype=torch.float32)
    mass = torch.empty_like(kl)
    call = _call(spec, inputs, kl)
    by_key = _indexer_dki.by_key(spec)  # deterministic mode: dki from _indexer_dki, no atomics
    main = (dqi, None if by_key else dki, dw)
    lse, lse2 = _stats_pass(spec, inputs, call)
    stats = (lse, lse2, kl, mass)
    weight = reduced_row_weight(lse2, reduction).expand(kl.shape)
    _main_pass(call, spec, stats, (weight, weight), main, True, True)
    dki_coefs = (weight, weight)
    if inputs.lse is not None and any(spec.needs):
        dki_coefs, (coef_a, coef_b) = correction_coefs(weight, mass, lse2)  # the rows' whole dI
        if any(t is not None for t in main):
            _main_pass(call, spec, stats, dki_coefs, main, False, True, delta=(coef_a, coef_b))
    if by_key:
        _indexer_dki.dki_pass(call, spec, lse, lse2, dki_coefs, dki)
    return IndexerKLStats(kl, lse, lse2, mass), IndexerKLGrads(dqi, dki, dw)
