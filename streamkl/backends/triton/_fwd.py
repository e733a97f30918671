"""Forward kernels: the fused one-pass kernel (optionally one split of the key axis) and the
split-K merge.

Per query row the kernel keeps five running scalars, all in log2 units (t = S * log2(e)):

    m1 = max_j t1[j]            l1 = sum_j 2^(t1[j] - m1)
    m2 = max_j t2[j]            l2 = sum_j 2^(t2[j] - m2)
    acc = sum_j 2^(t1[j] - m1) * (t1[j] - t2[j])

A key tile that raises m1 rescales l1 and acc by 2^(m1_old - m1_new); l2 by 2^(m2_old - m2_new).
At the end, with ln2 = log(2):

    LSE_t = ln2 * (m_t + log2 l_t)
    KL    = ln2 * (acc / l1 + (m2 - m1) + log2 l2 - log2 l1)

(m2 - m1 is formed before adding the logs, so KL does not lose digits to LSE1 - LSE2 when the
logits are large.) A row whose l1 is 0 saw no key: kl = 0, lse = -inf.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import key_range, load_tile, sequence, split_keys, split_program, visible


@triton.jit
def _online_step(m1, l1, m2, l2, acc, t1, t2, valid, MASKED: tl.constexpr):
    """One key tile of the online form (module docstring) on log2-scaled logits t1, t2 [BM, BN].
    MASKED: `valid` marks the pairs seen; the rest enter as t = -inf and weigh nothing."""
    if MASKED:
        t1 = tl.where(valid, t1, float("-inf"))
        t2 = tl.where(valid, t2, float("-inf"))
    m1n = tl.maximum(m1, tl.max(t1, 1))
    m2n = tl.maximum(m2, tl.max(t2, 1))
    if MASKED:  # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no NaN)
        m1u = tl.where(m1n == float("-inf"), 0.0, m1n)
        m2u = tl.where(m2n == float("-inf"), 0.0, m2n)
    else:
        m1u = m1n
        m2u = m2n
    a1 = tl.math.exp2(m1 - m1u)
    a2 = tl.math.exp2(m2 - m2u)
    p1 = tl.math.exp2(t1 - m1u[:, None])
    p2 = tl.math.exp2(t2 - m2u[:, None])
    d = t1 - t2
    if MASKED:
        d = tl.where(valid, d, 0.0)
    l1 = l1 * a1 + tl.sum(p1, 1)
    l2 = l2 * a2 + tl.sum(p2, 1)
    acc = acc * a1 + tl.sum(p1 * d, 1)
    return m1n, l1, m2n, l2, acc


@triton.jit
def _store_result(KL, LSE1, LSE2, offs, mask, m1, l1, m2, l2, acc):
    """The end of the online form: KL, LSE1, LSE2 of rows `offs` from their five scalars
    (module docstring). A row with l1 = 0 saw no key: KL = 0, LSE = -inf."""
    seen = l1 > 0.0
    l1s = tl.where(seen, l1, 1.0)
    l2s = tl.where(seen, l2, 1.0)
    kl = (acc / l1s + (m2 - m1) + tl.math.log2(l2s) - tl.math.log2(l1s)) * 0.6931471805599453
    tl.store(KL + offs, tl.where(seen, kl, 0.0), mask=mask)
    tl.store(
        LSE1 + offs, tl.where(seen, (m1 + tl.math.log2(l1s)) * 0.6931471805599453, float("-inf")), mask=mask
    )
    tl.store(
        LSE2 + offs, tl.where(seen, (m2 + tl.math.log2(l2s)) * 0.6931471805599453, float("-inf")), mask=mask
    )


@triton.jit
def _fwd_inner(
    m1,
    l1,
    m2,
    l2,
    acc,
    q1,
    q2,
    K1,
    K2,  # tile-origin pointers of this (batch, key head, sequence)
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
    PREC: tl.constexpr,
):
    # Streams key tiles [lo, hi). MASKED tiles apply the key bound and the causal frontier
    # (row i sees key j <= i + diag); unmasked tiles are fully visible to every row of the tile.
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(lo, hi, BLOCK_N):
        k1 = load_tile(K1, n0, k_len, stride_k1n, stride_k1d, BLOCK_N, D1, D1P, MASKED)
        k2 = load_tile(K2, n0, k_len, stride_k2n, stride_k2d, BLOCK_N, D2, D2P, MASKED)
        t1 = tl.dot(q1, tl.trans(k1), input_precision=PREC) * c1  # S1 * log2(e)   [BM, BN]
        t2 = tl.dot(q2, tl.trans(k2), input_precision=PREC) * c2  # S2 * log2(e)   [BM, BN]
        valid = 0
        if MASKED:
            valid = visible(offs_m[:, None], (n0 + offs_n)[None, :], k_len, diag, CAUSAL)
        m1, l1, m2, l2, acc = _online_step(m1, l1, m2, l2, acc, t1, t2, valid, MASKED)
    return m1, l1, m2, l2, acc


# Sizes and head counts are not specialized (a training loop with varying lengths compiles once);
# strides are, so the loads stay 16-byte vectors.
@triton.jit(do_not_specialize=["H", "NQ", "NK", "G1", "G2", "split_len", "n_splits"])
def _fwd_kernel(
    Q1,
    K1,
    Q2,
    K2,  # [B, H, Nq, D1], [B, Hk1, Nk, D1], [B, H, Nq, D2], [B, Hk2, Nk, D2]
    KL,
    LSE1,
    LSE2,  # [B, H, Nq] float32 (unused when SPLIT)
    PART,  # [5, SPLITS, B, H, Nq] float32 partial (m1, l1, m2, l2, acc) when SPLIT
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
    split_len,
    n_splits,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D1P: tl.constexpr,
    D2P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
):
    # grid: (cdiv(Nq, BLOCK_M) [* n_splits when SPLIT], H, B or num_seqs). A program owns one
    # [BLOCK_M, D] tile of queries of head h (q1 and q2, loaded once) and streams [BLOCK_N, D]
    # tiles of k1 (head h // G1) and k2 (head h // G2) over all keys it sees, or with SPLIT over
    # its split's key range: unmasked tiles first, then the masked ones (the causal frontier and
    # the ragged last tile). All warps share every step (no warp roles). Reads q1, q2, k1, k2
    # (and CU when VARLEN); writes KL, LSE1, LSE2 of its rows, or with SPLIT their five partial
    # running scalars to PART for _merge_kernel.
    pid_m, split = split_program(tl.program_id(0), n_splits, SPLIT)
    h = tl.program_id(1)
    z = tl.program_id(2)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    diag = k_len - q_len  # bottom-right causal: row i sees keys j <= i + diag
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    Q1 += b64 * sq1b + h.to(tl.int64) * sq1h + seq64 * sq1n
    Q2 += b64 * sq2b + h.to(tl.int64) * sq2h + seq64 * sq2n
    K1 += b64 * sk1b + (h // G1).to(tl.int64) * sk1h + seq64 * sk1n
    K2 += b64 * sk2b + (h // G2).to(tl.int64) * sk2h + seq64 * sk2n

    offs_m = start_m + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    q1 = load_tile(Q1, start_m, q_len, sq1n, sq1d, BLOCK_M, D1, D1P, True)
    q2 = load_tile(Q2, start_m, q_len, sq2n, sq2d, BLOCK_M, D2, D2P, True)

    full_end, hi = key_range(start_m, k_len, diag, BLOCK_M, BLOCK_N, CAUSAL)
    lo, mid, hi = split_keys(split, split_len, full_end, hi, SPLIT)

    m1 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    m2 = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l1 = tl.zeros([BLOCK_M], tl.float32)
    l2 = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M], tl.float32)
    m1, l1, m2, l2, acc = _fwd_inner(
        m1,
        l1,
        m2,
        l2,
        acc,
        q1,
        q2,
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
        PREC,
    )
    m1, l1, m2, l2, acc = _fwd_inner(
        m1,
        l1,
        m2,
        l2,
        acc,
        q1,
        q2,
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
        PREC,
    )

    row = (b64 * H + h) * NQ + seq64 + offs_m
    if SPLIT:
        rows_all = tl.num_programs(2).to(tl.int64) * H * NQ
        stride_part = rows_all * n_splits
        base = PART + split.to(tl.int64) * rows_all + row
        tl.store(base, m1, mask=mmask)
        tl.store(base + stride_part, l1, mask=mmask)
        tl.store(base + 2 * stride_part, m2, mask=mmask)
        tl.store(base + 3 * stride_part, l2, mask=mmask)
        tl.store(base + 4 * stride_part, acc, mask=mmask)
    else:
        _store_result(KL, LSE1, LSE2, row, mmask, m1, l1, m2, l2, acc)


@triton.jit(do_not_specialize=["ROWS", "n_splits"])
def _merge_kernel(PART, KL, LSE1, LSE2, ROWS, n_splits, SPLITS_P: tl.constexpr, BLOCK_R: tl.constexpr):
    # grid: (cdiv(ROWS, BLOCK_R),), ROWS = B * H * Nq. A program merges BLOCK_R rows: it reads
    # the [SPLITS_P, BLOCK_R] tiles of each partial scalar (m1, l1, m2, l2, acc) of those rows
    # from PART ([5, n_splits, ROWS] float32, splits past n_splits masked) and writes KL, LSE1,
    # LSE2 of the rows. All warps share every step (no warp roles).
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, SPLITS_P)
    rmask = offs_r < ROWS
    mask = rmask[None, :] & (offs_s[:, None] < n_splits)
    ptrs = PART + offs_s[:, None].to(tl.int64) * ROWS + offs_r[None, :]
    sp = ROWS.to(tl.int64) * n_splits  # int64: a forced split count at long Nq passes 2^31
    m1 = tl.load(ptrs, mask=mask, other=float("-inf"))
    l1 = tl.load(ptrs + sp, mask=mask, other=0.0)
    m2 = tl.load(ptrs + 2 * sp, mask=mask, other=float("-inf"))
    l2 = tl.load(ptrs + 3 * sp, mask=mask, other=0.0)
    acc = tl.load(ptrs + 4 * sp, mask=mask, other=0.0)
    M1 = tl.max(m1, 0)
    M2 = tl.max(m2, 0)
    M1u = tl.where(M1 == float("-inf"), 0.0, M1)
    M2u = tl.where(M2 == float("-inf"), 0.0, M2)
    w1 = tl.math.exp2(m1 - M1u[None, :])  # 0 for splits that saw nothing (m = -inf)
    w2 = tl.math.exp2(m2 - M2u[None, :])
    L1 = tl.sum(l1 * w1, 0)
    L2 = tl.sum(l2 * w2, 0)
    A = tl.sum(tl.where(w1 > 0.0, acc * w1, 0.0), 0)
    _store_result(KL, LSE1, LSE2, offs_r, rmask, M1u, L1, M2u, L2, A)
