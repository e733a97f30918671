"""Input factories, the dense formula and the CLI's error budget, shared by tests and benchmarks.

`dense_attn_kl` is the definition (docs/contract.md, Definition) written the way users write
it: both Nq x Nk distributions materialized. It is the tests' oracle (in float64) and the
benchmarks' PyTorch baseline; it shares no code with the chunked reference backend. The
budget here is the CLI's check; the tests hold backends to the tighter
rule of tests/tolerance.py.
"""

from __future__ import annotations

import math

import torch

from ._spec import causal_offset


def visible_mask(nq: int, nk: int, causal: bool, device=None, cu_seqlens=None) -> torch.Tensor:
    """(Nq, Nk) bool: which keys each query row may see (bottom-right causal, packed sequences)."""
    rows = torch.arange(nq, device=device)[:, None]
    cols = torch.arange(nk, device=device)[None, :]
    mask = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        mask &= cols <= rows + causal_offset(nq, nk)
    if cu_seqlens is not None:
        bounds = cu_seqlens.to(device=device, dtype=torch.long)
        seq_of_row = torch.searchsorted(bounds, torch.arange(nq, device=device), right=True)
        seq_of_col = torch.searchsorted(bounds, torch.arange(nk, device=device), right=True)
        mask &= seq_of_row[:, None] == seq_of_col[None, :]
        if causal:  # inside a packed sequence Nq == Nk, so bottom-right is the plain diagonal
            mask &= cols <= rows
    return mask


def _logits(q, k, scale, dtype):
    groups = q.shape[1] // k.shape[1]
    k = k.to(dtype).repeat_interleave(groups, dim=1)
    return scale * (q.to(dtype) @ k.transpose(-1, -2))


def dense_attn_kl(
    q1,
    k1,
    q2,
    k2,
    causal=False,
    scale1=None,
    scale2=None,
    cu_seqlens=None,
    dtype=torch.float64,
    return_lse=False,
):
    """KL(softmax(S1) || softmax(S2)) per row, materializing both (B, H, Nq, Nk) matrices."""
    scale1 = 1.0 / math.sqrt(q1.shape[-1]) if scale1 is None else scale1
    scale2 = 1.0 / math.sqrt(q2.shape[-1]) if scale2 is None else scale2
    s1 = _logits(q1, k1, scale1, dtype)
    s2 = _logits(q2, k2, scale2, dtype)
    mask = visible_mask(s1.shape[-2], s1.shape[-1], causal, s1.device, cu_seqlens)
    s1 = s1.masked_fill(~mask, -math.inf)
    s2 = s2.masked_fill(~mask, -math.inf)
    lse1 = torch.logsumexp(s1, -1)
    lse2 = torch.logsumexp(s2, -1)
    seen = mask.any(-1)
    logp1 = torch.where(mask, s1 - lse1[..., None].nan_to_num(neginf=0.0), 0.0)
    logp2 = torch.where(mask, s2 - lse2[..., None].nan_to_num(neginf=0.0), 0.0)
    kl = (logp1.exp() * (logp1 - logp2)).masked_fill(~mask, 0.0).sum(-1)
    kl = torch.where(seen, kl, 0.0)
    return (kl, lse1, lse2) if return_lse else kl


def make_inputs(
    b=1,
    h=2,
    nq=64,
    nk=64,
    d1=32,
    d2=32,
    hk1=None,
    hk2=None,
    dtype=torch.float32,
    device="cpu",
    seed=0,
    layout="bhnd",
    requires_grad=False,
    std=1.0,
):
    """Random (never zero) q1, k1, q2, k2. layout="bnhd" returns (B,N,H,D) tensors viewed as
    (B,H,N,D) through .transpose(1, 2), the strides flash-attn users pass."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hk1 = h if hk1 is None else hk1
    hk2 = h if hk2 is None else hk2

    def rand(heads, n, d):
        if layout == "bnhd":
            t = torch.randn(b, n, heads, d, generator=gen) * std
            t = t.to(device=device, dtype=dtype).transpose(1, 2)
        else:
            t = (torch.randn(b, heads, n, d, generator=gen) * std).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    return rand(h, nq, d1), rand(hk1, nk, d1), rand(h, nq, d2), rand(hk2, nk, d2)


def rel_err(x: torch.Tensor, ref: torch.Tensor, chunk_elems: int = 1 << 24) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are zero).

    Summed over slices of the longest dimension, about `chunk_elems` elements at a time: a
    long-context gradient (1M tokens x 32 heads x 128 is 32 GiB in float64) is never copied whole.
    """
    if x.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(x.shape)} vs {tuple(ref.shape)}")
    if x.dim() == 0:
        x, ref = x.reshape(1), ref.reshape(1)
    dim = max(range(x.dim()), key=lambda d: x.shape[d])
    n = x.shape[dim]
    step = max(1, chunk_elems * n // max(x.numel(), 1))
    sq_diff = sq_ref = 0.0
    for start in range(0, n, step):
        width = min(step, n - start)
        xs = x.narrow(dim, start, width).double()
        rs = ref.narrow(dim, start, width).to(device=xs.device, dtype=torch.float64)
        sq_diff += (xs - rs).square().sum().item()
        sq_ref += rs.square().sum().item()
    diff, denom = math.sqrt(sq_diff), math.sqrt(sq_ref)
    return diff / denom if denom > 0 else diff


def kl_tolerance(dtype: torch.dtype) -> float:
    """The check the CLI prints: per-row |kl - ref| <= tol * max(1, |ref|).
    (The tests hold backends to a tighter, method-derived rule: tests/tolerance.py.)"""
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-3)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Tracks the bytes of tensors that ops allocate and that are still alive (CPU stand-in for
    torch.cuda.max_memory_allocated)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen = set()

    def _free(self, key, nbytes):
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t._base is None:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key in self._seen or storage.nbytes() == 0:
                    continue
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, storage.nbytes())
        return out


def cpu_peak_bytes(fn) -> int:
    """Peak bytes of tensors allocated and alive while fn() runs on the CPU (outputs included:
    subtract them yourself). A dispatch mode sees a custom op as one call, so call backend
    functions, not the op, to see their workspace; on CUDA use torch.cuda.max_memory_allocated."""
    with _LiveBytes() as mode:
        fn()
    return mode.peak
