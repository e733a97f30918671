"""attn_kl on the reference backend (streamkl/_backend.py's protocol). For each chunk of query
rows (all batches and heads at once):

    S_t = scale_t * q_t[rows] @ k_t^T                         (masked to the visible keys)
    log P_t = (S_t - max S_t) - log sum exp(S_t - max S_t);  LSE_t = max S_t + log sum ...
    KL = sum_j P1 * (log P1 - log P2)                          (the same value as
                                                                sum P1 (S1 - S2) - LSE1 + LSE2
                                                                of docs/contract.md, Definition,
                                                                without the cancellation)
backward:  log P_t = S_t - LSE_t from the LSEs it is given (context parallelism passes the merged,
           global ones);  dS2 = g (P2 - P1);  dS1 = g P1 (log P1 - log P2 - KL)
           dq_t = scale_t dS_t @ k_t;  dk_t += scale_t dS_t^T @ q_t   (summed over GQA groups)

Memory (docs/contract.md, Memory): a chunk of rows holds at most _LIVE_CHUNK_TEMPS temporaries of
(B, H, rows, Nk) in the compute dtype at once (forward: logp2, logp1, p1, or logp2, logits1 and
the exp inside its log-softmax; backward: logp2, p1 and dS1), every other step works in place.
The default chunk keeps the working set within the two dense Nq x Nk matrices and the chunk's
temporaries within _CHUNK_BYTES; see _chunk_rows for what else a call holds.
"""

from __future__ import annotations

import math

import torch

from .. import _checks, _env
from .._spec import AttnKLGrads, AttnKLInputs, AttnKLSpec, AttnKLStats, causal_offset

op = "attn_kl"
backward_backend = None

# The most bytes one chunk's temporaries take when STREAMKL_REFERENCE_CHUNK is not set.
_CHUNK_BYTES = 256 << 20

# (B, H, rows, Nk) temporaries of the compute dtype alive at once inside a chunk (see above).
_LIVE_CHUNK_TEMPS = 3


def supports(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    return None  # every dtype, every device


def auto_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    return None  # the last backend auto tries


def _compute_dtype(q1, q2):
    return torch.float64 if torch.float64 in (q1.dtype, q2.dtype) else torch.float32


def _chunk_rows(b, h, nq, nk, dtype, d=0, held=0) -> int:
    """Query rows per chunk: STREAMKL_REFERENCE_CHUNK, else as many as keep the call's working
    set within the two dense (B, H, Nq, Nk) matrices of `dtype`, and the chunk's own
    temporaries within _CHUNK_BYTES (at least one row).

    Per row: the _LIVE_CHUNK_TEMPS logit-sized temporaries, one causal mask row (bool) and one
    (B, H, D) row of q cast or of the dq product. `held`: bytes the call holds besides its chunk
    (a key-sized cast or copy of k, accumulators that are not the returned gradients). They are
    O((Nq + Nk) * D), like the gradients, and count against the dense bound only: charged to the
    cap as well, they would leave long-context 16-bit calls (float32 dk accumulators of 256 MiB
    and more) one row per chunk."""
    chunk = _env.reference_chunk()
    if chunk is None:
        size = torch.finfo(dtype).bits // 8
        per_row = max(1, b * h * (_LIVE_CHUNK_TEMPS * nk + d) * size + nk)
        budget = min(2 * b * h * nq * nk * size - held, _CHUNK_BYTES)
        chunk = max(1, budget // per_row)
    return max(1, min(chunk, max(nq, 1)))


def _key_bytes(k1, k2, dtype) -> int:
    """Bytes of the larger key tensor in `dtype`: a cast of k, or its copy for the matrix product."""
    return max(k.numel() for k in (k1, k2)) * (torch.finfo(dtype).bits // 8)


def _segments(cu_seqlens, nq):
    """The token slice of each non-empty packed sequence, or None once for the whole axis."""
    if cu_seqlens is None:
        return [None]
    offsets = _checks.packed_offsets(cu_seqlens, nq)
    return [slice(a, b) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]


def _sliced(seq, *tensors):
    """Each tensor's tokens `seq` (axis 2); with seq None the tensors themselves, not aliases."""
    return [t if t is None or seq is None else t[:, :, seq] for t in tensors]


def _grouped_rows(q, rows, hk, dtype):
    """q[:, :, rows] as (B, Hk, groups * rows, D): the query heads of a GQA group stacked."""
    b, h, _, d = q.shape
    qc = q[:, :, rows].to(dtype)
    return qc.reshape(b, hk, (h // hk) * qc.shape[2], d)


def _logits(q, k, rows, scale, dtype, hidden):
    """scale * q[:, :, rows] @ k^T as a contiguous (B, H, rows, Nk), -inf where `hidden`; GQA by
    stacking each group's query heads against their shared key head, no copy of k per group."""
    b, h, _, _ = q.shape
    hk, nk = k.shape[1], k.shape[2]
    s = torch.matmul(_grouped_rows(q, rows, hk, dtype), k.to(dtype).transpose(-1, -2)).mul_(scale)
    s = s.view(b, h, -1, nk)
    return s if hidden is None else s.masked_fill_(hidden, -math.inf)


def _hidden(row0, nrows, nq, nk, causal, device):
    """(rows, Nk) bool of keys rows row0.. may not see (bottom-right causal), or None if none."""
    if not causal:
        return None
    rows = torch.arange(row0, row0 + nrows, device=device)[:, None]
    cols = torch.arange(nk, device=device)[None, :]
    return cols > rows + causal_offset(nq, nk)


def _log_softmax_(s, hidden):
    """In place: s becomes log P = (s - m) - log sum exp(s - m), 0 where hidden; returns the
    row's logsumexp m + log sum (-inf for a row that sees no key, whose log P is all 0). The max
    is subtracted first, exactly where s is near it, so log P keeps float32's relative accuracy
    at large logits (s - LSE in one step would round at |LSE|). One temporary of s's size;
    torch.log_softmax and logsumexp would hold two together."""
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(torch.isinf(m), 0.0)
    log_total = s.sub_(m).exp().sum(-1, keepdim=True).log_()
    s.sub_(torch.nan_to_num(log_total, neginf=0.0))
    if hidden is not None:
        s.masked_fill_(hidden, 0.0)
    return log_total.add_(m).squeeze(-1)


def _log_probs_(s, lse, hidden):
    """In place: s - lse, 0 where hidden. Empty rows (lse = -inf) shift by 0, so nothing becomes NaN."""
    s.sub_(torch.nan_to_num(lse, neginf=0.0)[..., None])
    return s if hidden is None else s.masked_fill_(hidden, 0.0)


def _forward_dense_rows(q1, k1, q2, k2, causal, scale1, scale2, kl, lse1, lse2):
    b, h, nq, d1 = q1.shape
    nk, d2 = k1.shape[2], q2.shape[3]
    dtype = kl.dtype
    chunk = _chunk_rows(b, h, nq, nk, dtype, max(d1, d2), _key_bytes(k1, k2, dtype))
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        hidden = _hidden(row0, rows.stop - row0, nq, nk, causal, q1.device)
        logp2 = _logits(q2, k2, rows, scale2, dtype, hidden)
        l2 = _log_softmax_(logp2, hidden)
        logp1 = _logits(q1, k1, rows, scale1, dtype, hidden)
        l1 = _log_softmax_(logp1, hidden)
        p1 = logp1.exp()
        if hidden is not None:
            p1.masked_fill_(hidden, 0.0)
        diff = logp1.sub_(logp2)  # logp1 - logp2 in logp1's storage
        del logp2
        kl[:, :, rows] = diff.mul_(p1).sum(-1)
        lse1[:, :, rows] = l1
        lse2[:, :, rows] = l2
        del diff, p1


def backward_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    return None  # its own backward runs every call its forward does


def forward(spec: AttnKLSpec, inputs: AttnKLInputs) -> AttnKLStats:
    q1, k1, q2, k2, cu_seqlens = inputs
    causal, scale1, scale2 = spec.causal, spec.scale1, spec.scale2
    b, h, nq = spec.batch, spec.heads, spec.nq
    dtype = _compute_dtype(q1, q2)
    kl = torch.zeros(b, h, nq, dtype=dtype, device=q1.device)
    lse1 = torch.full_like(kl, -math.inf)
    lse2 = torch.full_like(kl, -math.inf)
    if k1.shape[2] == 0 or kl.numel() == 0:
        return kl, lse1, lse2
    for seq in _segments(cu_seqlens, nq):
        q1s, k1s, q2s, k2s, kls, lse1s, lse2s = _sliced(seq, q1, k1, q2, k2, kl, lse1, lse2)
        _forward_dense_rows(q1s, k1s, q2s, k2s, causal, scale1, scale2, kls, lse1s, lse2s)
    return AttnKLStats(kl, lse1, lse2)


def _backward_dense_rows(
    grad, q1, k1, q2, k2, kl, lse1, lse2, causal, scale1, scale2, needs, grads, dtype, held
):
    b, h, nq, d1 = q1.shape
    nk, d2 = k1.shape[2], q2.shape[3]
    dq1, dk1, dq2, dk2 = grads
    need_1 = needs[0] or needs[1]
    need_2 = needs[2] or needs[3]
    chunk = _chunk_rows(b, h, nq, nk, dtype, max(d1, d2), held + _key_bytes(k1, k2, dtype))
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        hidden = _hidden(row0, rows.stop - row0, nq, nk, causal, q1.device)
        g = grad[:, :, rows, None].to(dtype)
        logp1 = _log_probs_(_logits(q1, k1, rows, scale1, dtype, hidden), lse1[:, :, rows], hidden)
        logp2 = _log_probs_(_logits(q2, k2, rows, scale2, dtype, hidden), lse2[:, :, rows], hidden)
        empty = torch.isneginf(lse1[:, :, rows])[..., None]  # rows that see no key
        p1 = logp1.exp()
        if hidden is not None:
            p1.masked_fill_(hidden, 0.0)
        p1.masked_fill_(empty, 0.0)
        if need_1:  # dS1 in logp1's storage: logp1 is not needed after it
            ds1 = logp1.sub_(logp2).sub_(kl[:, :, rows, None].to(dtype)).mul_(p1).mul_(g)
            _accumulate(ds1, q1, k1, rows, scale1, needs[0], needs[1], dq1, dk1)
            del ds1
        del logp1
        if need_2:  # P2 and then dS2 in logp2's storage
            p2 = logp2.exp_()
            if hidden is not None:
                p2.masked_fill_(hidden, 0.0)
            ds2 = p2.masked_fill_(empty, 0.0).sub_(p1).mul_(g)
            _accumulate(ds2, q2, k2, rows, scale2, needs[2], needs[3], dq2, dk2)
            del p2, ds2
        del logp2, p1


def _accumulate(ds, q, k, rows, scale, need_dq, need_dk, dq, dk):
    """dq[rows] = scale ds @ k;  dk += scale ds^T @ q[rows], summed over the heads of a group
    (ds is contiguous, so its (B, Hk, groups * rows, Nk) view is free)."""
    b, h, n, nk = ds.shape
    hk, d = k.shape[1], k.shape[3]
    ds_grouped = ds.view(b, hk, (h // hk) * n, nk)
    if need_dq:
        dq[:, :, rows] = torch.matmul(ds_grouped, k.to(ds.dtype)).mul_(scale).view(b, h, n, d)
    if need_dk:
        qc = _grouped_rows(q, rows, hk, ds.dtype)
        dk.view(b * hk, nk, d).baddbmm_(
            ds_grouped.transpose(-1, -2).reshape(b * hk, nk, -1), qc.reshape(b * hk, -1, d), alpha=scale
        )


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl) -> AttnKLGrads:
    q1, k1, q2, k2, cu_seqlens = inputs
    kl, lse1, lse2 = stats
    causal, scale1, scale2, needs = spec.causal, spec.scale1, spec.scale2, spec.needs
    dtype = _compute_dtype(q1, q2)
    tensors = (q1, k1, q2, k2)
    # dq rows are written once, in the input's dtype; dk sums over every chunk, so it accumulates
    # in the compute dtype and is cast to the input's dtype once at the end.
    acc = [
        torch.zeros(t.shape, dtype=t.dtype if i % 2 == 0 else dtype, device=t.device) if need else None
        for i, (t, need) in enumerate(zip(tensors, needs))
    ]
    # Accumulators that are not the returned gradients (16-bit inputs) count against the chunk.
    held = sum(
        a.numel() * a.element_size() for a, t in zip(acc, tensors) if a is not None and a.dtype != t.dtype
    )
    if k1.shape[2] > 0 and kl.numel() > 0 and any(needs):
        for seq in _segments(cu_seqlens, q1.shape[2]):
            part = _sliced(seq, grad_kl, *tensors, kl, lse1, lse2, *acc)
            _backward_dense_rows(*part[:8], causal, scale1, scale2, needs, part[8:], dtype, held)
    return AttnKLGrads(*(None if a is None else a.to(t.dtype) for a, t in zip(acc, tensors)))
