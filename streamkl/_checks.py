"""Validation that holds for every backend (docs/contract.md, Errors): runs before any kernel,
raises ValueError/TypeError naming the argument and what was expected."""

from __future__ import annotations

import math
import weakref

import torch

from ._spec import AttnKLSpec, IndexerKLSpec

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


# --- indexer_kl -------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)
_LSE_DTYPES = (torch.float32, torch.float64)

# (batch, heads, heads_kv, index_heads, nq, nk, d, di) of one indexer_kl call.
IndexerSizes = tuple[int, int, int, int, int, int, int, int]


def indexer_kl_spec(
    q, k, qi, ki, w, *, lse, topk, causal, scale, cu_seqlens=None, max_seqlen=None, read_values=True
) -> IndexerKLSpec:
    """Validates one indexer_kl call and builds its spec (docs/indexer.md, Errors).

    read_values: read topk's range and cu_seqlens on the host (one sync each); False for fake or
    traced calls, which validate metadata only and launch nothing (the registered op validates
    the values when it runs)."""
    sizes = check_indexer_inputs(q, k, qi, ki, w, lse, topk, cu_seqlens, max_seqlen)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = resolve_scale(scale, sizes[6], "scale")
    if read_values and topk is not None:
        check_topk_values(topk, sizes[5])
    width = 0 if topk is None else topk.shape[2]
    options = (causal, scale, width, topk is not None, lse is not None)
    if cu_seqlens is None:
        return IndexerKLSpec(*sizes, *options, sizes[0], None, False)
    if read_values:
        max_seqlen = resolve_max_seqlen(cu_seqlens, max_seqlen, sizes[4])
    return IndexerKLSpec(*sizes, *options, cu_seqlens.shape[0] - 1, max_seqlen, True)


def indexer_kl_spec_of_saved(
    q, k, qi, ki, w, *, lse_given, topk, causal, scale, cu_seqlens, max_seqlen
) -> IndexerKLSpec:
    """The spec of a call indexer_kl_spec validated before (the compiled backward's saved
    inputs): no rule re-checked; packed offsets come from the cache the forward filled."""
    b, h, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g, di = qi.shape[1], qi.shape[3]
    width = 0 if topk is None else topk.shape[2]
    head = (b, h, hk, g, nq, nk, d, di, causal, scale, width, topk is not None, lse_given)
    if cu_seqlens is None:
        return IndexerKLSpec(*head, b, None, False)
    max_seqlen = resolve_max_seqlen(cu_seqlens, max_seqlen, nq)
    return IndexerKLSpec(*head, cu_seqlens.shape[0] - 1, max_seqlen, True)


def check_indexer_inputs(
    q, k, qi, ki, w, lse=None, topk=None, cu_seqlens=None, max_seqlen=None
) -> IndexerSizes:
    """Shapes, dtypes and devices of an indexer_kl call, rule by rule: the first one broken
    raises, naming the argument. Metadata only: safe on fake tensors and under tracing."""
    layouts = {
        "q": (4, "4-D (B, H, Sq, D)"),
        "k": (4, "4-D (B, H_kv, Sk, D) or 3-D (B, Sk, D)"),
        "qi": (4, "4-D (B, G, Sq, Di)"),
        "ki": (4, "4-D (B, 1, Sk, Di) or 3-D (B, Sk, Di)"),
        "w": (3, "3-D (B, G, Sq)"),
    }
    tensors = dict(q=q, k=k, qi=qi, ki=ki, w=w)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        dims, layout = layouts[name]
        if t.dim() != dims:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"{name} has dtype {t.dtype}; expected one of float16, bfloat16, float32, float64"
            )
    for q_name, k_name in (("q", "k"), ("qi", "ki")):
        a, c = tensors[q_name], tensors[k_name]
        if a.dtype != c.dtype:
            raise TypeError(f"{q_name} and {k_name} must share a dtype, got {a.dtype} and {c.dtype}")
        if a.shape[-1] != c.shape[-1]:
            raise ValueError(
                f"{q_name} and {k_name} must share the head dim, got {a.shape[-1]} and {c.shape[-1]}"
            )
        if a.shape[-1] == 0:
            raise ValueError(f"{q_name} has head dim 0; expected at least 1")
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"q, k, qi, ki, w must be on one device, got {sorted(map(str, devices))}")
    b, h, nq, d = q.shape
    for name, t in tensors.items():
        if t.shape[0] != b:
            raise ValueError(f"{name} has batch {t.shape[0]}; expected {b} (the batch of q)")
    if h == 0:
        raise ValueError("q has 0 heads; the teacher's mixture needs at least 1")
    hk, nk = k.shape[1], k.shape[2]
    if hk == 0 or h % hk != 0:
        raise ValueError(f"k has {hk} heads; the {h} query heads of q must be a multiple of it")
    g = qi.shape[1]
    if qi.shape[2] != nq:
        raise ValueError(f"qi has {qi.shape[2]} query rows; expected Sq = {nq} like q")
    if g == 0:
        raise ValueError("qi has 0 indexer heads; expected at least 1")
    if ki.shape[1] != 1:
        raise ValueError(f"ki must have one head (B, 1, Sk, Di), got {ki.shape[1]} heads")
    if ki.shape[2] != nk:
        raise ValueError(f"ki has {ki.shape[2]} keys; expected Sk = {nk} like k")
    if tuple(w.shape) != (b, g, nq):
        raise ValueError(f"w must be (B, G, Sq) = {(b, g, nq)} like qi, got {tuple(w.shape)}")
    device = q.device
    if lse is not None:
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"lse must be a torch.Tensor or None, got {type(lse).__name__}")
        if lse.dtype not in _LSE_DTYPES:
            raise TypeError(f"lse has dtype {lse.dtype}; expected float32 or float64 (natural log)")
        if tuple(lse.shape) != (b, h, nq):
            raise ValueError(f"lse must be (B, H, Sq) = {(b, h, nq)} like q, got {tuple(lse.shape)}")
        if lse.device != device:
            raise ValueError(f"lse is on {lse.device}; expected {device} like q")
    if topk is not None:
        if not isinstance(topk, torch.Tensor):
            raise TypeError(f"topk must be a torch.Tensor or None, got {type(topk).__name__}")
        if topk.dtype not in _INDEX_DTYPES:
            raise TypeError(f"topk has dtype {topk.dtype}; expected int32 or int64")
        if topk.dim() != 3 or tuple(topk.shape[:2]) != (b, nq):
            raise ValueError(f"topk must be (B, Sq, K) with (B, Sq) = {(b, nq)}, got {tuple(topk.shape)}")
        if topk.device != device:
            raise ValueError(f"topk is on {topk.device}; expected {device} like q")
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}; expected {device} like q")
        _check_cu_seqlens_meta(cu_seqlens, b, nq, nk, device)
        if max_seqlen is not None and (
            isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 0
        ):
            raise ValueError(f"max_seqlen must be a non-negative int, got {max_seqlen!r}")
    elif max_seqlen is not None:
        raise ValueError("max_seqlen is only meaningful with cu_seqlens")
    return (b, h, hk, g, nq, nk, d, qi.shape[-1])


def check_topk_values(topk, nk: int) -> None:
    """Every entry of topk is a key index in [0, nk) or -1 (padding): one read on the host. Not
    read while a CUDA graph is being captured (reading would synchronize the device)."""
    if topk.numel() == 0 or (topk.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    low, high = torch.stack(torch.aminmax(topk)).tolist()
    if low < -1 or high >= nk:
        bad = low if low < -1 else high
        raise ValueError(
            f"topk holds the index {bad}; expected key indices in [0, {nk}) (Sk = {nk}) or -1 for padding"
        )
