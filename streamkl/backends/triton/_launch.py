"""Launchers: pick configs, allocate outputs, pass every stride (no input is ever copied)."""

from __future__ import annotations

import math

import torch
import triton

from ... import _env
from . import _config
from ._bwd import _bwd_dk_kernel, _bwd_dq_kernel
from ._config import pow2_dim
from ._fwd import _fwd_kernel, _merge_kernel

LOG2E = 1.4426950408889634


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _config.H200_SMS


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: true fp32 products (tf32 off, SPEC section 6); 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(q1, k1, q2, k2):
    return (*q1.stride(), *k1.stride(), *q2.stride(), *k2.stride())


def _geometry(q1, k1, q2, k2, cu_seqlens, max_seqlen):
    B, H, NQ, D1 = q1.shape
    NK = k1.shape[2]
    D2 = q2.shape[3]
    g1 = H // k1.shape[1]
    g2 = H // k2.shape[1]
    if cu_seqlens is not None:
        n_seqs = cu_seqlens.numel() - 1
        rows = int(max_seqlen)
        zdim = n_seqs
    else:
        rows = NQ
        zdim = B
    return B, H, NQ, NK, D1, D2, g1, g2, rows, zdim


def forward(q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens, max_seqlen):
    B, H, NQ, NK, D1, D2, g1, g2, rows, zdim = _geometry(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    D1P, D2P = pow2_dim(D1), pow2_dim(D2)
    dev = q1.device
    interpret = dev.type != "cuda"
    kl = torch.empty((B, H, NQ), device=dev, dtype=torch.float32)
    lse1 = torch.empty_like(kl)
    lse2 = torch.empty_like(kl)
    if B * H * NQ == 0:
        return kl, lse1, lse2
    varlen = cu_seqlens is not None
    cfg = _config.fwd_cfg(D1P, D2P, q1.dtype, causal, rows, interpret)
    m_tiles = triton.cdiv(rows, cfg.block_m)
    nk = rows if varlen else NK
    nk_tiles = triton.cdiv(max(nk, 1), cfg.block_n)
    splits = 1
    if not varlen:
        splits = _config.split_count(
            zdim * H * m_tiles, nk_tiles, _num_sms(dev), _env.triton_split_k(), cfg.block_m
        )
    cu = cu_seqlens if varlen else kl  # placeholder pointer when not varlen (never read)
    c1 = float(scale1) * LOG2E
    c2 = float(scale2) * LOG2E
    common = dict(
        D1=D1,
        D2=D2,
        D1P=D1P,
        D2P=D2P,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal),
        VARLEN=varlen,
        PREC=_prec(q1.dtype),
        ABLATE=int(cfg.ablate),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    part = kl  # placeholder pointer without split-K (never read)
    split_len = nk
    if splits > 1:
        # Split-K: each split covers a whole number of key tiles.
        split_len = triton.cdiv(nk_tiles, splits) * cfg.block_n
        splits = triton.cdiv(nk, split_len)
        part = torch.empty((5, splits, B, H, NQ), device=dev, dtype=torch.float32)
    _fwd_kernel[(m_tiles * splits, H, zdim)](
        q1,
        k1,
        q2,
        k2,
        kl,
        lse1,
        lse2,
        part,
        cu,
        *_strides(q1, k1, q2, k2),
        H,
        NQ,
        NK,
        g1,
        g2,
        c1,
        c2,
        split_len,
        splits,
        SPLIT=splits > 1,
        **common,
    )
    if splits == 1:
        return kl, lse1, lse2
    n_rows = B * H * NQ
    block_r = 128
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](
        part,
        kl,
        lse1,
        lse2,
        n_rows,
        splits,
        SPLITS_P=triton.next_power_of_2(splits),
        BLOCK_R=block_r,
        num_warps=4,
    )
    return kl, lse1, lse2


def backward(
    grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *, causal, scale1, scale2, cu_seqlens, max_seqlen, needs
):
    B, H, NQ, NK, D1, D2, g1, g2, rows, zdim = _geometry(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    D1P, D2P = pow2_dim(D1), pow2_dim(D2)
    dev = q1.device
    interpret = dev.type != "cuda"
    need_dq1, need_dk1, need_dq2, need_dk2 = (bool(x) for x in needs)
    dq1 = torch.empty_like(q1, memory_format=torch.contiguous_format) if need_dq1 else None
    dq2 = torch.empty_like(q2, memory_format=torch.contiguous_format) if need_dq2 else None
    dk1 = torch.empty_like(k1, memory_format=torch.contiguous_format) if need_dk1 else None
    dk2 = torch.empty_like(k2, memory_format=torch.contiguous_format) if need_dk2 else None
    out = (dq1, dk1, dq2, dk2)
    if not any(needs):
        return out
    if B * H * NQ == 0 or NK == 0:
        for t in out:
            if t is not None:
                t.zero_()
        return out
    grad_kl = grad_kl.to(torch.float32).contiguous()
    kl, lse1, lse2 = (t.to(torch.float32).contiguous() for t in (kl, lse1, lse2))
    varlen = cu_seqlens is not None
    cu = cu_seqlens if varlen else kl
    nk = rows if varlen else NK
    both = (need_dq1 or need_dk1) and (need_dq2 or need_dk2)
    cq, ck = _config.bwd_cfgs(D1P, D2P, q1.dtype, causal, interpret, both)
    c1 = float(scale1) * LOG2E
    c2 = float(scale2) * LOG2E
    prec = _prec(q1.dtype)
    strides = _strides(q1, k1, q2, k2)
    dims = dict(D1=D1, D2=D2, D1P=D1P, D2P=D2P, CAUSAL=bool(causal), VARLEN=varlen, PREC=prec)
    dummy = kl

    strategy = _env.triton_bwd()
    if strategy == "auto":
        strategy = choose_bwd(zdim, H, rows, nk, g1, g2, needs, cq, ck, _num_sms(dev))
    fused = strategy == "fused" and (need_dk1 or need_dk2) and (need_dq1 or need_dq2)

    # Key-major launches: one per distinct grouping of the key heads. With g1 == g2 a single
    # launch serves dk1 and dk2; otherwise dk1 walks groups of g1 heads and dk2 groups of g2.
    launches = []
    if need_dk1 and need_dk2 and g1 == g2:
        launches.append((g1, True, True))
    else:
        if need_dk1:
            launches.append((g1, True, False))
        if need_dk2:
            launches.append((g2, False, True))
    dqa1 = dqa2 = None
    fq = [False, False]
    if fused:
        fq = [need_dq1, need_dq2]
        dqa1 = (
            (
                dq1 if q1.dtype == torch.float32 else torch.empty(q1.shape, device=dev, dtype=torch.float32)
            ).zero_()
            if need_dq1
            else None
        )
        dqa2 = (
            (
                dq2 if q2.dtype == torch.float32 else torch.empty(q2.shape, device=dev, dtype=torch.float32)
            ).zero_()
            if need_dq2
            else None
        )
    # dq_t rides on the launch that already forms dS_t for dk_t, else on the first launch.
    owner = [next((i for i, la in enumerate(launches) if la[1 + t]), 0) if fq[t] else -1 for t in (0, 1)]
    for i, (gg, do1, do2) in enumerate(launches):
        f1 = owner[0] == i
        f2 = owner[1] == i
        _bwd_dk_kernel[(triton.cdiv(nk, ck.block_n), H // gg, zdim)](
            q1,
            k1,
            q2,
            k2,
            grad_kl,
            kl,
            lse1,
            lse2,
            dk1 if do1 else dummy,
            dk2 if do2 else dummy,
            dqa1 if f1 else dummy,
            dqa2 if f2 else dummy,
            cu,
            *strides,
            H,
            k1.shape[1],
            k2.shape[1],
            NQ,
            NK,
            g1,
            g2,
            gg,
            c1,
            c2,
            float(scale1),
            float(scale2),
            BLOCK_M=ck.block_m,
            BLOCK_N=ck.block_n,
            DK1_ON=do1,
            DK2_ON=do2,
            FQ1=f1,
            FQ2=f2,
            QROWS=ck.qrows,
            ABLATE=ck.ablate,
            num_warps=ck.num_warps,
            num_stages=ck.num_stages,
            **dims,
        )
    if fused:
        if need_dq1 and dqa1 is not dq1:
            dq1.copy_(dqa1)
        if need_dq2 and dqa2 is not dq2:
            dq2.copy_(dqa2)
    elif need_dq1 or need_dq2:
        _bwd_dq_kernel[(triton.cdiv(rows, cq.block_m), H, zdim)](
            q1,
            k1,
            q2,
            k2,
            grad_kl,
            kl,
            lse1,
            lse2,
            dq1 if need_dq1 else dummy,
            dq2 if need_dq2 else dummy,
            cu,
            *strides,
            H,
            NQ,
            NK,
            g1,
            g2,
            c1,
            c2,
            float(scale1),
            float(scale2),
            BLOCK_M=cq.block_m,
            BLOCK_N=cq.block_n,
            DQ1_ON=need_dq1,
            DQ2_ON=need_dq2,
            ABLATE=cq.ablate,
            num_warps=cq.num_warps,
            num_stages=cq.num_stages,
            **dims,
        )
    return out


def choose_bwd(Z, H, rows, nk, g1, g2, needs, cq, ck, num_sms) -> str:
    """STREAMKL_TRITON_BWD=auto: fused only when one setting's dq is requested and both grids of
    the separate strategy fit in one wave (Z * H/g * cdiv(Nk, BLOCK_N) and Z * H * cdiv(Nq,
    BLOCK_M) at most the SM count): there its two launches run one after the other on a part of
    the GPU each. Otherwise separate. Z is the grids' third axis: the batch, or the number of
    packed sequences. The fused fp32 dq accumulator then holds at most SMs * BLOCK_M rows.

    Measured on the H200 with the shipped tiles (B=1, H=32, D=128, bf16, setting 1, 2026-11-29,
    commit 902b6aa; docs/triton.md), separate vs fused, ms, non-causal / causal:
      N=1024:               0.136 vs 0.237 / 0.121 vs 0.162
      N=4096:               1.73 vs 2.77 / 0.99 vs 1.48
      N=8192:               6.69 vs 10.4 / 3.50 vs 5.32
      N=32768:              106 vs 180 / 53.5 vs 84.3
      Nq=256, Nk=32K:       1.47 vs 2.05 / 1.56 vs 2.13 (dq grid 64, key grid 16384)
      Nq=2K, Nk=32K:        6.68 vs 10.6 / 6.63 vs 10.4
    (N=2048 read 1.04 vs 0.81 non-causal but 0.79 vs 0.96 causal: windows too short to rank.)
    Since the key-major kernel moved to (64, 64) tiles in two programs per SM, its atomics cost
    more than the second pass everywhere it was measured. Both dq: 5-7x slower fused.
    The one-wave case was measured before that change only (N=256: 0.132 vs 0.061 ms, 0.201 vs
    0.068 causal), when both strategies' grids left most SMs idle.
    """
    if needs[0] and needs[2]:
        return "separate"
    g = min(g1, g2)
    kv_programs = Z * (H // g) * math.ceil(nk / ck.block_n)
    dq_programs = Z * H * math.ceil(rows / cq.block_m)
    if max(kv_programs, dq_programs) <= FUSED_MAX_WAVES * num_sms:
        return "fused"
    return "separate"


FUSED_MAX_WAVES = 1
