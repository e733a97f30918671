"""Context parallelism (streamkl.distributed, docs/distributed.md) on gloo CPU process groups of
2, 3 and 4 ranks: the forward and all four gradients of every rank's shard against the
single-process op on the full sequence, both layouts and both communication forms, causal and
not, GQA, D1 != D2, reductions, subgroups, a group of one rank, torch.compile, one validation
and one backend selection per call however many blocks it runs, and bad input raising the same
error on every rank.

Each world size is spawned once: its processes run every case of that size in turn and report
each outcome through a queue, so one test per case reads its outcome. Every spawn has a deadline,
so a deadlock fails the tests instead of hanging CI.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import math
import os
import queue as queue_module
import subprocess
import sys
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import streamkl
from streamkl import _checks, _dispatch
from streamkl import distributed as cp
from streamkl.distributed import _plan
from streamkl.reference import attn_kl as reference_attn_kl
from streamkl.testing import make_inputs

from .tolerance import Expected

DEADLINE_S = 120.0
COLLECTIVE_TIMEOUT_S = 30.0

# The merge is exact math: measured at ~2e-15 of the largest value. With a gloo group up,
# repeats of one identical float64 CPU computation have been seen to differ by up to 2e-9,
# so the bar stays above that noise.
RTOL_FLOAT64 = 1e-7
RTOL_FLOAT32 = 1e-5


# --- what the worker processes run ----------------------------------------------------------


def _relative_error(got, want) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _assert_close(got, want, rtol, what):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    err = _relative_error(got, want)
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def _problem(world, *, hk1, hk2, dtype, seed, chunk=3, layout="bhnd"):
    """Full-sequence inputs (identical on every rank) with N = 2 * world * chunk tokens, so both
    layouts split it, and an upstream gradient for the rows."""
    n = 2 * world * chunk
    inputs = make_inputs(
        b=2, h=4, nq=n, nk=n, d1=8, d2=6, hk1=hk1, hk2=hk2, dtype=dtype, seed=seed, layout=layout
    )
    upstream = torch.randn(2, 4, n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return inputs, upstream


def _single_process(inputs, upstream, needs, causal, reduction):
    """The plain op on the full sequence: its result and the gradients of `needs`."""
    leaves = [t.detach().clone().requires_grad_(need) for t, need in zip(inputs, needs)]
    out = streamkl.attn_kl(*leaves, causal=causal, reduction=reduction, backend="reference")
    wanted = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(out, wanted, upstream.to(out.dtype) if reduction == "none" else None)
    grads = iter(grads)
    return out.detach(), [next(grads) if need else None for need in needs]


def case_against_single(
    rank,
    world,
    *,
    layout,
    comm,
    causal,
    hk1,
    hk2,
    reduction="none",
    heads_per_step=None,
    needs=(True, True, True, True),
    dtype=torch.float64,
    strides="bhnd",
    subgroups=None,
    seed=0,
):
    """Every rank's shard of the result and of each requested gradient equals the single-process
    op's on the full sequence; a reduction gives the same value on every rank."""
    group, group_world = None, world
    if subgroups is not None:  # every rank creates every subgroup, in the same order
        made = [dist.new_group(ranks) for ranks in subgroups]
        mine = next(i for i, ranks in enumerate(subgroups) if rank in ranks)
        group, group_world = made[mine], len(subgroups[mine])
        seed += mine
    inputs, upstream = _problem(group_world, hk1=hk1, hk2=hk2, dtype=dtype, seed=seed, layout=strides)
    want, want_grads = _single_process(inputs, upstream, needs, causal, reduction)
    local = [cp.shard(t, layout, group).detach().requires_grad_(need) for t, need in zip(inputs, needs)]
    got = cp.attn_kl(
        *local,
        group=group,
        causal=causal,
        layout=layout,
        comm=comm,
        reduction=reduction,
        heads_per_step=heads_per_step,
        backend="reference",
    )
    # every collective runs before any check, so a failing check leaves no rank waiting
    if reduction == "none":
        got.backward(cp.shard(upstream, layout, group).to(got.dtype))
        want = cp.shard(want, layout, group)
    else:
        got.backward()
        values = [None] * group_world
        dist.all_gather_object(values, got.item(), group=group)
        assert len(set(values)) == 1, f"{reduction} differs across ranks: {values}"
    rtol = RTOL_FLOAT64 if dtype == torch.float64 else RTOL_FLOAT32
    _assert_close(got, want, rtol, f"kl ({reduction})")
    for name, t, want_grad in zip(("dq1", "dk1", "dq2", "dk2"), local, want_grads):
        if want_grad is None:
            assert t.grad is None, f"{name} was not requested"
            continue
        assert t.grad.dtype == t.dtype, (name, t.grad.dtype)
        _assert_close(t.grad, cp.shard(want_grad, layout, group), rtol, name)


def case_accuracy_rule(rank, world, *, dtype, comm, layout, causal, backend="reference"):
    """16-bit and float32 shards held to the project's rule against the float64 oracle
    (tests/tolerance.py, docs/contract.md, Numerics), on the unsharded result and gradients."""
    inputs = make_inputs(
        b=1, h=4, nq=8 * world, nk=8 * world, d1=16, d2=32, hk1=2, hk2=1, dtype=dtype, seed=5
    )
    upstream = torch.randn(1, 4, 8 * world, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    expected = Expected(inputs, causal=causal, grad=upstream)
    local = [cp.shard(t, layout).requires_grad_() for t in inputs]
    kl = cp.attn_kl(*local, causal=causal, layout=layout, comm=comm, backend=backend)
    kl.backward(cp.shard(upstream, layout).to(kl.dtype))
    full_kl = cp.unshard(kl, layout)
    full_grads = [cp.unshard(t.grad, layout) for t in local]
    expected.check_kl(full_kl)
    expected.check_grads(full_grads, inputs)


def case_rule_packed(rank, world, *, comm, backend):
    """Per-document zigzag shards of packed documents, float32, held to the project's rule against
    the float64 packed oracle: the blocks' keys start inside the gathered sequence or a shard
    (key_start > 0), which every backend must read at that offset."""
    cu = _documents(world)
    n = int(cu[-1])
    inputs = make_inputs(b=1, h=4, nq=n, nk=n, d1=16, d2=32, hk1=2, hk2=1, dtype=torch.float32, seed=7)
    upstream = torch.randn(1, 4, n, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    expected = Expected(inputs, causal=True, cu_seqlens=cu, grad=upstream)
    pairs = [cp.shard_and_positions(t, "zigzag-per-document", cu_seqlens=cu) for t in inputs]
    positions = pairs[0][1]
    local = [shard.detach().requires_grad_() for shard, _ in pairs]
    kl = cp.attn_kl(*local, causal=True, positions=positions, cu_seqlens=cu, comm=comm, backend=backend)
    kl.backward(upstream.index_select(2, positions).to(kl.dtype))
    expected.check_kl(cp.unshard(kl, positions=positions))
    expected.check_grads([cp.unshard(t.grad, positions=positions) for t in local], inputs)


def case_group_of_one(rank, world, *, layout, comm, causal):
    """A group of one rank is the plain op on the local (full) sequence, bit for bit."""
    groups = [dist.new_group([r]) for r in range(world)]
    inputs, upstream = _problem(1, hk1=2, hk2=1, dtype=torch.float64, seed=10 + rank)
    want, want_grads = _single_process(inputs, upstream, (True,) * 4, causal, "none")
    local = [t.detach().clone().requires_grad_() for t in inputs]
    got = cp.attn_kl(*local, group=groups[rank], causal=causal, layout=layout, comm=comm, backend="reference")
    got.backward(upstream)
    assert torch.equal(got, want)
    for t, want_grad in zip(local, want_grads):
        assert torch.equal(t.grad, want_grad)


def case_empty_shards(rank, world, *, comm):
    """Shards of length 0: an empty result, zero gradients, a mean of 0."""
    local = [t.requires_grad_() for t in make_inputs(h=4, nq=0, nk=0, d1=8, d2=6, hk1=2, dtype=torch.float64)]
    got = cp.attn_kl(*local, causal=True, comm=comm, reduction="mean")
    got.backward()
    assert got.item() == 0.0
    assert all(t.grad is not None and t.grad.shape == t.shape for t in local)


def case_one_validation_per_call(rank, world, *, comm):
    """A call is validated, its spec built and its backend selected once, however many blocks it
    runs: every block calls the selected backend directly, forward and backward."""
    counts = collections.Counter()
    patched = [
        (_checks, "attn_kl_spec"),
        (_checks, "attn_kl_spec_of_saved"),
        (_dispatch, "select"),
        (reference_attn_kl, "forward"),
        (reference_attn_kl, "backward"),
    ]
    originals = [getattr(module, name) for module, name in patched]

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return counted

    inputs, _ = _problem(world, hk1=4, hk2=4, dtype=torch.float64, seed=4)
    local = [cp.shard(t, "zigzag").requires_grad_() for t in inputs]
    try:
        for (module, name), function in zip(patched, originals):
            setattr(module, name, counting(name, function))
        kl = cp.attn_kl(*local, causal=True, comm=comm, heads_per_step=2, backend="reference")
        kl.sum().backward()
    finally:
        for (module, name), function in zip(patched, originals):
            setattr(module, name, function)
    assert counts["attn_kl_spec"] + counts["attn_kl_spec_of_saved"] == 1, counts
    assert counts["select"] == 1, counts
    assert counts["forward"] > 1 and counts["backward"] == counts["forward"], counts


def case_shard_round_trip(rank, world, *, layout):
    x = torch.arange(2 * 3 * 4 * world * 5, dtype=torch.float32).reshape(2, 3, 4 * world, 5)
    local = cp.shard(x, layout)
    assert local.shape == (2, 3, 4, 5)
    assert torch.equal(cp.unshard(local, layout), x)
    assert torch.equal(cp.unshard(cp.shard(x.mT, layout, dim=3), layout, dim=-1), x.mT)
    if layout == "zigzag":  # rank r holds chunks r and 2P-1-r of 2P
        chunks = x.chunk(2 * world, dim=2)
        assert torch.equal(local, torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], 2))


def case_compiled(rank, world, *, comm, compiler):
    """torch.compile(fullgraph=True) traces a loss that calls attn_kl; compiled and eager agree.
    The cross-rank checks run inside the op at run time: shards of unequal length raise on every
    rank."""
    torch._dynamo.reset()
    inputs, _ = _problem(world, hk1=2, hk2=4, dtype=torch.float64, seed=3)
    local = [cp.shard(t, "zigzag").requires_grad_() for t in inputs]

    def loss(q1, k1, q2, k2):
        kl = cp.attn_kl(q1, k1, q2 * 1.5, k2, causal=True, comm=comm, reduction="mean", backend="reference")
        return kl * 2.0

    compiled = torch.compile(loss, fullgraph=True, backend=compiler)
    got = compiled(*local)
    got.backward()
    got_grads = [t.grad for t in local]
    for t in local:
        t.grad = None
    want = loss(*local)
    want.backward()
    uneven = [t.detach()[:, :, : 4 if rank == 0 else 6] for t in local]
    with _raises(ValueError, "local sequence length differs across ranks"):
        compiled(*uneven)
    _assert_close(got, want, RTOL_FLOAT64, "compiled loss")
    for g, t in zip(got_grads, local):
        _assert_close(g, t.grad, RTOL_FLOAT64, "compiled grad")


def _documents(world, per_doc_chunks=(1, 3, 2)) -> torch.Tensor:
    """Offsets of documents of 2P, 6P and 4P tokens: every one splits per-document zigzag."""
    lengths = [2 * world * c for c in per_doc_chunks]
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _packed_problem(n, *, seed, dtype=torch.float64, strides="bhnd"):
    inputs = make_inputs(
        b=1, h=4, nq=n, nk=n, d1=8, d2=6, hk1=4, hk2=2, dtype=dtype, seed=seed, layout=strides
    )
    upstream = torch.randn(1, 4, n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return inputs, upstream


def _single_packed(inputs, upstream, causal, cu_seqlens):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = streamkl.attn_kl(*leaves, causal=causal, cu_seqlens=cu_seqlens, backend="reference")
    return out.detach(), torch.autograd.grad(out, leaves, upstream.to(out.dtype))


def _check_positions_call(
    group, inputs, upstream, positions_by_rank, *, causal, comm, cu_seqlens, layout=None, pass_positions=True,
    heads_per_step=None, what="",
):  # fmt: skip
    """attn_kl on this rank's tokens at positions_by_rank[rank] (any layout, any lengths) against
    the single-process (packed) op: the local rows' KL and all four gradients, at 1e-7 relative."""
    rank = dist.get_rank(group)
    mine = positions_by_rank[rank]
    index = torch.tensor(mine, dtype=torch.int64)
    want, want_grads = _single_packed(inputs, upstream, causal, cu_seqlens)
    local = [t.detach().index_select(2, index).requires_grad_() for t in inputs]
    got = cp.attn_kl(
        *local,
        group=group,
        causal=causal,
        layout=layout,
        positions=index if pass_positions else None,
        cu_seqlens=cu_seqlens,
        comm=comm,
        heads_per_step=heads_per_step,
        backend="reference",
    )
    got.backward(upstream.index_select(2, index).to(got.dtype))
    _assert_close(got, want.index_select(2, index), RTOL_FLOAT64, f"kl {what}")
    for name, t, want_grad in zip(("dq1", "dk1", "dq2", "dk2"), local, want_grads):
        _assert_close(t.grad, want_grad.index_select(2, index), RTOL_FLOAT64, f"{name} {what}")


def case_framework_layouts(rank, world, *, comm):
    """Every framework's cut (shard_and_positions) with and without documents, causal and not,
    through positions= and, for the named layouts, through layout= alone: equal to the
    single-process op (packed where documents are given)."""
    cu = _documents(world)
    n = int(cu[-1])
    inputs, upstream = _packed_problem(n, seed=20)
    k = 0
    for layout in ("contiguous", "zigzag", "zigzag-per-document", "ptrr"):
        for causal in (True, False):
            for docs in (None, cu):
                if layout == "zigzag-per-document" and docs is None:
                    continue
                _, positions = cp.shard_and_positions(
                    inputs[0], layout, cu_seqlens=cu, block_size=2, causal=causal
                )
                every = [None] * world
                dist.all_gather_object(every, positions.tolist())
                named = layout != "ptrr" and k % 2 == 0
                _check_positions_call(
                    None, inputs, upstream, every, causal=causal, comm=comm, cu_seqlens=docs,
                    layout=layout if named else None, pass_positions=not named or k % 4 == 0,
                    heads_per_step=2 if k % 3 == 0 else None, what=f"{layout} {causal=} {k=}",
                )  # fmt: skip
                k += 1


def case_unequal_shards(rank, world, *, comm, causal):
    """Shards of different lengths, one of them empty: a random permutation cut unevenly, and the
    contiguous cut of a length P does not divide (torch.chunk's, PyTorch's fallback)."""
    gen = torch.Generator().manual_seed(30 + world)
    lengths = [5, 0, 9, 3][:world]
    lengths[-1] += 2
    n = sum(lengths)
    perm = torch.randperm(n, generator=gen).tolist()
    starts = list(itertools.accumulate([0, *lengths]))
    every = [perm[starts[r] : starts[r + 1]] for r in range(world)]
    cu = torch.tensor([0, 4, 4, n - 3, n], dtype=torch.int32)
    inputs, upstream = _packed_problem(n, seed=31, strides="bnhd")
    for docs in (None, cu):
        _check_positions_call(
            None, inputs, upstream, every, causal=causal, comm=comm, cu_seqlens=docs, what="permutation"
        )
    n = 4 * world + 1
    inputs, upstream = _packed_problem(n, seed=32)
    size = -(-n // world)
    every = [list(range(min(r * size, n), min((r + 1) * size, n))) for r in range(world)]
    _check_positions_call(
        None, inputs, upstream, every, causal=causal, comm=comm, cu_seqlens=None, layout="contiguous",
        pass_positions=False, what="contiguous, uneven",
    )  # fmt: skip
    # shard/unshard round trip of the uneven cut
    x = torch.arange(2 * n, dtype=torch.float32).reshape(1, 2, n)
    local, positions = cp.shard_and_positions(x, "contiguous")
    assert positions.tolist() == every[rank]
    assert torch.equal(cp.unshard(local, "contiguous"), x)
    assert torch.equal(cp.unshard(local, positions=positions), x)


def case_device_mesh(rank, world, *, comm):
    """group= as a 1-D DeviceMesh, and as (mesh, "cp") of a 2-D mesh (two sequences on 4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = [(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), None)]
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        meshes.append(((mesh2, "cp"), mesh2.get_local_rank("dp")))
    for group_arg, dp in meshes:
        group = cp._comm.resolve_group(group_arg)
        size = dist.get_world_size(group)
        inputs, upstream = _packed_problem(4 * size, seed=40 + (dp or 0))
        chunk = 2
        r = dist.get_rank(group)
        index = torch.tensor(
            [*range(r * chunk, (r + 1) * chunk), *range((2 * size - 1 - r) * chunk, (2 * size - r) * chunk)]
        )
        want, want_grads = _single_packed(inputs, upstream, True, None)
        local = [t.detach().index_select(2, index).requires_grad_() for t in inputs]
        got = cp.attn_kl(*local, group=group_arg, causal=True, comm=comm, backend="reference")
        got.backward(upstream.index_select(2, index))
        _assert_close(got, want.index_select(2, index), RTOL_FLOAT64, "kl (mesh)")
        for t, want_grad in zip(local, want_grads):
            _assert_close(t.grad, want_grad.index_select(2, index), RTOL_FLOAT64, "grad (mesh)")


def case_qkv_formats(rank, world, *, comm):
    """qkv_format "bshd" and "sbhd": the same KL (in the inputs' format) and gradients as "bhsd"."""
    inputs, upstream = _packed_problem(4 * world, seed=50)
    local = [cp.shard(t, "zigzag").detach() for t in inputs]
    base = [t.clone().requires_grad_() for t in local]
    want = cp.attn_kl(*base, causal=True, comm=comm, backend="reference")
    want.backward(cp.shard(upstream, "zigzag"))
    for fmt, to, back in (
        ("bshd", lambda t: t.transpose(1, 2).contiguous(), lambda t: t.transpose(1, 2)),
        ("sbhd", lambda t: t.permute(2, 0, 1, 3).contiguous(), lambda t: t.permute(1, 2, 0, 3)),
        ("thd", lambda t: t[0].transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1).unsqueeze(0)),
    ):
        stored = [to(t).requires_grad_() for t in local]
        got = cp.attn_kl(*stored, causal=True, comm=comm, qkv_format=fmt, backend="reference")
        kl_back = back(got.unsqueeze(-1)).squeeze(-1)  # the KL is laid out as a one-dim head
        _assert_close(kl_back, want, RTOL_FLOAT64, f"kl ({fmt})")
        kl_back.backward(cp.shard(upstream, "zigzag"))
        for t, ref in zip(stored, base):
            _assert_close(back(t.grad), ref.grad, RTOL_FLOAT64, f"grad ({fmt})")


def case_compiled_packed(rank, world):
    """torch.compile traces a call with positions and cu_seqlens; its backward (the compiled
    graph's op) exchanges the runs again and matches eager. A max_seqlen shorter than the
    longest document raises inside the op, on every rank, the same ValueError as eager."""
    torch._dynamo.reset()
    cu = _documents(world)
    inputs, _ = _packed_problem(int(cu[-1]), seed=60)
    pairs = [cp.shard_and_positions(t, "zigzag-per-document", cu_seqlens=cu) for t in inputs]
    positions = pairs[0][1]
    local = [p[0].detach().requires_grad_() for p in pairs]

    def loss(q1, k1, q2, k2, max_seqlen=None):
        return cp.attn_kl(
            q1,
            k1,
            q2,
            k2,
            positions=positions,
            cu_seqlens=cu,
            max_seqlen=max_seqlen,
            causal=True,
            reduction="mean",
            backend="reference",
        )

    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(*local)
    got.backward()
    got_grads = [t.grad for t in local]
    for t in local:
        t.grad = None
    want = loss(*local)
    want.backward()
    _assert_close(got, want, RTOL_FLOAT64, "compiled loss")
    for g, t in zip(got_grads, local):
        _assert_close(g, t.grad, RTOL_FLOAT64, "compiled grad")
    fragment = "max_seqlen must be an int of at least the longest document"
    with _raises(ValueError, fragment) as eager:
        loss(*local, max_seqlen=2)
    with _raises(ValueError, fragment) as compiled:
        torch.compile(loss, fullgraph=True, backend="aot_eager")(*local, max_seqlen=2)
    assert str(compiled.raised) == str(eager.raised), (str(compiled.raised), str(eager.raised))


def _good_shards(world, n_local=6):
    return make_inputs(b=1, h=4, nq=n_local, nk=n_local, d1=8, d2=6, hk1=2, dtype=torch.float64, seed=1)


# Bad input: (what one or every rank passes, the expected error type, a fragment of its message).
# Every rank must raise, before any data moves, and the group must stay usable afterwards.
BAD_INPUTS = {
    "unequal_lengths": (ValueError, "local sequence length differs across ranks"),
    "odd_zigzag_length": (ValueError, "not a multiple of 2"),
    "head_dim_differs": (ValueError, "q1 shape differs across ranks"),
    "dtype_differs": (ValueError, "dtypes differs across ranks"),
    "causal_differs": (ValueError, "causal differs across ranks"),
    "requires_grad_differs": (ValueError, "requires_grad differs across ranks"),
    "unknown_layout": (ValueError, "layout must be one of"),
    "layout_not_str": (TypeError, "layout must be a str"),
    "unknown_comm_on_one_rank": (ValueError, "comm must be one of"),
    "cu_seqlens_of_a_shard": (cp.LayoutError, "cu_seqlens ends at 6, but the ranks' shards hold"),
    "positions_twice": (cp.LayoutError, "is held more than once"),
    "positions_gap": (cp.LayoutError, "no rank holds position"),
    "positions_contradict_layout": (cp.LayoutError, "positions contradict layout='zigzag'"),
    "positions_wrong_length": (ValueError, "positions must be 1-D (N_local,) = (6,)"),
    "positions_float": (TypeError, "positions must be int32 or int64"),
    "positions_on_one_rank": (ValueError, "positions given differs across ranks"),
    "document_not_split": (cp.LayoutError, "document 0 of cu_seqlens ([0, 3)) has 3 tokens"),
    "max_seqlen_short": (ValueError, "max_seqlen must be an int of at least the longest document"),
    "dtensor": (TypeError, "is a DTensor; streamkl.distributed.attn_kl takes this rank's shard"),
    "mesh_2d": (ValueError, "does not say which dimension"),
    "mesh_unknown_dim": (ValueError, "the mesh's dimensions are named ('dp', 'cp')"),
    "unknown_qkv_format": (ValueError, "qkv_format must be one of"),
    "k1_not_in_format_on_one_rank": (ValueError, "k1 must be 4-D (bshd) under qkv_format='bshd'"),
    "qkv_format_differs": (ValueError, "qkv_format differs across ranks"),
    "mixed_devices_on_one_rank": (ValueError, "must be on one device"),
    "device_type_differs": (ValueError, "device type differs across ranks"),
    "queries_and_keys_differ": (ValueError, "same token range of queries and keys"),
    "bad_heads_per_step": (ValueError, "heads_per_step must be a positive multiple of 2"),
    "unknown_backend": (ValueError, "is not a backend"),
    "unknown_reduction": (ValueError, "reduction must be one of"),
}


def case_bad_input(rank, world, *, which):
    kind, fragment = BAD_INPUTS[which]
    q1, k1, q2, k2 = _good_shards(world)
    kw = {"causal": True, "backend": "reference"}
    if which == "unequal_lengths":
        q1, k1, q2, k2 = _good_shards(world, n_local=6 if rank == 0 else 4)
    elif which == "odd_zigzag_length":
        q1, k1, q2, k2 = _good_shards(world, n_local=5)
    elif which == "head_dim_differs" and rank == world - 1:
        q1, k1 = q1[..., :4], k1[..., :4]
    elif which == "dtype_differs" and rank == 0:
        q2, k2 = q2.float(), k2.float()
    elif which == "causal_differs":
        kw["causal"] = rank == 0
    elif which == "requires_grad_differs" and rank == 1:
        q2 = q2.requires_grad_()
    elif which == "unknown_layout":
        kw["layout"] = "striped"
    elif which == "layout_not_str":
        kw["layout"] = 2
    elif which == "unknown_comm_on_one_rank" and rank == world - 1:
        kw["comm"] = "all_to_all"
    elif which == "cu_seqlens_of_a_shard":
        kw["cu_seqlens"] = torch.tensor([0, 6], dtype=torch.int32)
    elif which == "positions_twice":  # every rank claims the first tokens
        kw["positions"] = torch.arange(6)
    elif which == "positions_gap":
        kw["positions"] = torch.arange(6) + 6 * rank + (rank == world - 1)
    elif which == "positions_contradict_layout":
        kw["layout"], kw["positions"] = "zigzag", torch.arange(6) + 6 * rank
    elif which == "positions_wrong_length":
        kw["positions"] = torch.arange(5)
    elif which == "positions_float":
        kw["positions"] = torch.arange(6, dtype=torch.float32)
    elif which == "positions_on_one_rank" and rank == 0:
        kw["positions"] = torch.arange(6)
    elif which == "document_not_split":
        kw["layout"] = "zigzag-per-document"
        kw["cu_seqlens"] = torch.tensor([0, 3, 6 * world], dtype=torch.int32)
    elif which == "max_seqlen_short":
        kw["cu_seqlens"], kw["max_seqlen"] = torch.tensor([0, 6 * world], dtype=torch.int32), 2
    elif which == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        q1 = distribute_tensor(q1, mesh, [Replicate()])
    elif which in ("mesh_2d", "mesh_unknown_dim"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
        kw["group"] = mesh if which == "mesh_2d" else (mesh, "sequence")
    elif which == "unknown_qkv_format":
        kw["qkv_format"] = "bnhd"
    elif which in ("k1_not_in_format_on_one_rank", "qkv_format_differs"):
        if rank == 0 or which == "k1_not_in_format_on_one_rank":  # (B, N, H, D)
            kw["qkv_format"] = "bshd"
            q1, k1, q2, k2 = (t.transpose(1, 2) for t in (q1, k1, q2, k2))
        if rank == 0 and which == "k1_not_in_format_on_one_rank":
            k1 = k1[0]
    elif which == "mixed_devices_on_one_rank" and rank == 0:
        k2 = k2.to("meta")
    elif which == "device_type_differs" and rank == 0:
        q1, k1, q2, k2 = (t.to("meta") for t in (q1, k1, q2, k2))
    elif which == "queries_and_keys_differ":
        k1, k2 = k1[:, :, :4], k2[:, :, :4]
    elif which == "bad_heads_per_step":
        kw["heads_per_step"] = 3
    elif which == "unknown_backend":
        kw["backend"] = "fastest"
    elif which == "unknown_reduction":
        kw["reduction"] = "max"
    with _raises(kind, fragment):
        cp.attn_kl(q1, k1, q2, k2, **kw)
    # nothing was left in flight: the group still works
    ok = cp.attn_kl(*_good_shards(world), causal=True, reduction="sum", backend="reference")
    assert math.isfinite(ok.item())


def case_unshard_mismatch(rank, world):
    x = torch.zeros(1, 2 if rank == 0 else 3, 4, 3)
    with _raises(ValueError, "shape differs across ranks"):
        cp.unshard(x, "zigzag")
    with _raises(cp.LayoutError, "local sequence length differs across ranks"):
        cp.unshard(torch.zeros(1, 2, 4 if rank == 0 else 6, 3), "zigzag")


def case_shard_indivisible(rank, world):
    with _raises(ValueError, f"not a multiple of {2 * world}"):
        cp.shard(torch.zeros(1, 2, 2 * world + 1, 3), "zigzag")


class _raises:
    """pytest.raises for the worker processes (which report through the queue)."""

    def __init__(self, kind, fragment):
        self.kind, self.fragment = kind, fragment

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        assert exc_type is not None, (
            f"expected {self.kind.__name__} matching {self.fragment!r}, nothing raised"
        )
        assert issubclass(exc_type, self.kind), (
            f"expected {self.kind.__name__}, got {exc_type.__name__}: {exc}"
        )
        assert self.fragment in str(exc), f"{self.fragment!r} not in {str(exc)!r}"
        self.raised = exc
        return True


def _worker(rank, world, init_file, cases, results):
    """Runs `cases` in order and reports each outcome, then ("<done>", rank, error or None) once
    its group is destroyed."""
    try:
        torch.set_num_threads(1)  # up to 4 processes share the CI machine's cores
        # a collective that waits longer than this raises instead of hanging (a deadlock fails
        # one case, not the whole world size); the spawn's deadline is the last resort
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timeout
        )
        for name, function, kwargs in cases:
            try:
                globals()[function](rank, world, **kwargs)
                results.put((name, rank, None))
            except Exception:
                results.put((name, rank, traceback.format_exc()))
            dist.barrier()  # the next case starts together on every rank
        dist.destroy_process_group()
        results.put(("<done>", rank, None))
    except BaseException:
        results.put(("<done>", rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
    # Leave without the interpreter's teardown: once in a few dozen runs, after every case
    # passed and the group was destroyed, a native thread aborted it (SIGABRT, "terminate called
    # without an active exception"). Every outcome is reported by now.
    os._exit(0)


# --- the cases, by world size -----------------------------------------------------------------


def _cases(world: int) -> list[tuple[str, str, dict]]:
    cases = []
    combos = [
        (layout, comm, causal)
        for layout in ("zigzag", "contiguous")
        for comm in ("allgather", "ring")
        for causal in (True, False)
    ]
    # GQA shapes, reductions, requested gradients and head steps rotate through the combos
    gqa = [(2, 1), (4, 4), (1, 2)]
    reductions = ["none", "sum", "mean"]
    needs = [(True, True, True, True), (False, False, True, True), (True, False, False, True)]
    for i, (layout, comm, causal) in enumerate(combos):
        for j, (hk1, hk2) in enumerate(gqa[:2] if world != 3 else gqa):
            k = i + j
            kwargs = dict(
                layout=layout,
                comm=comm,
                causal=causal,
                hk1=hk1,
                hk2=hk2,
                reduction=reductions[k % 3],
                needs=needs[(k + world) % 3],
                heads_per_step=math.lcm(4 // hk1, 4 // hk2) if (k + world) % 2 else None,
                strides="bnhd" if k % 4 == 1 else "bhnd",
            )
            cases.append(
                (
                    f"{layout}-{comm}-{'causal' if causal else 'full'}-hk{hk1}{hk2}",
                    "case_against_single",
                    kwargs,
                )
            )
    for layout in ("zigzag", "contiguous"):
        cases.append((f"shard-round-trip-{layout}", "case_shard_round_trip", dict(layout=layout)))
    for which in BAD_INPUTS:
        cases.append((f"bad-{which}", "case_bad_input", dict(which=which)))
    cases.append(("bad-unshard-mismatch", "case_unshard_mismatch", {}))
    for i, comm in enumerate(("allgather", "ring")):
        causal = (i + world) % 2 == 0
        cases.append((f"unequal-shards-{comm}", "case_unequal_shards", dict(comm=comm, causal=causal)))
        # every cut through both forms at 2 ranks; one form a size at 3 and 4 keeps CI short
        if world == 2 or comm == ("ring" if world == 3 else "allgather"):
            cases.append((f"framework-layouts-{comm}", "case_framework_layouts", dict(comm=comm)))
        if world == 4 or comm == ("allgather" if world == 2 else "ring"):
            cases.append((f"device-mesh-{comm}", "case_device_mesh", dict(comm=comm)))
    if world == 2:
        cases.append(("compiled-packed", "case_compiled_packed", {}))
        for comm in ("allgather", "ring"):
            cases.append((f"qkv-formats-{comm}", "case_qkv_formats", dict(comm=comm)))
    cases.append(("bad-shard-indivisible", "case_shard_indivisible", {}))
    if world == 2:
        for comm in ("allgather", "ring"):
            cases.append(
                (f"group-of-one-{comm}", "case_group_of_one", dict(layout="zigzag", comm=comm, causal=True))
            )
            cases.append((f"empty-shards-{comm}", "case_empty_shards", dict(comm=comm)))
            cases.append((f"one-validation-{comm}", "case_one_validation_per_call", dict(comm=comm)))
            compiler = "inductor" if comm == "ring" else "aot_eager"
            cases.append((f"compiled-{comm}-{compiler}", "case_compiled", dict(comm=comm, compiler=compiler)))
            cases.append(
                (
                    f"float32-{comm}",
                    "case_against_single",
                    dict(layout="zigzag", comm=comm, causal=True, hk1=2, hk2=1, dtype=torch.float32),
                )
            )
        if TRITON_ON_CPU:  # any backend runs the blocks: triton too, under its interpreter
            for comm in ("allgather", "ring"):
                kwargs = dict(comm=comm, backend="triton")
                cases.append((f"rule-packed-triton-{comm}", "case_rule_packed", kwargs))
                kwargs = dict(dtype=torch.float32, comm=comm, layout="zigzag", causal=True, backend="triton")
                cases.append((f"rule-triton-float32-{comm}", "case_accuracy_rule", kwargs))
        cases.append(
            (
                "group-of-one-contiguous-full",
                "case_group_of_one",
                dict(layout="contiguous", comm="ring", causal=False),
            )
        )
    cases.append(("rule-packed-reference", "case_rule_packed", dict(comm="ring", backend="reference")))
    for dtype in (torch.bfloat16, torch.float32):
        for comm in ("allgather", "ring"):
            kwargs = dict(dtype=dtype, comm=comm, layout="zigzag", causal=True)
            cases.append((f"rule-{str(dtype)[6:]}-{comm}", "case_accuracy_rule", kwargs))
    if world == 4:  # two groups of two, interleaved: ranks of a subgroup are not global ranks
        for comm in ("allgather", "ring"):
            kwargs = dict(layout="zigzag", comm=comm, causal=True, hk1=2, hk2=1, subgroups=[[0, 2], [1, 3]])
            cases.append((f"subgroups-{comm}", "case_against_single", kwargs))
    return cases


# tests/conftest.py sets TRITON_INTERPRET=1 without a GPU; the spawned processes inherit it
TRITON_ON_CPU = streamkl.available_backends(*make_inputs(h=2, nq=4, nk=4, d1=16, d2=16))["triton"] is None
WORLDS = (2, 3, 4)
CASES = [(world, name) for world in WORLDS for name, _, _ in _cases(world)]


def _run_world(world: int, tmp_dir: str) -> dict:
    """Spawns `world` processes running every case of that size; {(case, rank): error or None}.
    Cases a process did not report by the deadline (a deadlock, a crash) come back as errors."""
    context = mp.get_context("spawn")
    results = context.Queue()
    cases = _cases(world)
    init_file = os.path.join(tmp_dir, f"init-{world}")
    processes = [
        context.Process(target=_worker, args=(rank, world, init_file, cases, results))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    outcomes = {}
    deadline = time.monotonic() + DEADLINE_S
    expected = (len(cases) + 1) * world
    while len(outcomes) < expected and time.monotonic() < deadline:
        if not any(p.is_alive() for p in processes) and results.empty():
            break
        try:
            name, rank, error = results.get(timeout=0.5)
        except queue_module.Empty:
            continue
        outcomes[(name, rank)] = error
    for process in processes:
        process.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [p for p in processes if p.is_alive()]
    for process in hung:
        process.kill()
        process.join()
    for name in [name for name, _, _ in cases] + ["<done>"]:
        for rank in range(world):
            if (name, rank) not in outcomes:
                why = "still running at the deadline (a deadlock?)" if hung else "its process exited"
                outcomes[(name, rank)] = f"rank {rank} did not report: {why}"
    exit_codes = [p.exitcode for p in processes]
    if any(code != 0 for code in exit_codes):
        outcomes[("<exit>", -1)] = f"exit codes {exit_codes}"
    return outcomes


@pytest.fixture(scope="module")
def world_outcomes(tmp_path_factory):
    cache = {}

    def outcomes(world):
        if world not in cache:
            cache[world] = _run_world(world, str(tmp_path_factory.mktemp(f"world{world}")))
        return cache[world]

    return outcomes


@pytest.mark.parametrize("world,name", CASES, ids=[f"{w}ranks-{n}" for w, n in CASES])
def test_case(world_outcomes, world, name):
    outcomes = world_outcomes(world)
    errors = [
        f"rank {rank}:\n{error}" for rank in range(world) if (error := outcomes[(name, rank)]) is not None
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("world", WORLDS)
def test_processes_finish(world_outcomes, world):
    """Every process ran all its cases, destroyed its group and exited."""
    outcomes = world_outcomes(world)
    errors = [
        f"rank {rank}:\n{error}" for rank in range(world) if (error := outcomes[("<done>", rank)]) is not None
    ]
    assert not errors, "\n".join(errors)
    assert ("<exit>", -1) not in outcomes, outcomes.get(("<exit>", -1))


# A rank of a 2-rank gloo group in a fresh interpreter where numpy cannot be imported, as after
# the README's install (torch and streamkl, no numpy): a differentiable call under both forms, an
# unshard, and an error agreed across ranks.
WITHOUT_NUMPY = """
import sys

sys.modules["numpy"] = None  # `import numpy` raises ImportError from here on

import datetime
import os

import torch
import torch.distributed as dist

import streamkl
from streamkl import distributed as cp

rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=float(sys.argv[4]))
init = f"file://{init_file}"
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timeout)
gen = torch.Generator().manual_seed(0)
full = [torch.randn(1, 2, 4 * world, 8, generator=gen, dtype=torch.float64) for _ in range(4)]
local = [cp.shard(t).requires_grad_() for t in full]
for comm in ("allgather", "ring"):
    cp.attn_kl(*local, causal=True, comm=comm, reduction="mean").backward()
kl = cp.unshard(cp.attn_kl(*(t.detach() for t in local), causal=True))
torch.testing.assert_close(kl, streamkl.attn_kl(*full, causal=True))
try:
    cp.attn_kl(*local, causal=rank == 0)
except ValueError as exc:
    assert "causal differs across ranks" in str(exc), exc
else:
    raise AssertionError("causal differs across ranks: nothing raised")
dist.destroy_process_group()
print("ok", flush=True)
os._exit(0)  # past gloo's teardown, which at times aborts a finished process (see _worker)
"""


def test_runs_without_numpy(tmp_path):
    """streamkl.distributed needs torch alone: its cross-rank checks exchange tensors, not Python
    objects (torch's object collectives need numpy)."""
    script = tmp_path / "without_numpy.py"
    script.write_text(WITHOUT_NUMPY)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    world = 2
    args = [str(world), str(tmp_path / "init"), str(COLLECTIVE_TIMEOUT_S)]
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + DEADLINE_S
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    for rank, (process, (out, err)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0 and out.strip() == "ok", f"rank {rank}:\n{out}\n{err}"


def test_plan_causal_blocks():
    """The calls that cover a zigzag rank's two chunks (docs/distributed.md, Causal): rank 1 of
    4 holds chunks 1 and 6 of 8."""
    plan = _plan.plan
    call = _plan.Call
    # its own shard: one causal call over both chunks (row i of chunk 6 sees chunk 1 whole)
    assert plan((1, 6), (1, 6), 3, True) == [call(slice(0, 6), 6, True)]
    # rank 0's shard (chunks 0, 7): both query chunks see chunk 0 whole, neither sees chunk 7
    assert plan((1, 6), (0, 7), 3, True) == [call(slice(0, 6), 3, False)]
    # rank 2's shard (chunks 2, 5): only chunk 6 sees it, whole
    assert plan((1, 6), (2, 5), 3, True) == [call(slice(3, 6), 6, False)]
    # the whole sequence (all-gather): chunk 1 against 0..1, chunk 6 against 0..6
    assert plan((1, 6), tuple(range(8)), 3, True) == [call(slice(0, 3), 6, True), call(slice(3, 6), 21, True)]
    assert plan((1, 6), tuple(range(8)), 3, False) == [call(slice(0, 6), 24, False)]


@pytest.mark.parametrize("world", (2, 3, 4))
def test_framework_positions_match_pytorch_balancers(world):
    """shard_and_positions' "zigzag" and "ptrr" cuts are PyTorch's head-tail and PTRR balancers'
    (their indices, cut into P equal shards as context_parallel cuts them), the PTRR one on
    document masks built by flex_attention's create_block_mask, causal and not."""
    balancers = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")
    from torch.nn.attention.flex_attention import create_block_mask

    from streamkl.distributed._layout import framework_positions

    block = 8
    n = 8 * world * block
    per = n // world
    offsets = [0, 2 * block, 7 * block, n]
    document = torch.zeros(n, dtype=torch.long)
    for d, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        document[start:end] = d
    head_tail = balancers._HeadTailLoadBalancer(n, world, "cpu")._generate_indices()[0]
    for causal in (True, False):

        def mask(b, h, q, kv, causal=causal):
            same = document[q] == document[kv]
            return same & (kv <= q) if causal else same

        block_mask = create_block_mask(mask, 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
        ptrr = balancers._PTRRLoadBalancer(block_mask, world)._generate_indices()[0]
        for rank in range(world):
            theirs = ptrr[rank * per : (rank + 1) * per].tolist()
            assert theirs == framework_positions("ptrr", n, rank, world, offsets, block, causal)
            theirs = head_tail[rank * per : (rank + 1) * per].tolist()
            assert theirs == framework_positions("zigzag", n, rank, world, None, block, causal)
