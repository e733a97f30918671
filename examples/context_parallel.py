"""Context-parallel attention KL and DSA indexer loss with each framework's shards: what to pass
to streamkl.distributed.attn_kl and indexer_kl when Megatron-LM, TransformerEngine, PyTorch's
context_parallel or ring-flash-attention has cut the sequence (docs/distributed.md, Your
framework).

    torchrun --nproc-per-node 2 examples/context_parallel.py                  every framework, both ops
    torchrun --nproc-per-node 2 examples/context_parallel.py --framework te-thd
    torchrun --nproc-per-node 2 examples/context_parallel.py --op indexer_kl  Megatron's DSA, TE's THD
    torchrun --nproc-per-node 2 examples/context_parallel.py --device cuda    NCCL, one GPU a rank

Each section cuts a full batch the way that framework does (its own function where it is
installed: TransformerEngine's thd_get_partitioned_indices, PyTorch's context_parallel), passes
this rank's shard to the op with the arguments that describe the cut, and checks the KL of every
row, gathered, against the single-process op (streamkl.attn_kl, streamkl.indexer_kl) on the whole
sequence. attn_kl runs every framework; indexer_kl runs Megatron-LM's DSA (one sequence, "sbhd",
top-k as Megatron stores it) and TransformerEngine's THD (packed documents).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import streamkl
from streamkl import distributed as cp

FRAMEWORKS = (
    "megatron",
    "te-thd",
    "te-sbhd",
    "pytorch",
    "pytorch-ptrr",
    "ring-flash-attn",
    "ring-flash-attn-varlen",
)
INDEXER_FRAMEWORKS = ("megatron", "te-thd")  # the frameworks' cuts indexer_kl runs here


def full_batch(args, n, device, gen):
    """q1, k1, q2, k2 of one sequence of n tokens, (B, N, H, D) as most frameworks store them."""
    shapes = [
        (args.heads, args.d1),
        (args.kv_heads, args.d1),
        (args.heads, args.d2),
        (args.kv_heads, args.d2),
    ]
    return [torch.randn(1, n, h, d, generator=gen, dtype=args.dtype).to(device) for h, d in shapes]


def documents(world, device):
    """Packed documents of 2P, 6P and 8P tokens: each splits into 2P chunks, as TE's THD format
    and the per-document balancers need (pad documents to a multiple of 2P otherwise)."""
    lengths = [2 * world * 8, 6 * world * 8, 8 * world * 8]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def zigzag_rows(t, dim, world, rank):
    """Megatron's get_batch_on_this_cp_rank on one tensor: dim cut into 2P chunks, rank r keeping
    chunks r and 2P-1-r."""
    keep = torch.tensor([rank, 2 * world - 1 - rank], device=t.device)
    chunked = t.view(*t.shape[:dim], 2 * world, t.shape[dim] // (2 * world), *t.shape[dim + 1 :])
    return chunked.index_select(dim, keep).flatten(dim, dim + 1)


def thd_indices(cu, world, rank, device):
    """This rank's tokens under TransformerEngine's THD cut (per-document zigzag):
    thd_get_partitioned_indices where TransformerEngine is installed, else streamkl's helper."""
    try:
        import transformer_engine_torch as tex

        return tex.thd_get_partitioned_indices(cu, int(cu[-1]), world, rank)
    except ImportError:  # the same indices
        tokens = torch.arange(int(cu[-1]), device=device)
        return cp.shard_and_positions(tokens, "zigzag-per-document", cu_seqlens=cu, dim=0)[1]


def megatron(args, world, rank, device, gen):
    """Megatron's get_batch_on_this_cp_rank: the sequence (dim 1) cut into 2P chunks, rank r
    keeping chunks r and 2P-1-r. attn_kl: layout="zigzag", qkv_format="bshd"."""
    n = 2 * world * 32
    full = full_batch(args, n, device, gen)
    local = [zigzag_rows(t, 1, world, rank) for t in full]
    kl = cp.attn_kl(*local, causal=True, layout="zigzag", qkv_format="bshd")  # (B, N_local, H)
    got = cp.unshard(kl, "zigzag", dim=1)
    want = streamkl.attn_kl(*(t.transpose(1, 2) for t in full), causal=True).transpose(1, 2)
    return got, want


def te_thd(args, world, rank, device, gen):
    """TransformerEngine's THD format: packed tokens (T, H, D), documents by cu_seqlens (padded
    to multiples of 2P), this rank's tokens from thd_get_partitioned_indices (per-document
    zigzag). attn_kl: positions=those indices, cu_seqlens=, qkv_format="thd"."""
    cu = documents(world, device)
    full = [t[0] for t in full_batch(args, int(cu[-1]), device, gen)]  # (T, H, D)
    index = thd_indices(cu, world, rank, device)
    local = [t.index_select(0, index) for t in full]
    kl = cp.attn_kl(*local, causal=True, positions=index, cu_seqlens=cu, qkv_format="thd")  # (T_local, H)
    got = cp.unshard(kl, positions=index, cu_seqlens=cu, dim=0)
    full_bhsd = [t.transpose(0, 1).unsqueeze(0) for t in full]
    want = streamkl.attn_kl(*full_bhsd, causal=True, cu_seqlens=cu)[0].transpose(0, 1)
    return got, want


def te_sbhd(args, world, rank, device, gen):
    """TransformerEngine's sbhd format on one sequence: (N, B, H, D), the sequence cut as
    Megatron cuts it (chunks r and 2P-1-r of 2P). attn_kl: layout="zigzag", qkv_format="sbhd"."""
    n = 2 * world * 32
    full = [t.transpose(0, 1).contiguous() for t in full_batch(args, n, device, gen)]  # (N, B, H, D)
    local = [
        torch.cat([t.chunk(2 * world, 0)[rank], t.chunk(2 * world, 0)[2 * world - 1 - rank]]) for t in full
    ]
    kl = cp.attn_kl(*local, causal=True, layout="zigzag", qkv_format="sbhd")  # (N_local, B, H)
    got = cp.unshard(kl, "zigzag", dim=0)
    want = streamkl.attn_kl(*(t.permute(1, 2, 0, 3) for t in full), causal=True).permute(2, 0, 1)
    return got, want


def pytorch(args, world, rank, device, gen):
    """PyTorch's context_parallel shards the buffers it is given in place: head-tail (zigzag)
    with load balancing on and N % 2P == 0, else torch.chunk's contiguous cut. Adding
    torch.arange(N) to the buffers makes it hand back each rank's positions, whichever cut it
    chose. attn_kl: positions=that buffer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    got, want = [], []
    # N % 2P == 0: head-tail; N odd: torch.chunk's cut, shards of different lengths
    for n in (2 * world * 32, 2 * world * 32 + 1):
        full = [t.transpose(1, 2).contiguous() for t in full_batch(args, n, device, gen)]  # (B, H, N, D)
        want.append(streamkl.attn_kl(*full, causal=True))
        buffers = [t.clone() for t in full]
        positions = torch.arange(n, device=device)
        with context_parallel(mesh, buffers=[*buffers, positions], buffer_seq_dims=[2, 2, 2, 2, 0]):
            kl = cp.attn_kl(*buffers, causal=True, positions=positions, group=mesh)
            got.append(cp.unshard(kl, positions=positions, group=mesh))
    return torch.cat(got, 2), torch.cat(want, 2)


def pytorch_ptrr(args, world, rank, device, gen):
    """PyTorch's PTRR balancer (flex_attention with a document mask): blocks dealt to the ranks
    by their cost under the mask. shard_and_positions("ptrr") makes the same cut and its
    positions. attn_kl: positions=, cu_seqlens=."""
    cu = documents(world, device)
    full = [t.transpose(1, 2) for t in full_batch(args, int(cu[-1]), device, gen)]
    pairs = [cp.shard_and_positions(t, "ptrr", cu_seqlens=cu, block_size=16) for t in full]
    positions = pairs[0][1]
    kl = cp.attn_kl(*(local for local, _ in pairs), causal=True, positions=positions, cu_seqlens=cu)
    return cp.unshard(kl, positions=positions), streamkl.attn_kl(*full, causal=True, cu_seqlens=cu)


def ring_flash_attn(args, world, rank, device, gen):
    """ring-flash-attention's zigzag_ring_flash_attn_func: (B, N, H, D) cut into 2P chunks
    along N, rank r holding chunks r and 2P-1-r. attn_kl: layout="zigzag", qkv_format="bshd",
    comm="ring" (the same ring, keys travelling)."""
    n = 2 * world * 32
    full = full_batch(args, n, device, gen)
    local = [
        torch.cat([t.chunk(2 * world, 1)[rank], t.chunk(2 * world, 1)[2 * world - 1 - rank]], 1) for t in full
    ]
    kl = cp.attn_kl(*local, causal=True, layout="zigzag", qkv_format="bshd", comm="ring")
    got = cp.unshard(kl, "zigzag", dim=1)
    want = streamkl.attn_kl(*(t.transpose(1, 2) for t in full), causal=True).transpose(1, 2)
    return got, want


def ring_flash_attn_varlen(args, world, rank, device, gen):
    """ring-flash-attention's llama3_flash_attn_varlen_func: packed documents (global
    cu_seqlens) cut into contiguous stretches, N / P tokens a rank. attn_kl:
    layout="contiguous", cu_seqlens= (the global one), qkv_format="thd"."""
    cu = documents(world, device)
    n = int(cu[-1])
    full = [t[0] for t in full_batch(args, n, device, gen)]
    local = [t.chunk(world, 0)[rank] for t in full]
    kl = cp.attn_kl(*local, causal=True, layout="contiguous", cu_seqlens=cu, qkv_format="thd")
    got = cp.unshard(kl, "contiguous", dim=0)
    full_bhsd = [t.transpose(0, 1).unsqueeze(0) for t in full]
    want = streamkl.attn_kl(*full_bhsd, causal=True, cu_seqlens=cu)[0].transpose(0, 1)
    return got, want


# --- indexer_kl: the DSA indexer loss -------------------------------------------------------


def indexer_batch(args, n, device, gen):
    """indexer_kl's inputs for n tokens, stored as Megatron-LM's DSA stores them ("sbhd", B = 1):
    the attention's queries q (N, B, H, D) and its absorbed one-head key k (N, B, D), the
    indexer's queries qi (N, B, G, Di) and key ki (N, B, Di), its weights w (N, B, G), and the
    top-k key positions (B, N, K) in the whole sequence (each row's own first, -1 padding)."""

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=args.dtype).to(device)

    groups, top = 2, 8
    q, k = rand(n, 1, args.heads, args.d1), rand(n, 1, args.d1)
    qi, ki = rand(n, 1, groups, args.d2), rand(n, 1, args.d2)
    w = rand(n, 1, groups) * (groups * args.d2) ** -0.5  # the indexer's scale folded in
    topk = torch.randint(0, n, (1, n, top), generator=gen)
    topk[..., 0] = torch.arange(n)
    topk[..., -1] = -1
    return q, k, qi, ki, w, topk.to(device)


def single_process_indexer_kl(q, k, qi, ki, w, topk, **kwargs):
    """streamkl.indexer_kl on the whole sequence of indexer_batch's tensors: (B, N) rows."""
    bhsd = (q.permute(1, 2, 0, 3), k.transpose(0, 1), qi.permute(1, 2, 0, 3), ki.transpose(0, 1))
    return streamkl.indexer_kl(*bhsd, w.permute(1, 2, 0), topk=topk, reduction="none", **kwargs)


def megatron_indexer(args, world, rank, device, gen):
    """Megatron-LM's DSA: get_batch_on_this_cp_rank's cut (the sequence, dim 0 of its [S, B, ...]
    tensors, in 2P chunks, rank r keeping r and 2P-1-r), the top-k indices [B, S_local, K] of
    this rank's rows as positions in the whole sequence. indexer_kl: layout="zigzag",
    qkv_format="sbhd", topk.transpose(0, 1)."""
    n = 2 * world * 32
    q, k, qi, ki, w, topk = indexer_batch(args, n, device, gen)
    local = [zigzag_rows(t, 0, world, rank) for t in (q, k, qi, ki, w)]
    local_topk = zigzag_rows(topk, 1, world, rank)  # the rows cut, their positions untouched
    # topk [B, S_local, K] read as "sbhd"'s (S_local, B, K); the KL comes back (S_local, B)
    kl = cp.indexer_kl(*local, topk=local_topk.transpose(0, 1), layout="zigzag", qkv_format="sbhd",
                       reduction="none")  # fmt: skip
    got = cp.unshard(kl, "zigzag", dim=0)
    want = single_process_indexer_kl(q, k, qi, ki, w, topk).transpose(0, 1)
    return got, want


def te_thd_indexer(args, world, rank, device, gen):
    """TransformerEngine's THD cut (Megatron's packed sequences): packed tokens (T, heads, D),
    one-head keys (T, D), weights (T, G), top-k (T, K) of positions in the whole packed sequence,
    this rank's tokens from thd_get_partitioned_indices. indexer_kl: positions= those indices,
    cu_seqlens=, qkv_format="thd"; the top-k rows cut alike."""
    cu = documents(world, device)
    q, k, qi, ki, w, topk = indexer_batch(args, int(cu[-1]), device, gen)
    index = thd_indices(cu, world, rank, device)
    local = [t[:, 0].index_select(0, index) for t in (q, k, qi, ki, w)]  # B = 1 dropped: "thd"
    local_topk = topk[0].index_select(0, index)
    kl = cp.indexer_kl(*local, topk=local_topk, positions=index, cu_seqlens=cu, qkv_format="thd",
                       reduction="none")  # fmt: skip
    got = cp.unshard(kl, positions=index, cu_seqlens=cu, dim=0)
    want = single_process_indexer_kl(q, k, qi, ki, w, topk, cu_seqlens=cu)[0]
    return got, want


RUN = {
    "megatron": megatron,
    "te-thd": te_thd,
    "te-sbhd": te_sbhd,
    "pytorch": pytorch,
    "pytorch-ptrr": pytorch_ptrr,
    "ring-flash-attn": ring_flash_attn,
    "ring-flash-attn-varlen": ring_flash_attn_varlen,
}
RUN_INDEXER = {"megatron": megatron_indexer, "te-thd": te_thd_indexer}
# (op, framework): every section main() runs by default
SECTIONS = [("attn_kl", name) for name in FRAMEWORKS] + [("indexer_kl", name) for name in INDEXER_FRAMEWORKS]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("all", *FRAMEWORKS), default="all")
    parser.add_argument("--op", choices=("all", "attn_kl", "indexer_kl"), default="all")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d1", type=int, default=32)
    parser.add_argument("--d2", type=int, default=16)
    args = parser.parse_args()
    args.dtype = torch.float32
    chosen = [s for s in SECTIONS if args.op in ("all", s[0]) and args.framework in ("all", s[1])]
    if not chosen:
        parser.error(f"indexer_kl runs here for {', '.join(INDEXER_FRAMEWORKS)}; attn_kl for every framework")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    runs = {"attn_kl": RUN, "indexer_kl": RUN_INDEXER}
    for op, name in chosen:
        gen = torch.Generator().manual_seed(0)  # the same full batch on every rank
        got, want = runs[op][name](args, world, rank, device, gen)
        error = ((got - want).abs().max() / want.abs().max()).item()
        if rank == 0:
            print(
                f"{op + ' ' + name:34s} {world} ranks: KL of {want.numel()} rows, relative error {error:.1e}",
                flush=True,
            )
        assert error < 1e-5, f"{op} {name}: relative error {error:.1e}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
