"""Launchers: pick configs, allocate outputs, pass every stride (no input is ever copied).

What a launch needs besides the tensors (configs, grids, split count, constexprs, the backward
strategy and its key-major launches, the size and scale arguments) is a plan, computed once per
key by `fwd_plan` / `bwd_plan` (functools.lru_cache) from the call's spec (streamkl._spec), the
dtype, the device and the STREAMKL_TRITON_* settings. The launchers read those settings through
streamkl._env on every call and pass their values in, so a call pays a cache lookup, never the
selection rules. `_launch` then skips
Triton's per-call argument binding for a launch it has seen before (docs/overhead.md).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch
import triton
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from ... import _env
from ..._spec import AttnKLInputs, AttnKLSpec, AttnKLStats
from . import _config
from ._bwd import _bwd_dk_kernel, _bwd_dq_kernel
from ._config import pow2_dim
from ._fwd import _fwd_kernel, _merge_kernel

LOG2E = 1.4426950408889634
PLAN_CACHE_SIZE = 1024  # distinct shape keys kept (varlen batches key on max_seqlen)
MERGE_BLOCK_R = 128


# (id of a plan's constexpr dict, current device, integer arguments, tensors' dtypes and low 7
# address bits) -> (that dict, kept so its id stays unique; the compiled kernel, its launcher,
# function handle and packed metadata; the constexpr values that follow the runtime arguments),
# or None where Triton returned no compiled kernel.
_SEEN: dict[tuple, tuple | None] = {}
_KNOBS = getattr(triton, "knobs", None)
SEEN_MAX = 4096


def _launch(kernel, grid, args, consts):
    """kernel[grid](*args, **consts), without JITFunction.run's binding once seen.

    Triton specializes a compiled kernel on its constexprs, on the values of integer arguments
    (1, multiples of 16, 32- or 64-bit) and on pointer dtypes and alignment (16 bytes). A launch
    whose constexprs, exact integers, tensor dtypes and pointer addresses modulo 128 match an
    earlier one therefore runs that one's compiled kernel: the launch goes straight to Triton's C
    launcher on the current stream. Anything else goes through kernel[grid] as usual, and so does
    every launch while Triton runs anything per launch: launch hooks (its profilers), pre-run
    hooks, debug mode or instrumentation, or where it has no runtime knobs to read (before 3.4).
    """
    if not isinstance(kernel, JITFunction) or _KNOBS is None:  # the interpreter, or an old triton
        kernel[grid](*args, **consts)
        return
    device = _current_device()
    key = (
        id(consts),
        device,
        tuple(a for a in args if type(a) is int),
        tuple((a.data_ptr() & 127, a.dtype) for a in args if isinstance(a, torch.Tensor)),
    )
    seen = _SEEN.get(key, False)
    if seen is False or seen is None or _per_launch_work(kernel):
        compiled = kernel[grid](*args, **consts)
        if seen is False:
            if len(_SEEN) >= SEEN_MAX:
                _SEEN.clear()
            _SEEN[key] = _fast_entry(kernel, compiled, len(args), consts)
        return
    _, _, run, function, packed, tail = seen
    g = (*grid, 1, 1)
    run(g[0], g[1], g[2], _current_stream(device), function, packed, None, None, None, *args, *tail)


def _fast_entry(kernel, compiled, n_args, consts):
    """What a later launch of the same specialization needs, or None if it cannot skip binding:
    no compiled kernel came back, or constexprs do not all follow the runtime arguments. The
    compiled kernel is kept with its handles, so its module stays loaded while they are used."""
    if hasattr(compiled, "result"):  # a future, where Triton compiles asynchronously
        compiled = compiled.result()
    if not hasattr(compiled, "packed_metadata"):
        return None
    names = kernel.arg_names[n_args:]
    if any(name not in consts for name in names):
        return None
    tail = tuple(consts[name] for name in names)
    return consts, compiled, compiled.run, compiled.function, compiled.packed_metadata, tail


def _per_launch_work(kernel) -> bool:
    """Whether JITFunction.run would do more than bind and launch: hooks, debug, instrumentation."""
    runtime, compilation = _KNOBS.runtime, _KNOBS.compilation
    return (
        _hooked(runtime.launch_enter_hook)
        or _hooked(runtime.launch_exit_hook)
        or bool(kernel.pre_run_hooks)
        or bool(runtime.debug)
        or bool(getattr(compilation, "instrumentation_mode", None))
    )


def _hooked(hook) -> bool:
    """Whether a launch hook would run: Triton keeps them in chains that are empty by default."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _current_device() -> int:
    return driver.active.get_current_device()


def _current_stream(device: int):
    return driver.active.get_current_stream(device)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _config.H200_SMS


def _prec(dtype: torch.dtype) -> str:
    # fp32 inputs: true fp32 products (tf32 off: docs/contract.md, Numerics); 16-bit inputs
    # ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(q1, k1, q2, k2):
    return (*q1.stride(), *k1.stride(), *q2.stride(), *k2.stride())


def _grid_z(spec: AttnKLSpec) -> int:
    """The grids' third axis: the batch, or the number of packed sequences."""
    return spec.num_seqs if spec.packed else spec.batch


class FwdPlan(NamedTuple):
    grid: tuple[int, int, int]
    splits: int  # key splits (1: no split, no merge)
    consts: dict  # _fwd_kernel's constexprs and launch options
    scalars: tuple  # arguments after the strides: H, NQ, NK, G1, G2, c1, c2, split_len, n_splits
    merge_grid: tuple[int] | None
    merge_consts: dict | None
    merge_scalars: tuple | None  # _merge_kernel's ROWS, n_splits


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def fwd_plan(
    spec: AttnKLSpec, dtype: torch.dtype, device: torch.device, forced_splits: int | None
) -> FwdPlan:
    """The forward's launches for a call of `spec` with at least one output row. forced_splits:
    the value of STREAMKL_TRITON_SPLIT_K (_env.triton_split_k), None when packed."""
    D1P, D2P = pow2_dim(spec.d1), pow2_dim(spec.d2)
    rows, zdim = spec.seq_q, _grid_z(spec)  # query rows per grid slot: Nq, or max_seqlen when packed
    cfg = _config.fwd_cfg(D1P, D2P, dtype, spec.causal, rows, device.type != "cuda")
    m_tiles = triton.cdiv(rows, cfg.block_m)
    ctas = zdim * spec.heads * m_tiles
    splits, split_len = _key_splits(ctas, spec.seq_k, cfg, spec.packed, device, forced_splits)
    consts = dict(
        D1=spec.d1,
        D2=spec.d2,
        D1P=D1P,
        D2P=D2P,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        CAUSAL=spec.causal,
        VARLEN=spec.packed,
        SPLIT=splits > 1,
        PREC=_prec(dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    scalars = (
        spec.heads,
        spec.nq,
        spec.nk,
        spec.group1,
        spec.group2,
        spec.scale1 * LOG2E,
        spec.scale2 * LOG2E,
        split_len,
        splits,
    )
    merge_grid = merge_consts = merge_scalars = None
    if splits > 1:
        merge_grid = (triton.cdiv(spec.rows, MERGE_BLOCK_R),)
        merge_consts = dict(SPLITS_P=triton.next_power_of_2(splits), BLOCK_R=MERGE_BLOCK_R, num_warps=4)
        merge_scalars = (spec.rows, splits)
    return FwdPlan(
        (m_tiles * splits, spec.heads, zdim), splits, consts, scalars, merge_grid, merge_consts, merge_scalars
    )


def forward(spec: AttnKLSpec, inputs: AttnKLInputs):
    """The backend's forward (streamkl/_backend.py): (kl, lse1, lse2), each (B, H, Nq) float32."""
    q1, k1, q2, k2, cu_seqlens = inputs
    dev = q1.device
    kl = torch.empty((spec.batch, spec.heads, spec.nq), device=dev, dtype=torch.float32)
    lse1 = torch.empty_like(kl)
    lse2 = torch.empty_like(kl)
    if kl.numel() == 0:
        return kl, lse1, lse2
    plan = fwd_plan(spec, q1.dtype, dev, None if spec.packed else _env.triton_split_k())
    cu = cu_seqlens if spec.packed else kl  # placeholder pointer when not packed (never read)
    part = kl  # placeholder pointer without split-K (never read)
    if plan.splits > 1:
        part = torch.empty((5, plan.splits, spec.batch, spec.heads, spec.nq), device=dev, dtype=torch.float32)
    args = (q1, k1, q2, k2, kl, lse1, lse2, part, cu, *_strides(q1, k1, q2, k2), *plan.scalars)
    _launch(_fwd_kernel, plan.grid, args, plan.consts)
    if plan.merge_grid is not None:
        _launch(
            _merge_kernel, plan.merge_grid, (part, kl, lse1, lse2, *plan.merge_scalars), plan.merge_consts
        )
    return kl, lse1, lse2


class KeyMajorLaunch(NamedTuple):
    grid: tuple[int, int, int]
    dk1: bool  # writes dk1
    dk2: bool  # writes dk2
    fq1: bool  # adds dq1 into its fp32 accumulator (fused)
    fq2: bool  # adds dq2 into its fp32 accumulator (fused)
    consts: dict  # _bwd_dk_kernel's constexprs and launch options
    scalars: tuple  # arguments after the strides: H, HK1, HK2, NQ, NK, G1, G2, GG, c1, c2, scale1, scale2


class BwdPlan(NamedTuple):
    fused: bool  # dq by atomics in the key-major launches, no dq launch
    key_major: tuple[KeyMajorLaunch, ...]
    dq_grid: tuple[int, int, int] | None  # None: no dq launch
    dq_consts: dict | None  # _bwd_dq_kernel's constexprs and launch options
    dq_splits: int  # key splits of the dq launch (1: none; else float32 shares, summed after)
    # _bwd_dq_kernel's arguments after the strides: H, NQ, NK, G1, G2, c1, c2, scale1, scale2,
    # split_len, n_splits, n_rows
    dq_scalars: tuple | None


def _key_splits(ctas, nk, cfg, varlen, device, forced_splits) -> tuple[int, int]:
    """(splits, keys per split) of a query-major launch of `ctas` programs over nk keys: the
    split-K rule (_config.split_count), each split a whole number of key tiles; packed
    sequences are never split."""
    nk_tiles = triton.cdiv(max(nk, 1), cfg.block_n)
    if varlen:
        return 1, nk
    splits = _config.split_count(ctas, nk_tiles, _num_sms(device), forced_splits, cfg.block_m)
    if splits == 1:
        return 1, nk
    split_len = triton.cdiv(nk_tiles, splits) * cfg.block_n
    return triton.cdiv(nk, split_len), split_len


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def bwd_plan(
    spec: AttnKLSpec, dtype: torch.dtype, device: torch.device, strategy: str, forced_splits: int | None
) -> BwdPlan:
    """The backward's launches for a call of `spec` with at least one row, one key and one
    gradient needed (spec.needs). strategy: the value of STREAMKL_TRITON_BWD (_env.triton_bwd);
    forced_splits: as in fwd_plan, for the dq launch, which splits the key axis by the forward's
    rule (few query-row tiles)."""
    need_dq1, need_dk1, need_dq2, need_dk2 = needs = spec.needs
    H, g1, g2 = spec.heads, spec.group1, spec.group2
    rows, nk, zdim = spec.seq_q, spec.seq_k, _grid_z(spec)  # per grid slot
    D1P, D2P = pow2_dim(spec.d1), pow2_dim(spec.d2)
    both = (need_dq1 or need_dk1) and (need_dq2 or need_dk2)
    cq, ck = _config.bwd_cfgs(D1P, D2P, dtype, spec.causal, device.type != "cuda", both)
    dims = dict(
        D1=spec.d1, D2=spec.d2, D1P=D1P, D2P=D2P, CAUSAL=spec.causal, VARLEN=spec.packed, PREC=_prec(dtype)
    )
    if strategy == "auto":
        strategy = choose_bwd(zdim, H, rows, nk, g1, g2, needs, cq, ck, _num_sms(device))
    fused = strategy == "fused" and (need_dk1 or need_dk2) and (need_dq1 or need_dq2)
    c1, c2 = spec.scale1 * LOG2E, spec.scale2 * LOG2E

    # Key-major launches: one per distinct grouping of the key heads. With g1 == g2 a single
    # launch serves dk1 and dk2; otherwise dk1 walks groups of g1 heads and dk2 groups of g2.
    groups = []
    if need_dk1 and need_dk2 and g1 == g2:
        groups.append((g1, True, True))
    else:
        if need_dk1:
            groups.append((g1, True, False))
        if need_dk2:
            groups.append((g2, False, True))
    fq = (need_dq1, need_dq2) if fused else (False, False)
    # dq_t rides on the launch that already forms dS_t for dk_t, else on the first launch.
    owner = [next((i for i, la in enumerate(groups) if la[1 + t]), 0) if fq[t] else -1 for t in (0, 1)]
    key_major = []
    for i, (gg, do1, do2) in enumerate(groups):
        f1, f2 = owner[0] == i, owner[1] == i
        consts = dict(
            BLOCK_M=ck.block_m,
            BLOCK_N=ck.block_n,
            DK1_ON=do1,
            DK2_ON=do2,
            FQ1=f1,
            FQ2=f2,
            QROWS=ck.qrows,
            num_warps=ck.num_warps,
            num_stages=ck.num_stages,
            **dims,
        )
        scalars = (
            H,
            spec.heads_kv1,
            spec.heads_kv2,
            spec.nq,
            spec.nk,
            g1,
            g2,
            gg,
            c1,
            c2,
            spec.scale1,
            spec.scale2,
        )
        grid = (triton.cdiv(nk, ck.block_n), H // gg, zdim)
        key_major.append(KeyMajorLaunch(grid, do1, do2, f1, f2, consts, scalars))
    dq_grid = dq_consts = dq_scalars = None
    splits = 1
    if not fused and (need_dq1 or need_dq2):
        m_tiles = triton.cdiv(rows, cq.block_m)
        splits, split_len = _key_splits(zdim * H * m_tiles, nk, cq, spec.packed, device, forced_splits)
        dq_grid = (m_tiles * splits, H, zdim)
        dq_consts = dict(
            BLOCK_M=cq.block_m,
            BLOCK_N=cq.block_n,
            SPLIT=splits > 1,
            DQ1_ON=need_dq1,
            DQ2_ON=need_dq2,
            num_warps=cq.num_warps,
            num_stages=cq.num_stages,
            **dims,
        )
        dq_scalars = (
            H,
            spec.nq,
            spec.nk,
            g1,
            g2,
            c1,
            c2,
            spec.scale1,
            spec.scale2,
            split_len,
            splits,
            spec.rows,
        )
    return BwdPlan(fused, tuple(key_major), dq_grid, dq_consts, splits, dq_scalars)


def _dq_accumulator(dq: torch.Tensor) -> torch.Tensor:
    """The fused strategy's zeroed fp32 dq buffer: the output itself when it is fp32."""
    if dq.dtype == torch.float32:
        return dq.zero_()
    return torch.zeros(dq.shape, device=dq.device, dtype=torch.float32)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: torch.Tensor):
    """The backend's backward (streamkl/_backend.py): (dq1, dk1, dq2, dk2), each contiguous in
    its input's shape and dtype where spec.needs asks for it, else None."""
    q1, k1, q2, k2, cu_seqlens = inputs
    need_dq1, need_dk1, need_dq2, need_dk2 = needs = spec.needs
    empty = spec.rows == 0 or spec.nk == 0
    alloc = torch.zeros_like if empty else torch.empty_like  # nothing to launch: zero gradients
    dq1 = alloc(q1, memory_format=torch.contiguous_format) if need_dq1 else None
    dk1 = alloc(k1, memory_format=torch.contiguous_format) if need_dk1 else None
    dq2 = alloc(q2, memory_format=torch.contiguous_format) if need_dq2 else None
    dk2 = alloc(k2, memory_format=torch.contiguous_format) if need_dk2 else None
    out = (dq1, dk1, dq2, dk2)
    if empty or not any(needs):
        return out
    grad_kl = grad_kl.to(torch.float32).contiguous()
    kl, lse1, lse2 = (t.to(torch.float32).contiguous() for t in stats)
    forced = None if spec.packed else _env.triton_split_k()
    plan = bwd_plan(spec, q1.dtype, q1.device, bwd_strategy(), forced)
    if plan.fused and torch.are_deterministic_algorithms_enabled():
        deterministic_refusal(FUSED_NONDETERMINISTIC)  # STREAMKL_TRITON_BWD=fused, forced
    cu = cu_seqlens if spec.packed else kl  # placeholder pointer when not packed (never read)
    dummy = kl  # placeholder pointer of an output a launch does not write (never read)
    strides = _strides(q1, k1, q2, k2)
    dqa1 = dqa2 = None
    if plan.fused:
        dqa1 = _dq_accumulator(dq1) if need_dq1 else None
        dqa2 = _dq_accumulator(dq2) if need_dq2 else None
    for la in plan.key_major:
        args = (
            q1,
            k1,
            q2,
            k2,
            grad_kl,
            kl,
            lse1,
            lse2,
            dk1 if la.dk1 else dummy,
            dk2 if la.dk2 else dummy,
            dqa1 if la.fq1 else dummy,
            dqa2 if la.fq2 else dummy,
            cu,
            *strides,
            *la.scalars,
        )
        _launch(_bwd_dk_kernel, la.grid, args, la.consts)
    if plan.fused:
        if need_dq1 and dqa1 is not dq1:
            dq1.copy_(dqa1)
        if need_dq2 and dqa2 is not dq2:
            dq2.copy_(dqa2)
    if plan.dq_grid is not None:
        out1, out2 = dq1, dq2
        if plan.dq_splits > 1:  # each split writes its float32 share; their sum is dq
            out1, out2 = (
                torch.empty((plan.dq_splits, *dq.shape), device=dq.device, dtype=torch.float32)
                if dq is not None
                else None
                for dq in (dq1, dq2)
            )
        args = (
            q1,
            k1,
            q2,
            k2,
            grad_kl,
            kl,
            lse1,
            lse2,
            out1 if need_dq1 else dummy,
            out2 if need_dq2 else dummy,
            cu,
            *strides,
            *plan.dq_scalars,
        )
        _launch(_bwd_dq_kernel, plan.dq_grid, args, plan.dq_consts)
        if plan.dq_splits > 1:
            for dq, shares in ((dq1, out1), (dq2, out2)):
                if shares is not None:
                    dq.copy_(shares.sum(0))
    return out


FUSED_NONDETERMINISTIC = (
    "STREAMKL_TRITON_BWD=fused adds dq with float32 atomics, whose summation order varies from run "
    "to run, and torch.use_deterministic_algorithms(True) is on. Unset STREAMKL_TRITON_BWD (or set "
    "it to auto or separate: under deterministic mode both run the separate strategy, whose "
    "summation order is fixed), or turn deterministic mode off"
)


def bwd_strategy() -> str:
    """The strategy handed to bwd_plan: STREAMKL_TRITON_BWD's value, except that under
    torch.use_deterministic_algorithms(True) `auto` becomes `separate` (the fused strategy's dq
    atomics sum in a varying order; the separate strategy sums every gradient in registers or in
    float32 shares reduced in a fixed order). A forced `fused` stays, and backward refuses it
    (docs/triton.md, "Determinism"). The one place the backward's determinism is decided; the
    cuda backend's backward is this one."""
    strategy = _env.triton_bwd()
    if strategy == "auto" and torch.are_deterministic_algorithms_enabled():
        return "separate"
    return strategy


def deterministic_refusal(message: str) -> None:
    """What a launcher does where deterministic mode is on and only a nondeterministic path is
    left: RuntimeError, or a UserWarning (and the path runs) under
    torch.use_deterministic_algorithms(True, warn_only=True), as PyTorch's own ops do."""
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=3)
        return
    raise RuntimeError(message)


def choose_bwd(Z, H, rows, nk, g1, g2, needs, cq, ck, num_sms) -> str:
    """STREAMKL_TRITON_BWD=auto: fused only when one setting's dq is requested and both grids of
    the separate strategy fit in one wave (Z * H/g * cdiv(Nk, BLOCK_N) and Z * H * cdiv(Nq,
    BLOCK_M) at most the SM count): there its two launches run one after the other on a part of
    the GPU each. Otherwise separate. Z is the grids' third axis: the batch, or the number of
    packed sequences. The fused fp32 dq accumulator then holds at most SMs * BLOCK_M rows.

    Why: on the H200 the separate strategy takes 1.3-1.7x less time than the fused one at every
    grid larger than one wave (setting 1, N=1K-32K and Nq=256-2K against Nk=32K), and 5-7x less
    with both dq (two atomic streams); on one-wave grids (N=256) the fused strategy is 2-3x
    faster, timed with the keys x queries tiles of the key-major kernel (docs/triton.md,
    "Fused vs separate backward").
    """
    if needs[0] and needs[2]:
        return "separate"
    g = min(g1, g2)
    kv_programs = Z * (H // g) * math.ceil(nk / ck.block_n)
    dq_programs = Z * H * math.ceil(rows / cq.block_m)
    if max(kv_programs, dq_programs) <= FUSED_MAX_WAVES * num_sms:
        return "fused"
    return "separate"


FUSED_MAX_WAVES = 1
