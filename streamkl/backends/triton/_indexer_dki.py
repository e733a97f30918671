"""indexer_kl, the key-major dki pass: dki with a fixed summation order, for
torch.use_deterministic_algorithms(True) (docs/indexer.md, "Determinism").

The main pass adds each program's dki share with float32 atomics (a key's rows live in many
programs), so the order of the sum varies from run to run. Here a program owns a tile of BN keys
and walks, BM rows at a time in increasing order, every row that sees them, with its dki tile in
registers: dki[j] = sum_rows dz^T qi, as the main pass forms it (dI_j = a q_j - b p_j, dz_g =
dI w_g [z_g > 0]), written once. The price is the teacher: its head mixture p is recomputed for
every (row, key) pair, the work of one more main pass.

Sparse mode has no such walk (a key's rows are whichever rows chose it), and a row's queries
(H x D, the teacher's) are the large read there, so rows stay the programs' axis: each row's
shares of its top-k keys are stored, a chunk of rows at a time (at most PART_BYTES), and added
into dki by index_add_, whose deterministic form sums each key's shares in row order.
"""

from __future__ import annotations

import torch
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
)  # fmt: skip
from ._launch import _launch
from ._tiles import sequence

PART_BYTES = 512 << 20  # sparse mode: the float32 shares of one chunk of rows, at most (one row's more)


def by_key(spec) -> bool:
    """Whether this call's dki is summed key by key in a fixed order by dki_pass instead of the
    main pass's float32 atomics: where dki is needed and torch.use_deterministic_algorithms(True)
    is on (the main pass then forms dqi, dw and the KL without dki). The one place indexer_kl's
    determinism is decided (docs/indexer.md, "Determinism")."""
    return spec.needs[1] and torch.are_deterministic_algorithms_enabled()


def dki_pass(call, spec, lse, lse2, coefs, dki) -> None:
    """Writes dki (B, Sk, Di) float32 in a fixed summation order, for per-row coefficients
    coefs = (a, b), (B, Sq) float32: dI = a q - b p, as the main pass's (call: the launcher's
    _Call of the main pass, whose plan and tensors this pass shares). Dense: the key-major kernel.
    Sparse: the rows in chunks, each row's top-k shares stored by _indexer_dki_rows_kernel and
    added into dki by index_add_ (deterministic under this mode: PyTorch sorts the indices, and
    its sort is stable). As in the main pass, each row tile's coefficients enter scaled so that
    the largest is 1 and its sums are multiplied back (_indexer_tiles.unit_coefs)."""
    coefs = tuple(c.contiguous() for c in coefs)
    key = "dki-rows" if spec.sparse else "dki"
    consts = call.plan.variants.get(key)
    if consts is None:  # its own dict: the launch cache keys on the dict's identity
        consts = call.plan.variants[key] = dict(call.plan.consts)
    if spec.sparse:
        _rows_pass(call, spec, lse, lse2, coefs, dki, consts)
        return
    grid = (triton.cdiv(spec.seq_k, consts["BN"]), call.plan.grid[1])
    args = (*call.lead, lse, lse2, *coefs, dki, *call.strides, *call.plan.scalars, 1.0 / spec.heads)
    _launch(_indexer_dki_kernel, grid, args, consts)


def _rows_pass(call, spec, lse, lse2, coefs, dki, consts) -> None:
    """Sparse dki: chunks of rows whose (rows, K, Di) float32 shares fit PART_BYTES, each chunk
    one launch of _indexer_dki_rows_kernel and one index_add_ into dki at the shares' keys."""
    assert consts["BM"] == 1, "sparse programs hold one row"
    q, topk, cu = call.lead[0], call.lead[5], call.lead[6]  # topk: the sorted key sets
    width, di, n_rows = spec.topk_width, spec.di, spec.batch * spec.nq
    if width == 0:  # no row admits a key: dki stays zero
        return
    chunk = max(1, min(n_rows, PART_BYTES // (width * di * 4)))
    part = torch.empty((chunk, width, di), device=q.device, dtype=torch.float32)
    seq_of = lse2  # placeholder pointer when not packed (never read)
    if spec.packed:  # each packed row's sequence
        rows = torch.arange(spec.nq, device=q.device, dtype=torch.int32)
        seq_of = torch.searchsorted(cu[1:], rows, right=True).to(torch.int32)
    sets = topk.view(n_rows, width)
    flat = dki.view(-1, di)
    for row0 in range(0, n_rows, chunk):
        n = min(chunk, n_rows - row0)
        tensors = (*call.lead[:7], seq_of, lse, lse2, *coefs, part)
        args = (*tensors, *call.strides, *call.plan.scalars, 1.0 / spec.heads, row0, n_rows)
        _launch(_indexer_dki_rows_kernel, (n,), args, consts)
        # the chunk's shares' keys on dki's (B * Sk) axis, formed per chunk (bounded memory):
        # padding and repeats (-1) read key 0 and add zeros
        batch = torch.arange(row0, row0 + n, device=q.device) // spec.nq
        keys = sets[row0 : row0 + n].clamp_min(0) + (batch * spec.nk)[:, None]
        flat.index_add_(0, keys.reshape(-1), part[:n].view(-1, di))


@triton.jit(do_not_specialize=["H", "NQ", "NK", "G", "GROUP", "CPG", "N_CHUNKS", "TOPK_W"])
def _indexer_dki_kernel(
    Q, K, QI, KI, W, TOPK, CU, LSE, LSE2, COEF_A, COEF_B, DKI,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sib, sig, sin, sid, skib, skin, skid, swb, swg, swn,
    H, NQ, NK, G, GROUP, CPG, N_CHUNKS, TOPK_W, c_log2, inv_h,
    D: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr, GP: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPARSE: tl.constexpr,
    PREC_T: tl.constexpr, PREC_S: tl.constexpr,
):  # fmt: skip
    # grid: (cdiv(Sk or max_seqlen, BN), B or num_seqs). The program owns keys n0 .. n0 + BN - 1
    # of its sequence, holds their ki tile [BN, DIP] and a float32 dki tile [BN, DIP], and walks
    # the row tiles from the first that sees key n0 (causal) to the sequence's end. Per row tile,
    # the main pass's step: teacher mixture p [BM, BN] (head chunks stacked as GEMM rows), the
    # student's stacked [GP * BM, DIP] qi against the ki tile, dI = a q - b p with (a, b) of
    # COEF_A, COEF_B (rows with both 0 skipped; the tile's scaled so that the largest is 1, dz
    # rounded to the inputs' dtype at that size), dki += (dz^T @ qi) times that scale. Reads q,
    # k, qi, ki, w, LSE (B, H, Sq), LSE2 (B, Sq), cu_seqlens (VARLEN), COEF_A/COEF_B;
    # writes its rows of DKI (B, Sk, Di) fp32, every key of the tile (zero where no row adds
    # anything). TOPK, TOPK_W: the main pass's arguments, unused (SPARSE is False).
    z = tl.program_id(1)
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    n0 = tl.program_id(0) * BN
    if n0 >= k_len:
        return
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    diag = k_len - q_len
    key = n0 + tl.arange(0, BN)
    ok = key < k_len
    offs_di = tl.arange(0, DIP)
    ki = load_keys(KI + b64 * skib + seq64 * skin, key, ok, skin, skid, 0, DI, DIP)
    Q_B = Q + b64 * sqb + seq64 * sqn
    K_B = K + b64 * skb + seq64 * skn
    LSE_B = LSE + b64 * H * NQ + seq64
    QI_B = QI + b64 * sib + seq64 * sin
    W_B = W + b64 * swb + seq64 * swn

    M: tl.constexpr = HB * BM
    MG: tl.constexpr = GP * BM
    g_slot = tl.arange(0, MG) // BM
    g_ok = g_slot < G
    r_lo = 0
    if CAUSAL:
        r_lo = tl.maximum(n0 - diag, 0) // BM * BM  # row i sees key j when j <= i + diag
    dki = tl.zeros([BN, DIP], tl.float32)
    for r0 in range(r_lo, q_len, BM):
        rows = r0 + tl.arange(0, BM)
        row_ok = rows < q_len
        row_at = b64 * NQ + seq64 + rows
        coef_a = tl.load(COEF_A + row_at, mask=row_ok, other=0.0)
        coef_b = tl.load(COEF_B + row_at, mask=row_ok, other=0.0)
        coef_a, coef_b, scale = unit_coefs(coef_a, coef_b)
        if tl.max(tl.abs(coef_a) + tl.abs(coef_b), 0) > 0.0:
            lse2 = tl.load(LSE2 + row_at, mask=row_ok, other=float("-inf"))
            lse2 = tl.where(lse2 > float("-inf"), lse2, float("inf"))
            t_rows = r0 + tl.arange(0, M) % BM
            t_row_ok = t_rows < q_len
            adm = admitted(rows, q_len, key, ok, k_len, diag, CAUSAL)
            t_adm = admitted(t_rows, q_len, key, ok, k_len, diag, CAUSAL)
            p = teacher_mixture(
                Q_B, K_B, LSE_B, NQ, t_rows, t_row_ok, key, ok, t_adm, N_CHUNKS, GROUP, CPG, c_log2, inv_h,
                sqh, sqn, sqd, skh, skn, skd, D, BD, HB, BM, BN, PREC_T,
            )  # fmt: skip
            g_rows = r0 + tl.arange(0, MG) % BM
            g_row_ok = g_rows < q_len
            qi = load_rows(QI_B, g_slot, g_rows, g_ok, g_row_ok, sig, sin, sid, 0, DI, DIP)
            w_ptrs = W_B + g_slot.to(tl.int64) * swg + g_rows.to(tl.int64) * swn
            w_s = tl.load(w_ptrs, mask=g_ok & g_row_ok, other=0.0).to(tl.float32)
            scores, zs = index_scores(qi, ki, w_s, GP, BM, BN, PREC_S)
            log_q = tl.where(adm, scores - lse2[:, None], 0.0)
            q = tl.where(adm, tl.exp(log_q), 0.0)
            _, dz = score_grads(coef_a, coef_b, q, p, zs, w_s, GP, BM, BN)
            dki += tl.dot(tl.trans(dz.to(qi.dtype)), qi, input_precision=PREC_S) * scale
    ptrs = DKI + (b64 * NK + seq64 + key.to(tl.int64))[:, None] * DI + offs_di[None, :]
    tl.store(ptrs, dki, mask=ok[:, None] & (offs_di[None, :] < DI))


@triton.jit(do_not_specialize=["H", "NQ", "NK", "G", "GROUP", "CPG", "N_CHUNKS", "TOPK_W", "ROW0", "N_ROWS"])
def _indexer_dki_rows_kernel(
    Q, K, QI, KI, W, TOPK, CU, SEQ_OF, LSE, LSE2, COEF_A, COEF_B, PART,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, sib, sig, sin, sid, skib, skin, skid, swb, swg, swn,
    H, NQ, NK, G, GROUP, CPG, N_CHUNKS, TOPK_W, c_log2, inv_h, ROW0, N_ROWS,
    D: tl.constexpr, DI: tl.constexpr, DIP: tl.constexpr, BD: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, HB: tl.constexpr, GP: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, SPARSE: tl.constexpr,
    PREC_T: tl.constexpr, PREC_S: tl.constexpr,
):  # fmt: skip
    # Sparse mode (BM = 1). grid: (rows of the chunk,). Program i owns row ROW0 + i of the
    # (B, Sq) row space (its packed sequence read from SEQ_OF), walks its top-k set BN entries
    # at a time as the main pass does, and stores each entry's share dz^T qi (coefficients
    # scaled as the main pass's;
    # 0 for padding, repeats and keys the row does not admit) to PART [i, entry, :] (chunk rows
    # x TOPK_W x DI, fp32). No atomics: the launcher adds PART into dki with one index_add_.
    g_row = ROW0 + tl.program_id(0)
    if g_row >= N_ROWS:
        return
    if VARLEN:
        z = tl.load(SEQ_OF + g_row)
    else:
        z = g_row // NQ
    b, seq0, q_len, k_len = sequence(CU, z, NQ, NK, VARLEN)
    b64 = b.to(tl.int64)
    seq64 = seq0.to(tl.int64)
    r0 = g_row - b * NQ - seq0
    diag = k_len - q_len
    rows = r0 + tl.arange(0, BM)
    row_ok = rows < q_len
    row_at = b64 * NQ + seq64 + rows
    coef_a = tl.load(COEF_A + row_at, mask=row_ok, other=0.0)
    coef_b = tl.load(COEF_B + row_at, mask=row_ok, other=0.0)
    lse2 = tl.load(LSE2 + row_at, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse2 > float("-inf"), lse2, float("inf"))
    TOPK_ROW = TOPK + (b64 * NQ + seq64 + r0) * TOPK_W

    M: tl.constexpr = HB * BM
    MG: tl.constexpr = GP * BM
    t_rows = r0 + tl.arange(0, M) % BM
    t_row_ok = t_rows < q_len
    g_slot = tl.arange(0, MG) // BM
    g_rows = r0 + tl.arange(0, MG) % BM
    g_ok = g_slot < G
    g_row_ok = g_rows < q_len
    qi = load_rows(QI + b64 * sib + seq64 * sin, g_slot, g_rows, g_ok, g_row_ok, sig, sin, sid, 0, DI, DIP)
    w_ptrs = W + b64 * swb + seq64 * swn + g_slot.to(tl.int64) * swg + g_rows.to(tl.int64) * swn
    w_s = tl.load(w_ptrs, mask=g_ok & g_row_ok, other=0.0).to(tl.float32)
    coef_a, coef_b, grad_scale = unit_coefs(coef_a, coef_b)
    offs_di = tl.arange(0, DIP)
    PART_ROW = PART + tl.program_id(0).to(tl.int64) * TOPK_W * DI
    for n0 in range(0, TOPK_W, BN):
        key, ok = key_tile(TOPK_ROW, n0, TOPK_W, seq0, k_len, BN, SPARSE)
        adm = admitted(rows, q_len, key, ok, k_len, diag, CAUSAL)
        t_adm = admitted(t_rows, q_len, key, ok, k_len, diag, CAUSAL)
        p = teacher_mixture(
            Q + b64 * sqb + seq64 * sqn, K + b64 * skb + seq64 * skn, LSE + b64 * H * NQ + seq64, NQ, t_rows,
            t_row_ok, key, ok, t_adm, N_CHUNKS, GROUP, CPG, c_log2, inv_h,
            sqh, sqn, sqd, skh, skn, skd, D, BD, HB, BM, BN, PREC_T,
        )  # fmt: skip
        ki = load_keys(KI + b64 * skib + seq64 * skin, key, ok, skin, skid, 0, DI, DIP)
        scores, zs = index_scores(qi, ki, w_s, GP, BM, BN, PREC_S)
        log_q = tl.where(adm, scores - lse2[:, None], 0.0)
        q = tl.where(adm, tl.exp(log_q), 0.0)
        _, dz = score_grads(coef_a, coef_b, q, p, zs, w_s, GP, BM, BN)
        part = tl.dot(tl.trans(dz.to(qi.dtype)), qi, input_precision=PREC_S) * grad_scale  # [BN, DIP]
        entry = n0 + tl.arange(0, BN)
        ptrs = PART_ROW + entry.to(tl.int64)[:, None] * DI + offs_di[None, :]
        tl.store(ptrs, part, mask=(entry < TOPK_W)[:, None] & (offs_di[None, :] < DI))
