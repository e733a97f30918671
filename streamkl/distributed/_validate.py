"""Cross-rank validation (docs/distributed.md, Errors): every rank checks its own arguments, then
one exchange of the outcomes makes any rank's error, or any metadata that differs between ranks,
raise the same error on every rank before any data collective.

    agree            the exchange, for any op's local checks
    check_local_layout, resolve_layout, agree_on_layout, context_of_saved
                     where the tokens are (layout, positions, documents): one rank's checks,
                     every rank's runs resolved alike after the exchange, the call's plan Context
    check_comm, check_same_tokens, check_group_device
                     the context-parallel rules every op shares
    check_attn_kl    one rank's checks of an attn_kl call: its spec (built and validated by
                     streamkl._checks) plus the context-parallel options; selects the backend
"""

from __future__ import annotations

import hashlib
import json
import math
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _checks, _dispatch, _env
from .._spec import AttnKLInputs, AttnKLSpec
from . import _plan
from ._comm import COMMS, all_gather_bytes
from ._layout import LayoutError, Runs, check_cover, check_layout, host_ints, layout_runs

_ERROR_TYPES = {
    kind.__name__: kind for kind in (ValueError, TypeError, RuntimeError, NotImplementedError, LayoutError)
}

_MISMATCH_HINTS = {
    "requires_grad": "; every rank runs the same backward, so the same inputs must require grad",
}


def agree(group, local: Callable[[], tuple], what: str, *, share: bool = False):
    """Runs the local checks on every rank, then one exchange of their outcome (an error or a
    small dict of metadata): any rank's error, or any metadata that differs between ranks,
    raises the same error on every rank, before any data collective. Returns what `local`
    returned besides the metadata. With `share`, `local` returns (result, metadata, what this
    rank tells the others) and agree returns (result, every rank's share, by rank)."""
    try:
        result, meta, *mine = local()
        error = None
    except Exception as exc:  # travels to the other ranks, which would otherwise wait forever
        meta, mine, error, raised = None, [None], (type(exc).__name__, str(exc)), exc
    outcomes = _exchange(group, {"meta": meta, "error": error, "share": mine[0] if share else None})
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
    if share:
        return result, [outcome["share"] for outcome in outcomes]
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


def check_same_tokens(nq: int, nk: int) -> None:
    """Queries and keys cover the same tokens: a shard holds both of each of its tokens."""
    if nk != nq:
        raise ValueError(
            f"the keys hold {nk} tokens but the queries {nq}: with context parallelism each rank "
            "passes the same token range of queries and keys"
        )


def check_group_device(group, device_type: str) -> None:
    if dist.get_backend(group) == "nccl" and device_type != "cuda":
        raise ValueError(
            f"the group's backend is nccl, which needs CUDA tensors; the inputs are on {device_type}"
        )


class Options(NamedTuple):
    """The context-parallel options of a call, as its caller passed them. layout None: the
    positions' layout, or "zigzag" without positions."""

    layout: str | None
    comm: str
    heads_per_step: int | None
    reduction: str
    backend: str | None
    requires_grad: tuple[bool, ...]
    positions: Tensor | None = None
    cu_seqlens: Tensor | None = None
    max_seqlen: int | None = None


class Checked(NamedTuple):
    """A validated call: its spec, the query heads per pass over the keys, the backend that runs
    every block: its name (STREAMKL_BACKEND resolved) and, where the call runs now rather than
    being traced, its implementation."""

    spec: AttnKLSpec
    heads_per_step: int
    backend: str
    impl: object | None


# --- where the tokens are: layouts, positions, documents -------------------------------------


def runs_of_positions(positions: Tensor) -> Runs:
    """The runs of a positions tensor, found on its device; only the runs' ends are read on the
    host (one sync per tensor, cached until it changes)."""
    if positions.numel() == 0:
        return ()
    jumps = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    firsts = torch.cat([jumps.new_zeros(1), jumps])
    starts = positions[firsts].to(torch.int64)
    ends = torch.cat([jumps, jumps.new_full((1,), positions.numel())])
    table = torch.stack([starts, (ends - firsts).to(torch.int64)], 1)
    return tuple((a, n) for a, n in table.tolist())


# id(positions) -> (weak reference, version counter, its runs): a model's layers pass one
# positions tensor, read once
_RUNS: dict[int, tuple] = {}


def check_local_layout(layout, positions, cu_seqlens, max_seqlen, batch: int, n_local: int, device):
    """One rank's checks of where its tokens are. Returns (the layout's name or None, this
    rank's runs or None, the documents' offsets or None, metadata every rank must share)."""
    if layout is not None:
        layout = check_layout(layout)
    runs = None
    if positions is not None:
        if not isinstance(positions, Tensor):
            raise TypeError(f"positions must be a torch.Tensor or None, got {type(positions).__name__}")
        if positions.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32 or int64, got {positions.dtype}")
        if positions.dim() != 1 or positions.shape[0] != n_local:
            raise ValueError(
                f"positions must be 1-D (N_local,) = ({n_local},), one global index per local "
                f"token, got shape {tuple(positions.shape)}"
            )
        if positions.device != device and positions.device.type != "cpu":
            raise ValueError(
                f"positions is on {positions.device}; expected {device} like the inputs, or the CPU"
            )
        runs = _runs_cached(positions)
    offsets = None
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(
                "cu_seqlens must be 1-D (num_seqs + 1,) with at least 2 entries: the offsets of the "
                f"documents in the whole packed sequence, got shape {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.device != device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}; expected {device} like the inputs")
        if batch != 1:
            raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got B = {batch}")
        offsets = host_ints(cu_seqlens)
        if offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]}")
        if any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets}")
        longest = max(b - a for a, b in zip(offsets[:-1], offsets[1:]))
        if max_seqlen is not None:
            if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest:
                raise ValueError(
                    f"max_seqlen must be an int of at least the longest document ({longest}), "
                    f"got {max_seqlen!r}"
                )
    elif max_seqlen is not None:
        raise ValueError("max_seqlen is only meaningful with cu_seqlens")
    if layout is None and runs is None:
        layout = "zigzag"
    meta = {
        "positions given": runs is not None,
        "layout": layout,
        "cu_seqlens": None if offsets is None else _digest(offsets),
    }
    return layout, runs, offsets, meta


def local_layout(options, batch: int, n_local: int, device, *, run: bool):
    """check_local_layout on a call's options (layout, positions, cu_seqlens, max_seqlen) where
    the call runs now; where it is traced, the checks that read no tensor (the op's forward runs
    the others when it runs)."""
    if run:
        return check_local_layout(
            options.layout, options.positions, options.cu_seqlens, options.max_seqlen, batch, n_local, device
        )
    if options.max_seqlen is not None and options.cu_seqlens is None:
        raise ValueError("max_seqlen is only meaningful with cu_seqlens")
    if options.layout is not None:
        check_layout(options.layout)
    return options.layout, None, None, {}


def _runs_cached(positions: Tensor) -> Runs:
    key = id(positions)
    entry = _RUNS.get(key)
    if (
        not positions.is_inference()
        and entry is not None
        and entry[0]() is positions
        and entry[1] == positions._version
    ):
        return entry[2]
    runs = runs_of_positions(positions)
    if not positions.is_inference():
        _RUNS[key] = (weakref.ref(positions), positions._version, runs)
        weakref.finalize(positions, _RUNS.pop, key, None)
    return runs


def _digest(offsets: list[int]) -> str:
    digest = hashlib.sha1(",".join(map(str, offsets)).encode()).hexdigest()[:12]
    return f"{len(offsets) - 1} documents of {offsets[-1]} tokens (digest {digest})"


def resolve_layout(layout, shares: list, offsets) -> list:
    """Every rank's runs, from what every rank shared ({"length", "runs"}); the same on every
    rank, so an error here is raised alike everywhere without another exchange. Raises
    LayoutError where the shards cannot hold the named layout, where positions do not cover
    0..N-1 once, or where positions contradict a named layout."""
    lengths = [share["length"] for share in shares]
    given = [share["runs"] for share in shares]
    total = sum(lengths)
    if offsets is not None and offsets[-1] != total:
        raise LayoutError(
            f"cu_seqlens ends at {offsets[-1]}, but the ranks' shards hold {total} tokens together "
            f"({lengths}); cu_seqlens holds the documents of the whole packed sequence, the same "
            "on every rank"
        )
    if given[0] is None:
        return layout_runs(layout, lengths, offsets)
    runs_by_rank = [tuple(tuple(run) for run in runs) for runs in given]
    check_cover(runs_by_rank)
    if layout is not None:
        expected = layout_runs(layout, lengths, offsets)
        for rank, (got, want) in enumerate(zip(runs_by_rank, expected)):
            if got != want:
                raise LayoutError(
                    f"positions contradict layout={layout!r}: rank {rank} holds the runs "
                    f"(start, length) {list(got)[:4]}, where {layout!r} puts {list(want)[:4]}; pass "
                    "positions alone (or the layout alone)"
                )
    return runs_by_rank


def agree_on_layout(group, local: Callable[[], tuple], what: str, comm: str):
    """agree on a call whose `local` checks return ((result, the layout's name, the documents'
    offsets), metadata, {"length", "runs", ...}), then every rank's runs resolved alike
    (resolve_layout). Returns (result, the call's plan Context, every rank's share)."""
    (result, layout, offsets), shares = agree(group, local, what, share=True)
    try:
        runs = resolve_layout(layout, shares, offsets)
    except ValueError as exc:  # the same on every rank: every rank raises it, none waits
        raise type(exc)(f"{what}: {exc}") from None
    return result, _plan.context(group, layout or "positions", comm, runs, offsets), shares


def context_of_saved(group, layout, positions, cu_seqlens, n_local: int, comm: str, what: str):
    """The plan Context of a call whose forward validated it, for a backward that does not hold
    the forward's (a compiled graph's): every rank's length and runs exchanged again, without
    the other checks."""
    runs = None if positions is None else _runs_cached(positions)
    local = lambda: (None, {}, {"length": n_local, "runs": runs})  # noqa: E731
    shares = agree(group, local, what, share=True)[1]
    offsets = None if cu_seqlens is None else host_ints(cu_seqlens)
    if layout is not None:
        layout = check_layout(layout)
    elif positions is None:
        layout = "zigzag"
    runs_by_rank = resolve_layout(layout, shares, offsets)
    return _plan.context(group, layout or "positions", comm, runs_by_rank, offsets)


def check_attn_kl(group, spec: AttnKLSpec, inputs: AttnKLInputs, options: Options, *, run: bool):
    """Everything one rank can check alone of an attn_kl call whose spec streamkl._checks built;
    raises ValueError/TypeError naming the argument. Returns (Checked, the metadata every rank
    must share, what this rank shares: its length and runs, the layout's name and the
    documents' offsets). `run`: the inputs are real tensors about to run (not traced), so the
    backend is selected here, once for every block: a block is a slice of the local call (the
    same dtypes and device, strides of the same alignment), so a backend that runs the call runs
    it; and positions and cu_seqlens are read."""
    check_comm(options.comm)
    _checks.check_reduction(options.reduction)
    check_same_tokens(spec.nq, spec.nk)
    layout, runs, offsets, layout_meta = local_layout(options, spec.batch, spec.nq, inputs.q1.device, run=run)
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
        # shapes but the sequence axis: shards may differ in length where the layout allows
        **{
            f"{arg} shape": tuple(t.shape[:2]) + ("N_local",) + tuple(t.shape[3:])
            for arg, t in tensors.items()
        },
        "dtypes": tuple(str(t.dtype) for t in tensors.values()),
        "device type": device_type,
        "causal": spec.causal,
        "comm": options.comm,
        "scale1": spec.scale1,
        "scale2": spec.scale2,
        "reduction": options.reduction,
        "heads_per_step": heads_per_step,
        "requires_grad": tuple(options.requires_grad),
        **layout_meta,
    }
    share = {"length": spec.nq, "runs": runs}
    checked = Checked(spec, min(heads_per_step, spec.heads), name, impl)
    return (checked, layout, offsets), meta, share
