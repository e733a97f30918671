"""Validation that holds for every backend (docs/contract.md, Errors): runs before any kernel,
raises ValueError/TypeError naming the argument and what was expected."""

from __future__ import annotations

import math
import weakref

import torch

from ._spec import AttnKLSpec

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("none", "sum", "mean")

# (batch, heads, heads_kv1, heads_kv2, nq, nk, d1, d2) of one call, read off validated inputs.
Sizes = tuple[int, int, int, int, int, int, int, int]


def attn_kl_spec(
    q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens=None, max_seqlen=None, read_offsets=True
) -> AttnKLSpec:
    """Validates one attn_kl call and builds its spec (docs/contract.md, Errors).

    read_offsets: read cu_seqlens on the host (once per tensor, cached) to resolve max_seqlen;
    False for fake or traced calls, which validate metadata only and launch nothing."""
    sizes = check_inputs(q1, k1, q2, k2, cu_seqlens, max_seqlen)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale1 = resolve_scale(scale1, sizes[6], "scale1")
    scale2 = resolve_scale(scale2, sizes[7], "scale2")
    if cu_seqlens is None:
        return AttnKLSpec(*sizes, causal, scale1, scale2, sizes[0], None, False)
    if read_offsets:
        max_seqlen = resolve_max_seqlen(cu_seqlens, max_seqlen, sizes[4])
    return AttnKLSpec(*sizes, causal, scale1, scale2, cu_seqlens.shape[0] - 1, max_seqlen, True)


def attn_kl_spec_of_saved(q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens, max_seqlen) -> AttnKLSpec:
    """The spec of a call attn_kl_spec validated before (the compiled backward's saved inputs):
    no rule re-checked; packed offsets come from the cache the forward filled."""
    b, h, nq, d1 = q1.shape
    hk1, nk = k1.shape[1], k1.shape[2]
    hk2, d2 = k2.shape[1], q2.shape[3]
    if cu_seqlens is None:
        return AttnKLSpec(b, h, hk1, hk2, nq, nk, d1, d2, causal, scale1, scale2, b, None, False)
    max_seqlen = resolve_max_seqlen(cu_seqlens, max_seqlen, nq)
    return AttnKLSpec(
        b, h, hk1, hk2, nq, nk, d1, d2, causal, scale1, scale2, cu_seqlens.shape[0] - 1, max_seqlen, True
    )


def check_reduction(reduction: str) -> None:
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_inputs(q1, k1, q2, k2, cu_seqlens=None, max_seqlen=None) -> Sizes:
    """Shapes, dtypes and devices. Metadata only: safe on fake tensors and under tracing."""
    if cu_seqlens is None and max_seqlen is None:
        problem = _valid_dense(q1, k1, q2, k2)
        if problem is not None:
            return problem
    return _check_each_rule(q1, k1, q2, k2, cu_seqlens, max_seqlen)


def _check_each_rule(q1, k1, q2, k2, cu_seqlens, max_seqlen) -> Sizes:
    """check_inputs rule by rule: the first one broken raises, naming the argument."""
    names = ("q1", "k1", "q2", "k2")
    tensors = (q1, k1, q2, k2)
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(B, H, Nq, D)" if name.startswith("q") else "(B, H_kv, Nk, D)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64"
            )
    for q_name, k_name, q, k in (("q1", "k1", q1, k1), ("q2", "k2", q2, k2)):
        if q.dtype != k.dtype:
            raise TypeError(f"{q_name} and {k_name} must share a dtype, got {q.dtype} and {k.dtype}")
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(
                f"{q_name} and {k_name} must share the head dim, got {q.shape[-1]} and {k.shape[-1]}"
            )
        if q.shape[-1] == 0:
            raise ValueError(f"{q_name} has head dim 0; expected at least 1")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"q1, k1, q2, k2 must be on one device, got {sorted(map(str, devices))}")
    b, h, nq = q1.shape[:3]
    for name, t in zip(names, tensors):
        if t.shape[0] != b:
            raise ValueError(f"{name} has batch {t.shape[0]}; expected {b} (the batch of q1)")
    if tuple(q2.shape[:3]) != (b, h, nq):
        raise ValueError(f"q2 must have (B, H, Nq) = {(b, h, nq)} like q1, got {tuple(q2.shape[:3])}")
    nk = k1.shape[2]
    if k2.shape[2] != nk:
        raise ValueError(f"k2 has {k2.shape[2]} keys; expected Nk = {nk} like k1")
    for name, k in (("k1", k1), ("k2", k2)):
        hk = k.shape[1]
        if hk == 0 or h % hk != 0:
            raise ValueError(f"{name} has {hk} heads; the {h} query heads must be a multiple of it")
    if cu_seqlens is not None:
        _check_cu_seqlens_meta(cu_seqlens, b, nq, nk, q1.device)
        if max_seqlen is not None and (
            isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 0
        ):
            raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    elif max_seqlen is not None:
        raise ValueError("max_seqlen is only meaningful with cu_seqlens")
    return (b, h, k1.shape[1], k2.shape[1], nq, nk, q1.shape[-1], q2.shape[-1])


def _valid_dense(q1, k1, q2, k2) -> Sizes | None:
    """The sizes of a valid call without packed sequences in one pass over the metadata, or
    None: then check_inputs walks every rule and names what is wrong."""
    Tensor = torch.Tensor
    if not (
        isinstance(q1, Tensor)
        and isinstance(k1, Tensor)
        and isinstance(q2, Tensor)
        and isinstance(k2, Tensor)
    ):
        return None
    if not (q1.dim() == k1.dim() == q2.dim() == k2.dim() == 4):
        return None
    b, h, nq, d1 = q1.shape
    bk1, hk1, nk, dk1 = k1.shape
    b2, h2, nq2, d2 = q2.shape
    bk2, hk2, nk2, dk2 = k2.shape
    valid = (
        bk1 == b
        and b2 == b
        and bk2 == b
        and h2 == h
        and nq2 == nq
        and nk2 == nk
        and dk1 == d1
        and dk2 == d2
        and d1 > 0
        and d2 > 0
        and hk1 > 0
        and hk2 > 0
        and h % hk1 == 0
        and h % hk2 == 0
        and q1.dtype == k1.dtype
        and q2.dtype == k2.dtype
        and q1.dtype in _DTYPES
        and q2.dtype in _DTYPES
        and q1.device == k1.device == q2.device == k2.device
    )
    return (b, h, hk1, hk2, nq, nk, d1, d2) if valid else None


def _check_cu_seqlens_meta(cu_seqlens, b, nq, nk, device) -> None:
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(
            "cu_seqlens must be 1-D (num_seqs + 1,) with at least 2 entries, got "
            f"shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}; expected {device} like q1")
    if b != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got B = {b}")
    if nq != nk:
        raise ValueError(
            f"packed sequences share offsets between queries and keys, so Nq must "
            f"equal Nk; got Nq = {nq}, Nk = {nk}"
        )


def _read_cu_seqlens(cu_seqlens, total: int) -> tuple[list[int], int]:
    """Reads cu_seqlens (one host sync): starts at 0, never decreases, ends at the total length.
    Returns the offsets and the longest sequence."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(f"cu_seqlens must end at the total length {total}, got {offsets[-1]}")
    return offsets, max(lengths)


# id(cu_seqlens) -> (weak reference, version counter, offsets, longest sequence) of offsets
# already read, so that a packed batch reused across layers, and every backward, never sync again.
_CHECKED_OFFSETS: dict[int, tuple[weakref.ref, int, list[int], int]] = {}


def _cached(cu_seqlens):
    """The cache entry of cu_seqlens if its offsets were read and have not changed since, else None.
    Inference tensors keep no version counter, so an in-place change would go unseen: never cached."""
    if cu_seqlens.is_inference():
        return None
    entry = _CHECKED_OFFSETS.get(id(cu_seqlens))
    if entry is not None and entry[0]() is cu_seqlens and entry[1] == cu_seqlens._version:
        return entry
    return None


def _read_and_cache(cu_seqlens, total: int) -> tuple[list[int], int]:
    offsets, longest = _read_cu_seqlens(cu_seqlens, total)
    if not cu_seqlens.is_inference():
        key = id(cu_seqlens)
        _CHECKED_OFFSETS[key] = (weakref.ref(cu_seqlens), cu_seqlens._version, offsets, longest)
        weakref.finalize(cu_seqlens, _CHECKED_OFFSETS.pop, key, None)
    return offsets, longest


def packed_offsets(cu_seqlens, total: int) -> list[int]:
    """The offsets of a validated cu_seqlens (packing `total` tokens) as host ints: read once,
    then from the cache."""
    entry = _cached(cu_seqlens)
    return entry[2] if entry is not None else _read_and_cache(cu_seqlens, total)[0]


def resolve_max_seqlen(cu_seqlens, max_seqlen: int | None, total: int) -> int | None:
    """The longest packed sequence the kernels must cover (max_seqlen, else the longest one).

    A cu_seqlens tensor is read on the host (one sync) the first time it is seen, and again only
    after an in-place change (an inference-mode tensor, which keeps no version, on every call).
    While a CUDA graph is being captured nothing is read, and then max_seqlen is required
    (docs/contract.md, Packed sequences)."""
    if cu_seqlens is None:
        return None
    entry = _cached(cu_seqlens)
    if entry is not None:
        longest = entry[3]
    elif cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        if max_seqlen is None:
            raise ValueError(
                "cu_seqlens under CUDA graph capture needs max_seqlen: reading the offsets to find "
                "the longest sequence would synchronize the device"
            )
        return max_seqlen
    else:
        longest = _read_and_cache(cu_seqlens, total)[1]
    if max_seqlen is None:
        return longest
    if max_seqlen < longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is shorter than the longest sequence in cu_seqlens "
            f"({longest}); nothing is truncated, so pass at least {longest}"
        )
    return max_seqlen


def resolve_scale(scale, head_dim: int, name: str) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{name} must be finite, got {scale}")
    return float(scale)
