"""indexer_kl on the reference backend (streamkl/_backend.py's protocol; docs/indexer.md). For
each chunk of query rows (all batches and heads at once), over the keys each row admits:

    S_h  = scale q_h[rows] @ k^T                         teacher logits, each head h of H
    p    = (1/H) sum_h exp(S_h - lse_h)                  lse_h given, or logsumexp_j S_h
    T    = sum_j p_j;   pn = p / T                       the target (T = 1 when lse_h is the
                                                         log-sum-exp over the admitted keys)
    I    = sum_g w_g relu(qi_g[rows] @ ki^T)             index scores
    KL   = sum_j pn_j (log pn_j - (I_j - LSE2))          LSE2 = logsumexp_j I_j
backward (student only), z_g = qi_g . ki_j:
    dI   = g (softmax(I) - pn)                           0 on a row of no target mass (T = 0)
    dz_g = dI w_g [z_g > 0];  dw_g = sum_j dI_j relu(z_g);  dqi_g = dz_g @ ki;  dki += sum_g dz_g^T @ qi_g

A chunk holds at most max(H, G) + _LIVE_CHUNK_TEMPS temporaries of (B, rows, Sk) in the compute
dtype (the teacher's (B, H, rows, Sk) logits or the indexer's (B, G, rows, Sk) head scores, and
a few row-sized ones), never (B, H, Sq, Sk): the default chunk keeps them within _CHUNK_BYTES.
KL is formed as sum pn (log pn - log q), not E/T - log T - A/T + LSE2 (the streaming form of
docs/indexer.md, the same value), so nothing cancels when the logits are large.
"""

from __future__ import annotations

import math

import torch

from .. import _checks, _env
from .._spec import (
    IndexerKLGrads,
    IndexerKLInputs,
    IndexerKLSpec,
    IndexerKLStats,
    causal_offset,
    reduced_row_weight,
)

op = "indexer_kl"
backward_backend = None

# The most bytes one chunk's temporaries take when STREAMKL_REFERENCE_CHUNK is not set.
_CHUNK_BYTES = 256 << 20

# (B, rows, Sk) temporaries of the compute dtype alive beside the per-head ones (see above).
_LIVE_CHUNK_TEMPS = 4


def supports(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    return None  # every dtype, every device


def auto_declines(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    return None  # the last backend auto tries


def _compute_dtype(inputs: IndexerKLInputs) -> torch.dtype:
    wide = torch.float64 in (inputs.q.dtype, inputs.qi.dtype, inputs.w.dtype)
    return torch.float64 if wide else torch.float32


def _chunk_rows(spec: IndexerKLSpec, nq: int, nk: int, dtype) -> int:
    """Query rows per chunk: STREAMKL_REFERENCE_CHUNK, else as many as keep a chunk's
    temporaries (see the module docstring, plus a bool mask row) within _CHUNK_BYTES, at least
    one row."""
    chunk = _env.reference_chunk()
    if chunk is None:
        size = torch.finfo(dtype).bits // 8
        heads = max(spec.heads, spec.index_heads) + _LIVE_CHUNK_TEMPS
        per_row = max(1, spec.batch * nk * (heads * size + 1))
        chunk = max(1, _CHUNK_BYTES // per_row)
    return max(1, min(chunk, max(nq, 1)))


def _segments(spec: IndexerKLSpec, cu_seqlens):
    """(start, stop) of each non-empty packed sequence, or one (0, Sq) for the whole axis."""
    if cu_seqlens is None:
        return [(0, spec.nq)]
    offsets = _checks.packed_offsets(cu_seqlens, spec.nq)
    return [(a, b) for a, b in zip(offsets[:-1], offsets[1:]) if b > a]


def _segment_view(spec: IndexerKLSpec, inputs: IndexerKLInputs, seg):
    """(first key, slice of the sequence axis, Sq, Sk) of one segment: the whole call, or one
    packed sequence (whose rows see only its own keys)."""
    start, stop = seg
    if inputs.cu_seqlens is None:
        return 0, slice(None), spec.nq, spec.nk
    return start, slice(start, stop), stop - start, stop - start


def _admitted(spec: IndexerKLSpec, topk, rows: slice, start: int, nq: int, nk: int, device):
    """(B or 1, rows, nk) bool of the keys rows `rows` of a segment admit (the segment's keys
    start at key `start`), or None when every key is admitted. Causal: bottom-right. Sparse: the
    row's topk entries inside the segment; -1 padding and repeated entries add nothing."""
    mask = None
    if spec.causal:
        r = torch.arange(rows.start, rows.stop, device=device)[:, None]
        mask = (torch.arange(nk, device=device)[None, :] <= r + causal_offset(nq, nk))[None]
    if topk is not None:
        index = topk[:, start + rows.start : start + rows.stop].long() - start
        inside = (index >= 0) & (index < nk)  # padding (-1) and other sequences' keys fall out
        index = torch.where(inside, index, nk)  # a spare column, dropped below
        chosen = torch.zeros(*index.shape[:2], nk + 1, dtype=torch.bool, device=device)
        chosen = chosen.scatter_(-1, index, True)[..., :nk]
        mask = chosen if mask is None else chosen & mask
    return mask


def _teacher_logits(q, k, rows: slice, scale: float, dtype):
    """scale * q[:, :, rows] @ k^T as a contiguous (B, H, rows, Sk) (k already in `dtype`);
    GQA/MQA by stacking each key head's query heads as the rows of one product, no copy of k
    per head."""
    b, h, _, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    qc = q[:, :, rows].to(dtype)
    n = qc.shape[2]
    s = torch.matmul(qc.reshape(b, hk, (h // hk) * n, d), k.transpose(-1, -2))
    return s.mul_(scale).view(b, h, n, nk)


def _index_head_scores(qi, ki, rows: slice, dtype):
    """relu(qi[:, :, rows] @ ki^T): (B, G, rows, Sk), each indexer head's scores (ki already in
    `dtype`; its one head broadcasts over the G heads)."""
    z = torch.matmul(qi[:, :, rows].to(dtype), ki.transpose(-1, -2))
    return z.relu_()


def _log_sum_exp(s):
    """logsumexp over the last axis, -inf for a row of -inf only (no NaN)."""
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(torch.isinf(m), 0.0)
    return (s - m).exp_().sum(-1).log_().add_(m.squeeze(-1))


def _target(spec, q, k, lse, rows, admitted, dtype):
    """(p, lse_h): the teacher's head mixture p (B, rows, Sk), 0 outside the admitted keys, and
    the per-head log-sum-exp it was formed with (given, or over the admitted keys)."""
    s = _teacher_logits(q, k, rows, spec.scale, dtype)
    if admitted is not None:
        s.masked_fill_(~admitted[:, None], -math.inf)
    lse_h = lse[:, :, rows].to(dtype) if lse is not None else _log_sum_exp(s)
    # A row that sees no key has lse -inf: shift it by 0, so its p stays exactly 0, not NaN.
    s.sub_(torch.nan_to_num(lse_h, neginf=0.0)[..., None]).exp_()
    return s.sum(1).div_(spec.heads), lse_h


def _log_student(qi, ki, w, rows, admitted, dtype, lse2=None):
    """(log q, LSE2, relu head scores): log softmax(I) over the admitted keys (0 elsewhere),
    its log-sum-exp (given, else computed; -inf on rows that see no key) and relu(z)."""
    rz = _index_head_scores(qi, ki, rows, dtype)
    scores = torch.einsum("bgr,bgrj->brj", w[:, :, rows].to(dtype), rz)
    if admitted is not None:
        scores.masked_fill_(~admitted, -math.inf)
    if lse2 is None:
        lse2 = _log_sum_exp(scores)
    scores.sub_(torch.nan_to_num(lse2, neginf=0.0)[..., None])
    if admitted is not None:
        scores.masked_fill_(~admitted, 0.0)
    return scores, lse2, rz


def _normalized_(p, mass):
    """In place: p / T per row; rows of no mass stay 0."""
    return p.div_(torch.where(mass > 0, mass, 1.0)[..., None])


def _forward_rows(spec, inputs, seg, stats, dtype):
    start, whole, nq, nk = _segment_view(spec, inputs, seg)
    q, qi, w = (t[:, :, whole] for t in (inputs.q, inputs.qi, inputs.w))
    k, ki = (t[:, :, whole].to(dtype) for t in (inputs.k, inputs.ki))  # cast once per segment
    lse = None if inputs.lse is None else inputs.lse[:, :, whole]
    kl, lse_out, lse2_out, mass_out = (t[..., whole] for t in stats)
    chunk = _chunk_rows(spec, nq, nk, dtype)
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        admitted = _admitted(spec, inputs.topk, rows, start, nq, nk, q.device)
        p, lse_h = _target(spec, q, k, lse, rows, admitted, dtype)
        mass = p.sum(-1)
        logq, lse2, rz = _log_student(qi, ki, w, rows, admitted, dtype)
        del rz
        pn = _normalized_(p, mass)
        # sum_j pn (log pn - log q): where pn is 0 the term is 0 (log pn = -inf, not NaN).
        terms = torch.log(pn).sub_(logq).mul_(pn).masked_fill_(pn == 0, 0.0)
        kl[:, rows] = terms.sum(-1)
        lse_out[:, :, rows] = lse_h
        lse2_out[:, rows] = lse2
        mass_out[:, rows] = mass
        del p, pn, logq, terms


def forward(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
    b, h, nq = spec.batch, spec.heads, spec.nq
    dtype = _compute_dtype(inputs)
    device = inputs.q.device
    kl = torch.zeros(b, nq, dtype=dtype, device=device)
    lse2 = torch.full_like(kl, -math.inf)
    mass = torch.zeros_like(kl)
    if inputs.lse is not None:
        lse = inputs.lse.to(dtype=dtype, copy=True).contiguous()
    else:
        lse = torch.full((b, h, nq), -math.inf, dtype=dtype, device=device)
    if spec.nk == 0 or kl.numel() == 0:
        return IndexerKLStats(kl, lse, lse2, mass)
    for seg in _segments(spec, inputs.cu_seqlens):
        _forward_rows(spec, inputs, seg, (kl, lse, lse2, mass), dtype)
    return IndexerKLStats(kl, lse, lse2, mass)


def _backward_rows(spec, inputs, seg, stats, grad, acc, dtype):
    start, whole, nq, nk = _segment_view(spec, inputs, seg)
    q, qi, w = (t[:, :, whole] for t in (inputs.q, inputs.qi, inputs.w))
    k, ki = (t[:, :, whole].to(dtype) for t in (inputs.k, inputs.ki))  # cast once per segment
    lse = stats.lse[:, :, whole]
    lse2, mass, g = (t[:, whole] for t in (stats.lse2, stats.mass, grad))
    dqi, dki, dw = (None if a is None else a[:, :, whole] for a in acc)
    chunk = _chunk_rows(spec, nq, nk, dtype)
    for row0 in range(0, nq, chunk):
        rows = slice(row0, min(row0 + chunk, nq))
        admitted = _admitted(spec, inputs.topk, rows, start, nq, nk, q.device)
        p, _ = _target(spec, q, k, lse, rows, admitted, dtype)
        pn = _normalized_(p, mass[:, rows].to(dtype))
        logq, _, rz = _log_student(qi, ki, w, rows, admitted, dtype, lse2[:, rows].to(dtype))
        softmax = logq.exp_()
        if admitted is not None:
            softmax.masked_fill_(~admitted, 0.0)
        # dI = g (softmax(I) sum_j pn_j - pn): sum_j pn_j is 1, or 0 on a row without target mass
        # (one that sees no key, or whose given lse leaves p underflowing to 0).
        softmax.masked_fill_((mass[:, rows] == 0)[..., None], 0.0)
        d_scores = softmax.sub_(pn).mul_(g[:, rows, None].to(dtype))
        del p, pn
        if dw is not None:
            dw[:, :, rows] = torch.einsum("brj,bgrj->bgr", d_scores, rz)
        if dqi is not None or dki is not None:
            # dz_g = dI w_g [z_g > 0] in rz's storage (relu(z) > 0 exactly where z > 0).
            dz = rz.gt_(0.0).mul_(w[:, :, rows, None].to(dtype)).mul_(d_scores[:, None])
            if dqi is not None:
                dqi[:, :, rows] = torch.matmul(dz, ki)
            if dki is not None:
                b, g_heads, n, _ = dz.shape
                qi_rows = qi[:, :, rows].to(dtype).reshape(b, g_heads * n, -1)
                dki[:, 0].baddbmm_(dz.reshape(b, g_heads * n, nk).transpose(1, 2), qi_rows)
            del dz
        del rz, d_scores, logq


def backward(spec: IndexerKLSpec, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl) -> IndexerKLGrads:
    return _gradients(spec, inputs, stats, grad_kl, held=False)


def forward_with_grads(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str
) -> tuple[IndexerKLStats, IndexerKLGrads]:
    """forward, then the backward's gradients for every row's weight in the reduced loss (no
    fused kernel here); dki, and float16 dqi and dw (which float16 could not hold before a loss
    scale brings them back into range), left in the compute dtype (streamkl/_backend.py)."""
    stats = forward(spec, inputs)
    weight = reduced_row_weight(stats.lse2, reduction).expand(stats.kl.shape)
    return stats, _gradients(spec, inputs, stats, weight, held=True)


def _gradients(spec, inputs, stats, grad_kl, held: bool) -> IndexerKLGrads:
    dtype = _compute_dtype(inputs)
    students = (inputs.qi, inputs.ki, inputs.w)
    # dqi and dw rows are written once, in their input's dtype; dki sums over every chunk, so it
    # accumulates in the compute dtype and is cast once at the end, unless `held` (the fused
    # step's gradients) keeps it, and float16 dqi, dw, in the compute dtype.
    kept = [held and t.dtype == torch.float16 for t in students]
    kept[1] = held
    wide = [i == 1 or keep for i, keep in enumerate(kept)]
    acc = [
        None if not need else torch.zeros(t.shape, dtype=dtype if w else t.dtype, device=t.device)
        for t, need, w in zip(students, spec.needs, wide)
    ]
    if spec.nk > 0 and stats.kl.numel() > 0 and any(spec.needs):
        for seg in _segments(spec, inputs.cu_seqlens):
            _backward_rows(spec, inputs, seg, stats, grad_kl, acc, dtype)
    return IndexerKLGrads(
        *(a if a is None or keep else a.to(t.dtype) for a, t, keep in zip(acc, students, kept))
    )
