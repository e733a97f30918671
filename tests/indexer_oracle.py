"""indexer_kl's float64 oracle, Megatron's formula beside it, input factories and the tolerance
rule of tests/tolerance.py applied to this op (docs/indexer.md).

`dense_indexer_kl` is the definition written densely: every (B, H, Sq, Sk) teacher probability,
each head's softmax over the admitted keys (or exp(S - lse) with a given lse), the head sum, its
L1 normalization, the index scores and KL(p || softmax(I)) with no epsilon. It shares no code
with the reference backend. `megatron_indexer_kl` is the formula Megatron-LM's DSA reference
uses (1e-10 inside both logarithms), written here from its description, for the test that
bounds the oracle's distance to it.
"""

from __future__ import annotations

import math

import torch

from streamkl.testing import visible_mask

from .tolerance import FLOOR, RATIO, _largest, _report, _with_rms

MEGATRON_EPS = 1e-10


def admitted_mask(b, nq, nk, causal, topk=None, cu_seqlens=None) -> torch.Tensor:
    """(B, Sq, Sk) bool: the keys each row admits (visible, and in its topk set if any)."""
    mask = visible_mask(nq, nk, causal, cu_seqlens=cu_seqlens)[None].expand(b, nq, nk)
    if topk is None:
        return mask.clone()
    chosen = torch.zeros(b, nq, nk + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(topk < 0, nk, topk).long().cpu(), True)
    return mask & chosen[..., :nk]


def _keys(t):
    return t.unsqueeze(1) if t.dim() == 3 else t


def index_scores(qi, ki, w, dtype):
    """I (B, Sq, Sk) = sum_g w_g relu(qi_g . ki_j)."""
    z = torch.relu(qi.to(dtype) @ _keys(ki).to(dtype).transpose(-1, -2))
    return torch.einsum("bgr,bgrj->brj", w.to(dtype), z)


def teacher_logits(q, k, scale, dtype):
    k = _keys(k)
    k = k.to(dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return scale * (q.to(dtype) @ k.transpose(-1, -2))


def dense_indexer_kl(
    q, k, qi, ki, w, *, lse=None, topk=None, causal=True, scale=None, cu_seqlens=None, dtype=torch.float64
):
    """(kl, lse, lse2, mass) per row by the definition, materializing (B, H, Sq, Sk);
    differentiable in qi, ki and w by autograd."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, h, nq, _ = q.shape
    nk = _keys(k).shape[2]
    adm = admitted_mask(b, nq, nk, causal, topk, cu_seqlens).to(q.device)
    seen = adm.any(-1)
    s = teacher_logits(q, k, scale, dtype).masked_fill(~adm[:, None], -math.inf)
    if lse is None:
        lse = torch.logsumexp(s, -1)
    lse = lse.to(dtype)
    probs = torch.where(adm[:, None], (s - lse.nan_to_num(neginf=0.0)[..., None]).exp(), 0.0)
    p = probs.sum(1) / h
    mass = p.sum(-1)
    target = torch.where(seen[..., None], p / torch.where(mass > 0, mass, 1.0)[..., None], 0.0)
    scores = index_scores(qi, ki, w, dtype)
    scores = torch.where(adm, scores, -math.inf)
    scores = torch.where(seen[..., None], scores, 0.0)  # an empty row: finite, so no NaN gradient
    lse2 = torch.where(seen, torch.logsumexp(scores, -1), -math.inf)
    logq = torch.log_softmax(scores, -1)
    kl = torch.where(adm, torch.xlogy(target, target) - target * torch.where(adm, logq, 0.0), 0.0).sum(-1)
    return kl, lse, lse2, mass


def megatron_indexer_kl(q, k, qi, ki, w, *, topk=None, scale, eps=MEGATRON_EPS):
    """Megatron-LM's DSA indexer loss per row (square causal, float64, every topk entry a key):
    per-head masked softmax, head sum, division by the row sum, then
    sum_j t_j (log(t_j + eps) - log(softmax(I)_j + eps))."""
    b, _, n, _ = q.shape
    adm = admitted_mask(b, n, n, True, topk)
    s = teacher_logits(q, k, scale, torch.float64).masked_fill(~adm[:, None], -math.inf)
    t = torch.softmax(s, -1).sum(1)
    t = t / t.sum(-1, keepdim=True)
    i = torch.softmax(index_scores(qi, ki, w, torch.float64).masked_fill(~adm, -math.inf), -1)
    return (t * (torch.log(t + eps) - torch.log(i + eps))).sum(-1), t, i


def random_topk(b, nq, nk, width, seed, pad=0.25) -> torch.Tensor:
    """(B, Sq, width) int64: distinct key indices per row in random order, a fraction `pad` of
    the entries (and every entry past Sk) -1."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.rand(b, nq, max(nk, 1), generator=gen).argsort(-1)[..., : min(width, nk)]
    if nk == 0:
        order = order[..., :0]
    padding = torch.full((b, nq, width - order.shape[-1]), -1, dtype=torch.long)
    topk = torch.cat([order, padding], -1)
    return topk.masked_fill(torch.rand(topk.shape, generator=gen) < pad, -1)


def make_indexer_inputs(
    b=1, h=4, hk=1, g=3, nq=12, nk=12, d=16, di=8, dtype=torch.float32, w_dtype=None, device="cpu",
    seed=0, layout="bhnd", std=1.0, requires_grad=False,
):  # fmt: skip
    """Random (q, k, qi, ki, w). layout "bnhd": (B, S, heads, D) storage viewed through
    .transpose(1, 2); "sbhd": Megatron's [S, B, heads, D] viewed through .permute(1, 2, 0, 3)
    (w likewise, a (B, G, Sq) view of storage with a trailing dim of 1)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(heads, n, dim, kind=dtype):
        if layout == "bnhd":
            t = (torch.randn(b, n, heads, dim, generator=gen) * std).transpose(1, 2)
        elif layout == "sbhd":
            t = (torch.randn(n, b, heads, dim, generator=gen) * std).permute(1, 2, 0, 3)
        else:
            t = torch.randn(b, heads, n, dim, generator=gen) * std
        return t.to(device=device, dtype=kind)

    q, k = rand(h, nq, d), rand(hk, nk, d)
    qi, ki = rand(g, nq, di), rand(1, nk, di)
    w = rand(g, nq, 1, w_dtype or dtype)[..., 0] * (std / math.sqrt(g * di))  # (B, G, Sq) view
    return q, k, *(t.requires_grad_(requires_grad) for t in (qi, ki, w))


def compute_dtype(q, qi, w) -> torch.dtype:
    return torch.float64 if torch.float64 in (q.dtype, qi.dtype, w.dtype) else torch.float32


def _dense(inputs, dtype, call, grad):
    q, k, qi, ki, w = inputs
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (qi, ki, w)]
    kl, lse, lse2, mass = dense_indexer_kl(q.cpu(), k.cpu(), *leaves, **call, dtype=dtype)
    grads = torch.autograd.grad(kl, leaves, grad.to(dtype), allow_unused=True)
    grads = [torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, leaves)]
    return kl.detach(), lse, lse2, mass, grads


def _row_norm(t, name):
    """A gradient's rows: qi (b, g, i) and ki (b, j) over the head dim; w element by element."""
    return t.abs() if name == "dw" else t.norm(dim=-1)


class Expected:
    """The oracle's KL, statistics and student gradients for one call and upstream gradient,
    with the bars of tests/tolerance.py's rule (docs/contract.md, Numerics) for this op:

    - per row of KL: RATIO x (the dense float32/float64 error + its rms) + FLOOR roundings of
      the compute dtype times M (the size the row's logits are rounded at: the largest
      |scale| |q_h| |k_j| plus sum_g |w_g| |qi_g| |ki_j| over its admitted keys) times KL's
      sensitivity to them (2 + sum_j pn_j |r_j - KL| with r the log-ratio);
    - per gradient row (dqi, dki per head-dim vector; dw per element): the same rule, a floor
      of M times the size of the terms the row sums, and for 16-bit inputs eps of that dtype
      times the sum of |dz| |ki| (dqi) or |dz| |qi| (dki) a kernel rounding dz to the input
      dtype before its products may add."""

    def __init__(self, inputs, *, grad=None, **call):
        q, k, qi, ki, w = inputs
        self.call = dict(call)
        self.call.setdefault("scale", 1.0 / math.sqrt(q.shape[-1]))
        for key in ("lse", "topk", "cu_seqlens"):
            if self.call.get(key) is not None:
                self.call[key] = self.call[key].cpu()
        self.call.pop("max_seqlen", None)
        shape = (q.shape[0], q.shape[2])
        if grad is None:
            grad = torch.randn(shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        self.grad = grad.double().cpu()
        self.kl, self.lse, self.lse2, self.mass, self.grads = _dense(
            inputs, torch.float64, self.call, self.grad
        )
        self.dtype = compute_dtype(q, qi, w)
        self.eps = torch.finfo(self.dtype).eps
        dense_kl, _, _, _, dense_grads = _dense(inputs, self.dtype, self.call, self.grad)
        self.dense_kl_err = (dense_kl.double() - self.kl).abs()
        names = ("dqi", "dki", "dw")
        self.dense_grad_err = [
            _row_norm(d.to(t.dtype).double() - r, n)
            for d, r, t, n in zip(dense_grads, self.grads, (qi, ki, w), names)
        ]
        self._scales(inputs)

    def _scales(self, inputs):
        q, k, qi, ki, w = (t.detach().cpu().double() for t in inputs)
        ki = _keys(ki)
        call = self.call
        b, nq, nk = q.shape[0], q.shape[2], ki.shape[2]
        adm = admitted_mask(b, nq, nk, call.get("causal", True), call.get("topk"), call.get("cu_seqlens"))
        k = _keys(k).repeat_interleave(q.shape[1] // _keys(k).shape[1], 1)
        teacher = (q.norm(dim=-1)[..., None] * k.norm(dim=-1)[:, :, None, :]).amax(1) * abs(call["scale"])
        student = torch.einsum("bgr,bgr,bj->brj", w.abs(), qi.norm(dim=-1), ki[:, 0].norm(dim=-1))
        size = (teacher + student).masked_fill(~adm, 0.0)
        self.magnitude = size.amax(-1) if nk else size.new_zeros(b, nq)
        mass = torch.where(self.mass > 0, self.mass, 1.0)[..., None]
        s = teacher_logits(q, k, call["scale"], torch.float64).masked_fill(~adm[:, None], -math.inf)
        lse = self.lse.nan_to_num(neginf=0.0)[..., None]
        pn = torch.where(adm, (s - lse).exp().sum(1) / q.shape[1], 0.0) / mass
        scores = index_scores(qi, ki, w, torch.float64).masked_fill(~adm, -math.inf)
        logq = torch.where(adm, scores - self.lse2.nan_to_num(neginf=0.0)[..., None], 0.0)
        ratio = torch.where(pn > 0, torch.log(pn) - logq, 0.0)
        spread = (pn * (ratio - self.kl[..., None]).abs()).sum(-1)
        self.spread = torch.where(adm.any(-1), 2.0 + spread, 0.0)
        # |dz_gj| = |g| |w_g| |softmax(I)_j - pn_j| [z_gj > 0], in float64.
        soft = torch.where(adm, logq.exp(), 0.0)
        d_scores = (self.grad[..., None] * (soft - pn)).abs()
        z = qi @ ki.transpose(-1, -2)
        dz = (z > 0) * w.abs()[..., None] * d_scores[:, None]
        self.rounding = [0.0, 0.0, 0.0]
        if inputs[2].dtype in (torch.float16, torch.bfloat16):
            eps16 = torch.finfo(inputs[2].dtype).eps
            self.rounding[0] = eps16 * (dz @ ki[:, 0].norm(dim=-1)[:, None, :, None])[..., 0]
            self.rounding[1] = eps16 * torch.einsum("bgrj,bgr->bj", dz, qi.norm(dim=-1))[:, None]
        m = 1.0 + _largest(self.magnitude)
        gmax, gsum = _largest(self.grad.abs()), self.grad.abs().sum().item()
        qin, kin, wmax = (_largest(t) for t in (qi.norm(dim=-1), ki.norm(dim=-1), w.abs()))
        unit = FLOOR * self.eps * m
        g_heads = qi.shape[1]
        self.grad_floor = [
            unit * gmax * wmax * kin,
            unit * gsum * g_heads * wmax * qin,
            unit * 2 * gmax * qin * kin,
        ]

    def check_kl(self, kl, what="kl"):
        kl = kl.detach().cpu().double()
        assert kl.shape == self.kl.shape, (what, kl.shape, self.kl.shape)
        assert torch.isfinite(kl).all(), f"{what}: non-finite values"
        floor = FLOOR * self.eps * (1.0 + self.magnitude) * self.spread
        _report(what, (kl - self.kl).abs(), RATIO * _with_rms(self.dense_kl_err) + floor)

    def check_stats(self, stats):
        """lse2 -inf exactly on the rows that see no key, mass 0 there; elsewhere lse, lse2 and
        mass within FLOOR roundings of (1 + M) of the oracle's (a given lse comes back as given)."""
        kl, lse, lse2, mass = (t.detach().cpu().double() for t in stats)
        self.check_kl(kl)
        empty = torch.isneginf(self.lse2)
        assert torch.equal(torch.isneginf(lse2), empty), "lse2: -inf exactly on rows that see no key"
        assert (mass[empty] == 0).all(), "mass: 0 on rows that see no key"
        bar = FLOOR * self.eps * (1.0 + self.magnitude)
        _report("lse2", (lse2 - self.lse2)[~empty].abs(), bar[~empty])
        _report("mass", (mass - self.mass)[~empty].abs(), bar[~empty] * (1.0 + self.mass[~empty]))
        seen = ~torch.isneginf(self.lse)
        assert torch.equal(~torch.isneginf(lse), seen), "lse: -inf exactly where the oracle's is"
        _report("lse", (lse - self.lse)[seen].abs(), bar[:, None].expand_as(seen)[seen] + 0.0)

    def check_grads(self, grads, inputs, needs=(True, True, True)):
        names = ("dqi", "dki", "dw")
        for i, (name, got, ref, t, need) in enumerate(zip(names, grads, self.grads, inputs[2:], needs)):
            if not need:
                assert got is None, f"{name} was not requested"
                continue
            assert got.shape == t.shape and got.dtype == t.dtype, (name, got.shape, got.dtype)
            got = got.detach().cpu().double()
            assert torch.isfinite(got).all(), f"{name}: non-finite values"
            bound = RATIO * _with_rms(self.dense_grad_err[i]) + self.grad_floor[i] + self.rounding[i]
            _report(name, _row_norm(got - ref, name), bound)
