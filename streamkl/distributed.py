"""Context parallelism: streamkl.attn_kl over one sequence sharded across the ranks of a
torch.distributed group (docs/distributed.md).

    attn_kl(q1, k1, q2, k2, *, group, causal, layout, comm, ...)   each rank passes its shard
    shard(x, layout) / unshard(x, layout)                           full tensor <-> local shard

Every block of work is a call of torch.ops.streamkl.attn_kl_fwd / attn_kl_bwd on a slice of
the local queries and a run of keys, so any backend runs it. The distributed forward and
backward are two custom ops of their own (streamkl::cp_attn_kl_fwd / cp_attn_kl_bwd) whose
bodies do the communication; their fake functions make torch.compile trace a model that calls
attn_kl (docs/distributed.md, torch.compile).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# importing the package (streamkl/__init__.py) registers torch.ops.streamkl.attn_kl_fwd / attn_kl_bwd
from . import _checks, _dispatch, _env, _ops

LAYOUTS = ("contiguous", "zigzag")
COMMS = ("allgather", "ring")

# batch_isend_irecv tags: gloo matches point-to-point messages by tag, and a key shard and a dk
# partial can travel between the same two ranks at once (docs/distributed.md, Ring).
_TAG_KEYS = 0
_TAG_DK = 2

__all__ = ["COMMS", "LAYOUTS", "attn_kl", "shard", "unshard"]


# --- layouts (docs/distributed.md, Layouts) ------------------------------------------------------


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def _chunks_of(layout: str, rank: int, world: int) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its shard stores them."""
    if layout == "zigzag":
        return (rank, 2 * world - 1 - rank)
    return (rank,)


def _owners(layout: str, world: int) -> list[tuple[int, int]]:
    """For each global chunk, in sequence order: (the rank holding it, its slot in that shard)."""
    owners = [(0, 0)] * (world * _chunks_per_rank(layout))
    for rank in range(world):
        for slot, chunk in enumerate(_chunks_of(layout, rank, world)):
            owners[chunk] = (rank, slot)
    return owners


def _check_layout(layout) -> None:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}; got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _check_comm(comm) -> None:
    if not isinstance(comm, str):
        raise TypeError(f"comm must be a str, one of {COMMS}; got {type(comm).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


def _resolve_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "streamkl.distributed needs an initialized process group: call "
            "torch.distributed.init_process_group first"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of `group`")
    return group


def shard(x: Tensor, layout: str = "zigzag", group=None, dim: int = 2) -> Tensor:
    """This rank's shard of the full tensor `x` along `dim` (the sequence axis of (B, H, N, D)).

    "contiguous": rank r holds tokens [r N/P, (r+1) N/P). "zigzag": the sequence is cut into 2P
    equal chunks and rank r holds chunks r and 2P-1-r, in that order. A new tensor, never a view;
    differentiable. Needs N divisible by P ("contiguous") or 2P ("zigzag"). No communication."""
    _check_layout(layout)
    group = _resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = world * _chunks_per_rank(layout)
    length = x.shape[dim]
    if length % count != 0:
        raise ValueError(
            f"layout={layout!r} over {world} ranks cuts the sequence into {count} equal chunks; "
            f"its length {length} (dim {dim}) is not a multiple of {count}"
        )
    chunk = length // count
    return torch.cat([x.narrow(dim, i * chunk, chunk) for i in _chunks_of(layout, rank, world)], dim)


def unshard(x: Tensor, layout: str = "zigzag", group=None, dim: int = 2) -> Tensor:
    """The full tensor from every rank's shard `x` (the inverse of `shard`), on every rank.

    A collective: every rank of `group` calls it. Shapes, dtypes and device types are compared
    across ranks first (one small all-gather), so a mismatch raises on every rank. The result
    carries no autograd history."""
    group = _resolve_group(group)
    world = dist.get_world_size(group)

    def local():
        _check_layout(layout)
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim={dim} is out of range for a {x.dim()}-D tensor")
        if x.shape[dim] % _chunks_per_rank(layout) != 0:
            raise ValueError(
                f"layout={layout!r} stores {_chunks_per_rank(layout)} chunks per rank; the shard's "
                f"length {x.shape[dim]} (dim {dim}) is not a multiple of that"
            )
        return None, {
            "layout": layout,
            "dim": dim % x.dim(),
            "shape": tuple(x.shape),
            "dtype": str(x.dtype),
            "device type": x.device.type,
        }

    _agree(group, local, "streamkl.distributed.unshard")
    dim = dim % x.dim()
    local_shard = x.detach().movedim(dim, 0).contiguous()
    gathered = _all_gather(local_shard, group, world)
    per_rank = _chunks_per_rank(layout)
    chunk = x.shape[dim] // per_rank
    pieces = [gathered[owner, slot * chunk : (slot + 1) * chunk] for owner, slot in _owners(layout, world)]
    return torch.cat(pieces, 0).movedim(0, dim)


# --- checks that every rank agrees on (docs/distributed.md, Errors) ----------------------------


_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}


def _agree(group, local: Callable[[], tuple], what: str):
    """Runs the local checks on every rank, then one all-gather of their outcome (an error or
    a small dict of metadata): any rank's error, or any metadata that differs between ranks,
    raises the same error on every rank, before any data collective. Returns what `local`
    returned besides the metadata."""
    try:
        result, meta = local()
        error = None
    except Exception as exc:  # travels to the other ranks, which would otherwise wait forever
        meta, error, raised = None, (type(exc).__name__, str(exc)), exc
    world = dist.get_world_size(group)
    outcomes: list = [None] * world
    if world == 1:
        outcomes[0] = (meta, error)
    else:
        dist.all_gather_object(outcomes, (meta, error), group=group)
    for rank, (_, rank_error) in enumerate(outcomes):
        if rank_error is not None:
            kind = _ERROR_TYPES.get(rank_error[0], RuntimeError)
            exc = kind(f"{what}: rank {rank} of the group: {rank_error[1]}")
            if error is not None:
                raise exc from raised
            raise exc
    first = outcomes[0][0]
    for key in first:
        values = [rank_meta[key] for rank_meta, _ in outcomes]
        if any(value != values[0] for value in values):
            listing = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            hint = _MISMATCH_HINTS.get(key, "")
            raise ValueError(f"{what}: {key} differs across ranks ({listing}){hint}")
    return result


_MISMATCH_HINTS = {
    "local sequence length": "; every rank holds an equal shard of the sequence",
    "requires_grad": "; every rank runs the same backward, so the same inputs must require grad",
}


class _Options(NamedTuple):
    """A validated call's resolved settings."""

    scale1: float
    scale2: float
    heads_per_step: int
    world: int


def _check_local(
    group,
    q1,
    k1,
    q2,
    k2,
    causal,
    layout,
    comm,
    scale1,
    scale2,
    reduction,
    heads_per_step,
    cu_seqlens,
    max_seqlen,
    backend,
    grad_flags,
) -> tuple[_Options, dict]:
    """Everything one rank can check alone; raises ValueError/TypeError naming the argument."""
    _check_layout(layout)
    _check_comm(comm)
    if cu_seqlens is not None or max_seqlen is not None:
        raise ValueError(
            "cu_seqlens / max_seqlen: packed sequences are not supported with context parallelism "
            "yet (docs/distributed.md, What is supported); pass one sequence per batch entry"
        )
    problem = _checks.check_inputs(q1, k1, q2, k2)
    s1, s2 = _checks.check_options(causal, scale1, scale2, reduction, problem.d1, problem.d2)
    if problem.nk != problem.nq:
        raise ValueError(
            f"k1 and k2 hold {problem.nk} keys but q1 and q2 hold {problem.nq} rows: with context "
            "parallelism each rank passes the same token range of queries and keys"
        )
    per_rank = _chunks_per_rank(layout)
    if problem.nq % per_rank != 0:
        raise ValueError(
            f"layout={layout!r} stores {per_rank} equal chunks per rank; the local length "
            f"{problem.nq} is not a multiple of {per_rank}"
        )
    unit = math.lcm(problem.heads // problem.heads_kv1, problem.heads // problem.heads_kv2)
    if heads_per_step is None:
        heads_per_step = problem.heads
    elif isinstance(heads_per_step, bool) or not isinstance(heads_per_step, int):
        raise TypeError(f"heads_per_step must be an int or None, got {type(heads_per_step).__name__}")
    elif heads_per_step < 1 or heads_per_step % unit != 0:
        raise ValueError(
            f"heads_per_step must be a positive multiple of {unit} (the query heads that share "
            f"a key head of k1 and of k2), got {heads_per_step}"
        )
    device_type = q1.device.type
    if torch.compiler.is_compiling():
        _dispatch.check_name(backend)  # the rest runs again inside the op, at run time
    else:
        _env.check_all()
        _dispatch.select(q1, k1, q2, k2, None, backend)  # a named backend that cannot run raises here
        if dist.get_backend(group) == "nccl" and device_type != "cuda":
            raise ValueError(
                f"the group's backend is nccl, which needs CUDA tensors; the inputs are on {device_type}"
            )
    meta = {
        "local sequence length": problem.nq,
        "q1 shape": tuple(q1.shape),
        "k1 shape": tuple(k1.shape),
        "q2 shape": tuple(q2.shape),
        "k2 shape": tuple(k2.shape),
        "dtypes": tuple(str(t.dtype) for t in (q1, k1, q2, k2)),
        "device type": device_type,
        "causal": causal,
        "layout": layout,
        "comm": comm,
        "scale1": s1,
        "scale2": s2,
        "reduction": reduction,
        "heads_per_step": heads_per_step,
        "requires_grad": tuple(grad_flags),
    }
    return _Options(s1, s2, min(heads_per_step, problem.heads), dist.get_world_size(group)), meta


# --- the blocks of work ---------------------------------------------------------------------


class _Call(NamedTuple):
    """One attn_kl_fwd / attn_kl_bwd call: local query rows against the first `keys` keys of a
    key block, causal or not (bottom-right aligned, docs/contract.md, Causal alignment)."""

    rows: slice
    keys: int
    causal: bool


def _plan(query_chunks, key_chunks, chunk: int, causal: bool) -> list[_Call]:
    """The calls that cover local query chunks `query_chunks` against a key block holding
    global chunks `key_chunks` (both increasing, `chunk` tokens each).

    Causal: a query chunk sees every key chunk before it in full and its own chunk (the
    diagonal) causally; a key chunk after it is skipped. The keys it sees are a prefix of the
    block, and bottom-right alignment makes "full chunks, then the diagonal" one causal call with
    Nk = that prefix. All local query chunks go into one call when their needs line up
    (docs/distributed.md, Causal)."""
    needs = []  # per query chunk: (key chunks seen in full, whether its diagonal is in the block)
    for qc in query_chunks:
        if causal:
            needs.append((sum(1 for kc in key_chunks if kc < qc), qc in key_chunks))
        else:
            needs.append((len(key_chunks), False))
    count = len(query_chunks)
    rows = slice(0, count * chunk)
    if needs[0][0] > 0 and all(need == (needs[0][0], False) for need in needs):
        return [_Call(rows, needs[0][0] * chunk, False)]
    if all(diag and full == needs[0][0] + t for t, (full, diag) in enumerate(needs)):
        return [_Call(rows, (needs[-1][0] + 1) * chunk, True)]
    return [
        _Call(slice(t * chunk, (t + 1) * chunk), (full + diag) * chunk, diag)
        for t, (full, diag) in enumerate(needs)
        if full + diag > 0
    ]


class _HeadStep(NamedTuple):
    """A run of query heads and the key heads of k1 and of k2 they read (GQA)."""

    q: slice
    k1: slice
    k2: slice


def _head_steps(heads: int, heads_kv1: int, heads_kv2: int, per_step: int) -> list[_HeadStep]:
    """Runs of `per_step` query heads (a multiple of both GQA group sizes, so every key head
    belongs to one run) and their key heads."""
    g1, g2 = heads // heads_kv1, heads // heads_kv2
    steps = []
    for start in range(0, heads, per_step):
        stop = min(start + per_step, heads)
        steps.append(
            _HeadStep(slice(start, stop), slice(start // g1, stop // g1), slice(start // g2, stop // g2))
        )
    return steps


def _merge_into(kl, lse1, lse2, part_kl, part_lse1, part_lse2) -> None:
    """In place: the state over the union of two disjoint key sets (docs/distributed.md, Merge).

        LSE_t = logaddexp(LSE_t,a, LSE_t,b)
        KL    = sum_p w_p (KL_p + log w_p - log v_p),  w_p = exp(LSE1_p - LSE1), v_p = exp(LSE2_p - LSE2)

    which equals KL = E + LSE2 - LSE1 with E = sum_p w_p E_p, E_p = KL_p + LSE1_p - LSE2_p, without
    the cancellation between E and the LSEs at large logits. A part that sees no key (LSE = -inf)
    adds nothing; a row no part sees stays KL 0, LSE -inf."""
    new_lse1 = torch.logaddexp(lse1, part_lse1)
    new_lse2 = torch.logaddexp(lse2, part_lse2)
    total = torch.zeros_like(kl)
    for p_kl, p_lse1, p_lse2 in ((kl, lse1, lse2), (part_kl, part_lse1, part_lse2)):
        log_w = p_lse1 - new_lse1
        term = log_w.exp() * (p_kl + log_w - (p_lse2 - new_lse2))
        total += torch.where(torch.isneginf(p_lse1), 0.0, term)
    kl.copy_(total)
    lse1.copy_(new_lse1)
    lse2.copy_(new_lse2)


# --- communication ----------------------------------------------------------------------------


def _all_gather_flat(out: Tensor, local: Tensor, group, async_op: bool = False):
    # all_gather_single is all_gather_into_tensor's name in recent torch (same semantics)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, local, group=group, async_op=async_op)


def _reduce_scatter_flat(out: Tensor, by_owner: Tensor, group, async_op: bool = False):
    # reduce_scatter_single is reduce_scatter_tensor's name in recent torch (same semantics)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return reduce_scatter(out, by_owner, group=group, async_op=async_op)


def _all_gather(t: Tensor, group, world: int) -> Tensor:
    """(world, *t.shape): every rank's `t`, by rank."""
    out = t.new_empty((world, *t.shape))
    if world == 1:
        out[0] = t
    else:
        # flat buffers: backends differ in the multi-dimensional forms they take
        _all_gather_flat(out.view(-1), t.contiguous().view(-1), group=group)
    return out


class _Gathered(NamedTuple):
    """Key heads of one head step gathered from every rank, in sequence order."""

    step: _HeadStep
    k1: Tensor
    k2: Tensor


def _gathered_steps(k1, k2, steps, group, layout, world) -> Iterator[_Gathered]:
    """For each head step, k1 and k2 (only the step's compact key heads) of the whole sequence.

    The gather of the next step is posted before the current one is handed out, so it travels
    while the caller computes (docs/distributed.md, All-gather)."""
    owners = _owners(layout, world)
    chunk = k1.shape[2] // _chunks_per_rank(layout)

    def post(step):
        posted = []
        for k, heads in ((k1, step.k1), (k2, step.k2)):
            local = k[:, heads].contiguous()
            out = local.new_empty((world, *local.shape))
            work = None
            if world == 1:
                out[0] = local
            else:
                work = _all_gather_flat(out.view(-1), local.view(-1), group=group, async_op=True)
            posted.append((work, out))
        return posted

    def in_sequence_order(work, out):
        if work is not None:
            work.wait()
        return torch.cat([out[rank, :, :, slot * chunk : (slot + 1) * chunk] for rank, slot in owners], 2)

    pending = post(steps[0])
    for i, step in enumerate(steps):
        keys = [in_sequence_order(work, out) for work, out in pending]
        pending = None  # the gathered shards are copied: free them before the next gather
        if i + 1 < len(steps):
            pending = post(steps[i + 1])
        yield _Gathered(step, *keys)
        del keys


def _p2p(send: list[Tensor], receive: list[Tensor], group, rank, world, tag: int):
    """Posts sends of `send` to the next rank and receives into `receive` from the previous
    one, in one batch_isend_irecv; returns the requests."""
    to_rank = dist.get_global_rank(group, (rank + 1) % world)
    from_rank = dist.get_global_rank(group, (rank - 1) % world)
    ops = [dist.P2POp(dist.isend, t, to_rank, group, tag + i) for i, t in enumerate(send)]
    ops += [dist.P2POp(dist.irecv, t, from_rank, group, tag + i) for i, t in enumerate(receive)]
    return dist.batch_isend_irecv(ops)


def _ring(shards: list[Tensor], group, rank: int, world: int) -> Iterator[tuple[int, list[Tensor]]]:
    """Yields (source rank, its shards) for each of the `world` steps of the ring: step s holds
    the shards of rank (rank - s) mod world. The exchange for step s + 1 is posted before step s
    is handed out, so it travels while the caller computes; two shards are alive at a time."""
    current = [t.contiguous() for t in shards]
    for step in range(world):
        requests, incoming = [], []
        if step + 1 < world:
            incoming = [torch.empty_like(t) for t in current]
            requests = _p2p(current, incoming, group, rank, world, _TAG_KEYS)
        yield (rank - step) % world, current
        for request in requests:
            request.wait()
        current = incoming


# --- forward and backward bodies --------------------------------------------------------------


class _Problem(NamedTuple):
    """What the forward and backward bodies share about a call."""

    group: object
    layout: str
    comm: str
    causal: bool
    scale1: float
    scale2: float
    heads_per_step: int
    backend: str | None
    world: int
    rank: int


def _local_chunks(p: _Problem) -> tuple[int, ...]:
    return _chunks_of(p.layout, p.rank, p.world)


def _key_blocks(
    p: _Problem, k1, k2, step_list
) -> Iterator[tuple[_HeadStep, tuple[int, ...], Tensor, Tensor]]:
    """(head step, global chunks the block holds, k1 block, k2 block) for every block of keys this
    rank's queries meet: the whole sequence once per head step (all-gather), or each rank's shard
    in turn (ring)."""
    if p.comm == "allgather":
        every_chunk = tuple(range(p.world * _chunks_per_rank(p.layout)))
        for gathered in _gathered_steps(k1, k2, step_list, p.group, p.layout, p.world):
            yield gathered.step, every_chunk, gathered.k1, gathered.k2
        return
    for step in step_list:
        for source, (key1, key2) in _ring([k1[:, step.k1], k2[:, step.k2]], p.group, p.rank, p.world):
            yield step, _chunks_of(p.layout, source, p.world), key1, key2


def _forward(q1, k1, q2, k2, p: _Problem):
    b, h, n, _ = q1.shape
    dtype = _ops.out_dtype(q1, q2)
    kl = torch.zeros(b, h, n, dtype=dtype, device=q1.device)
    lse1 = torch.full_like(kl, -math.inf)
    lse2 = torch.full_like(kl, -math.inf)
    if kl.numel() == 0:
        return kl, lse1, lse2
    chunk = n // _chunks_per_rank(p.layout)
    steps = _head_steps(h, k1.shape[1], k2.shape[1], p.heads_per_step)
    for step, key_chunks, key1, key2 in _key_blocks(p, k1, k2, steps):
        for call in _plan(_local_chunks(p), key_chunks, chunk, p.causal):
            part = torch.ops.streamkl.attn_kl_fwd(
                q1[:, step.q, call.rows],
                key1[:, :, : call.keys],
                q2[:, step.q, call.rows],
                key2[:, :, : call.keys],
                call.causal,
                p.scale1,
                p.scale2,
                None,
                None,
                p.backend,
            )
            state = [t[:, step.q, call.rows] for t in (kl, lse1, lse2)]
            _merge_into(*state, *part)
    return kl, lse1, lse2


def _block_backward(grad, q1, q2, kl, lse1, lse2, key1, key2, step, call, p: _Problem, needs):
    """attn_kl_bwd of one call: (dq1, dk1, dq2, dk2) of its rows and keys, empty where not needed."""
    rows = (slice(None), step.q, call.rows)
    return torch.ops.streamkl.attn_kl_bwd(
        grad[rows].contiguous(),
        q1[rows],
        key1[:, :, : call.keys],
        q2[rows],
        key2[:, :, : call.keys],
        kl[rows].contiguous(),
        lse1[rows].contiguous(),
        lse2[rows].contiguous(),
        call.causal,
        p.scale1,
        p.scale2,
        None,
        None,
        list(needs),
        p.backend,
    )


def _backward(grad, q1, k1, q2, k2, kl, lse1, lse2, p: _Problem, needs):
    """(dq1, dk1, dq2, dk2) of this rank's inputs, accumulated in float32 (float64 for float64
    inputs): dq from this rank's rows only; dk summed over every rank's rows, by a reduce-scatter
    (all-gather) or a second ring one hop behind the keys (ring)."""
    dtype = _ops.out_dtype(q1, q2)
    inputs = (q1, k1, q2, k2)
    grads = [
        torch.zeros(t.shape, dtype=dtype, device=t.device) if need else None for t, need in zip(inputs, needs)
    ]
    if kl.numel() > 0 and any(needs):
        steps = _head_steps(q1.shape[1], k1.shape[1], k2.shape[1], p.heads_per_step)
        if p.comm == "allgather":
            _backward_allgather(grad, q1, k1, q2, k2, kl, lse1, lse2, p, needs, grads, steps)
        else:
            _backward_ring(grad, q1, k1, q2, k2, kl, lse1, lse2, p, needs, grads, steps)
    return tuple(g.to(t.dtype) if g is not None else t.new_empty(0) for g, t in zip(grads, inputs))


def _accumulate_dq(grads, parts, step, call) -> None:
    for i in (0, 2):
        if grads[i] is not None:
            grads[i][:, step.q, call.rows] += parts[i]


def _key_heads(step: _HeadStep, i: int) -> slice:
    """The key heads of gradient `i` (1: dk1, 3: dk2) in head step `step`."""
    return step.k1 if i == 1 else step.k2


def _backward_allgather(grad, q1, k1, q2, k2, kl, lse1, lse2, p: _Problem, needs, grads, steps):
    n = q1.shape[2]
    chunk = n // _chunks_per_rank(p.layout)
    owners = _owners(p.layout, p.world)
    wanted = [i for i in (1, 3) if needs[i]]
    in_flight = []  # the previous head step's reduce-scatters: two steps' dk buffers live at most
    for step, key_chunks, key1, key2 in _key_blocks(p, k1, k2, steps):
        keys = {1: key1, 3: key2}
        # the dk partials of every rank's keys, stored by owner: (world, B, Hk, N_local, D), so that
        # one reduce-scatter hands each owner the sum over all ranks
        by_owner = {
            i: grads[i].new_zeros((p.world, keys[i].shape[0], keys[i].shape[1], n, keys[i].shape[3]))
            for i in wanted
        }
        for call in _plan(_local_chunks(p), key_chunks, chunk, p.causal):
            parts = _block_backward(grad, q1, q2, kl, lse1, lse2, key1, key2, step, call, p, needs)
            _accumulate_dq(grads, parts, step, call)
            for i, buffer in by_owner.items():
                for c in range(call.keys // chunk):
                    rank, slot = owners[key_chunks[c]]
                    buffer[rank, :, :, slot * chunk : (slot + 1) * chunk] += parts[i][
                        :, :, c * chunk : (c + 1) * chunk
                    ]
        _finish_reduce_scatters(in_flight, grads)
        in_flight = [
            (_reduce_scatter(buffer, p.group, p.world), i, _key_heads(step, i), buffer)
            for i, buffer in by_owner.items()
        ]
        del by_owner, keys
    _finish_reduce_scatters(in_flight, grads)


def _reduce_scatter(by_owner: Tensor, group, world: int):
    """Posts the sum over ranks of by_owner[this rank]; returns (request or None, the result)."""
    out = by_owner.new_empty(by_owner.shape[1:])
    if world == 1:
        out.copy_(by_owner[0])
        return None, out
    return _reduce_scatter_flat(out.view(-1), by_owner.view(-1), group=group, async_op=True), out


def _finish_reduce_scatters(in_flight, grads) -> None:
    for (request, out), i, heads, _ in in_flight:
        if request is not None:
            request.wait()
        grads[i][:, heads] += out


def _backward_ring(grad, q1, k1, q2, k2, kl, lse1, lse2, p: _Problem, needs, grads, steps):
    chunk = q1.shape[2] // _chunks_per_rank(p.layout)
    wanted = [i for i in (1, 3) if needs[i]]
    for step in steps:
        requests, sent, arriving = [], [], []
        for _, key_chunks, key1, key2 in _key_blocks(p, k1, k2, [step]):
            keys = {1: key1, 3: key2}
            partial = [
                torch.zeros(keys[i].shape, dtype=grads[i].dtype, device=keys[i].device) for i in wanted
            ]
            for call in _plan(_local_chunks(p), key_chunks, chunk, p.causal):
                parts = _block_backward(grad, q1, q2, kl, lse1, lse2, key1, key2, step, call, p, needs)
                _accumulate_dq(grads, parts, step, call)
                for buffer, i in zip(partial, wanted):
                    buffer[:, :, : call.keys] += parts[i]
            # the dk partials of this block's keys travel one hop behind the keys: add what the
            # previous rank sent for this block, pass the sum on (docs/distributed.md, Ring)
            for request in requests:
                request.wait()
            for buffer, arrived in zip(partial, arriving):
                buffer += arrived
            if p.world == 1:
                arriving = partial
                continue
            sent, arriving = partial, [torch.empty_like(buffer) for buffer in partial]
            requests = _p2p(sent, arriving, p.group, p.rank, p.world, _TAG_DK)
        for request in requests:
            request.wait()
        del sent
        # after `world` hops the partials of this rank's own keys are home, summed over all ranks
        for arrived, i in zip(arriving, wanted):
            grads[i][:, _key_heads(step, i)] += arrived


# --- the registered ops -----------------------------------------------------------------------


def _problem(group_name, layout, comm, causal, scale1, scale2, heads_per_step, backend) -> _Problem:
    group = _group_by_name(group_name)
    return _Problem(
        group,
        layout,
        comm,
        causal,
        scale1,
        scale2,
        heads_per_step,
        backend,
        dist.get_world_size(group),
        dist.get_rank(group),
    )


def _group_by_name(name: str):
    """The process group named `name`: custom op schemas take no ProcessGroup, so the group
    travels into the ops by name, the way torch's functional collectives pass it."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("streamkl::cp_attn_kl_fwd", mutates_args=())
def _cp_attn_kl_fwd(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    group_name: str,
    layout: str,
    comm: str,
    causal: bool,
    scale1: float,
    scale2: float,
    heads_per_step: int,
    backend: str | None,
    grad_flags: list[bool],
    reduction: str,
    verify: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The local rows' (kl, lse1, lse2) over the whole sequence. `verify`: run the cross-rank
    checks here (a compiled call, whose Python wrapper ran at trace time)."""
    group = _group_by_name(group_name)
    if verify:
        _agree(
            group,
            lambda: _check_local(
                group,
                q1,
                k1,
                q2,
                k2,
                causal,
                layout,
                comm,
                scale1,
                scale2,
                reduction,
                heads_per_step,
                None,
                None,
                backend,
                grad_flags,
            ),
            "streamkl.distributed.attn_kl",
        )
    p = _problem(group_name, layout, comm, causal, scale1, scale2, heads_per_step, backend)
    return _forward(q1, k1, q2, k2, p)


@_cp_attn_kl_fwd.register_fake
def _(
    q1,
    k1,
    q2,
    k2,
    group_name,
    layout,
    comm,
    causal,
    scale1,
    scale2,
    heads_per_step,
    backend,
    grad_flags,
    reduction,
    verify,
):
    dtype = _ops.out_dtype(q1, q2)
    return tuple(q1.new_empty(q1.shape[:3], dtype=dtype) for _ in range(3))


@torch.library.custom_op("streamkl::cp_attn_kl_bwd", mutates_args=())
def _cp_attn_kl_bwd(
    grad_kl: Tensor,
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    kl: Tensor,
    lse1: Tensor,
    lse2: Tensor,
    group_name: str,
    layout: str,
    comm: str,
    causal: bool,
    scale1: float,
    scale2: float,
    heads_per_step: int,
    backend: str | None,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq1, dk1, dq2, dk2) of this rank's shards; an unneeded gradient is an empty tensor."""
    p = _problem(group_name, layout, comm, causal, scale1, scale2, heads_per_step, backend)
    grad_kl = grad_kl.to(kl.dtype)
    return _backward(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, p, needs)


@_cp_attn_kl_bwd.register_fake
def _(
    grad_kl,
    q1,
    k1,
    q2,
    k2,
    kl,
    lse1,
    lse2,
    group_name,
    layout,
    comm,
    causal,
    scale1,
    scale2,
    heads_per_step,
    backend,
    needs,
):
    return tuple(t.new_empty(t.shape if need else (0,)) for t, need in zip((q1, k1, q2, k2), needs))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, *options = inputs
    kl, lse1, lse2 = output
    ctx.save_for_backward(q1, k1, q2, k2, kl, lse1, lse2)
    ctx.options = options[:8]  # group_name .. backend
    ctx.mark_non_differentiable(lse1, lse2)


def _cp_backward(ctx, grad_kl, grad_lse1, grad_lse2):
    q1, k1, q2, k2, kl, lse1, lse2 = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    grads = _cp_attn_kl_bwd(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *ctx.options, needs)
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 11


_cp_attn_kl_fwd.register_autograd(_cp_backward, setup_context=_setup_context)


@torch.library.custom_op("streamkl::cp_sum", mutates_args=())
def _cp_sum(x: Tensor, group_name: str) -> Tensor:
    """The sum of `x` over the ranks of the group (an all-reduce), the same on every rank."""
    out = x.clone()
    group = _group_by_name(group_name)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


@_cp_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x)


# --- the public call ------------------------------------------------------------------------


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
    group = _resolve_group(group)
    grad_flags = [
        torch.is_grad_enabled() and isinstance(t, Tensor) and t.requires_grad for t in (q1, k1, q2, k2)
    ]
    args = (causal, layout, comm, scale1, scale2, reduction, heads_per_step, cu_seqlens, max_seqlen, backend)

    def local():
        return _check_local(group, q1, k1, q2, k2, *args, grad_flags)

    if torch.compiler.is_compiling():
        # checks that need no communication run at trace time; the cross-rank ones at run time
        options, verify = local()[0], True
    else:
        options, verify = _agree(group, local, "streamkl.distributed.attn_kl"), False
    kl, _, _ = _cp_attn_kl_fwd(
        q1,
        k1,
        q2,
        k2,
        group.group_name,
        layout,
        comm,
        causal,
        options.scale1,
        options.scale2,
        options.heads_per_step,
        backend,
        grad_flags,
        reduction,
        verify,
    )
    if reduction == "none":
        return kl
    local_sum = kl.sum()
    # the global value, bit-identical on every rank; its gradient reaches this rank's rows only,
    # since every rank's backward starts from the same global loss (docs/distributed.md, Reductions)
    total = _cp_sum(local_sum.detach(), group.group_name) + (local_sum - local_sum.detach())
    if reduction == "sum":
        return total
    rows = kl.shape[0] * kl.shape[1] * kl.shape[2] * options.world  # causal: every row sees its own key
    return total / max(rows, 1)
