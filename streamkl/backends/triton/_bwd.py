"""Backward kernels: recompute S1, S2 from the inputs and the saved LSEs (nothing quadratic kept).

With t = S * log2(e), L_t = LSE_t * log2(e), g = dLoss/dKL of the row and ln2 = log(2):

    P_t = 2^(t_t - L_t)
    dS2 = g * (P2 - P1)                                       setting 1 (teacher fixed)
    dS1 = g * P1 * (ln2 * (t1 - t2) - c),  c = ln2*(L1 - L2) + KL      setting 2 (target fixed)
        (= g * P1 * ((S1 - LSE1) - (S2 - LSE2) - KL), formed from logits: never log P)
    dq_t = scale_t * dS_t @ k_t          dk_t = scale_t * dS_t^T @ q_t

A row that saw no key has LSE = -inf; the kernels read it as L = +inf (so P = 0) and c = 0, and
entries outside the causal frontier or past the key bound get t = -inf (P = 0, dS forced to 0).

Two strategies:
  * separate: `_bwd_dq_kernel` (a program per query tile walks the key tiles, dq in registers)
    plus `_bwd_dk_kernel` (a program per key tile walks every query head of its key-head group
    and the query tiles, dk in registers).
  * fused: `_bwd_dk_kernel` with FQ1/FQ2, which also adds each pair's dq share into an
    fp32 buffer with atomics, so every (query tile, key tile) pair is recomputed once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import ds_student, ds_teacher, key_range, load_tile, sequence, split_keys, split_program, visible


@triton.jit
def _row_state(LSE1, LSE2, KLp, G, row, mmask):
    # Per query row: L1, L2 in log2 units (+inf for rows that saw nothing), c, g.
    lse1 = tl.load(LSE1 + row, mask=mmask, other=float("-inf"))
    lse2 = tl.load(LSE2 + row, mask=mmask, other=float("-inf"))
    kl = tl.load(KLp + row, mask=mmask, other=0.0)
    g = tl.load(G + row, mask=mmask, other=0.0)
    seen = lse1 > float("-inf")
    L1 = tl.where(seen, lse1 * 1.4426950408889634, float("inf"))
    L2 = tl.where(seen, lse2 * 1.4426950408889634, float("inf"))
    c = tl.where(seen, lse1 - lse2 + kl, 0.0)
    g = tl.where(seen, g, 0.0)
    return L1, L2, c, g


@triton.jit
def _prob(t, L):
    """P = 2^(t - L)."""
    return tl.math.exp2(t - L)


@triton.jit
def _keys_by_queries(ds, QROWS: tl.constexpr):
    """A dS tile of the key-major kernel as keys x queries: the A operand of dk += dS^T q."""
    if QROWS:
        return tl.trans(ds)
    else:
        return ds


@triton.jit
def _queries_by_keys(ds, QROWS: tl.constexpr):
    """The same tile as queries x keys: the A operand of the fused dq share dS k."""
    if QROWS:
        return ds
    else:
        return tl.trans(ds)


@triton.jit
def _bwd_dq_inner(
    dq1,
    dq2,
    q1,
    q2,
    L1,
    L2,
    c,
    g,
    K1,
    K2,
    stride_k1n,
    stride_k1d,
    stride_k2n,
    stride_k2d,
    lo,
    hi,
    offs_m,
    k_len,
    diag,
    c1,
    c2,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D1P: tl.constexpr,
    D2P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    DQ1: tl.constexpr,
    DQ2: tl.constexpr,
    PREC: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        k1 = load_tile(K1, n0, k_len, stride_k1n, stride_k1d, BLOCK_N, D1, D1P, MASKED)
        k2 = load_tile(K2, n0, k_len, stride_k2n, stride_k2d, BLOCK_N, D2, D2P, MASKED)
        t1 = tl.dot(q1, tl.trans(k1), input_precision=PREC) * c1
        t2 = tl.dot(q2, tl.trans(k2), input_precision=PREC) * c2
        if MASKED:
            valid = visible(offs_m[:, None], (n0 + offs_n)[None, :], k_len, diag, CAUSAL)
            t1 = tl.where(valid, t1, float("-inf"))
            t2 = tl.where(valid, t2, float("-inf"))
        p1 = _prob(t1, L1[:, None])
        if DQ2:
            ds2 = ds_student(g[:, None], p1, _prob(t2, L2[:, None]))
            dq2 += tl.dot(ds2.to(k2.dtype), k2, input_precision=PREC)
        if DQ1:
            ds1 = ds_teacher(g[:, None], p1, t1, t2, c[:, None])
            if MASKED:
                ds1 = tl.where(valid, ds1, 0.0)
            dq1 += tl.dot(ds1.to(k1.dtype), k1, input_precision=PREC)
    return dq1, dq2


@triton.jit(do_not_specialize=["H", "NQ", "NK", "G1", "G2", "split_len", "n_rows"])
def _bwd_dq_kernel(
    Q1,
    K1,
    Q2,
    K2,  # [B, H, Nq, D1], [B, Hk1, Nk, D1], [B, H, Nq, D2], [B, Hk2, Nk, D2]
    G,
    KLp,
    LSE1,
    LSE2,  # [B, H, Nq] float32, contiguous
    DQ1,
    DQ2,  # [B, H, Nq, D1], [B, H, Nq, D2] contiguous, input dtype; SPLIT: [n_splits, ...] float32
    CU,  # [num_seqs + 1] int32 when VARLEN
    sq1b,
    sq1h,
    sq1n,
    sq1d,
    sk1b,
    sk1h,
    sk1n,
    sk1d,
    sq2b,
    sq2h,
    sq2n,
    sq2d,
    sk2b,
    sk2h,
    sk2n,
    sk2d,
    H,
    NQ,
    NK,
    G1,
    G2,
    c1,
    c2,
    scale1,
    scale2,
    split_len,
    n_splits,
    n_rows,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D1P: tl.constexpr,
    D2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    SPLIT: tl.constexpr,
    DQ1_ON: tl.constexpr,
    DQ2_ON: tl.constexpr,
    PREC: tl.constexpr,
):
    # grid: (cdiv(Nq, BLOCK_M) [* n_splits when SPLIT], H, B or num_seqs). A program owns one
    # [BLOCK_M, D] tile of queries of head h (q1, q2 and their row statistics, loaded once) and
    # streams [BLOCK_N, D] tiles of k1 (head h // G1) and k2 (head h // G2) over the keys its rows
    # see, or with SPLIT over its split's key range, unmasked tiles first, then the masked ones;
    # logits are [BLOCK_M, BLOCK_N] and dq accumulates in registers. All warps share every step
    # (no warp roles). Reads q, k, LSE1/LSE2, KL, G (and CU when VARLEN); writes the dq1 / dq2
    # rows of its tile (DQ1_ON / DQ2_ON), with SPLIT its split's float32 share of them.
    pid_m, split = split_program(tl.program_id(0), n_splits, SPLIT)
    h = tl.program_id(1)
    z = tl.program_id(2)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    h64 = h.to(tl.int64)
    Q1 += b64 * sq1b + h64 * sq1h + seq64 * sq1n
    Q2 += b64 * sq2b + h64 * sq2h + seq64 * sq2n
    K1 += b64 * sk1b + (h // G1).to(tl.int64) * sk1h + seq64 * sk1n
    K2 += b64 * sk2b + (h // G2).to(tl.int64) * sk2h + seq64 * sk2n

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d1 = tl.arange(0, D1P)
    offs_d2 = tl.arange(0, D2P)
    mmask = offs_m < q_len
    q1 = load_tile(Q1, start_m, q_len, sq1n, sq1d, BLOCK_M, D1, D1P, True)
    q2 = load_tile(Q2, start_m, q_len, sq2n, sq2d, BLOCK_M, D2, D2P, True)
    row = (b64 * H + h) * NQ + seq64 + offs_m
    L1, L2, c, g = _row_state(LSE1, LSE2, KLp, G, row, mmask)

    full_end, hi = key_range(start_m, k_len, diag, BLOCK_M, BLOCK_N, CAUSAL)
    lo, mid, hi = split_keys(split, split_len, full_end, hi, SPLIT)

    dq1 = tl.zeros([BLOCK_M, D1P], tl.float32)
    dq2 = tl.zeros([BLOCK_M, D2P], tl.float32)
    dq1, dq2 = _bwd_dq_inner(
        dq1,
        dq2,
        q1,
        q2,
        L1,
        L2,
        c,
        g,
        K1,
        K2,
        sk1n,
        sk1d,
        sk2n,
        sk2d,
        lo,
        mid,
        offs_m,
        k_len,
        diag,
        c1,
        c2,
        D1,
        D2,
        D1P,
        D2P,
        BLOCK_N,
        False,
        CAUSAL,
        DQ1_ON,
        DQ2_ON,
        PREC,
    )
    dq1, dq2 = _bwd_dq_inner(
        dq1,
        dq2,
        q1,
        q2,
        L1,
        L2,
        c,
        g,
        K1,
        K2,
        sk1n,
        sk1d,
        sk2n,
        sk2d,
        mid,
        hi,
        offs_m,
        k_len,
        diag,
        c1,
        c2,
        D1,
        D2,
        D1P,
        D2P,
        BLOCK_N,
        True,
        CAUSAL,
        DQ1_ON,
        DQ2_ON,
        PREC,
    )
    if SPLIT:  # this split's share, rows of [n_splits, B * H * Nq, D] float32
        DQ1 += split.to(tl.int64) * n_rows * D1
        DQ2 += split.to(tl.int64) * n_rows * D2
    if DQ1_ON:
        ptrs = DQ1 + row[:, None] * D1 + offs_d1[None, :]
        tl.store(ptrs, (dq1 * scale1).to(DQ1.dtype.element_ty), mask=mmask[:, None] & (offs_d1[None, :] < D1))
    if DQ2_ON:
        ptrs = DQ2 + row[:, None] * D2 + offs_d2[None, :]
        tl.store(ptrs, (dq2 * scale2).to(DQ2.dtype.element_ty), mask=mmask[:, None] & (offs_d2[None, :] < D2))


@triton.jit
def _bwd_kv_inner(
    dk1,
    dk2,
    k1,
    k2,
    Q1,
    Q2,
    stride_q1n,
    stride_q1d,
    stride_q2n,
    stride_q2d,
    LSE1,
    LSE2,
    KLp,
    G,
    row0,
    DQA1,
    DQA2,
    lo,
    hi,
    offs_n,
    q_len,
    k_len,
    diag,
    c1,
    c2,
    scale1,
    scale2,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D1P: tl.constexpr,
    D2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    NEED1: tl.constexpr,
    NEED2: tl.constexpr,
    DK1: tl.constexpr,
    DK2: tl.constexpr,
    FQ1: tl.constexpr,
    FQ2: tl.constexpr,
    PREC: tl.constexpr,
    QROWS: tl.constexpr,
):
    # Walks query tiles [lo, hi) against one key tile. QROWS lays the tiles out queries x keys
    # ([BM, BN], as the dq kernel does): the per-query statistics then sit along rows, two
    # registers per thread each instead of BM / 4, and dk takes dS^T through shared memory.
    # Otherwise the tiles are keys x queries ([BN, BM]) and dS feeds dk from registers.
    offs_d1 = tl.arange(0, D1P)
    offs_d2 = tl.arange(0, D2P)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mmask = offs_m < q_len
        q1 = load_tile(Q1, m0, q_len, stride_q1n, stride_q1d, BLOCK_M, D1, D1P, True)
        q2 = load_tile(Q2, m0, q_len, stride_q2n, stride_q2d, BLOCK_M, D2, D2P, True)
        row = row0 + offs_m
        L1, L2, c, g = _row_state(LSE1, LSE2, KLp, G, row, mmask)
        if QROWS:
            s1 = tl.dot(q1, tl.trans(k1), input_precision=PREC)  # [BM, BN]
            L1b, L2b, cb, gb = L1[:, None], L2[:, None], c[:, None], g[:, None]
        else:
            s1 = tl.dot(k1, tl.trans(q1), input_precision=PREC)  # [BN, BM]
            L1b, L2b, cb, gb = L1[None, :], L2[None, :], c[None, :], g[None, :]
        t1 = s1 * c1
        if QROWS:
            t2 = tl.dot(q2, tl.trans(k2), input_precision=PREC) * c2
        else:
            t2 = tl.dot(k2, tl.trans(q2), input_precision=PREC) * c2
        if MASKED:
            if QROWS:
                valid = visible(offs_m[:, None], offs_n[None, :], k_len, diag, CAUSAL)
            else:
                valid = visible(offs_m[None, :], offs_n[:, None], k_len, diag, CAUSAL)
            t1 = tl.where(valid, t1, float("-inf"))
            t2 = tl.where(valid, t2, float("-inf"))
        p1 = _prob(t1, L1b)
        if NEED2:
            ds2 = ds_student(gb, p1, _prob(t2, L2b)).to(q2.dtype)
            if DK2:
                dk2 += tl.dot(_keys_by_queries(ds2, QROWS), q2, input_precision=PREC)
            if FQ2:
                part = tl.dot(_queries_by_keys(ds2, QROWS), k2, input_precision=PREC) * scale2
                tl.atomic_add(
                    DQA2 + row[:, None] * D2 + offs_d2[None, :],
                    part,
                    mask=mmask[:, None] & (offs_d2[None, :] < D2),
                    sem="relaxed",
                )
        if NEED1:
            ds1 = ds_teacher(gb, p1, t1, t2, cb)
            if MASKED:
                ds1 = tl.where(valid, ds1, 0.0)
            ds1 = ds1.to(q1.dtype)
            if DK1:
                dk1 += tl.dot(_keys_by_queries(ds1, QROWS), q1, input_precision=PREC)
            if FQ1:
                part = tl.dot(_queries_by_keys(ds1, QROWS), k1, input_precision=PREC) * scale1
                tl.atomic_add(
                    DQA1 + row[:, None] * D1 + offs_d1[None, :],
                    part,
                    mask=mmask[:, None] & (offs_d1[None, :] < D1),
                    sem="relaxed",
                )
    return dk1, dk2


@triton.jit(do_not_specialize=["H", "HK1", "HK2", "NQ", "NK", "G1", "G2", "GG"])
def _bwd_dk_kernel(
    Q1,
    K1,
    Q2,
    K2,  # [B, H, Nq, D1], [B, Hk1, Nk, D1], [B, H, Nq, D2], [B, Hk2, Nk, D2]
    G,
    KLp,
    LSE1,
    LSE2,  # [B, H, Nq] float32, contiguous
    DK1,
    DK2,  # [B, Hk1, Nk, D1], [B, Hk2, Nk, D2] contiguous, input dtype
    DQA1,
    DQA2,  # [B, H, Nq, D1], [B, H, Nq, D2] contiguous fp32 accumulators (fused)
    CU,  # [num_seqs + 1] int32 when VARLEN
    sq1b,
    sq1h,
    sq1n,
    sq1d,
    sk1b,
    sk1h,
    sk1n,
    sk1d,
    sq2b,
    sq2h,
    sq2n,
    sq2d,
    sk2b,
    sk2h,
    sk2n,
    sk2d,
    H,
    HK1,
    HK2,
    NQ,
    NK,
    G1,
    G2,
    GG,
    c1,
    c2,
    scale1,
    scale2,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D1P: tl.constexpr,
    D2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    DK1_ON: tl.constexpr,
    DK2_ON: tl.constexpr,
    FQ1: tl.constexpr,
    FQ2: tl.constexpr,
    PREC: tl.constexpr,
    QROWS: tl.constexpr,
):
    # grid: (cdiv(Nk, BLOCK_N), H // GG, B or num_seqs). The program owns one key tile of key
    # group `hg` and walks the GG query heads hg*GG .. hg*GG+GG-1 (GG = g1 when it computes dk1,
    # g2 when dk2, either when g1 == g2), accumulating dk over them in registers. Tiles: the
    # [BLOCK_N, D] key tiles stay put, [BLOCK_M, D] query tiles stream (masked ones first);
    # logits are formed as [BLOCK_M, BLOCK_N] with QROWS, else [BLOCK_N, BLOCK_M]. All warps
    # share every step (no warp roles). Reads q, k, LSE1/LSE2, KL, G (and CU when VARLEN);
    # writes dk1/dk2 (DK1_ON / DK2_ON), and with FQ1/FQ2 adds dq into the fp32 DQA buffers
    # (atomics).
    pid_n = tl.program_id(0)
    hg = tl.program_id(1)
    z = tl.program_id(2)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    start_n = pid_n * BLOCK_N
    if start_n >= k_len:
        return
    diag = k_len - q_len
    NEED1: tl.constexpr = DK1_ON or FQ1
    NEED2: tl.constexpr = DK2_ON or FQ2
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1P)
    offs_d2 = tl.arange(0, D2P)
    nmask = offs_n < k_len

    # Query tiles: rows i see key j iff j <= i + diag, so the first row that sees this tile is
    # start_n - diag; tiles from m_full on see all of it. A tile past the key bound is all masked.
    if CAUSAL:
        m_lo = tl.maximum(start_n - diag, 0) // BLOCK_M * BLOCK_M
        m_full = tl.maximum(start_n + BLOCK_N - 1 - diag, 0)
        m_full = (m_full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        m_lo = start_n * 0
        m_full = start_n * 0
    if start_n + BLOCK_N > k_len:
        m_full = q_len
    m_full = tl.minimum(tl.maximum(m_full, m_lo), q_len)

    dk1 = tl.zeros([BLOCK_N, D1P], tl.float32)
    dk2 = tl.zeros([BLOCK_N, D2P], tl.float32)
    for hh in range(0, GG):
        h = hg * GG + hh
        h64 = h.to(tl.int64)
        k1b = K1 + b64 * sk1b + (h // G1).to(tl.int64) * sk1h + seq64 * sk1n
        k2b = K2 + b64 * sk2b + (h // G2).to(tl.int64) * sk2h + seq64 * sk2n
        k1 = load_tile(k1b, start_n, k_len, sk1n, sk1d, BLOCK_N, D1, D1P, True)
        k2 = load_tile(k2b, start_n, k_len, sk2n, sk2d, BLOCK_N, D2, D2P, True)
        q1b = Q1 + b64 * sq1b + h64 * sq1h + seq64 * sq1n
        q2b = Q2 + b64 * sq2b + h64 * sq2h + seq64 * sq2n
        row0 = (b64 * H + h) * NQ + seq64
        dk1, dk2 = _bwd_kv_inner(
            dk1,
            dk2,
            k1,
            k2,
            q1b,
            q2b,
            sq1n,
            sq1d,
            sq2n,
            sq2d,
            LSE1,
            LSE2,
            KLp,
            G,
            row0,
            DQA1,
            DQA2,
            m_lo,
            m_full,
            offs_n,
            q_len,
            k_len,
            diag,
            c1,
            c2,
            scale1,
            scale2,
            D1,
            D2,
            D1P,
            D2P,
            BLOCK_M,
            True,
            CAUSAL,
            NEED1,
            NEED2,
            DK1_ON,
            DK2_ON,
            FQ1,
            FQ2,
            PREC,
            QROWS,
        )
        dk1, dk2 = _bwd_kv_inner(
            dk1,
            dk2,
            k1,
            k2,
            q1b,
            q2b,
            sq1n,
            sq1d,
            sq2n,
            sq2d,
            LSE1,
            LSE2,
            KLp,
            G,
            row0,
            DQA1,
            DQA2,
            m_full,
            q_len,
            offs_n,
            q_len,
            k_len,
            diag,
            c1,
            c2,
            scale1,
            scale2,
            D1,
            D2,
            D1P,
            D2P,
            BLOCK_M,
            False,
            CAUSAL,
            NEED1,
            NEED2,
            DK1_ON,
            DK2_ON,
            FQ1,
            FQ2,
            PREC,
            QROWS,
        )
    if DK1_ON:
        hk = hg * GG // G1
        ptrs = DK1 + ((b64 * HK1 + hk) * NK + seq64 + offs_n[:, None]) * D1 + offs_d1[None, :]
        tl.store(ptrs, (dk1 * scale1).to(DK1.dtype.element_ty), mask=nmask[:, None] & (offs_d1[None, :] < D1))
    if DK2_ON:
        hk = hg * GG // G2
        ptrs = DK2 + ((b64 * HK2 + hk) * NK + seq64 + offs_n[:, None]) * D2 + offs_d2[None, :]
        tl.store(ptrs, (dk2 * scale2).to(DK2.dtype.element_ty), mask=nmask[:, None] & (offs_d2[None, :] < D2))
