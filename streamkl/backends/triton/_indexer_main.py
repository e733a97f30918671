"""indexer_kl, the main pass: the teacher streamed once, with the student's LSE2 known (pass 1).

Per key tile of a program's rows: the head mixture p_j (teacher, _indexer_tiles.teacher_mixture),
the index scores I_j and log q_j = I_j - LSE2. Then, as asked:

  WRITE_KL   T += sum_j p_j,  C += sum_j p_j (log p_j - log q_j);  at the end
             KL = C/T - log T  (0 where T = 0), MASS = T.
             This is docs/indexer.md's E/T - log T - A/T + LSE2 with A and E in one sum: each
             term is a log-ratio of target to student, so nothing of the size of the scores
             cancels (A/T against LSE2 would, at scores ~1e2), and with LSE2 known no online
             rescaling is needed.
  GRADS      dI_j = a q_j - b p_j with per-row (a, b) read from COEF_A, COEF_B (the backward:
             a = g [T > 0], b = g / T; the fused training step: a = b = the row's weight in the
             reduced loss, T = 1; its correction where T != 1), scaled so that the program's
             largest is 1 and the sums below multiplied back (_indexer_tiles.unit_coefs). Then
             dz_g = dI w_g [z_g > 0] and dw_g += sum_j dI_j relu(z_g), dqi_g += dz_g @ ki (both
             per row, in registers), dki += dz^T @ qi (fp32 atomics: a key's rows live in many
             programs, and a key-major pass would recompute the teacher, the cost this pass exists
             to pay once). REDO (the fused step's correction, on rows whose T != 1): dqi and
             dw are formed again with the rows' whole coefficients and overwrite the stored
             ones (each rounded once), while dki, which mixes rows, receives only the
             difference from the first pass's, from DCOEF_A, DCOEF_B.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._indexer_tiles import (
    admitted,
    index_scores,
    key_tile,
    load_keys,
    load_rows,
    score_grads,
    teacher_mixture,
    unit_coefs,
)
from ._tiles import key_range, sequence


@triton.jit(do_not_specialize=["H", "NQ", "NK", "G", "GROUP", "CPG", "N_CHUNKS", "TOPK_W"])
def _indexer_main_kernel(
    Q, K, QI, KI, W, TOPK, CU, LSE, LSE2, COEF_A, COEF_B, DCOEF_A, DCOEF_B, KL, MASS, DQI, DKI, DW,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sib, sig, sin, sid, skib, skin, skid, swb, swg, swn,
    H, NQ, NK, G, GROUP, CPG, N_CHUNKS, TOPK_W, c_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr, GP: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPARSE: tl.constexpr,
    WRITE_KL: tl.constexpr, GRADS: tl.constexpr, REDO: tl.constexpr,
    NEED_DQI: tl.constexpr, NEED_DKI: tl.constexpr, NEED_DW: tl.constexpr,
    PREC_T: tl.constexpr, PREC_S: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(Sq or max_seqlen, BM), B or num_seqs). A program owns BM query rows (BM = 1 in
    # sparse mode) and walks their key tiles as pass 1 does (dense key axis to the causal
    # frontier, or the row's deduplicated top-k entries BN at a time). Per key tile, teacher:
    # each chunk of HB heads of one key head as [HB * BM, BD] stacked q tiles against the
    # [BN, BD] k tile, D walked BD at a time, summed over the heads into p [BM, BN]; student: the
    # G heads x BM rows as one [GP * BM, DIP] operand held for the whole walk against the
    # [BN, DIP] ki tile. Registers also hold dqi [GP * BM, DIP] and dw [GP * BM] (fp32). All
    # warps share every step (no warp roles). Reads q, k, qi, ki, w, LSE (B, H, Sq), LSE2
    # (B, Sq), topk (SPARSE), cu_seqlens (VARLEN), COEF_A/COEF_B (GRADS), DCOEF_A/DCOEF_B
    # (REDO); writes KL and MASS (B, Sq) fp32 (WRITE_KL), its rows of dqi
    # (B, G, Sq, Di) and dw (B, G, Sq) in their dtypes, and adds into dki (B, Sk, Di) fp32 with
    # atomics.
    z = tl.program_id(1)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    r0 = tl.program_id(0) * BM
    if r0 >= q_len:
        return
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < q_len
    row_at = b64 * NQ + seq64 + rows  # (B, Sq) statistics of the rows
    if GRADS:
        coef_a = tl.load(COEF_A + row_at, mask=row_ok, other=0.0)
        coef_b = tl.load(COEF_B + row_at, mask=row_ok, other=0.0)
        coef_a, coef_b, grad_scale = unit_coefs(coef_a, coef_b)
        if REDO:
            dcoef_a = tl.load(DCOEF_A + row_at, mask=row_ok, other=0.0)
            dcoef_b = tl.load(DCOEF_B + row_at, mask=row_ok, other=0.0)
            dcoef_a, dcoef_b, dgrad_scale = unit_coefs(dcoef_a, dcoef_b)
            if tl.max(tl.abs(dcoef_a) + tl.abs(dcoef_b), 0) == 0.0:
                return  # the correction: these rows' gradients are right already
            idle = r0 < 0  # a row of no target mass still adds its -q to dki
        else:
            dcoef_a = coef_a
            dcoef_b = coef_b
            dgrad_scale = grad_scale
            idle = tl.max(tl.abs(coef_a) + tl.abs(coef_b), 0) == 0.0  # no row adds anything
    else:
        coef_a = tl.zeros([BM], tl.float32)
        coef_b = tl.zeros([BM], tl.float32)
        grad_scale = 0.0
        idle = r0 < 0
    diag = k_len - q_len
    if SPARSE:
        TOPK_ROW = TOPK + (b64 * NQ + seq64 + r0) * TOPK_W
        n_hi = TOPK_W
    else:
        TOPK_ROW = TOPK
        n_hi = key_range(r0, k_len, diag, BM, BN, CAUSAL)[1]
    if idle:
        n_hi = 0  # the backward's rows that see no key or have g = 0: their zero gradients only
    lse2 = tl.load(LSE2 + row_at, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse2 > float("-inf"), lse2, float("inf"))  # no key seen: log q = -inf, q = 0

    M: tl.constexpr = HB * BM
    t_rows = r0 + tl.arange(0, M) % BM
    t_row_ok = t_rows < q_len
    Q_B = Q + b64 * sqb + seq64 * sqn
    K_B = K + b64 * skb + seq64 * skn
    LSE_B = LSE + b64 * H * NQ + seq64

    MG: tl.constexpr = GP * BM
    g_slot = tl.arange(0, MG) // BM
    g_rows = r0 + tl.arange(0, MG) % BM
    g_ok = g_slot < G
    g_row_ok = g_rows < q_len
    qi = load_rows(QI + b64 * sib + seq64 * sin, g_slot, g_rows, g_ok, g_row_ok, sig, sin, sid, 0, DI, DIP)
    w_ptrs = W + b64 * swb + seq64 * swn + g_slot.to(tl.int64) * swg + g_rows.to(tl.int64) * swn
    w_s = tl.load(w_ptrs, mask=g_ok & g_row_ok, other=0.0).to(tl.float32)
    KI_B = KI + b64 * skib + seq64 * skin
    offs_di = tl.arange(0, DIP)

    mass = tl.zeros([BM], tl.float32)
    ratio = tl.zeros([BM], tl.float32)
    dqi = tl.zeros([MG, DIP], tl.float32)
    dw = tl.zeros([MG], tl.float32)
    for n0 in range(0, n_hi, BN):
        key, ok = key_tile(TOPK_ROW, n0, TOPK_W, seq0, k_len, BN, SPARSE)
        adm = admitted(rows, q_len, key, ok, k_len, diag, CAUSAL)
        t_adm = admitted(t_rows, q_len, key, ok, k_len, diag, CAUSAL)
        p = teacher_mixture(
            Q_B, K_B, LSE_B, NQ, t_rows, t_row_ok, key, ok, t_adm, N_CHUNKS, GROUP, CPG, c_log2, inv_h,
            sqh, sqn, sqd, skh, skn, skd, D, BD, HB, BM, BN, PREC_T,
        )  # fmt: skip
        ki = load_keys(KI_B, key, ok, skin, skid, 0, DI, DIP)
        scores, zs = index_scores(qi, ki, w_s, GP, BM, BN, PREC_S)
        log_q = tl.where(adm, scores - lse2[:, None], 0.0)  # log q where admitted (p > 0 only there)
        if WRITE_KL:
            mass += tl.sum(p, 1)
            pos = p > 0.0
            ratio += tl.sum(tl.where(pos, p * (tl.log(tl.where(pos, p, 1.0)) - log_q), 0.0), 1)
        if GRADS:
            q = tl.where(adm, tl.exp(log_q), 0.0)
            d_scores, dz = score_grads(coef_a, coef_b, q, p, zs, w_s, GP, BM, BN)
            if NEED_DW:
                dw += tl.sum(d_scores * tl.maximum(zs, 0.0), 1)
            if NEED_DQI:
                dqi += tl.dot(dz.to(ki.dtype), ki, input_precision=PREC_S)
            if NEED_DKI:
                if REDO:
                    _, dz_k = score_grads(dcoef_a, dcoef_b, q, p, zs, w_s, GP, BM, BN)
                else:
                    dz_k = dz
                part = tl.dot(tl.trans(dz_k.to(qi.dtype)), qi, input_precision=PREC_S)  # [BN, DIP]
                part *= dgrad_scale
                ptrs = DKI + (b64 * NK + seq64 + key.to(tl.int64))[:, None] * DI + offs_di[None, :]
                tl.atomic_add(ptrs, part, mask=ok[:, None] & (offs_di[None, :] < DI), sem="relaxed")

    if WRITE_KL:
        seen = mass > 0.0
        t = tl.where(seen, mass, 1.0)
        tl.store(KL + row_at, tl.where(seen, ratio / t - tl.log(t), 0.0), mask=row_ok)
        tl.store(MASS + row_at, mass, mask=row_ok)
    out_at = (b64 * G + g_slot) * NQ + seq64 + g_rows  # (B, G, Sq) rows of dqi and dw
    out_ok = g_ok & g_row_ok
    if NEED_DW:
        tl.store(DW + out_at, (dw * grad_scale).to(DW.dtype.element_ty), mask=out_ok)
    if NEED_DQI:
        ptrs = DQI + out_at[:, None] * DI + offs_di[None, :]
        mask = out_ok[:, None] & (offs_di[None, :] < DI)
        tl.store(ptrs, (dqi * grad_scale).to(DQI.dtype.element_ty), mask=mask)
