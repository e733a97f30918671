"""What indexer_kl's two kernels share (docs/indexer.md, "The triton backend"): which keys a key
tile holds (a block of the key axis, or a block of a row's top-k set), which (row, key) pairs are
admitted, and the two products per key tile, the teacher's head mixture and the student's index
scores, each with its heads stacked as the M dimension of one tl.dot.

Stacking: a program owns BM query rows. A [S * BM, ...] stacked tile holds slot s (a teacher
head, or an indexer head) of row r at index m = s * BM + r, so a per-row [BM, BN] value reaches
the stacked layout by `stack` and a stacked one returns by a reshape to [S, BM, BN] and a sum
over the slots. For the MQA teacher all heads of a chunk share the key tile: one wide GEMM.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import visible


@triton.jit
def unit_coefs(coef_a, coef_b):
    """(a / s, b / s, s) for the per-row coefficients [R] of the rows a tile holds, s their
    largest magnitude (1 where all are 0): the gradient passes round dz = (a q - b p) w to 16
    bits before their GEMMs and multiply the sums by s, so small or far-apart row weights (a
    mean's 1 / rows, a row's 1 / T) keep a 16-bit dz's full precision."""
    s = tl.max(tl.maximum(tl.abs(coef_a), tl.abs(coef_b)), 0)
    s = tl.where(s > 0.0, s, 1.0)
    return coef_a / s, coef_b / s, s


@triton.jit
def score_grads(coef_a, coef_b, q, p, zs, w_s, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """(dI, dz), both [GP * BM, BN] stacked: each row's dI_j = a q_j - b p_j over the indexer
    heads, and dz_g = dI w_g [z_g > 0], the gradient through head g's ReLU and weight
    (docs/indexer.md, Gradients); coef_a, coef_b [BM], q, p [BM, BN], zs [GP * BM, BN]."""
    d_scores = stack(coef_a[:, None] * q - coef_b[:, None] * p, GP, BM, BN)
    return d_scores, tl.where(zs > 0.0, d_scores * w_s[:, None], 0.0)


@triton.jit
def stack(x, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN] per-row values as the [S * BM, BN] stacked layout (each slot a copy)."""
    return tl.reshape(tl.broadcast_to(x[None, :, :], (S, BM, BN)), (S * BM, BN))


@triton.jit
def unstack_sum(x, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """[S * BM, BN] stacked values summed over the slots: [BM, BN]."""
    return tl.sum(tl.reshape(x, (S, BM, BN)), 0)


@triton.jit
def key_tile(TOPK_ROW, n0, width, seq0, k_len, BN: tl.constexpr, SPARSE: tl.constexpr):
    """(key [BN], ok [BN]): the positions inside the sequence of the keys of tile n0 and which of
    them exist. Dense: keys n0 .. n0 + BN - 1. Sparse: entries n0 .. of the row's deduplicated
    top-k set (positions on the call's key axis, -1 padding), those outside the row's sequence
    dropped; a dropped key reads position 0 (in range) and is masked."""
    offs = n0 + tl.arange(0, BN)
    if SPARSE:
        ids = tl.load(TOPK_ROW + offs, mask=offs < width, other=-1)
        key = ids - seq0
        ok = (ids >= 0) & (key >= 0) & (key < k_len)
        key = tl.where(ok, key, 0)
    else:
        key = offs
        ok = key < k_len
    return key, ok


@triton.jit
def admitted(rows, q_len, key, ok, k_len, diag, CAUSAL: tl.constexpr):
    """[R, BN] bool: row rows[r] (inside the sequence) admits key[n] (bottom-right causal rule of
    _tiles.visible, the key existing, the row existing)."""
    return visible(rows[:, None], key[None, :], k_len, diag, CAUSAL) & ok[None, :] & (rows < q_len)[:, None]


@triton.jit
def load_rows(
    base, slots, rows, slot_ok, row_ok, stride_s, stride_r, stride_d, d0, D: tl.constexpr, BD: tl.constexpr
):
    """[M, BD] tile of stacked rows: element (m, d) at base + slots[m] stride_s + rows[m]
    stride_r + (d0 + d) stride_d, 0 where the slot or row does not exist or d0 + d >= D."""
    offs_d = d0 + tl.arange(0, BD)
    ptrs = base + slots.to(tl.int64)[:, None] * stride_s + rows.to(tl.int64)[:, None] * stride_r
    ptrs += offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=(slot_ok & row_ok)[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def load_keys(base, key, ok, stride_n, stride_d, d0, D: tl.constexpr, BD: tl.constexpr):
    """[BN, BD] tile of keys key[n] (gathered: a sparse tile's keys are any positions)."""
    offs_d = d0 + tl.arange(0, BD)
    ptrs = base + key.to(tl.int64)[:, None] * stride_n + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def teacher_logits(
    Q, K, h, kv, rows, head_ok, row_ok, key, ok, sqh, sqn, sqd, skh, skn, skd,
    D: tl.constexpr, BD: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """[M, BN] q_h . k_j of the stacked (head h[m], row rows[m]) against one key tile of key head
    kv, the head dim walked BD at a time (D up to 576: MLA's absorbed key)."""
    s = tl.zeros([M, BN], tl.float32)
    for d0 in range(0, D, BD):
        qt = load_rows(Q, h, rows, head_ok, row_ok, sqh, sqn, sqd, d0, D, BD)
        kt = load_keys(K + kv.to(tl.int64) * skh, key, ok, skn, skd, d0, D, BD)
        s += tl.dot(qt, tl.trans(kt), input_precision=PREC)
    return s


@triton.jit
def index_scores(qi, ki, w_s, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """(I [BM, BN], z [GP * BM, BN]): the student's scores sum_g w_g relu(qi_g . ki_j) of one key
    tile from the stacked indexer queries qi [GP * BM, DiP] and their weights w_s [GP * BM] (0 for
    padding heads), and the heads' products z."""
    z = tl.dot(qi, tl.trans(ki), input_precision=PREC)
    scores = unstack_sum(tl.maximum(z, 0.0) * w_s[:, None], GP, BM, BN)
    return scores, z


@triton.jit
def head_chunk(c, slot, group, cpg, HB: tl.constexpr):
    """(teacher heads [M], which exist, key head) of head chunk c: HB consecutive query heads of
    one key head's group (cpg = cdiv(group, HB) chunks per group; a chunk past the group's end
    holds padding heads)."""
    kv = c // cpg
    in_group = (c % cpg) * HB + slot
    return kv * group + in_group, in_group < group, kv


@triton.jit
def teacher_mixture(
    Q, K, LSE_B, NQ, rows, row_ok, key, ok, adm, n_chunks, group, cpg, c_log2, inv_h,
    sqh, sqn, sqd, skh, skn, skd,
    D: tl.constexpr, BD: tl.constexpr, HB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    PREC: tl.constexpr,
):  # fmt: skip
    """[BM, BN] p_j = (1/H) sum_h 2^(t_hj - L_h) over one key tile, 0 where not admitted (adm,
    stacked [HB * BM, BN]): the head chunks in turn, each one GEMM of its HB heads x BM rows
    against the key tile of its key head. LSE_B: the teacher LSE (natural log) of this batch
    entry and sequence, (H, NQ) rows; -inf (a row that sees no key) reads as L = +inf, so p = 0."""
    M: tl.constexpr = HB * BM
    slot = tl.arange(0, M) // BM
    p = tl.zeros([BM, BN], tl.float32)
    for c in range(n_chunks):
        h, head_ok, kv = head_chunk(c, slot, group, cpg, HB)
        s = teacher_logits(
            Q, K, h, kv, rows, head_ok, row_ok, key, ok, sqh, sqn, sqd, skh, skn, skd, D, BD, M, BN, PREC
        )  # fmt: skip
        lse = tl.load(LSE_B + h.to(tl.int64) * NQ + rows, mask=head_ok & row_ok, other=float("-inf"))
        L = tl.where(lse > float("-inf"), lse * 1.4426950408889634, float("inf"))
        e = tl.math.exp2(tl.where(adm & head_ok[:, None], s * c_log2 - L[:, None], float("-inf")))
        p += unstack_sum(e, HB, BM, BN)
    return p * inv_h
