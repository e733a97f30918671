"""Layouts: which tokens of the sequence each rank holds, in which order (docs/distributed.md,
Layouts). Pure index arithmetic plus the local cut and the reassembly; no communication.

The general layout is a shard's positions: each local token's global index, in the order the
shard stores them. The plan reads positions as runs, `(start, length)` pairs of consecutive
positions in storage order (zigzag: two runs per rank), so its cost grows with the runs, not
the tokens. The named layouts are shorthands that produce runs:

    "contiguous"           rank r holds the r-th stretch; shards may differ in length
    "zigzag"               2P equal chunks, rank r holds chunks r and 2P-1-r, in that order
                           (PyTorch's head-tail balancer, Megatron/TE on one sequence,
                           ring-flash-attention's zigzag)
    "zigzag-per-document"  the same within every document of cu_seqlens, documents in order
                           (TE's THD partitioned indices, Megatron's packed sequences)

`framework_positions` also makes PyTorch's PTRR order, which depends on the mask, so it is a
positions-only layout for attn_kl.
"""

from __future__ import annotations

import bisect
import weakref

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag", "zigzag-per-document")
SHARD_LAYOUTS = (*LAYOUTS, "ptrr")
HEAD_TAIL_ALIASES = {"head-tail": "zigzag"}

Runs = tuple[tuple[int, int], ...]  # (first position, length) per run, in storage order


class LayoutError(ValueError):
    """Shards, positions or documents inconsistent with the layout they are said to have."""


def check_layout(layout, allowed=LAYOUTS) -> str:
    """The canonical name of `layout` (aliases resolved); raises naming the allowed ones."""
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {allowed}; got {type(layout).__name__}")
    layout = HEAD_TAIL_ALIASES.get(layout, layout)
    if layout not in allowed:
        raise ValueError(f"layout must be one of {allowed}, got {layout!r}")
    return layout


def chunks_of(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its shard stores them."""
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank)
    return (rank,)


# --- runs -------------------------------------------------------------------------------------


def runs_of(positions: list[int]) -> Runs:
    """Positions in storage order as runs of consecutive positions."""
    runs = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return tuple((start, length) for start, length in runs)


def positions_of(runs: Runs) -> list[int]:
    return [p for start, length in runs for p in range(start, start + length)]


def runs_of_runs(runs) -> Runs:
    """Runs with the empty ones dropped and those that continue each other joined."""
    out: list[list[int]] = []
    for start, length in runs:
        if length == 0:
            continue
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


def layout_runs(layout: str, lengths: list[int], offsets: list[int] | None) -> list[Runs]:
    """Every rank's runs under a named layout, given every rank's shard length and the packed
    documents' offsets (or None). Raises LayoutError where the lengths or documents cannot be
    laid out so: what shards alone can tell of a mislabelled layout."""
    world = len(lengths)
    if layout == "contiguous":
        starts = [sum(lengths[:r]) for r in range(world)]
        return [runs_of_runs([(starts[r], lengths[r])]) for r in range(world)]
    if layout == "zigzag":
        if len(set(lengths)) != 1:
            listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            raise LayoutError(
                f"local sequence length differs across ranks ({listing}); layout='zigzag' holds "
                "two equal chunks on every rank: pass positions= (or layout='contiguous') for "
                "shards of different lengths"
            )
        if lengths[0] % 2:
            raise LayoutError(
                f"layout='zigzag' stores 2 equal chunks per rank; the local length {lengths[0]} "
                "is not a multiple of 2"
            )
        chunk = lengths[0] // 2
        return [
            runs_of_runs([(c * chunk, chunk) for c in chunks_of("zigzag", r, world)]) for r in range(world)
        ]
    # zigzag-per-document
    if offsets is None:
        raise LayoutError("layout='zigzag-per-document' cuts every document of cu_seqlens; pass cu_seqlens")
    per_rank = [[] for _ in range(world)]
    for doc, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        if (end - start) % (2 * world):
            raise LayoutError(
                f"layout='zigzag-per-document' cuts every document into {2 * world} equal chunks; "
                f"document {doc} of cu_seqlens ([{start}, {end})) has {end - start} tokens, not a "
                f"multiple of {2 * world} (pad each document, as TransformerEngine's THD format does)"
            )
        chunk = (end - start) // (2 * world)
        for r in range(world):
            per_rank[r] += [(start + c * chunk, chunk) for c in chunks_of("zigzag", r, world)]
    runs = [runs_of_runs(r) for r in per_rank]
    held = [sum(n for _, n in r) for r in runs]
    if held != list(lengths):
        raise LayoutError(
            f"layout='zigzag-per-document' over cu_seqlens gives the ranks {held} tokens, but they "
            f"hold {list(lengths)}"
        )
    return runs


def check_cover(runs_by_rank: list[Runs]) -> None:
    """The ranks' positions together are 0..N-1, each once (N: the tokens of all shards)."""
    pieces = sorted((start, length, rank) for rank, runs in enumerate(runs_by_rank) for start, length in runs)
    expected = 0
    for start, length, rank in pieces:
        if start < 0:
            raise LayoutError(f"positions: rank {rank} holds position {start}; positions start at 0")
        if start > expected:
            raise LayoutError(
                f"positions: no rank holds position {expected}; the ranks' positions together "
                f"must be 0..N-1 (N = {sum(n for _, n, _ in pieces)}, the tokens of all shards), each once"
            )
        if start < expected:
            holders = sorted({r for s, n, r in pieces if s <= start < s + n})
            raise LayoutError(
                f"positions: position {start} is held more than once (ranks {holders}); the ranks' "
                "positions together must be 0..N-1, each once"
            )
        expected = start + length


class SeqIndex:
    """Where each global position is stored: the runs of every rank, sorted by position."""

    def __init__(self, runs_by_rank: list[Runs]):
        pieces = []
        for rank, runs in enumerate(runs_by_rank):
            offset = 0
            for start, length in runs:
                pieces.append((start, length, rank, offset))
                offset += length
        pieces.sort()
        self.pieces = pieces
        self.starts = [p[0] for p in pieces]

    def pieces_in(self, start: int, stop: int):
        """(position, length, rank, storage offset) of the stored pieces covering [start, stop)."""
        i = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while i < len(self.pieces) and start < stop:
            p_start, p_len, rank, offset = self.pieces[i]
            if p_start + p_len > start:
                lo = max(start, p_start)
                hi = min(stop, p_start + p_len)
                if hi > lo:
                    yield lo, hi - lo, rank, offset + lo - p_start
                    start = hi
            i += 1


# --- host reads of small index tensors, once per tensor -------------------------------------

# id(tensor) -> (weak reference, version counter, its values as host ints)
_READ: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def host_ints(t: Tensor) -> list[int]:
    """t.tolist(), read on the host (one device sync) the first time a tensor is seen and again
    only after an in-place change; an inference tensor (no version counter) on every call."""
    if t.is_inference():
        return t.tolist()
    entry = _READ.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    values = t.tolist()
    key = id(t)
    _READ[key] = (weakref.ref(t), t._version, values)
    weakref.finalize(t, _READ.pop, key, None)
    return values


# --- framework layouts ------------------------------------------------------------------------


def framework_positions(
    layout: str, n: int, rank: int, world: int, offsets: list[int] | None, block_size: int, causal: bool
) -> list[int]:
    """Rank `rank`'s positions under `layout` (SHARD_LAYOUTS) for a sequence of n tokens."""
    if layout == "contiguous":
        # torch.chunk's cut, which DTensor's Shard(dim) uses: ceil(n / P) per rank, the last
        # ranks shorter (or empty)
        size = -(-n // world) if world else 0
        return list(range(min(rank * size, n), min((rank + 1) * size, n)))
    if layout == "zigzag":
        if n % (2 * world):
            raise LayoutError(
                f"layout='zigzag' over {world} ranks cuts the sequence into {2 * world} equal "
                f"chunks; its length {n} is not a multiple of {2 * world}"
            )
        return positions_of(layout_runs("zigzag", [n // world] * world, None)[rank])
    if offsets is None:
        offsets = [0, n]
    if layout == "zigzag-per-document":
        per_doc = [(end - start) // world for start, end in zip(offsets[:-1], offsets[1:])]
        lengths = [sum(per_doc)] * world
        return positions_of(layout_runs(layout, lengths, offsets)[rank])
    return _ptrr_positions(n, rank, world, offsets, block_size, causal)


def _ptrr_positions(n, rank, world, offsets, block_size, causal) -> list[int]:
    """PyTorch's processing-time round robin (its _PTRRLoadBalancer, for flex_attention): blocks
    of `block_size` tokens, each costing the key blocks it touches under the (document, causal)
    mask, sorted by cost, longest first (ties in sequence order), dealt to the ranks in a snake
    (0..P-1, then P-1..0, ...); each rank's blocks in sequence order. On a plain causal mask this
    is zigzag over every group of 2P blocks."""
    if n % (block_size * world):
        raise LayoutError(
            f"layout='ptrr' deals blocks of {block_size} tokens to {world} ranks; the sequence's "
            f"length {n} is not a multiple of {block_size * world}"
        )
    blocks = n // block_size
    cost = []
    for b in range(blocks):
        first, last = b * block_size, (b + 1) * block_size - 1
        lo = offsets[bisect.bisect_right(offsets, first) - 1]  # document start of the first row
        d = bisect.bisect_right(offsets, last) - 1
        hi = last if causal else (offsets[d + 1] - 1 if d + 1 < len(offsets) else n - 1)
        cost.append(hi // block_size - lo // block_size + 1)
    order = sorted(range(blocks), key=lambda b: -cost[b])
    mine = [
        order[i]
        for i in range(blocks)
        if (i % world if (i // world) % 2 == 0 else world - 1 - i % world) == rank
    ]
    return [p for b in sorted(mine) for p in range(b * block_size, (b + 1) * block_size)]


# --- the local cut and the reassembly ---------------------------------------------------------


def cut_positions(x: Tensor, positions: list[int], dim: int) -> Tensor:
    """The tokens of `x` at `positions` along `dim`, in that order: a new tensor, differentiable."""
    runs = runs_of(positions)
    if not runs:
        return x.narrow(dim, 0, 0).clone()
    return torch.cat([x.narrow(dim, start, length) for start, length in runs], dim)


def assemble_runs(gathered: Tensor, runs_by_rank: list[Runs]) -> Tensor:
    """The full sequence, along dim 0, from every rank's shard `gathered` (world, max N_local, ...)
    stored as `runs_by_rank`."""
    index = SeqIndex(runs_by_rank)
    total = sum(n for runs in runs_by_rank for _, n in runs)
    pieces = [gathered[rank, offset : offset + n] for _, n, rank, offset in index.pieces_in(0, total)]
    return torch.cat(pieces, 0) if pieces else gathered[0, :0].clone()
