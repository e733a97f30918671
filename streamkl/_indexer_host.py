"""What every indexer_kl backend's host side shares (docs/indexer.md, "Gradients" and "One teacher
pass per training step"): the outputs of a call with no row or no key, the gradient buffers, and
the per-row coefficients of dI = a softmax(I) - b p that the recompute backward and the fused
step's correction hand to a kernel."""

from __future__ import annotations

import torch

from ._spec import IndexerKLInputs, IndexerKLSpec, IndexerKLStats

# The fused step corrects a row whose target mass T differs from 1 by more than this: a lse
# computed in float32 over the admitted keys (an attention forward's) leaves T within a few
# float32 roundings of 1, and the skipped term, (1/T - 1) p, stays below 1e-5 of p.
MASS_TOLERANCE = 1e-5


def empty(spec: IndexerKLSpec) -> bool:
    """A call with no row or no key: every row sees nothing."""
    return spec.batch * spec.nq == 0 or spec.nk == 0


def empty_stats(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
    """Statistics of a call where every row sees nothing."""
    dev = inputs.q.device
    kl = torch.zeros((spec.batch, spec.nq), device=dev, dtype=torch.float32)
    if inputs.lse is not None:
        lse = inputs.lse.to(dtype=torch.float32, copy=True).contiguous()
    else:
        lse = torch.full((spec.batch, spec.heads, spec.nq), float("-inf"), device=dev, dtype=torch.float32)
    return IndexerKLStats(kl, lse, torch.full_like(kl, float("-inf")), torch.zeros_like(kl))


def grad_outputs(spec: IndexerKLSpec, inputs: IndexerKLInputs, held: bool = False):
    """(dqi, dki accumulator, dw) where spec.needs asks: dqi, dw in their inputs' dtypes (each row
    written once), dki a zeroed float32 buffer (atomics). `held` (the fused step's, kept until
    the upstream gradient scales them): float16 ones in float32, as float16 cannot hold a mean's
    gradient (1 / rows of a row's) before a loss scale brings it back into range."""
    qi, ki, w = inputs.qi, inputs.ki, inputs.w
    need_dqi, need_dki, need_dw = spec.needs
    alloc = torch.zeros if empty(spec) else torch.empty

    def kept(t):
        return torch.float32 if held and t.dtype == torch.float16 else t.dtype

    dqi = alloc(qi.shape, device=qi.device, dtype=kept(qi)) if need_dqi else None
    dki = torch.zeros(ki.shape, device=ki.device, dtype=torch.float32) if need_dki else None
    dw = alloc(w.shape, device=w.device, dtype=kept(w)) if need_dw else None
    return dqi, dki, dw


# What key_sets' sort may hold at once beyond its output: a chunk of rows' int32 copy, sorted
# values and int64 sort indices (16 bytes an entry), so a long sparse call (64K rows of 2048)
# does not hold 1.5 GiB of them at once.
KEY_SET_CHUNK_BYTES = 64 * 2**20


def key_sets(topk: torch.Tensor) -> torch.Tensor:
    """Each row's top-k set sorted, repeats of an index replaced by -1 (a set counts a key once),
    int32 contiguous (B, Sq, K): what the kernels gather from. Sorted a chunk of rows at a time
    (KEY_SET_CHUNK_BYTES)."""
    b, sq, k = topk.shape
    out = torch.empty((b, sq, k), device=topk.device, dtype=torch.int32)
    rows = max(1, KEY_SET_CHUNK_BYTES // max(1, 16 * b * k))
    for r0 in range(0, sq, rows):
        keys = topk[:, r0 : r0 + rows].to(torch.int32).sort(-1).values
        if k > 1:
            keys[..., 1:].masked_fill_(keys[..., 1:] == keys[..., :-1], -1)
        out[:, r0 : r0 + rows] = keys
    return out


def inverse_mass(mass: torch.Tensor, has_mass: torch.Tensor) -> torch.Tensor:
    """1 / T where T > 0 (T below float32's smallest normal read as that, so 1 / T stays finite;
    p / T <= 1 whatever T is), 1 elsewhere."""
    return 1.0 / torch.where(has_mass, mass.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def finite(t: torch.Tensor) -> torch.Tensor:
    """t with infinities clamped to float32's largest (a huge upstream gradient over a tiny T)."""
    return torch.nan_to_num(t, posinf=torch.finfo(torch.float32).max, neginf=-torch.finfo(torch.float32).max)


def backward_coefs(mass: torch.Tensor, grad_kl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recompute backward's (a, b): a = g [T > 0], b = g / T (0 where T = 0), float32."""
    g = grad_kl.to(torch.float32)
    has_mass = mass > 0
    coef_a = torch.where(has_mass, g, 0.0)
    coef_b = finite(torch.where(has_mass, g * inverse_mass(mass, has_mass), 0.0))
    return coef_a, coef_b


def correction_coefs(weight: torch.Tensor, mass: torch.Tensor, lse2: torch.Tensor):
    """The fused step's correction with a given lse (its first pass took dI = w_r (q - p), exact
    where T = 1): ((a, b) the rows' whole coefficients, (da, db) the difference from the first
    pass's), both 0 on rows that need none. A row with no target mass that sees a key has
    da = -w_r (its q term only); a row whose T differs from 1 by more than MASS_TOLERANCE has
    db = (1/T - 1) w_r."""
    has_mass = mass > 0
    excess = inverse_mass(mass, has_mass) - 1.0
    coef_a = torch.where(~has_mass & (lse2 > float("-inf")), -weight, 0.0)
    coef_b = finite(torch.where(has_mass & (excess.abs() > MASS_TOLERANCE), excess * weight, 0.0))
    return (weight + coef_a, weight + coef_b), (coef_a, coef_b)
