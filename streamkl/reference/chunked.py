"""The reference computation. For each chunk of query rows (all batches and heads at once):

    S_t = scale_t * q_t[rows] @ k_t^T                         (masked to the visible keys)
    LSE_t = logsumexp(S_t);  P1 = exp(S1 - LSE1)
    KL = sum_j P1 * ((S1 - LSE1) - (S2 - LSE2))                (the same value as SPEC's
                                                                sum P1 (S1 - S2) - LSE1 + LSE2,
                                                                without the cancellation)
backward:  dS2 = g (P2 - P1);  dS1 = g P1 ((S1 - LSE1) - (S2 - LSE2) - KL)
           dq_t = scale_t dS_t @ k_t;  dk_t += scale_t dS_t^T @ q_t   (summed over GQA groups)
"""

from __future__ import annotations

import math

import torch

from .. import _env

# One chunk's logits take about this many bytes per distribution when no chunk is set.
_CHUNK_BYTES = 64 << 20


def supports(q1, k1, q2, k2, cu_seqlens=None) -> str | None:
    return None  # every dtype, every device


def _compute_dtype(q1, q2):
    return torch.float64 if torch.float64 in (q1.dtype, q2.dtype) else torch.float32


def _chunk_rows(b, h, nq, nk, dtype) -> int:
    chunk = _env.reference_chunk()
    if chunk is None:
        per_row = max(1, b * h * nk * torch.finfo(dtype).bits // 8)
        chunk = max(1, _CHUNK_BYTES // per_row)
    return max(1, min(chunk, max(nq, 1)))


def _segments(cu_seqlens, nq):
    """(start, end) of each packed sequence, or the whole axis once."""
    if cu_seqlens is None:
        return [(0, nq)]
    offsets = cu_seqlens.tolist()
    return [(a, b) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]


def _logits(q, k, rows, scale, dtype):
    """scale * q[:, :, rows] @ k^T as (B, H, len(rows), Nk), GQA by a grouped view, no copy of k."""
    b, h, _, d = q.shape
    hk = k.shape[1]
    qc = q[:, :, rows].to(dtype).reshape(b, hk, h // hk, -1, d)
    s = torch.matmul(qc, k.to(dtype).unsqueeze(2).transpose(-1, -2))
    return (s * scale).reshape(b, h, -1, k.shape[2])


def _mask(row0, nrows, nq, nk, causal, device):
    """(rows, Nk) bool of visible keys for rows row0.. (bottom-right causal), or None if all."""
    if not causal:
        return None
    rows = torch.arange(row0, row0 + nrows, device=device)[:, None]
    cols = torch.arange(nk, device=device)[None, :]
    return cols <= rows + (nk - nq)


def _chunk_stats(q1, k1, q2, k2, rows, row0, causal, scale1, scale2, dtype):
    """Masked logits of one chunk and their log-probabilities (0 where masked or row empty)."""
    nq, nk = q1.shape[2], k1.shape[2]
    s1 = _logits(q1, k1, rows, scale1, dtype)
    s2 = _logits(q2, k2, rows, scale2, dtype)
    mask = _mask(row0, s1.shape[2], nq, nk, causal, s1.device)
    if mask is not None:
        s1 = s1.masked_fill(~mask, -math.inf)
        s2 = s2.masked_fill(~mask, -math.inf)
    return s1, s2, mask


def _log_probs(s, lse, mask):
    # Empty rows have lse = -inf; shift by 0 instead so nothing becomes NaN, then zero them.
    out = s - torch.nan_to_num(lse, neginf=0.0)[..., None]
    return out if mask is None else out.masked_fill(~mask, 0.0)


def _forward_dense_rows(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1, lse2):
    b, h, nq, _ = q1.shape
    nk = k1.shape[2]
    dtype = kl.dtype
    chunk = _chunk_rows(b, h, nq, nk, dtype)
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        s1, s2, mask = _chunk_stats(q1, k1, q2, k2, rows, row0, causal, scale1, scale2, dtype)
        l1 = torch.logsumexp(s1, -1)
        l2 = torch.logsumexp(s2, -1)
        logp1 = _log_probs(s1, l1, mask)
        logp2 = _log_probs(s2, l2, mask)
        p1 = torch.exp(s1 - torch.nan_to_num(l1, neginf=0.0)[..., None])
        kl[:, :, rows] = (p1 * (logp1 - logp2)).sum(-1)
        lse1[:, :, rows] = l1
        lse2[:, :, rows] = l2
        del s1, s2, logp1, logp2, p1


def forward(q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None):
    b, h, nq, _ = q1.shape
    dtype = _compute_dtype(q1, q2)
    kl = torch.zeros(b, h, nq, dtype=dtype, device=q1.device)
    lse1 = torch.full_like(kl, -math.inf)
    lse2 = torch.full_like(kl, -math.inf)
    if k1.shape[2] == 0:
        return kl, lse1, lse2
    for start, end in _segments(cu_seqlens, nq):
        seq = slice(start, end) if cu_seqlens is not None else slice(None)
        _forward_dense_rows(
            q1[:, :, seq],
            k1[:, :, seq],
            q2[:, :, seq],
            k2[:, :, seq],
            causal,
            scale1,
            scale2,
            kl[:, :, seq],
            lse1[:, :, seq],
            lse2[:, :, seq],
        )
    return kl, lse1, lse2


def _backward_dense_rows(grad, q1, k1, q2, k2, kl, lse1, lse2, causal, scale1, scale2, needs, grads):
    b, h, nq, _ = q1.shape
    nk = k1.shape[2]
    dtype = grads[4]
    dq1, dk1, dq2, dk2 = grads[:4]
    need_1 = needs[0] or needs[1]
    need_2 = needs[2] or needs[3]
    chunk = _chunk_rows(b, h, nq, nk, dtype)
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        s1, s2, mask = _chunk_stats(q1, k1, q2, k2, rows, row0, causal, scale1, scale2, dtype)
        g = grad[:, :, rows, None].to(dtype)
        logp1 = _log_probs(s1, lse1[:, :, rows], mask)
        logp2 = _log_probs(s2, lse2[:, :, rows], mask)
        del s1, s2
        p1 = logp1.exp()
        if mask is not None:
            p1 = p1.masked_fill(~mask, 0.0)
        empty = torch.isneginf(lse1[:, :, rows])[..., None]  # rows that see no key
        p1 = p1.masked_fill(empty, 0.0)
        if need_2:
            p2 = logp2.exp()
            if mask is not None:
                p2 = p2.masked_fill(~mask, 0.0)
            ds2 = g * (p2.masked_fill(empty, 0.0) - p1)
            del p2
            _accumulate(ds2, q2, k2, rows, scale2, needs[2], needs[3], dq2, dk2)
            del ds2
        if need_1:
            ds1 = g * p1 * (logp1 - logp2 - kl[:, :, rows, None].to(dtype))
            _accumulate(ds1, q1, k1, rows, scale1, needs[0], needs[1], dq1, dk1)
            del ds1
        del logp1, logp2, p1


def _accumulate(ds, q, k, rows, scale, need_dq, need_dk, dq, dk):
    """dq[rows] = scale ds @ k;  dk += scale ds^T @ q[rows], summed over the heads of a group."""
    b, h, n, nk = ds.shape
    hk, d = k.shape[1], k.shape[3]
    ds_grouped = ds.reshape(b, hk, h // hk, n, nk)
    if need_dq:
        kk = k.to(ds.dtype).unsqueeze(2)
        dq[:, :, rows] = (scale * torch.matmul(ds_grouped, kk)).reshape(b, h, n, d)
    if need_dk:
        qc = q[:, :, rows].to(ds.dtype).reshape(b, hk, h // hk, n, d)
        dk += scale * torch.matmul(ds_grouped.transpose(-1, -2), qc).sum(2)


def backward(
    grad_kl,
    q1,
    k1,
    q2,
    k2,
    kl,
    lse1,
    lse2,
    *,
    causal,
    scale1,
    scale2,
    cu_seqlens=None,
    max_seqlen=None,
    needs=(True, True, True, True),
):
    dtype = _compute_dtype(q1, q2)
    inputs = (q1, k1, q2, k2)
    # Accumulate in the compute dtype; cast to each input's dtype once at the end.
    acc = [
        torch.zeros(t.shape, dtype=dtype, device=t.device) if need else None for t, need in zip(inputs, needs)
    ]
    if k1.shape[2] > 0 and any(needs):
        nq = q1.shape[2]
        for start, end in _segments(cu_seqlens, nq):
            seq = slice(start, end) if cu_seqlens is not None else slice(None)
            part = [None if t is None else t[:, :, seq] for t in (*inputs, *acc)]
            _backward_dense_rows(
                grad_kl[:, :, seq],
                *part[:4],
                kl[:, :, seq],
                lse1[:, :, seq],
                lse2[:, :, seq],
                causal,
                scale1,
                scale2,
                needs,
                part[4:] + [dtype],
            )
    return tuple(None if a is None else a.to(t.dtype) for a, t in zip(acc, inputs))
