"""Layouts: how a sequence of N tokens is cut into chunks and which rank holds which
(docs/distributed.md, Layouts). Pure index arithmetic plus the local cut and the reassembly
that streamkl.distributed.shard / unshard are made of; no communication.

    "contiguous": P chunks, rank r holds chunk r.
    "zigzag":     2P chunks, rank r holds chunks r and 2P-1-r, in that order.
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> None:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}; got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def chunks_of(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its shard stores them."""
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank)
    return (rank,)


def owners(layout: str, world: int) -> list[tuple[int, int]]:
    """For each global chunk, in sequence order: (the rank holding it, its slot in that shard)."""
    owner = [(0, 0)] * (world * chunks_per_rank(layout))
    for rank in range(world):
        for slot, chunk in enumerate(chunks_of(layout, rank, world)):
            owner[chunk] = (rank, slot)
    return owner


def cut(x: Tensor, layout: str, rank: int, world: int, dim: int) -> Tensor:
    """Rank `rank`'s shard of the full tensor `x` along `dim`: a new tensor, differentiable."""
    count = world * chunks_per_rank(layout)
    length = x.shape[dim]
    if length % count != 0:
        raise ValueError(
            f"layout={layout!r} over {world} ranks cuts the sequence into {count} equal chunks; "
            f"its length {length} (dim {dim}) is not a multiple of {count}"
        )
    chunk = length // count
    return torch.cat([x.narrow(dim, i * chunk, chunk) for i in chunks_of(layout, rank, world)], dim)


def check_shard(x, layout, dim: int) -> dict:
    """What one rank can check of a shard to reassemble; returns the metadata every rank must share."""
    check_layout(layout)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
    if x.shape[dim] % chunks_per_rank(layout) != 0:
        raise ValueError(
            f"layout={layout!r} stores {chunks_per_rank(layout)} chunks per rank; the shard's "
            f"length {x.shape[dim]} (dim {dim}) is not a multiple of that"
        )
    return {
        "layout": layout,
        "dim": dim % x.dim(),
        "shape": tuple(x.shape),
        "dtype": str(x.dtype),
        "device type": x.device.type,
    }


def assemble(gathered: Tensor, layout: str, world: int) -> Tensor:
    """The full sequence, along dim 0, from every rank's shard `gathered` (world, N_local, ...)."""
    chunk = gathered.shape[1] // chunks_per_rank(layout)
    pieces = [gathered[owner, slot * chunk : (slot + 1) * chunk] for owner, slot in owners(layout, world)]
    return torch.cat(pieces, 0)
