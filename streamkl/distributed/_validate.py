"""Cross-rank validation (docs/distributed.md, Errors): every rank checks its own arguments, then
one all-gather of the outcomes makes any rank's error, or any metadata that differs between
ranks, raise the same error on every rank before any data collective."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import _checks, _dispatch, _env
from ._comm import COMMS
from ._layout import check_layout, chunks_per_rank

_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}

_MISMATCH_HINTS = {
    "local sequence length": "; every rank holds an equal shard of the sequence",
    "requires_grad": "; every rank runs the same backward, so the same inputs must require grad",
}


def agree(group, local: Callable[[], tuple], what: str):
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


def check_comm(comm) -> None:
    if not isinstance(comm, str):
        raise TypeError(f"comm must be a str, one of {COMMS}; got {type(comm).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


class Options(NamedTuple):
    """A validated call's resolved settings."""

    scale1: float
    scale2: float
    heads_per_step: int
    world: int


def check_local(
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
) -> tuple[Options, dict]:
    """Everything one rank can check alone; raises ValueError/TypeError naming the argument."""
    check_layout(layout)
    check_comm(comm)
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
    per_rank = chunks_per_rank(layout)
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
    return Options(s1, s2, min(heads_per_step, problem.heads), dist.get_world_size(group)), meta
