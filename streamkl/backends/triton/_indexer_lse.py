"""indexer_kl, pass 1: the log-sum-exps the main pass needs before it streams the teacher.

Per query row, over the keys it admits: the student's LSE2 = log sum_j exp(I_j) by the online
(m2, l2) of a softmax (a row that admits nothing keeps l2 = 0: LSE2 = -inf), and with
TEACHER_LSE each teacher head's LSE over the same keys, (m, l) online in log2 units. With a
given lse the pass is the student's alone: G Di per pair against the teacher's H D.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexer_tiles import admitted, head_chunk, index_scores, key_tile, load_keys, load_rows, teacher_logits
from ._tiles import key_range, sequence


@triton.jit(do_not_specialize=["H", "NQ", "NK", "G", "GROUP", "CPG", "N_CHUNKS", "TOPK_W"])
def _indexer_lse_kernel(
    Q, K, QI, KI, W, TOPK, CU, LSE, LSE2,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sib, sig, sin, sid, skib, skin, skid, swb, swg, swn,
    H, NQ, NK, G, GROUP, CPG, N_CHUNKS, TOPK_W, c_log2,
    D: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr, GP: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPARSE: tl.constexpr, TEACHER_LSE: tl.constexpr,
    PREC_T: tl.constexpr, PREC_S: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(Sq or max_seqlen, BM), B or num_seqs). A program owns BM query rows (BM = 1 in
    # sparse mode: each row gathers its own keys) and walks their key tiles: the dense key axis
    # up to the causal frontier of its last row, or the row's deduplicated top-k entries BN at a
    # time. Student: the G indexer heads x BM rows stacked as one [GP * BM, DIP] operand (loaded
    # once) against each [BN, DIP] ki tile. Teacher (TEACHER_LSE): per chunk of HB heads of one
    # key head, HB x BM stacked rows against each [BN, D] k tile, D walked BD at a time. All
    # warps share every step (no warp roles). Reads q, k (TEACHER_LSE), qi, ki, w, topk (SPARSE),
    # cu_seqlens (VARLEN); writes LSE2 (B, Sq) and with TEACHER_LSE LSE (B, H, Sq), float32.
    z = tl.program_id(1)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    r0 = tl.program_id(0) * BM
    if r0 >= q_len:
        return
    diag = k_len - q_len
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    if SPARSE:
        TOPK_ROW = TOPK + (b64 * NQ + seq64 + r0) * TOPK_W
        n_hi = TOPK_W
    else:
        TOPK_ROW = TOPK
        n_hi = key_range(r0, k_len, diag, BM, BN, CAUSAL)[1]
    KI_B = KI + b64 * skib + seq64 * skin
    rows = r0 + tl.arange(0, BM)

    MG: tl.constexpr = GP * BM
    g_slot = tl.arange(0, MG) // BM
    g_rows = r0 + tl.arange(0, MG) % BM
    g_ok = g_slot < G
    g_row_ok = g_rows < q_len
    qi = load_rows(QI + b64 * sib + seq64 * sin, g_slot, g_rows, g_ok, g_row_ok, sig, sin, sid, 0, DI, DIP)
    w_ptrs = W + b64 * swb + seq64 * swn + g_slot.to(tl.int64) * swg + g_rows.to(tl.int64) * swn
    w_s = tl.load(w_ptrs, mask=g_ok & g_row_ok, other=0.0).to(tl.float32)
    m2 = tl.full([BM], float("-inf"), tl.float32)
    l2 = tl.zeros([BM], tl.float32)
    for n0 in range(0, n_hi, BN):
        key, ok = key_tile(TOPK_ROW, n0, TOPK_W, seq0, k_len, BN, SPARSE)
        ki = load_keys(KI_B, key, ok, skin, skid, 0, DI, DIP)
        scores, _ = index_scores(qi, ki, w_s, GP, BM, BN, PREC_S)
        scores = tl.where(admitted(rows, q_len, key, ok, k_len, diag, CAUSAL), scores, float("-inf"))
        m_new = tl.maximum(m2, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing admitted yet: no NaN
        l2 = l2 * tl.exp(m2 - m_use) + tl.sum(tl.exp(scores - m_use[:, None]), 1)
        m2 = m_new
    lse2 = tl.where(l2 > 0.0, m2 + tl.log(tl.where(l2 > 0.0, l2, 1.0)), float("-inf"))
    tl.store(LSE2 + b64 * NQ + seq64 + rows, lse2, mask=rows < q_len)

    if TEACHER_LSE:
        M: tl.constexpr = HB * BM
        slot = tl.arange(0, M) // BM
        t_rows = r0 + tl.arange(0, M) % BM
        t_row_ok = t_rows < q_len
        Q_B = Q + b64 * sqb + seq64 * sqn
        K_B = K + b64 * skb + seq64 * skn
        for c in range(N_CHUNKS):
            h, head_ok, kv = head_chunk(c, slot, GROUP, CPG, HB)
            m = tl.full([M], float("-inf"), tl.float32)
            l = tl.zeros([M], tl.float32)  # noqa: E741
            for n0 in range(0, n_hi, BN):
                key, ok = key_tile(TOPK_ROW, n0, TOPK_W, seq0, k_len, BN, SPARSE)
                s = teacher_logits(
                    Q_B, K_B, h, kv, t_rows, head_ok, t_row_ok, key, ok, sqh, sqn, sqd, skh, skn, skd,
                    D, BD, M, BN, PREC_T,
                )  # fmt: skip
                adm = admitted(t_rows, q_len, key, ok, k_len, diag, CAUSAL)
                t = tl.where(adm, s * c_log2, float("-inf"))
                m_new = tl.maximum(m, tl.max(t, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                l = l * tl.math.exp2(m - m_use) + tl.sum(tl.math.exp2(t - m_use[:, None]), 1)  # noqa: E741
                m = m_new
            log2_sum = m + tl.math.log2(tl.where(l > 0.0, l, 1.0))
            lse = tl.where(l > 0.0, log2_sum * 0.6931471805599453, float("-inf"))
            ptrs = LSE + (b64 * H + h) * NQ + seq64 + t_rows
            tl.store(ptrs, lse, mask=head_ok & t_row_ok)
