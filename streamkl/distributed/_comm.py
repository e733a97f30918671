"""Communication for context parallelism: the process group (and its name, which the custom
ops take), all-gather and reduce-scatter on flat buffers, and the point-to-point ring. Nothing
here knows a layout or an op: these move lists of tensors between the ranks of a group."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

COMMS = ("allgather", "ring")

# batch_isend_irecv tags: gloo matches point-to-point messages by tag, and a key shard and a dk
# partial can travel between the same two ranks at once (docs/distributed.md, Ring).
TAG_KEYS = 0
TAG_DK = 2


def resolve_group(group):
    """The ProcessGroup a call runs on: `group` itself, the world's for None, the group of a 1-D
    DeviceMesh, or of one named dimension of a mesh passed as (mesh, "dim")."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "streamkl.distributed needs an initialized process group: call "
            "torch.distributed.init_process_group first"
        )
    if group is None:
        return dist.group.WORLD
    group = _group_of_mesh(group)
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "group must be a torch.distributed ProcessGroup, a 1-D DeviceMesh, (mesh, dim name) "
            f"or None, got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of `group`")
    return group


def _group_of_mesh(group):
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        mesh, name = group
        names = mesh.mesh_dim_names or ()
        if not isinstance(name, str) or name not in names:
            raise ValueError(f"group=(mesh, {name!r}): the mesh's dimensions are named {names}")
        return mesh.get_group(name)
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names
            raise ValueError(
                f"group: a {group.ndim}-D DeviceMesh (dims {names}) does not say which dimension "
                'the sequence is sharded over; pass mesh["cp"] or (mesh, "cp") with that dimension\'s name'
            )
        return group.get_group()
    return group


def group_by_name(name: str):
    """The process group named `name`: custom op schemas take no ProcessGroup, so the group
    travels into the ops by name, the way torch's functional collectives pass it."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_gather_flat(out: Tensor, local: Tensor, group, async_op: bool = False):
    # all_gather_single is all_gather_into_tensor's name in recent torch (same semantics)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, local, group=group, async_op=async_op)


def reduce_scatter_flat(out: Tensor, by_owner: Tensor, group, async_op: bool = False):
    # reduce_scatter_single is reduce_scatter_tensor's name in recent torch (same semantics)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(out, by_owner, group=group, async_op=async_op)


def all_gather(t: Tensor, group, world: int, async_op: bool = False):
    """(world, *t.shape): every rank's `t`, by rank. With async_op: (request or None, that tensor),
    to be read once the request is waited on."""
    local = t.contiguous()
    out = local.new_empty((world, *local.shape))
    work = None
    if world == 1:
        out[0] = local
    else:
        # flat buffers: backends differ in the multi-dimensional forms they take
        work = all_gather_flat(out.view(-1), local.view(-1), group=group, async_op=async_op)
    return (work, out) if async_op else out


def host_device(group) -> torch.device:
    """Where small host data travels on `group`: the current GPU if the group moves CUDA
    tensors only (NCCL), else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(payload: bytes, group, world: int) -> list[bytes]:
    """Every rank's `payload`, by rank: an all-gather of the lengths, then one of the bytes padded
    to the longest. Tensors only: torch's object collectives need numpy, which streamkl does not."""
    if world == 1:
        return [payload]
    device = host_device(group)
    sizes = all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device), group, world)
    sizes = sizes.view(-1).tolist()
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    gathered = all_gather(padded, group, world).cpu()
    return [bytes(gathered[rank, :size].tolist()) for rank, size in enumerate(sizes)]


def reduce_scatter(by_owner: Tensor, group, world: int):
    """Posts the sum over ranks of by_owner[this rank]; returns (request or None, the result)."""
    out = by_owner.new_empty(by_owner.shape[1:])
    if world == 1:
        out.copy_(by_owner[0])
        return None, out
    return reduce_scatter_flat(out.view(-1), by_owner.view(-1), group=group, async_op=True), out


def p2p(send: list[Tensor], receive: list[Tensor], group, rank, world, tag: int):
    """Posts sends of `send` to the next rank and receives into `receive` from the previous
    one, in one batch_isend_irecv; returns the requests."""
    to_rank = dist.get_global_rank(group, (rank + 1) % world)
    from_rank = dist.get_global_rank(group, (rank - 1) % world)
    ops = [dist.P2POp(dist.isend, t, to_rank, group, tag + i) for i, t in enumerate(send)]
    ops += [dist.P2POp(dist.irecv, t, from_rank, group, tag + i) for i, t in enumerate(receive)]
    return dist.batch_isend_irecv(ops)


def ring(
    shards: list[Tensor], group, rank: int, world: int, lengths: list[int] | None = None
) -> Iterator[tuple[int, list[Tensor]]]:
    """Yields (source rank, its shards) for each of the `world` steps of the ring: step s holds
    the shards of rank (rank - s) mod world. The exchange for step s + 1 is posted before step s
    is handed out, so it travels while the caller computes; two shards are alive at a time.
    `lengths`: every rank's length along dim 2, where shards differ (default: all as this one)."""
    current = [t.contiguous() for t in shards]
    for step in range(world):
        requests, incoming = [], []
        if step + 1 < world:
            source = (rank - step - 1) % world
            incoming = [
                t.new_empty((*t.shape[:2], lengths[source], *t.shape[3:])) if lengths else torch.empty_like(t)
                for t in current
            ]
            requests = p2p(current, incoming, group, rank, world, TAG_KEYS)
        yield (rank - step) % world, current
        for request in requests:
            request.wait()
        current = incoming
