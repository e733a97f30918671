"""Pieces every kernel shares, written once: tile loads, the visibility mask, the sequence a
program works on, and the backward's two dS formulas. Triton inlines these @jit functions, so
they cost nothing at run time (tests/test_triton_sm90.py compares the generated PTX)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile(
    base,
    r0,
    n_rows,
    stride_r,
    stride_d,
    BLOCK: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """[BLOCK, DP] tile: rows r0 .. r0+BLOCK-1 of a (rows, D) matrix at `base`, columns past D
    (the pow2 padding of the head dim) read as 0, and with MASK_ROWS rows >= n_rows too. The
    row offset is formed in int64: r0 * stride_r passes 2^31 for long (B, N, H, D) inputs."""
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)
    ptrs = base + tl.cast(r0, tl.int64) * stride_r + (offs_r[:, None] * stride_r + offs_d[None, :] * stride_d)
    if MASK_ROWS:
        rmask = (r0 + offs_r) < n_rows
        tile = tl.load(ptrs, mask=rmask[:, None] & (offs_d[None, :] < D), other=0.0)
    elif D == DP:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return tile


@triton.jit
def visible(row, col, k_len, diag, CAUSAL: tl.constexpr):
    """Which (row, key) pairs are seen: key inside the sequence and, when causal, at or before
    the bottom-right frontier (key j <= row i + diag, diag = Nk - Nq). row and col come already
    broadcast ([M, 1] and [1, N], or transposed for key-major kernels)."""
    valid = col < k_len
    if CAUSAL:
        valid = valid & (col <= row + diag)
    return valid


@triton.jit
def sequence(CU, z, NQ, NK, VARLEN: tl.constexpr):
    """(batch, first token, query length, key length) of grid slot z: a batch entry, or a packed
    sequence of cu_seqlens (B = 1, Nq = Nk inside it)."""
    if VARLEN:
        seq0 = tl.load(CU + z)
        q_len = tl.load(CU + z + 1) - seq0
        k_len = q_len
        b = z * 0
    else:
        seq0 = z * 0
        q_len = NQ
        k_len = NK
        b = z
    return b, seq0, q_len, k_len


@triton.jit
def key_range(start_m, k_len, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys a query tile starting at start_m visits: [0, mid) is seen by every row of the tile
    (no mask), [mid, hi) needs the mask; hi stops at the causal frontier of the tile's last row,
    so keys past it are never loaded."""
    if CAUSAL:
        hi = tl.minimum(k_len, start_m + BLOCK_M + diag)
        full_end = tl.minimum(k_len, start_m + diag + 1)
    else:
        hi = k_len
        full_end = k_len
    hi = tl.maximum(hi, 0)
    full_end = tl.maximum(full_end, 0) // BLOCK_N * BLOCK_N
    return full_end, hi


@triton.jit
def split_program(pid0, n_splits, SPLIT: tl.constexpr):
    """(query tile, key split) of program pid0 on axis 0: split-K grids run cdiv(Nq, BLOCK_M) *
    n_splits programs there, split fastest."""
    if SPLIT:
        pid_m = pid0 // n_splits
        split = pid0 % n_splits
    else:
        pid_m = pid0
        split = pid0 * 0
    return pid_m, split


@triton.jit
def split_keys(split, split_len, full_end, hi, SPLIT: tl.constexpr):
    """(lo, mid, hi): the keys [lo, hi) a program walks, of the tile's [0, hi), with SPLIT only its
    split's whole key tiles; [lo, mid) need no mask (mid: full_end clipped into the range)."""
    lo = 0
    if SPLIT:
        lo = split * split_len
        hi = tl.minimum(hi, lo + split_len)
    return lo, tl.minimum(tl.maximum(full_end, lo), hi), hi


@triton.jit
def ds_student(g, p1, p2):
    """Setting 1 (teacher fixed): dS2 = g (P2 - P1)."""
    return g * (p2 - p1)


@triton.jit
def ds_teacher(g, p1, t1, t2, c):
    """Setting 2 (target fixed): dS1 = g P1 ((S1 - LSE1) - (S2 - LSE2) - KL), formed from the
    log2-scaled logits t and c = ln2 (L1 - L2) + KL, never from log P."""
    return g * p1 * ((t1 - t2) * 0.6931471805599453 - c)
