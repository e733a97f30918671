"""Context parallelism: streamkl.attn_kl and streamkl.indexer_kl over one sequence sharded
across the ranks of a torch.distributed group (docs/distributed.md).

    attn_kl(q1, k1, q2, k2, *, group, causal, layout, comm, ...)   each rank passes its shard
    indexer_kl(q, k, qi, ki, w, *, group, lse, topk, layout, ...)  likewise (all-gather form)
    shard(x, layout) / unshard(x, layout)                           full tensor <-> local shard

The package, one concern a module:

    _layout    layouts: which chunks of the sequence each rank holds; the cut and the reassembly
    _validate  cross-rank validation: local checks, then one exchange so every rank raises alike
    _plan      the blocks a rank's queries meet, the calls that cover them, head steps, the
               forward and backward drivers over them, the merge of partial states
    _comm      the process group, all-gather / reduce-scatter, the point-to-point ring
    _ops       attn_kl's block runners, its custom ops (streamkl::cp_attn_kl_fwd / cp_attn_kl_bwd /
               cp_sum) with their fakes and autograd, and the eager path
    _indexer   indexer_kl's validation, block runners, custom ops (streamkl::cp_indexer_kl_fwd /
               cp_indexer_kl_bwd) and eager path

_layout, _plan and _comm know no op: a second op whose partial state merges like a log-sum-exp
brings its own block runner and merge and reuses them. Every block of work is one call of the
backend selected for the whole call, on a slice of the local queries and a run of keys, so any
backend runs it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _comm, _indexer, _layout, _ops, _validate
from ._comm import COMMS
from ._layout import LAYOUTS

__all__ = ["COMMS", "LAYOUTS", "attn_kl", "indexer_kl", "shard", "unshard"]


def shard(x: Tensor, layout: str = "zigzag", group=None, dim: int = 2) -> Tensor:
    """This rank's shard of the full tensor `x` along `dim` (the sequence axis of (B, H, N, D)).

    "contiguous": rank r holds tokens [r N/P, (r+1) N/P). "zigzag": the sequence is cut into 2P
    equal chunks and rank r holds chunks r and 2P-1-r, in that order. A new tensor, never a view;
    differentiable. Needs N divisible by P ("contiguous") or 2P ("zigzag"). No communication."""
    _layout.check_layout(layout)
    group = _comm.resolve_group(group)
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return _layout.cut(x, layout, rank, world, dim)


def unshard(x: Tensor, layout: str = "zigzag", group=None, dim: int = 2) -> Tensor:
    """The full tensor from every rank's shard `x` (the inverse of `shard`), on every rank.

    A collective: every rank of `group` calls it. Shapes, dtypes and device types are compared
    across ranks first (two small all-gathers), so a mismatch raises on every rank. The result
    carries no autograd history."""
    group = _comm.resolve_group(group)
    world = torch.distributed.get_world_size(group)
    _validate.agree(
        group, lambda: (None, _layout.check_shard(x, layout, dim)), "streamkl.distributed.unshard"
    )
    dim = dim % x.dim()
    gathered = _comm.all_gather(x.detach().movedim(dim, 0).contiguous(), group, world)
    return _layout.assemble(gathered, layout, world).movedim(0, dim)


def attn_kl(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    comm: str = "allgather",
    scale1: float | None = None,
    scale2: float | None = None,
    reduction: str = "none",
    heads_per_step: int | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """streamkl.attn_kl over one sequence sharded across the ranks of `group` (default: the world).

    Each rank passes its shard (B, H, N_local, D) of q1, k1, q2, k2, laid out as `layout`
    ("zigzag": chunks r and 2P-1-r of 2P; "contiguous": chunk r of P; see `shard`). Returns the
    local rows' KL (B, H, N_local), or with reduction "sum" / "mean" the value over the whole
    sequence, the same on every rank. Differentiable in all four inputs; every rank must run the
    backward (it communicates). `comm`: "allgather" (gather the key heads, reduce-scatter their
    gradients) or "ring" (key shards pass from rank to rank). `heads_per_step`: query heads per
    pass over the keys (a multiple of the heads sharing a key head; default all), which bounds
    the keys held at once. causal, scale1, scale2, backend: as for streamkl.attn_kl, causal over
    the global positions. cu_seqlens is not supported yet. Bad input raises ValueError or
    TypeError on every rank before any data moves. docs/distributed.md states the whole call.
    """
    return _ops.attn_kl(
        q1, k1, q2, k2, group=group, causal=causal, layout=layout, comm=comm, scale1=scale1, scale2=scale2,
        reduction=reduction, heads_per_step=heads_per_step, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        backend=backend,
    )  # fmt: skip


def indexer_kl(
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    *,
    group=None,
    lse: Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    topk: Tensor | None = None,
    layout: str = "zigzag",
    reduction: str = "mean",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """streamkl.indexer_kl over one sequence sharded across the ranks of `group` (default: the
    world).

    Each rank passes its shard of the sequence, laid out as `layout` (see `shard`): q
    (B, H, N_local, D), k (B, H_kv, N_local, D) or (B, N_local, D), qi (B, G, N_local, Di), ki
    (B, 1, N_local, Di) or (B, N_local, Di), w (B, G, N_local), and optionally lse (B, H, N_local)
    (the teacher's per-head log-sum-exp over the keys each row admits in the whole sequence) and
    topk (B, N_local, K) (each row's key set as positions in the whole sequence, -1 padding).
    The key-side tensors k and ki are all-gathered; the rest stays local. Returns the local rows'
    KL (B, N_local) with reduction "none", or the sum / mean over the whole sequence (the mean
    over the rows that see a key), the same on every rank. Differentiable in qi, ki and w; every
    rank must run the backward (it communicates). causal, scale, backend: as for
    streamkl.indexer_kl, causal over global positions. cu_seqlens is not supported yet. Bad input
    raises ValueError or TypeError on every rank before any data moves. docs/distributed.md
    states the whole call.
    """
    return _indexer.indexer_kl(
        q, k, qi, ki, w, group=group, lse=lse, scale=scale, causal=causal, topk=topk, layout=layout,
        reduction=reduction, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=backend,
    )  # fmt: skip
