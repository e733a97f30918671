"""Cross-rank validation (docs/distributed.md, Errors): every rank checks its own arguments, then
one exchange of the outcomes makes any rank's error, or any metadata that differs between ranks,
raise the same error on every rank before any data collective.

    agree            the exchange, for any op's local checks
    check_comm, check_unpacked, check_shard_lengths, check_group_device
                     the context-parallel rules every op shares
    check_attn_kl    one rank's checks of an attn_kl call: its spec (built and validated by
                     streamkl._checks) plus the context-parallel options; selects the backend
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import NamedTuple

import torch.distributed as dist

from .. import _checks, _dispatch, _env
from .._spec import AttnKLInputs, AttnKLSpec
from ._comm import COMMS, all_gather_bytes
from ._layout import check_layout, chunks_per_rank

_ERROR_TYPES = {kind.__name__: kind for kind in (ValueError, TypeError, RuntimeError, NotImplementedError)}

_MISMATCH_HINTS = {
    "local sequence length": "; every rank holds an equal shard of the sequence",
    "requires_grad": "; every rank runs the same backward, so the same inputs must require grad",
}


def agree(group, local: Callable[[], tuple], what: str):
    """Runs the local checks on every rank, then one exchange of their outcome (an error or a
    small dict of metadata): any rank's error, or any metadata that differs between ranks,
    raises the same error on every rank, before any data collective. Returns what `local`
    returned besides the metadata."""
    try:
        result, meta = local()
        error = None
    except Exception as exc:  # travels to the other ranks, which would otherwise wait forever
        meta, error, raised = None, (type(exc).__name__, str(exc)), exc
    outcomes = _exchange(group, {"meta": meta, "error": error})
    for rank, outcome in enumerate(outcomes):
        if outcome["error"] is not None:
            kind_name, message = outcome["error"]
            exc = _ERROR_TYPES.get(kind_name, RuntimeError)(f"{what}: rank {rank} of the group: {message}")
            if error is not None:
                raise exc from raised
            raise exc
    for key in outcomes[0]["meta"]:
        values = [outcome["meta"][key] for outcome in outcomes]
        if any(value != values[0] for value in values):
            listing = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
            hint = _MISMATCH_HINTS.get(key, "")
            raise ValueError(f"{what}: {key} differs across ranks ({listing}){hint}")
    return result


def _exchange(group, outcome: dict) -> list[dict]:
    """Every rank's outcome, by rank, as JSON in a byte tensor (lists read back as tuples, floats
    exactly: JSON writes their shortest round-trip form)."""
    world = dist.get_world_size(group)
    payload = json.dumps(outcome).encode()
    return [json.loads(data, object_hook=_tuples) for data in all_gather_bytes(payload, group, world)]


def _tuples(obj: dict) -> dict:
    return {key: _as_tuple(value) for key, value in obj.items()}


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def check_comm(comm) -> None:
    if not isinstance(comm, str):
        raise TypeError(f"comm must be a str, one of {COMMS}; got {type(comm).__name__}")
    if comm not in COMMS:
        raise ValueError(f"comm must be one of {COMMS}, got {comm!r}")


def check_unpacked(cu_seqlens, max_seqlen) -> None:
    if cu_seqlens is not None or max_seqlen is not None:
        raise ValueError(
            "cu_seqlens / max_seqlen: packed sequences are not supported with context parallelism "
            "yet (docs/distributed.md, What is supported); pass one sequence per batch entry"
        )


def check_shard_lengths(layout: str, nq: int, nk: int) -> None:
    """Queries and keys cover the same tokens, cut into the layout's equal chunks."""
    if nk != nq:
        raise ValueError(
            f"the keys hold {nk} tokens but the queries {nq}: with context parallelism each rank "
            "passes the same token range of queries and keys"
        )
    per_rank = chunks_per_rank(layout)
    if nq % per_rank != 0:
        raise ValueError(
            f"layout={layout!r} stores {per_rank} equal chunks per rank; the local length "
            f"{nq} is not a multiple of {per_rank}"
        )


def check_group_device(group, device_type: str) -> None:
    if dist.get_backend(group) == "nccl" and device_type != "cuda":
        raise ValueError(
            f"the group's backend is nccl, which needs CUDA tensors; the inputs are on {device_type}"
        )


class Options(NamedTuple):
    """The context-parallel options of a call, as its caller passed them."""

    layout: str
    comm: str
    heads_per_step: int | None
    reduction: str
    backend: str | None
    requires_grad: tuple[bool, ...]


class Checked(NamedTuple):
    """A validated call: its spec, the query heads per pass over the keys, the backend that runs
    every block: its name (STREAMKL_BACKEND resolved) and, where the call runs now rather than
    being traced, its implementation."""

    spec: AttnKLSpec
    heads_per_step: int
    backend: str
    impl: object | None


def check_attn_kl(group, spec: AttnKLSpec, inputs: AttnKLInputs, options: Options, *, run: bool):
    """Everything one rank can check alone of an attn_kl call whose spec streamkl._checks built;
    raises ValueError/TypeError naming the argument. Returns (Checked, the metadata every rank
    must share). `run`: the inputs are real tensors about to run (not traced), so the backend
    is selected here, once for every block: a block is a slice of the local call (the same
    dtypes and device, strides of the same alignment), so a backend that runs the call runs it."""
    check_layout(options.layout)
    check_comm(options.comm)
    _checks.check_reduction(options.reduction)
    check_shard_lengths(options.layout, spec.nq, spec.nk)
    unit = math.lcm(spec.group1, spec.group2)
    heads_per_step = options.heads_per_step
    if heads_per_step is None:
        heads_per_step = spec.heads
    elif isinstance(heads_per_step, bool) or not isinstance(heads_per_step, int):
        raise TypeError(f"heads_per_step must be an int or None, got {type(heads_per_step).__name__}")
    elif heads_per_step < 1 or heads_per_step % unit != 0:
        raise ValueError(
            f"heads_per_step must be a positive multiple of {unit} (the query heads that share "
            f"a key head of k1 and of k2), got {heads_per_step}"
        )
    name = _dispatch.check_name(options.backend)
    impl = None
    device_type = inputs.q1.device.type
    if run:
        _env.check_all()
        impl = _dispatch.select("attn_kl", spec, inputs, name)  # a named backend that cannot run raises
        check_group_device(group, device_type)
    tensors = dict(zip(("q1", "k1", "q2", "k2"), inputs))
    meta = {
        "local sequence length": spec.nq,
        **{f"{arg} shape": tuple(t.shape) for arg, t in tensors.items()},
        "dtypes": tuple(str(t.dtype) for t in tensors.values()),
        "device type": device_type,
        "causal": spec.causal,
        "layout": options.layout,
        "comm": options.comm,
        "scale1": spec.scale1,
        "scale2": spec.scale2,
        "reduction": options.reduction,
        "heads_per_step": heads_per_step,
        "requires_grad": tuple(options.requires_grad),
    }
    return Checked(spec, min(heads_per_step, spec.heads), name, impl), meta
