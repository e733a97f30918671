"""Context parallelism: streamkl.attn_kl and streamkl.indexer_kl over one sequence sharded
across the ranks of a torch.distributed group (docs/distributed.md).

    attn_kl(q1, k1, q2, k2, *, group, causal, layout, positions, comm, ...)  each rank passes its shard
    indexer_kl(q, k, qi, ki, w, *, group, lse, topk, layout, positions, ...)  likewise (all-gather form)
    shard(x, layout) / unshard(x, layout)                                     full tensor <-> local shard

The package, one concern a module:

    _layout    layouts: which chunks of the sequence each rank holds; the cut and the reassembly
    _validate  cross-rank validation: local checks, then one exchange so every rank raises alike
    _plan      the blocks a rank's queries meet, the calls that cover them, head steps, the
               forward and backward drivers over them, the merge of partial states
    _comm      the process group, all-gather / reduce-scatter, the point-to-point ring
    _ops       attn_kl's block runners, its custom ops (streamkl::cp_attn_kl_fwd / cp_attn_kl_bwd /
               cp_sum) with their fakes and autograd, and the eager path; the qkv_format views and
               the DTensor refusal both ops use
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
from ._layout import LAYOUTS, SHARD_LAYOUTS, LayoutError

__all__ = [
    "COMMS",
    "LAYOUTS",
    "SHARD_LAYOUTS",
    "LayoutError",
    "attn_kl",
    "indexer_kl",
    "shard",
    "shard_and_positions",
    "unshard",
]


def shard(x: Tensor, layout: str = "zigzag", group=None, dim: int = 2, **kwargs) -> Tensor:
    """This rank's shard of the full tensor `x` along `dim` (the sequence axis of (B, H, N, D)):
    shard_and_positions(x, layout, group=group, dim=dim, **kwargs)[0]."""
    return shard_and_positions(x, layout, group=group, dim=dim, **kwargs)[0]


def shard_and_positions(
    x: Tensor,
    layout: str,
    *,
    group=None,
    dim: int = 2,
    cu_seqlens: Tensor | None = None,
    block_size: int = 128,
    causal: bool = True,
) -> tuple[Tensor, Tensor]:
    """This rank's shard of the full tensor `x` along `dim`, and its positions: each local
    token's index in `x` (int64, on x's device), what attn_kl takes as positions=. The shard is a
    new tensor, differentiable. No communication.

    layout, as the frameworks cut a sequence (docs/distributed.md, Your framework):
      "contiguous"           torch.chunk's cut: ceil(N/P) tokens per rank, the last ranks
                             shorter (PyTorch context_parallel without load balancing, or with
                             it when N % 2P != 0)
      "zigzag"               2P equal chunks, rank r holds chunks r and 2P-1-r ("head-tail":
                             PyTorch's head-tail balancer, Megatron's get_batch_on_this_cp_rank,
                             TransformerEngine's bshd/sbhd, ring-flash-attention's zigzag)
      "zigzag-per-document"  the same within every document of cu_seqlens, each a multiple of 2P
                             tokens, documents in order (TransformerEngine's THD
                             thd_get_partitioned_indices, Megatron's packed sequences)
      "ptrr"                 PyTorch's PTRR balancer: blocks of `block_size` tokens dealt by
                             their cost under the causal (or not) document mask of cu_seqlens
    """
    layout = _layout.check_layout(layout, _layout.SHARD_LAYOUTS)
    group = _comm.resolve_group(group)
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    n = x.shape[dim]
    offsets = None
    if cu_seqlens is not None:
        offsets = _layout.host_ints(cu_seqlens)
        if offsets[0] != 0 or offsets[-1] != n or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
            raise ValueError(
                f"cu_seqlens must run from 0 to the sequence's length {n} (dim {dim}), "
                f"non-decreasing; got {offsets}"
            )
    positions = _layout.framework_positions(layout, n, rank, world, offsets, block_size, causal)
    local = _layout.cut_positions(x, positions, dim)
    return local, torch.tensor(positions, dtype=torch.int64, device=x.device)


def unshard(
    x: Tensor,
    layout: str | None = None,
    group=None,
    dim: int = 2,
    *,
    positions: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """The full tensor from every rank's shard `x` (the inverse of `shard`), on every rank.

    The shards are laid out as `layout` ("contiguous", "zigzag", "zigzag-per-document" with
    cu_seqlens) or stored at `positions` (any layout; default "zigzag"); they may differ in
    length where the layout allows. A collective: every rank of `group` calls it. Shapes, dtypes
    and device types are compared across ranks first (two small all-gathers), so a mismatch
    raises on every rank. The result carries no autograd history."""
    group = _comm.resolve_group(group)
    world = torch.distributed.get_world_size(group)
    what = "streamkl.distributed.unshard"

    def local():
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
        shape = tuple(x.shape)
        name, runs, offsets, layout_meta = _validate.check_local_layout(
            layout, positions, cu_seqlens, None, 1, shape[dim % x.dim()], x.device
        )
        meta = {
            **layout_meta,
            "dim": dim % x.dim(),
            "shape": shape[: dim % x.dim()] + ("N_local",) + shape[dim % x.dim() + 1 :],
            "dtype": str(x.dtype),
            "device type": x.device.type,
        }
        return (name, offsets), meta, {"length": shape[dim % x.dim()], "runs": runs}

    (name, offsets), shares = _validate.agree(group, local, what, share=True)
    try:
        runs = _validate.resolve_layout(name, shares, offsets)
    except ValueError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    dim = dim % x.dim()
    longest = max(share["length"] for share in shares)
    flat = x.detach().movedim(dim, 0)
    if flat.shape[0] < longest:  # all-gathers move equal sizes
        flat = torch.cat([flat, flat.new_zeros((longest - flat.shape[0], *flat.shape[1:]))])
    gathered = _comm.all_gather(flat.contiguous(), group, world)
    return _layout.assemble_runs(gathered, runs).movedim(0, dim)


def attn_kl(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str | None = None,
    positions: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    comm: str = "allgather",
    scale1: float | None = None,
    scale2: float | None = None,
    reduction: str = "none",
    heads_per_step: int | None = None,
    qkv_format: str = "bhsd",
    backend: str | None = None,
) -> Tensor:
    """streamkl.attn_kl over one sequence sharded across the ranks of `group`: a ProcessGroup, a
    1-D DeviceMesh, (mesh, dim name), or None for the world.

    Each rank passes its shard (B, H, N_local, D) of q1, k1, q2, k2 (qkv_format "bhsd"; "bshd"
    and "sbhd" are read as TransformerEngine names them), the tokens at `positions` (1-D int,
    each local token's index in the whole sequence, in storage order; any layout) or laid out as
    `layout` ("zigzag", the default without positions: chunks r and 2P-1-r of 2P; "contiguous":
    the r-th stretch, any lengths; "zigzag-per-document": zigzag within every document). Shards
    may differ in length where the layout allows. cu_seqlens: int32 offsets of the documents of
    the whole packed sequence, the same on every rank (B = 1); a row sees its own document only.
    Returns the local rows' KL (B, H, N_local) in the inputs' format, or with reduction "sum" /
    "mean" the value over the whole sequence, the same on every rank. Differentiable in all four
    inputs; every rank must run the backward (it communicates). `comm`: "allgather" (gather the
    key heads, reduce-scatter their gradients) or "ring" (key shards pass from rank to rank).
    `heads_per_step`: query heads per pass over the keys (a multiple of the heads sharing a key
    head; default all), which bounds the keys held at once. causal, scale1, scale2, backend: as
    for streamkl.attn_kl, causal over the global positions. Bad input raises ValueError or
    TypeError on every rank before any data moves; shards that cannot be laid out as `layout`,
    or positions that do not cover the sequence once, raise LayoutError (a ValueError).
    docs/distributed.md states the whole call.
    """
    return _ops.attn_kl(
        q1, k1, q2, k2, group=group, causal=causal, layout=layout, positions=positions, comm=comm,
        scale1=scale1, scale2=scale2, reduction=reduction, heads_per_step=heads_per_step,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, qkv_format=qkv_format, backend=backend,
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
    layout: str | None = None,
    positions: Tensor | None = None,
    reduction: str = "mean",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    qkv_format: str = "bhsd",
    backend: str | None = None,
) -> Tensor:
    """streamkl.indexer_kl over one sequence sharded across the ranks of `group`: a
    ProcessGroup, a 1-D DeviceMesh, (mesh, dim name), or None for the world.

    Each rank passes its shard of the sequence: q (B, H, N_local, D), k (B, H_kv, N_local, D) or
    (B, N_local, D), qi (B, G, N_local, Di), ki (B, 1, N_local, Di) or (B, N_local, Di),
    w (B, G, N_local), and optionally lse (B, H, N_local) (the teacher's per-head log-sum-exp
    over the keys each row admits in the whole sequence) and topk (B, N_local, K) (each row's key
    set as positions in the whole sequence, packed or not, -1 padding). With qkv_format "bshd",
    "sbhd" or "thd" every tensor is stored in the format's axis order, less the axes it lacks
    (w and lse have no D, topk and a headless key no H): w (B, N_local, G) under "bshd",
    topk (N_local, B, K) under "sbhd", w (N_local, G) under "thd". The tokens are those at
    `positions` (1-D int, each local token's index in the whole sequence, in storage order; any
    layout) or laid out as `layout` ("zigzag", the default without positions; "contiguous";
    "zigzag-per-document"), as for attn_kl; shards may differ in length where the layout allows.
    cu_seqlens: int32 offsets of the documents of the whole packed sequence, the same on every
    rank (B = 1); a row admits its own document's keys only. The key-side tensors k and ki are
    all-gathered; the rest stays local. Returns the local rows' KL (B, N_local) (in the format's
    order: (N_local, B) under "sbhd", (N_local,) under "thd") with reduction "none", or the sum /
    mean over the whole sequence (the mean over the rows that see a key), the same on every rank.
    Differentiable in qi, ki and w; every rank must run the backward (it communicates). causal,
    scale, backend: as for streamkl.indexer_kl, causal over global positions. Bad input raises
    ValueError or TypeError on every rank before any data moves; shards that cannot be laid out
    as `layout`, or positions that do not cover the sequence once, raise LayoutError (a
    ValueError). docs/distributed.md states the whole call.
    """
    return _indexer.indexer_kl(
        q, k, qi, ki, w, group=group, lse=lse, scale=scale, causal=causal, topk=topk, layout=layout,
        positions=positions, reduction=reduction, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        qkv_format=qkv_format, backend=backend,
    )  # fmt: skip
