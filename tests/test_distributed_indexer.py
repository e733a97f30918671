"""streamkl.distributed.indexer_kl (docs/distributed.md, indexer_kl) on gloo CPU process groups of
2, 3 and 4 ranks: every rank's KL and its dqi, dki, dw against the single-process (packed) op on
the full sequence in float64, both named layouts, causal and not, dense and sparse (topk of global
positions), MQA / GQA / MHA teachers, lse given and computed, the three reductions, some gradients
only, subgroups, a group of one rank, empty shards; positions= against the named layouts, packed
documents (cu_seqlens of the whole sequence) inside and across shards, shards of different
lengths (one empty), group= as a DeviceMesh, every qkv_format; torch.compile, one validation and
one backend selection per call, and bad input raising the same error on every rank. Beside them, in one
process: the statistics of disjoint key sets merge exactly (the merge docs/distributed.md states).

Each world size is spawned once and runs all of its cases (as tests/test_distributed.py does);
every spawn has a deadline, so a deadlock fails the tests instead of hanging CI.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import math
import os
import queue as queue_module
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import streamkl
from streamkl import _checks, _dispatch
from streamkl import distributed as cp
from streamkl._spec import IndexerKLInputs
from streamkl.distributed import _plan
from streamkl.reference import indexer_kl as reference

from .indexer_oracle import Expected, dense_indexer_kl, make_indexer_inputs, random_topk

DEADLINE_S = 120.0
COLLECTIVE_TIMEOUT_S = 30.0
RTOL = 1e-7  # float64; the blocks are the single-process op's own computation on a slice

TEACHERS = {"mqa": 1, "gqa": 2, "mha": 4}  # key heads of a 4-head teacher


# --- what the worker processes run ----------------------------------------------------------


def _relative_error(got, want) -> float:
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _assert_close(got, want, what):
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    err = _relative_error(got, want)
    assert err <= RTOL, f"{what}: relative error {err:.3e} > {RTOL:.0e}"


def _problem(world, *, teacher, sparse, given_lse, causal, seed, chunk=3, strides="bhnd"):
    """The full sequence (identical on every rank), N = 2 * world * chunk tokens so both layouts
    cut it: (q, k, qi, ki, w), the call's lse / topk, and an upstream gradient for the rows."""
    n = 2 * world * chunk
    inputs = make_indexer_inputs(b=2, h=4, hk=TEACHERS[teacher], g=3, nq=n, nk=n, d=8, di=6,
                                 dtype=torch.float64, layout=strides, seed=seed, std=1.5)  # fmt: skip
    call = {"causal": causal, "scale": 0.4}
    if sparse:
        call["topk"] = random_topk(2, n, n, 5, seed=seed + 2)
        call["topk"][0, n - 1] = -1  # a row whose set is padding only: no key, outside the mean
    if given_lse:
        call["lse"] = dense_indexer_kl(*inputs, **call)[1]
    upstream = torch.randn(2, n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return inputs, call, upstream


def _single_process(inputs, call, upstream, needs, reduction):
    q, k, *students = inputs
    leaves = [t.detach().clone().requires_grad_(need) for t, need in zip(students, needs)]
    out = streamkl.indexer_kl(q, k, *leaves, **call, reduction=reduction, backend="reference")
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(torch.autograd.grad(out, wanted, upstream if reduction == "none" else None))
    return out.detach(), [next(grads) if need else None for need in needs]


def _shard_call(call, layout, group):
    """lse (B, H, N) by its rows; topk (B, N, K) by its rows, its values (global positions) kept."""
    local = dict(call)
    if call.get("lse") is not None:
        local["lse"] = cp.shard(call["lse"], layout, group)
    if call.get("topk") is not None:
        local["topk"] = cp.shard(call["topk"], layout, group, dim=1)
    return local


def case_against_single(
    rank,
    world,
    *,
    layout,
    causal,
    teacher,
    sparse,
    given_lse,
    reduction,
    needs=(True, True, True),
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
    inputs, call, upstream = _problem(
        group_world, teacher=teacher, sparse=sparse, given_lse=given_lse, causal=causal, seed=seed,
        strides=strides,
    )  # fmt: skip
    want, want_grads = _single_process(inputs, call, upstream, needs, reduction)
    q, k, qi, ki, w = (cp.shard(t, layout, group) for t in inputs)
    if teacher == "mqa":  # the 3-D keys (B, N, D) of MLA's absorbed key and of the indexer
        k, ki = k[:, 0], ki[:, 0]
    students = [t.detach().requires_grad_(need) for t, need in zip((qi, ki, w), needs)]
    local_call = _shard_call(call, layout, group)
    got = cp.indexer_kl(q, k, *students, **local_call, group=group, layout=layout, reduction=reduction,
                        backend="reference")  # fmt: skip
    # every collective runs before any check, so a failing check leaves no rank waiting
    if reduction == "none":
        got.backward(cp.shard(upstream, layout, group, dim=1))
        want = cp.shard(want, layout, group, dim=1)
    else:
        got.backward()
        values = [None] * group_world
        dist.all_gather_object(values, got.item(), group=group)
        assert len(set(values)) == 1, f"{reduction} differs across ranks: {values}"
    _assert_close(got, want, f"kl ({reduction})")
    for name, t, want_grad in zip(("dqi", "dki", "dw"), students, want_grads):
        if want_grad is None:
            assert t.grad is None, f"{name} was not requested"
            continue
        # every student tensor has its sequence on dim 2 in the single-process call's 4-D form
        want_shard = cp.shard(want_grad, layout, group).reshape(t.shape)
        assert t.grad.dtype == t.dtype, (name, t.grad.dtype)
        _assert_close(t.grad, want_shard, name)


def case_accuracy_rule(rank, world, *, dtype, layout, backend=None):
    """16-bit and float32 shards held to the project's rule against the float64 oracle
    (tests/indexer_oracle.py), on the unsharded result and gradients: a rank's blocks round dki
    to the input dtype once each before the float32 sum across ranks."""
    inputs = make_indexer_inputs(b=1, h=4, hk=1, g=3, nq=8 * world, nk=8 * world, d=16, di=8, dtype=dtype,
                                 seed=5)  # fmt: skip
    call = {"causal": True, "topk": random_topk(1, 8 * world, 8 * world, 6, seed=6)}
    upstream = torch.randn(1, 8 * world, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    expected = Expected(inputs, grad=upstream, **call)
    q, k, *students = (cp.shard(t, layout) for t in inputs)
    students = [t.requires_grad_() for t in students]
    local_call = _shard_call(call, layout, None)
    kl = cp.indexer_kl(q, k, *students, **local_call, layout=layout, reduction="none", backend=backend)
    kl.backward(cp.shard(upstream, layout, dim=1).to(kl.dtype))
    expected.check_kl(cp.unshard(kl, layout, dim=1))
    expected.check_grads([cp.unshard(t.grad, layout) for t in students], inputs)


def case_group_of_one(rank, world, *, layout, causal, sparse):
    """A group of one rank is the plain op on the local (full) sequence, bit for bit."""
    groups = [dist.new_group([r]) for r in range(world)]
    inputs, call, upstream = _problem(1, teacher="gqa", sparse=sparse, given_lse=False, causal=causal,
                                      seed=10 + rank)  # fmt: skip
    want, want_grads = _single_process(inputs, call, upstream, (True,) * 3, "none")
    q, k, *students = (t.detach().clone() for t in inputs)
    students = [t.requires_grad_() for t in students]
    got = cp.indexer_kl(q, k, *students, **call, group=groups[rank], layout=layout, reduction="none",
                        backend="reference")  # fmt: skip
    got.backward(upstream)
    assert torch.equal(got, want)
    for t, want_grad in zip(students, want_grads):
        assert torch.equal(t.grad, want_grad)


def case_empty_shards(rank, world):
    """Shards of length 0: an empty result, zero gradients, a mean of 0."""
    q, k, *students = make_indexer_inputs(b=1, h=4, hk=2, nq=0, nk=0, dtype=torch.float64)
    students = [t.requires_grad_() for t in students]
    got = cp.indexer_kl(q, k, *students, reduction="mean")
    got.backward()
    assert got.item() == 0.0
    assert all(t.grad is not None and t.grad.shape == t.shape for t in students)


def case_one_validation_per_call(rank, world):
    """A call is validated, its spec built and its backend selected once, however many blocks it
    runs: every block calls the selected backend directly, forward and backward."""
    counts = collections.Counter()
    patched = [
        (_checks, "indexer_kl_spec"),
        (_checks, "indexer_kl_spec_of_saved"),
        (_dispatch, "select"),
        (reference, "forward"),
        (reference, "backward"),
    ]
    originals = [getattr(module, name) for module, name in patched]

    def counting(name, function):
        def counted(*args, **kwargs):
            counts[name] += 1
            return function(*args, **kwargs)

        return counted

    inputs, call, _ = _problem(world, teacher="mha", sparse=True, given_lse=False, causal=True, seed=4)
    q, k, *students = (cp.shard(t, "zigzag") for t in inputs)
    students = [t.requires_grad_() for t in students]
    try:
        for (module, name), function in zip(patched, originals):
            setattr(module, name, counting(name, function))
        kl = cp.indexer_kl(q, k, *students, **_shard_call(call, "zigzag", None), backend="reference")
        kl.backward()
    finally:
        for (module, name), function in zip(patched, originals):
            setattr(module, name, function)
    assert counts["indexer_kl_spec"] + counts["indexer_kl_spec_of_saved"] == 1, counts
    assert counts["select"] == 1, counts
    # one backend call per call of the all-gather plan, the same forward and backward; rank 0's
    # chunks 0 and 2P-1 need two (against the first chunk, and against the whole sequence)
    assert counts["forward"] == counts["backward"] >= 1, counts
    assert rank != 0 or counts["forward"] == 2, counts


def case_compiled(rank, world, *, compiler):
    """torch.compile(fullgraph=True) traces a loss that calls indexer_kl with positions and packed
    documents; compiled and eager agree. The cross-rank checks run inside the op at run time:
    shards that do not add up to cu_seqlens raise on every rank, and so does a max_seqlen shorter
    than the longest document, as in eager."""
    torch._dynamo.reset()
    n = 6 * world
    cu = _documents(n)
    inputs, call, _ = _packed_problem(n, sparse=True, given_lse=True, causal=True, cu_seqlens=cu, seed=3)
    positions = torch.tensor(_cuts(world, n, seed=3)["zigzag"][rank])
    q, k, *students = (t.index_select(2, positions) for t in inputs)
    students = [t.requires_grad_() for t in students]

    def loss(q, k, qi, ki, w, lse, topk, positions, max_seqlen=None):
        kl = cp.indexer_kl(q, k, qi * 1.5, ki, w, lse=lse, topk=topk, scale=0.4, positions=positions,
                           cu_seqlens=cu, max_seqlen=max_seqlen, backend="reference")  # fmt: skip
        return kl * 2.0

    lse, topk = call["lse"].index_select(2, positions), call["topk"].index_select(1, positions)
    tensors = (q, k, *students, lse, topk, positions)
    compiled = torch.compile(loss, fullgraph=True, backend=compiler)
    got = compiled(*tensors)
    got.backward()
    got_grads = [t.grad for t in students]
    for t in students:
        t.grad = None
    want = loss(*tensors)
    want.backward()
    length = 4 if rank == 0 else 6
    uneven = [t.detach()[:, :, :length] for t in tensors[:6]] + [None, positions[:length]]
    with _raises(ValueError, f"cu_seqlens ends at {n}, but the ranks' shards hold"):
        compiled(*uneven)
    with _raises(ValueError, "max_seqlen must be an int of at least the longest document"):
        compiled(*tensors, max_seqlen=1)
    _assert_close(got, want, "compiled loss")
    for g, t in zip(got_grads, students):
        _assert_close(g, t.grad, "compiled grad")


# --- positions, documents, unequal shards, formats, meshes ------------------------------------

# Each kind of tensor stored as a qkv_format lays it out, and back to the canonical order: the
# format's axes less those a tensor lacks (docs/distributed.md, indexer_kl). "heads": q, qi and
# 4-D keys (B, H, N, D); "per_head": w, lse (B, G, N); "tokens": topk and headless keys (B, N, K);
# "rows": the KL (B, N).
_FORMATS = {
    "bhsd": {kind: (lambda t: t, lambda t: t) for kind in ("heads", "per_head", "tokens", "rows")},
    "bshd": {
        "heads": (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2)),
        "per_head": (lambda t: t.transpose(1, 2), lambda t: t.transpose(1, 2)),
        "tokens": (lambda t: t, lambda t: t),
        "rows": (lambda t: t, lambda t: t),
    },
    "sbhd": {
        "heads": (lambda t: t.permute(2, 0, 1, 3), lambda t: t.permute(1, 2, 0, 3)),
        "per_head": (lambda t: t.permute(2, 0, 1), lambda t: t.permute(1, 2, 0)),
        "tokens": (lambda t: t.transpose(0, 1), lambda t: t.transpose(0, 1)),
        "rows": (lambda t: t.transpose(0, 1), lambda t: t.transpose(0, 1)),
    },
    "thd": {
        "heads": (lambda t: t[0].transpose(0, 1), lambda t: t.transpose(0, 1).unsqueeze(0)),
        "per_head": (lambda t: t[0].transpose(0, 1), lambda t: t.transpose(0, 1).unsqueeze(0)),
        "tokens": (lambda t: t[0], lambda t: t.unsqueeze(0)),
        "rows": (lambda t: t[0], lambda t: t.unsqueeze(0)),
    },
}


def _documents(n: int) -> torch.Tensor:
    """Documents of the whole sequence (n >= 12): [0, 2) inside the first shard of every cut
    here, an empty one, [2, 7) and [7, n) crossing shards."""
    return torch.tensor([0, 2, 2, 7, n], dtype=torch.int32)


def _packed_problem(n, *, b=1, teacher="mqa", sparse, given_lse, causal, cu_seqlens, seed):
    """Full-sequence inputs of n tokens (identical on every rank), the single-process call
    (cu_seqlens, topk of global positions: each row's own position first, so every row that
    keeps it sees a key, then random positions anywhere, other documents' included) and an
    upstream gradient for the rows."""
    inputs = make_indexer_inputs(b=b, h=4, hk=TEACHERS[teacher], g=3, nq=n, nk=n, d=8, di=6,
                                 dtype=torch.float64, seed=seed, std=1.5)  # fmt: skip
    call = {"causal": causal, "scale": 0.4, "cu_seqlens": cu_seqlens}
    if sparse:
        topk = random_topk(b, n, n, 5, seed=seed + 2)
        topk[:, :, 0] = torch.arange(n)
        topk[0, n - 1] = -1  # a row whose set is padding only: no key, outside the mean
        call["topk"] = topk
    if given_lse:
        call["lse"] = dense_indexer_kl(*inputs, **call)[1]
    upstream = torch.randn(b, n, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return inputs, call, upstream


def _check_cut(
    group, problem, positions_by_rank, *, layout=None, pass_positions=True, qkv_format="bhsd",
    headless=False, reduction="none", needs=(True, True, True), what="",
):  # fmt: skip
    """indexer_kl on this rank's tokens at positions_by_rank[rank] (any layout, any lengths),
    stored as qkv_format lays them out, against the single-process (packed) op: the local rows'
    KL and the gradients of `needs`, at RTOL; a reduction the same on every rank. `group` as
    the call takes it (a ProcessGroup, a DeviceMesh, (mesh, name) or None)."""
    inputs, call, upstream = problem
    resolved = cp._comm.resolve_group(group)
    index = torch.tensor(positions_by_rank[dist.get_rank(resolved)], dtype=torch.int64)
    want, want_grads = _single_process(inputs, call, upstream, needs, reduction)
    to, back = {k: v[0] for k, v in _FORMATS[qkv_format].items()}, _FORMATS[qkv_format]
    q, k, qi, ki, w = (t.detach().index_select(2, index) for t in inputs)
    key_kind = "heads"
    if headless:  # the keys of one head as (B, N, D), the format's axes less H
        k, ki, key_kind = k[:, 0], ki[:, 0], "tokens"
    kinds = ("heads", key_kind, "heads", key_kind, "per_head")
    stored = [to[kind](t).contiguous() for kind, t in zip(kinds, (q, k, qi, ki, w))]
    students = [t.requires_grad_(need) for t, need in zip(stored[2:], needs)]
    local = {}
    if call.get("lse") is not None:
        local["lse"] = to["per_head"](call["lse"].index_select(2, index)).contiguous()
    if call.get("topk") is not None:  # its rows, its values (global positions) untouched
        local["topk"] = to["tokens"](call["topk"].index_select(1, index)).contiguous()
    got = cp.indexer_kl(
        *stored[:2], *students, **local, group=group, causal=call["causal"], scale=call["scale"],
        cu_seqlens=call.get("cu_seqlens"), layout=layout, positions=index if pass_positions else None,
        qkv_format=qkv_format, reduction=reduction, backend="reference",
    )  # fmt: skip
    # every collective runs before any check, so a failing check leaves no rank waiting
    if reduction == "none":
        got.backward(to["rows"](upstream.index_select(1, index)))
        got, want = back["rows"][1](got), want.index_select(1, index)
    else:
        got.backward()
        values = [None] * dist.get_world_size(resolved)
        dist.all_gather_object(values, got.item(), group=resolved)
        assert len(set(values)) == 1, f"{what}: {reduction} differs across ranks: {values}"
    _assert_close(got, want, f"kl ({what})")
    for name, t, kind, want_grad in zip(("dqi", "dki", "dw"), students, kinds[2:], want_grads):
        if want_grad is None:
            assert t.grad is None, f"{name} was not requested ({what})"
            continue
        assert t.grad.dtype == t.dtype, (name, t.grad.dtype)
        want_shard = want_grad.index_select(2, index)
        _assert_close(back[kind][1](t.grad).reshape(want_shard.shape), want_shard, f"{name} ({what})")


def _cuts(world: int, n: int, seed: int) -> dict:
    """Every rank's positions under the cuts the tests run: zigzag, contiguous, and a random
    permutation cut into shards of different lengths, the second one empty."""
    c = n // (2 * world)
    zigzag = [
        [*range(r * c, (r + 1) * c), *range((2 * world - 1 - r) * c, (2 * world - r) * c)]
        for r in range(world)
    ]
    size = n // world
    contiguous = [list(range(r * size, (r + 1) * size)) for r in range(world)]
    lengths = [5, 0, n - 5 - 3 * (world - 3)] + [3] * (world - 3) if world > 2 else [n, 0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    starts = list(itertools.accumulate([0, *lengths]))
    permutation = [perm[starts[r] : starts[r + 1]] for r in range(world)]
    return {"zigzag": zigzag, "contiguous": contiguous, "permutation": permutation}


def case_positions_and_documents(rank, world):
    """positions= of zigzag and contiguous cuts equal to layout= by name; packed documents of
    the whole sequence (one inside a shard, one empty, two crossing shards) under zigzag,
    contiguous and per-rank positions; a random permutation in shards of different lengths, one
    empty; the uneven contiguous cut by name. Dense and sparse, causal and not, lse given and
    computed, the three reductions, every gradient or some: all against the single-process op."""
    n = 6 * world
    cu = _documents(n)
    cuts = _cuts(world, n, seed=30 + world)
    # (cut, by name, documents, causal, sparse): every cut dense and sparse, packed and not
    combos = [
        ("zigzag", True, None, True, False),
        ("zigzag", False, None, True, True),
        ("contiguous", True, None, False, True),
        ("contiguous", False, None, True, False),
        ("zigzag", False, cu, True, True),
        ("zigzag", True, cu, False, False),
        ("contiguous", True, cu, True, False),
        ("contiguous", False, cu, False, True),
        ("permutation", False, None, False, False),
        ("permutation", False, cu, True, True),
    ]
    reductions = ["none", "mean", "sum"]
    needs = [(True, True, True), (False, True, False), (True, False, True)]
    for i, (cut, named, docs, causal, sparse) in enumerate(combos):
        what = f"{cut} {'by name' if named else 'positions'} {'packed' if docs is not None else ''} {i=}"
        problem = _packed_problem(n, teacher=list(TEACHERS)[i % 3], sparse=sparse, given_lse=i % 2 == 1,
                                  causal=causal, cu_seqlens=docs, seed=40 + i)  # fmt: skip
        _check_cut(
            None, problem, cuts[cut], layout=cut if named else None, pass_positions=not named,
            headless=i % 3 == 0, reduction=reductions[i % 3], needs=needs[(i // 3) % 3], what=what,
        )  # fmt: skip
    # torch.chunk's contiguous cut of a length the ranks do not divide: shards of different lengths
    n = 4 * world + 1
    size = -(-n // world)
    uneven = [list(range(min(r * size, n), min((r + 1) * size, n))) for r in range(world)]
    for causal, sparse in ((True, True), (False, False)):
        problem = _packed_problem(n, sparse=sparse, given_lse=False, causal=causal, cu_seqlens=None, seed=50)
        _check_cut(None, problem, uneven, layout="contiguous", pass_positions=False, what="uneven contiguous")


def case_qkv_formats(rank, world):
    """qkv_format "bshd", "sbhd" and "thd" for every tensor (w, lse without D; topk and headless
    keys without H; the KL (B, N) as the format orders it), stored contiguously in that format."""
    n = 6 * world
    cuts = _cuts(world, n, seed=60)
    cu = _documents(n)
    # (format, batch, documents, cut, by name, headless keys, sparse, lse given, reduction)
    combos = [
        ("bshd", 2, None, "zigzag", True, False, True, False, "none"),
        ("sbhd", 2, None, "contiguous", False, True, False, True, "none"),
        ("sbhd", 2, None, "zigzag", True, False, True, True, "mean"),
        ("thd", 1, cu, "permutation", False, True, True, False, "none"),
        ("thd", 1, cu, "zigzag", False, False, False, True, "none"),
    ]
    for i, (fmt, b, docs, cut, named, headless, sparse, given_lse, reduction) in enumerate(combos):
        problem = _packed_problem(n, b=b, teacher="mqa" if headless else "gqa", sparse=sparse,
                                  given_lse=given_lse, causal=True, cu_seqlens=docs, seed=70 + i)  # fmt: skip
        _check_cut(
            None, problem, cuts[cut], layout=cut if named else None, pass_positions=not named,
            qkv_format=fmt, headless=headless, reduction=reduction, what=f"{fmt} {cut} {i=}",
        )  # fmt: skip


def case_device_mesh(rank, world):
    """group= as a 1-D DeviceMesh, and (world 4) as (mesh, "cp") of a 2-D mesh: two sequences,
    each on its own two ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    meshes = [(init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)), 0)]
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        meshes.append(((mesh2, "cp"), mesh2.get_local_rank("dp")))
    for group, dp in meshes:
        size = dist.get_world_size(cp._comm.resolve_group(group))
        n = 6 * size
        problem = _packed_problem(n, sparse=True, given_lse=False, causal=True, cu_seqlens=_documents(n),
                                  seed=80 + dp)  # fmt: skip
        _check_cut(group, problem, _cuts(size, n, seed=81)["permutation"], what=f"mesh {dp=}")


def case_rule_packed(rank, world, *, backend):
    """float32 shards of packed documents at positions of a permutation cut (one shard empty),
    sparse and causal, held to the project's rule against the float64 packed oracle: the blocks'
    keys start inside the gathered sequence (key_start > 0), which every backend must read at
    that offset, and topk's positions in other documents must become padding."""
    n = 8 * world
    cu = torch.tensor([0, 3, 3, 11, n], dtype=torch.int32)
    inputs = make_indexer_inputs(b=1, h=4, hk=1, g=3, nq=n, nk=n, d=16, di=8, dtype=torch.float32, seed=9)
    topk = random_topk(1, n, n, 6, seed=10)
    topk[:, :, 0] = torch.arange(n)
    call = {"causal": True, "topk": topk, "cu_seqlens": cu}
    upstream = torch.randn(1, n, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    expected = Expected(inputs, grad=upstream, **call)
    positions = torch.tensor(_cuts(world, n, seed=12)["permutation"][rank], dtype=torch.int64)
    q, k, *students = (t.index_select(2, positions) for t in inputs)
    students = [t.requires_grad_() for t in students]
    kl = cp.indexer_kl(q, k, *students, causal=True, topk=topk.index_select(1, positions), cu_seqlens=cu,
                       positions=positions, reduction="none", backend=backend)  # fmt: skip
    kl.backward(upstream.index_select(1, positions).to(kl.dtype))
    expected.check_kl(cp.unshard(kl, dim=1, positions=positions))
    expected.check_grads([cp.unshard(t.grad, positions=positions) for t in students], inputs)


def _good_shards(n_local=6):
    q, k, qi, ki, w = make_indexer_inputs(b=1, h=4, hk=2, nq=n_local, nk=n_local, dtype=torch.float64, seed=1)
    return dict(q=q, k=k, qi=qi, ki=ki, w=w)


# Bad input: (what one or every rank passes, the expected error type, a fragment of its message).
# Every rank must raise, before any data moves, and the group must stay usable afterwards.
BAD_INPUTS = {
    "unequal_lengths": (ValueError, "local sequence length differs across ranks"),
    "odd_zigzag_length": (ValueError, "not a multiple of 2"),
    "teacher_heads_differ": (ValueError, "k shape differs across ranks"),
    "lse_on_one_rank": (ValueError, "lse shape differs across ranks"),
    "topk_width_differs": (ValueError, "topk shape differs across ranks"),
    "topk_past_the_sequence": (ValueError, "topk holds key positions in the whole sequence"),
    "dtype_differs": (ValueError, "dtypes differs across ranks"),
    "causal_differs": (ValueError, "causal differs across ranks"),
    "scale_differs": (ValueError, "scale differs across ranks"),
    "requires_grad_differs": (ValueError, "requires_grad differs across ranks"),
    "unknown_layout": (ValueError, "layout must be one of"),
    "layout_not_str": (TypeError, "layout must be a str"),
    "cu_seqlens_of_a_shard": (cp.LayoutError, "cu_seqlens ends at 6, but the ranks' shards hold"),
    "max_seqlen_short": (ValueError, "max_seqlen must be an int of at least the longest document"),
    "document_not_split": (cp.LayoutError, "document 0 of cu_seqlens ([0, 3)) has 3 tokens"),
    "positions_twice": (cp.LayoutError, "is held more than once"),
    "positions_contradict_layout": (cp.LayoutError, "positions contradict layout='zigzag'"),
    "positions_wrong_length": (ValueError, "positions must be 1-D (N_local,) = (6,)"),
    "positions_on_one_rank": (ValueError, "positions given differs across ranks"),
    "topk_below_padding_on_one_rank": (ValueError, "topk holds the index -2"),
    "dtensor": (TypeError, "is a DTensor; streamkl.distributed.indexer_kl takes this rank's shard"),
    "mesh_2d": (ValueError, "does not say which dimension"),
    "unknown_qkv_format": (ValueError, "qkv_format must be one of"),
    "w_not_in_format_on_one_rank": (ValueError, "w must be 3-D (bsh) under qkv_format='bshd'"),
    "qkv_format_differs": (ValueError, "qkv_format differs across ranks"),
    "w_shape_on_one_rank": (ValueError, "w must be (B, G, Sq)"),
    "device_type_differs": (ValueError, "device type differs across ranks"),
    "queries_and_keys_differ": (ValueError, "same token range of queries and keys"),
    "unknown_backend": (ValueError, "is not a backend"),
    "unknown_reduction": (ValueError, "reduction must be one of"),
}


def case_bad_input(rank, world, *, which):
    kind, fragment = BAD_INPUTS[which]
    args = _good_shards()
    kw = {"backend": "reference"}
    n = 6 * world
    if which == "unequal_lengths":
        args = _good_shards(6 if rank == 0 else 4)
    elif which == "odd_zigzag_length":
        args = _good_shards(5)
    elif which == "teacher_heads_differ" and rank == world - 1:
        args["k"] = args["k"][:, :1]
    elif which == "lse_on_one_rank" and rank == 0:
        kw["lse"] = torch.zeros(1, 4, 6, dtype=torch.float64)
    elif which == "topk_width_differs":
        kw["topk"] = torch.zeros(1, 6, 2 + (rank == 0), dtype=torch.int64)
    elif which == "topk_past_the_sequence":
        kw["topk"] = torch.full((1, 6, 2), n - 1 + (rank == world - 1), dtype=torch.int64)
    elif which == "dtype_differs" and rank == 0:
        args["qi"], args["ki"] = args["qi"].float(), args["ki"].float()
    elif which == "causal_differs":
        kw["causal"] = rank == 0
    elif which == "scale_differs":
        kw["scale"] = 0.5 + rank
    elif which == "requires_grad_differs" and rank == 1:
        args["w"] = args["w"].requires_grad_()
    elif which == "unknown_layout":
        kw["layout"] = "striped"
    elif which == "layout_not_str":
        kw["layout"] = 2
    elif which == "cu_seqlens_of_a_shard":
        kw["cu_seqlens"] = torch.tensor([0, 6], dtype=torch.int32)
    elif which == "max_seqlen_short":
        kw["cu_seqlens"], kw["max_seqlen"] = torch.tensor([0, n], dtype=torch.int32), 2
    elif which == "document_not_split":
        kw["layout"] = "zigzag-per-document"
        kw["cu_seqlens"] = torch.tensor([0, 3, n], dtype=torch.int32)
    elif which == "positions_twice":  # every rank claims the first tokens
        kw["positions"] = torch.arange(6)
    elif which == "positions_contradict_layout":
        kw["layout"], kw["positions"] = "zigzag", torch.arange(6) + 6 * rank
    elif which == "positions_wrong_length":
        kw["positions"] = torch.arange(5)
    elif which == "positions_on_one_rank" and rank == 0:
        kw["positions"] = torch.arange(6)
    elif which == "topk_below_padding_on_one_rank":
        kw["topk"] = torch.full((1, 6, 2), -1 - (rank == 0), dtype=torch.int64)
    elif which == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        args["qi"] = distribute_tensor(args["qi"], init_device_mesh("cpu", (world,)), [Replicate()])
    elif which == "mesh_2d":
        from torch.distributed.device_mesh import init_device_mesh

        kw["group"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    elif which == "unknown_qkv_format":
        kw["qkv_format"] = "bnhd"
    elif which in ("w_not_in_format_on_one_rank", "qkv_format_differs"):
        if rank == 0 or which == "w_not_in_format_on_one_rank":  # (B, N, heads, D), (B, N, G)
            kw["qkv_format"] = "bshd"
            args = {name: t.transpose(1, 2) for name, t in args.items()}
        if rank == 0 and which == "w_not_in_format_on_one_rank":
            args["w"] = args["w"][:, :, 0]
    elif which == "w_shape_on_one_rank" and rank == 0:
        args["w"] = args["w"][:, :2]
    elif which == "device_type_differs" and rank == 0:
        args = {name: t.to("meta") for name, t in args.items()}
    elif which == "queries_and_keys_differ":
        args["k"], args["ki"] = args["k"][:, :, :4], args["ki"][:, :, :4]
    elif which == "unknown_backend":
        kw["backend"] = "fastest"
    elif which == "unknown_reduction":
        kw["reduction"] = "max"
    with _raises(kind, fragment):
        cp.indexer_kl(*args.values(), **kw)
    # nothing was left in flight: the group still works
    ok = cp.indexer_kl(*_good_shards().values(), reduction="sum", backend="reference")
    assert math.isfinite(ok.item())


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
        return True


def _worker(rank, world, init_file, cases, results):
    """Runs `cases` in order and reports each outcome, then ("<done>", rank, error or None) once
    its group is destroyed."""
    try:
        torch.set_num_threads(1)  # up to 4 processes share the CI machine's cores
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
    os._exit(0)  # past gloo's teardown, which at times aborts a finished process (test_distributed)


# --- the cases, by world size -----------------------------------------------------------------


def _cases(world: int) -> list[tuple[str, str, dict]]:
    cases = []
    combos = [
        (layout, causal, sparse)
        for layout in ("zigzag", "contiguous")
        for causal in (True, False)
        for sparse in (False, True)
    ]
    # teachers, lse given or not, reductions, requested gradients and storages rotate through them
    teachers = list(TEACHERS)
    reductions = ["none", "sum", "mean"]
    needs = [(True, True, True), (False, True, False), (True, False, True)]
    for i, (layout, causal, sparse) in enumerate(combos):
        k = i + world
        kwargs = dict(
            layout=layout,
            causal=causal,
            sparse=sparse,
            teacher=teachers[k % 3],
            given_lse=bool(k % 2),
            reduction=reductions[(i + 2 * world) % 3],
            needs=needs[(k // 2) % 3],
            strides="bnhd" if k % 4 == 1 else "bhnd",
            seed=i,
        )
        name = f"{layout}-{'causal' if causal else 'full'}-{'sparse' if sparse else 'dense'}"
        cases.append((f"{name}-{kwargs['teacher']}-{kwargs['reduction']}", "case_against_single", kwargs))
    cases.append(("positions-and-documents", "case_positions_and_documents", {}))
    if world in (2, 3):
        cases.append(("qkv-formats", "case_qkv_formats", {}))
    if world in (2, 4):  # 4: a 2-D mesh's "cp" dimension too
        cases.append(("device-mesh", "case_device_mesh", {}))
    if world == 3:
        cases.append(("rule-packed-float32", "case_rule_packed", dict(backend="reference")))
    for which in BAD_INPUTS:
        cases.append((f"bad-{which}", "case_bad_input", dict(which=which)))
    if world == 2:
        for sparse in (False, True):
            kwargs = dict(layout="zigzag", causal=True, sparse=sparse)
            cases.append((f"group-of-one-{'sparse' if sparse else 'dense'}", "case_group_of_one", kwargs))
        cases.append(("empty-shards", "case_empty_shards", {}))
        cases.append(("one-validation", "case_one_validation_per_call", {}))
        cases.append(("compiled-aot_eager", "case_compiled", dict(compiler="aot_eager")))
        if TRITON_ON_CPU:  # any backend runs the blocks: triton too, under its interpreter
            kwargs = dict(dtype=torch.float32, layout="zigzag", backend="triton")
            cases.append(("rule-triton-float32-zigzag", "case_accuracy_rule", kwargs))
            cases.append(("rule-triton-float32-packed", "case_rule_packed", dict(backend="triton")))
    for dtype in (torch.bfloat16, torch.float32):
        layout = "zigzag" if world % 2 else "contiguous"
        kwargs = dict(dtype=dtype, layout=layout)
        cases.append((f"rule-{str(dtype)[6:]}-{layout}", "case_accuracy_rule", kwargs))
    if world == 4:  # two groups of two, interleaved: ranks of a subgroup are not global ranks
        kwargs = dict(layout="zigzag", causal=True, sparse=True, teacher="mqa", given_lse=False,
                      reduction="mean", subgroups=[[0, 2], [1, 3]])  # fmt: skip
        cases.append(("subgroups", "case_against_single", kwargs))
    return cases


def _triton_on_cpu() -> bool:
    """Whether triton runs indexer_kl on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1
    without a GPU; the spawned processes inherit it)."""
    q, k, qi, ki, w = make_indexer_inputs(dtype=torch.float32)
    spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=None, topk=None, causal=True, scale=None)
    return _dispatch.why_not("triton", "indexer_kl", spec, IndexerKLInputs(q, k, qi, ki, w)) is None


TRITON_ON_CPU = _triton_on_cpu()
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


# --- in one process ----------------------------------------------------------------------------


@pytest.mark.parametrize("given_lse", [False, True], ids=["lse-computed", "lse-given"])
def test_disjoint_key_sets_merge_exactly(given_lse):
    """The per-row state of two disjoint key sets, each computed with the teacher's lse over the
    union, merges into the union's exactly with attn_kl's merge (_plan.merge_into), log T in the
    teacher's log-sum-exp's place (docs/distributed.md, indexer_kl): the merge a split of one row's
    keys over several calls would need. The all-gather form never splits a row's keys."""
    q, k, qi, ki, w = inputs = make_indexer_inputs(b=2, h=4, hk=2, nq=10, nk=10, dtype=torch.float64,
                                                   seed=7, std=2.0)  # fmt: skip
    lse = dense_indexer_kl(*inputs, causal=True)[1] if given_lse else None
    everything = torch.arange(10).expand(2, 10, 10)
    parts = [torch.where(everything % 3 == r, everything, -1) for r in range(3)]

    def stats(topk, teacher_lse):
        spec = _checks.indexer_kl_spec(q, k, qi, ki, w, lse=teacher_lse, topk=topk, causal=True, scale=0.5)
        return reference.forward(spec, IndexerKLInputs(q, k, qi, ki, w, teacher_lse, topk))

    whole = stats(None, lse)
    kl = torch.zeros(2, 10, dtype=torch.float64)
    log_mass, lse2 = torch.full_like(kl, -math.inf), torch.full_like(kl, -math.inf)
    for topk in parts:
        part = stats(topk, whole.lse)  # the teacher's lse over every admitted key of the row
        _plan.merge_into(kl, log_mass, lse2, part.kl, part.mass.log(), part.lse2)
    torch.testing.assert_close(kl, whole.kl, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(lse2, whole.lse2, rtol=1e-13, atol=0)
    torch.testing.assert_close(log_mass.exp(), whole.mass, rtol=1e-13, atol=0)
