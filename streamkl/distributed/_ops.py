"""The context-parallel ops of attn_kl: streamkl::cp_attn_kl_fwd / cp_attn_kl_bwd (their bodies
run the blocks and do the communication), streamkl::cp_sum (the all-reduce of a reduction), their
fake functions and autograd, and the forward and backward runners over the plan's blocks. Every
block of work is a call of torch.ops.streamkl.attn_kl_fwd / attn_kl_bwd, so any backend runs it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# importing the package (streamkl/__init__.py) registers torch.ops.streamkl.attn_kl_fwd / attn_kl_bwd
from .. import _ops
from ._comm import TAG_DK, group_by_name, p2p, reduce_scatter, ring
from ._layout import chunks_of, chunks_per_rank, owners
from ._plan import HeadStep, gathered_steps, head_steps, merge_into, plan
from ._validate import agree, check_local

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
    return chunks_of(p.layout, p.rank, p.world)


def _key_blocks(p: _Problem, k1, k2, step_list) -> Iterator[tuple[HeadStep, tuple[int, ...], Tensor, Tensor]]:
    """(head step, global chunks the block holds, k1 block, k2 block) for every block of keys this
    rank's queries meet: the whole sequence once per head step (all-gather), or each rank's shard
    in turn (ring)."""
    if p.comm == "allgather":
        every_chunk = tuple(range(p.world * chunks_per_rank(p.layout)))
        for gathered in gathered_steps(k1, k2, step_list, p.group, p.layout, p.world):
            yield gathered.step, every_chunk, gathered.k1, gathered.k2
        return
    for step in step_list:
        for source, (key1, key2) in ring([k1[:, step.k1], k2[:, step.k2]], p.group, p.rank, p.world):
            yield step, chunks_of(p.layout, source, p.world), key1, key2


def _forward(q1, k1, q2, k2, p: _Problem):
    b, h, n, _ = q1.shape
    dtype = _ops.out_dtype(q1, q2)
    kl = torch.zeros(b, h, n, dtype=dtype, device=q1.device)
    lse1 = torch.full_like(kl, -math.inf)
    lse2 = torch.full_like(kl, -math.inf)
    if kl.numel() == 0:
        return kl, lse1, lse2
    chunk = n // chunks_per_rank(p.layout)
    steps = head_steps(h, k1.shape[1], k2.shape[1], p.heads_per_step)
    for step, key_chunks, key1, key2 in _key_blocks(p, k1, k2, steps):
        for call in plan(_local_chunks(p), key_chunks, chunk, p.causal):
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
            merge_into(*state, *part)
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
        steps = head_steps(q1.shape[1], k1.shape[1], k2.shape[1], p.heads_per_step)
        if p.comm == "allgather":
            _backward_allgather(grad, q1, k1, q2, k2, kl, lse1, lse2, p, needs, grads, steps)
        else:
            _backward_ring(grad, q1, k1, q2, k2, kl, lse1, lse2, p, needs, grads, steps)
    return tuple(g.to(t.dtype) if g is not None else t.new_empty(0) for g, t in zip(grads, inputs))


def _accumulate_dq(grads, parts, step, call) -> None:
    for i in (0, 2):
        if grads[i] is not None:
            grads[i][:, step.q, call.rows] += parts[i]


def _key_heads(step: HeadStep, i: int) -> slice:
    """The key heads of gradient `i` (1: dk1, 3: dk2) in head step `step`."""
    return step.k1 if i == 1 else step.k2


def _backward_allgather(grad, q1, k1, q2, k2, kl, lse1, lse2, p: _Problem, needs, grads, steps):
    n = q1.shape[2]
    chunk = n // chunks_per_rank(p.layout)
    owner = owners(p.layout, p.world)
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
        for call in plan(_local_chunks(p), key_chunks, chunk, p.causal):
            parts = _block_backward(grad, q1, q2, kl, lse1, lse2, key1, key2, step, call, p, needs)
            _accumulate_dq(grads, parts, step, call)
            for i, buffer in by_owner.items():
                for c in range(call.keys // chunk):
                    rank, slot = owner[key_chunks[c]]
                    buffer[rank, :, :, slot * chunk : (slot + 1) * chunk] += parts[i][
                        :, :, c * chunk : (c + 1) * chunk
                    ]
        _finish_reduce_scatters(in_flight, grads)
        in_flight = [
            (reduce_scatter(buffer, p.group, p.world), i, _key_heads(step, i), buffer)
            for i, buffer in by_owner.items()
        ]
        del by_owner, keys
    _finish_reduce_scatters(in_flight, grads)


def _finish_reduce_scatters(in_flight, grads) -> None:
    for (request, out), i, heads, _ in in_flight:
        if request is not None:
            request.wait()
        grads[i][:, heads] += out


def _backward_ring(grad, q1, k1, q2, k2, kl, lse1, lse2, p: _Problem, needs, grads, steps):
    chunk = q1.shape[2] // chunks_per_rank(p.layout)
    wanted = [i for i in (1, 3) if needs[i]]
    for step in steps:
        requests, sent, arriving = [], [], []
        for _, key_chunks, key1, key2 in _key_blocks(p, k1, k2, [step]):
            keys = {1: key1, 3: key2}
            partial = [
                torch.zeros(keys[i].shape, dtype=grads[i].dtype, device=keys[i].device) for i in wanted
            ]
            for call in plan(_local_chunks(p), key_chunks, chunk, p.causal):
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
            requests = p2p(sent, arriving, p.group, p.rank, p.world, TAG_DK)
        for request in requests:
            request.wait()
        del sent
        # after `world` hops the partials of this rank's own keys are home, summed over all ranks
        for arrived, i in zip(arriving, wanted):
            grads[i][:, _key_heads(step, i)] += arrived


# --- the registered ops -----------------------------------------------------------------------


def _problem(group_name, layout, comm, causal, scale1, scale2, heads_per_step, backend) -> _Problem:
    group = group_by_name(group_name)
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


@torch.library.custom_op("streamkl::cp_attn_kl_fwd", mutates_args=())
def cp_attn_kl_fwd(
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
    group = group_by_name(group_name)
    if verify:
        agree(
            group,
            lambda: check_local(
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


@cp_attn_kl_fwd.register_fake
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
def cp_attn_kl_bwd(
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


@cp_attn_kl_bwd.register_fake
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
    grads = cp_attn_kl_bwd(grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *ctx.options, needs)
    return (*(g if need else None for g, need in zip(grads, needs)),) + (None,) * 11


cp_attn_kl_fwd.register_autograd(_cp_backward, setup_context=_setup_context)


@torch.library.custom_op("streamkl::cp_sum", mutates_args=())
def cp_sum(x: Tensor, group_name: str) -> Tensor:
    """The sum of `x` over the ranks of the group (an all-reduce), the same on every rank."""
    out = x.clone()
    group = group_by_name(group_name)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


@cp_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x)
