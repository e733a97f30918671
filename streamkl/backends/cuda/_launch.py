"""The forward's host side: which instantiation of kernels/kl_fwd.cu runs, its split-K and grid
(the plan of a call's spec), its tensor maps, its parameter block and its launch on torch's
current stream (no host sync, no input copied).

A call costs: three output allocations, one cached lookup of the plan (keyed on the spec, the
dtype and the device), one dict lookup per input for its tensor map (encoded by
cuTensorMapEncodeTiled once per (address, shape, strides, dtype, box) and kept), one struct.pack
of the output pointers, one buffer of the parameter block, and cuLaunchKernel with a one-entry
argument array pointing at it; with split-K, one more allocation (the partial row states) and the
launch of kl_combine on the same block.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from typing import NamedTuple

import torch

from ..._spec import AttnKLInputs, AttnKLSpec, causal_offset
from . import _jit

LOG2E = 1.4426950408889634
SMEM_LIMIT = 232448  # dynamic shared memory one sm_90 CTA may opt into (227 KB)
TMA_BOX = 64  # 16-bit columns per TMA box: one 128-byte swizzle span
MAX_D = 128  # head dims are padded (by TMA's zero fill) to 64 or 128
PARAMS_BYTES = 640  # sizeof(Params) in kernels/schedule.cuh: four 128-byte maps, then the scalars
_POINTERS = struct.Struct("<5Q")  # kl, lse1, lse2, part, cu
# h, nq, nk, g1, g2, m_tiles, causal, splits, rows, hgroup, c1, c2, tail0, tail_splits
_SCALARS = struct.Struct("<10i2f2i")
_PAD = bytes(PARAMS_BYTES - 4 * 128 - _POINTERS.size - _SCALARS.size)
SOURCE_FILE = "kl_fwd.cu"
ENTRY = "kl_fwd"
COMBINE = "kl_combine"  # the split-K epilogue (kernels/combine.cuh), in the same module
PART = 6  # floats of one row's partial state (kernels/online_kl.cuh's PART)
# The kernel's fixed shape (kernels/kl_fwd.cu): NWG consumer warpgroups of 64 query rows and a
# producer warpgroup, over tiles of BN keys.
NWG = 3
BN = 64
BM = 64 * NWG  # query rows per CTA
THREADS = 128 * (NWG + 1)
MAX_STAGES = 4  # the key ring's depth where shared memory allows (more measured no faster)
SPLIT_OVERHEAD_KEYS = 256  # a CTA's fixed cost (Q loads, pipeline fill, epilogue) in keys
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64
# Under causal masking the grid starts the longest row tiles of this many heads first
# (kernels/schedule.cuh's hgroup), so the short ones fill the last wave; without it CTAs are alike
# and one head's row tiles after another's share its keys in L2.
CAUSAL_HEAD_GROUP = 8
# Dense inputs of at most this many query rows (one consumer's tile) run the DECODE instantiation:
# every consumer on those rows, each taking every third key tile.
DECODE_MAX_ROWS = 64


def padded_dim(d: int) -> int:
    return 64 if d <= 64 else 128


def smem_bytes(c: dict) -> int:
    """Mirrors SMEM_BYTES in kl_fwd.cu (the kernel traps if it is given less)."""
    q = (1 if c["DECODE"] else NWG) * 64 * (c["D1P"] + c["D2P"]) * 2
    k = c["STAGES"] * BN * (c["D1P"] + c["D2P"]) * 2
    return q + k + 8 * (1 + 2 * c["STAGES"]) + 1024


def q_in_registers(d1p: int, d2p: int) -> int:
    """QREGS: which queries a consumer keeps in registers (bit 1: Q1, bit 2: Q2). Its 160
    registers hold 128 query columns beside the rest: both Qs when both are 64 wide, else the
    wider one."""
    if d1p + d2p <= 128:
        return 3
    return 1 if d1p >= d2p else 2


def issue_split(d1p: int, d2p: int) -> int:
    """ISSUE_SPLIT: each GEMM's second half issued from inside the update under it. Measured 1-2%
    faster where both head dims are 64 (the exponentials bound the kernel), neither way at 128."""
    return int(d1p == d2p == 64)


def shipped(d1p: int, d2p: int, fp16: bool, decode: bool = False) -> dict:
    """The compile-time constants (kl_fwd.cu's header) of the instantiation that runs for padded
    head dims (d1p, d2p): the queries of q_in_registers as wgmma's register operand, issue_split's
    GEMM issue, and a ring of as many stages as shared memory holds, up to MAX_STAGES;
    decode: the consumers share one Q tile and split the key tiles (DECODE), over a ring of
    2 NWG stages where they fit, else NWG (a multiple of NWG: each stage has one reader)."""
    c = dict(KL_FP16=int(fp16), D1P=d1p, D2P=d2p, DECODE=int(decode))
    c["QREGS"] = q_in_registers(d1p, d2p)
    c["ISSUE_SPLIT"] = issue_split(d1p, d2p)
    if decode:
        c["STAGES"] = (2 if smem_bytes(dict(c, STAGES=2 * NWG)) <= SMEM_LIMIT else 1) * NWG
        return c
    c["STAGES"] = max(s for s in range(1, MAX_STAGES + 1) if smem_bytes(dict(c, STAGES=s)) <= SMEM_LIMIT)
    return c


def shipped_instantiations() -> list[dict]:
    """Every instantiation a supported input can select (CI compiles each of them)."""
    dims = [(a, b) for a in (64, 128) for b in (64, 128)]
    return [shipped(a, b, f, dec) for dec in (False, True) for f in (False, True) for a, b in dims]


def source() -> str:
    return (_jit.KERNELS / SOURCE_FILE).read_text()


def build(consts: dict) -> _jit.Build:
    """The compiled module of one instantiation (kl_fwd and kl_combine), from the disk cache when
    it holds it."""
    return _jit.compile_kernel(source(), ENTRY, consts)


class Kernel(NamedTuple):
    handle: object  # CUkernel of kl_fwd
    combine: object  # CUkernel of kl_combine
    consts: dict
    smem: int
    build: _jit.Build


@functools.cache
def kernel(d1p: int, d2p: int, fp16: bool, decode: bool, device_index: int) -> Kernel:
    """The loaded shipped instantiation for padded head dims (d1p, d2p) on one device (compiled
    or read from the disk cache once per process), with its dynamic shared memory limit raised."""
    from cuda.bindings import driver

    consts = shipped(d1p, d2p, fp16, decode)
    built = build(consts)
    handle, combine = (_jit.load(built, device_index, entry).handle for entry in (ENTRY, COMBINE))
    if not isinstance(handle, driver.CUkernel):
        handle, combine = driver.CUkernel(int(handle)), driver.CUkernel(int(combine))
    smem = smem_bytes(consts)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(
        driver.cuKernelSetAttribute(attr, smem, handle, driver.CUdevice(device_index)), "cuKernelSetAttribute"
    )
    return Kernel(handle, combine, consts, smem, built)


def _check(result, what):
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if len(result) > 1 else None


# ---- tensor maps ----

MAP_CACHE_SIZE = 4096
_MAPS: dict[tuple, bytes] = {}


@functools.cache
def _map_enums():
    from cuda.bindings import driver as d

    t = d.CUtensorMapDataType
    return (
        {
            torch.bfloat16: t.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            torch.float16: t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        },
        d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        d.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )


def tma_reason(t: torch.Tensor, name: str) -> str | None:
    """Why TMA cannot address tensor `name` in place, or None: its base 16-byte aligned, its
    last dim contiguous, every other stride (of a dim longer than 1) a positive multiple of 16
    bytes below 2^40, every size below 2^31."""
    reason = _tma_reason(t.data_ptr() % 16, t.shape, t.stride(), t.element_size())
    return None if reason is None else reason.format(name=name)


@functools.lru_cache(maxsize=4096)
def _tma_reason(misaligned: int, shape: torch.Size, stride: tuple, es: int) -> str | None:
    """tma_reason's answer from the tensor's metadata (cached: the op asks it every call)."""
    if misaligned:
        return "{name} does not start on a 16-byte boundary (TMA needs one; auto takes triton)"
    if shape[-1] > 1 and stride[-1] != 1:
        return "{name} is not contiguous in its last dim (TMA needs that; auto takes triton)"
    for size, st in zip(shape[:-1], stride[:-1]):
        if size > 1 and (st <= 0 or (st * es) % 16 or st * es >= 2**40):
            return (
                f"{{name}} has strides {tuple(stride)}: TMA needs every stride but the last to be a "
                "positive multiple of 16 bytes (auto takes triton)"
            )
    if max(shape) >= 2**31:
        return "{name} has a dim of 2^31 or more"
    return None


def tensor_map(t: torch.Tensor, rows: int) -> bytes:
    """The 128 bytes of a 4-D tensor map {D, N, heads, B} of `t` (B, heads, N, D) with boxes of
    64 columns x `rows` rows, 128-byte swizzle, zeros out of bounds."""
    return _encode(t, (3, 2, 1, 0), rows)


def head_map(t: torch.Tensor, heads: int) -> bytes:
    """The tensor map {D, heads, N, B} of `t` (B, heads, N, D) with boxes of 64 columns x `heads`
    heads of one row (all of a query row's heads in one box; missing heads read as zeros)."""
    return _encode(t, (3, 1, 2, 0), heads)


def _encode(t: torch.Tensor, order: tuple[int, int, int, int], rows: int) -> bytes:
    """The map of `t`'s dims in `order` (innermost first, contiguous), boxes of 64 x `rows`."""
    shape, stride = t.shape, t.stride()
    key = (t.data_ptr(), shape, stride, t.dtype, order, rows)
    found = _MAPS.get(key)
    if found is not None:
        return found
    from cuda.bindings import driver as d

    dtypes, interleave, swizzle, l2, oob = _map_enums()
    es = t.element_size()
    sizes = [shape[i] for i in order]
    # A dim of size 1 is only ever read at 0: any valid stride serves.
    strides = [stride[i] * es if shape[i] > 1 else 16 for i in order[1:]]
    tmap = _check(
        d.cuTensorMapEncodeTiled(
            dtypes[t.dtype],
            4,
            t.data_ptr(),
            [d.cuuint64_t(n) for n in sizes],
            [d.cuuint64_t(s) for s in strides],
            [d.cuuint32_t(TMA_BOX), d.cuuint32_t(rows), d.cuuint32_t(1), d.cuuint32_t(1)],
            [d.cuuint32_t(1)] * 4,
            interleave,
            swizzle,
            l2,
            oob,
        ),
        "cuTensorMapEncodeTiled",
    )
    raw = ctypes.string_at(tmap.getPtr(), 128)  # the encoded map, by value
    if len(_MAPS) >= MAP_CACHE_SIZE:
        _MAPS.clear()
    _MAPS[key] = raw
    return raw


# ---- launch ----


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=4096)
def splits_for(ctas: int, key_tiles: int, batch: int, sms: int, tile: int, causal=None) -> int:
    """How many ways to split each row tile's key tiles (of `tile` keys; split-K): the count that
    minimizes the time of the grid, one CTA per SM, each CTA its share of key tiles plus a fixed
    cost. Alike CTAs run in waves; under causal masking (causal = (nq, nk, rows per tile)) row
    tiles see different key counts, and the time is the larger of two lower bounds of any
    one-CTA-per-SM schedule: the work per SM, and for each CTA length p the ceil(n / sms) turns
    that the n CTAs at least that long need on some SM (for alike CTAs, as in decode, the
    unmasked count). A grid of few row tiles (decode) is split to fill the SMs; a large one stays
    unsplit unless its last wave is partial (dense unmasked grids take tail_for instead)."""
    overhead = -(-SPLIT_OVERHEAD_KEYS // tile)
    top = max(1, min(MAX_SPLITS, key_tiles * tile // MIN_KEYS_PER_SPLIT, 65535 // batch))
    if causal is None:
        cost = lambda s: -(-ctas * s // sms) * (-(-key_tiles // s) + overhead)
        return min(range(1, top + 1), key=cost)  # the fewest splits among the fastest
    nq, nk, bm = causal
    m_tiles = -(-nq // bm)
    # every (split count, row tile) at once in float64 on the host, exact for these integers: a
    # long causal grid has thousands of row tiles, and a new packed max_seqlen misses the cache
    f64 = dict(dtype=torch.float64, device="cpu")  # whatever the default device
    last_first = torch.arange(m_tiles, 0, -1, **f64)  # m + 1 for row tiles m = m_tiles - 1 .. 0
    lengths = torch.ceil((last_first * bm + causal_offset(nq, nk)).clamp(0, nk) / tile)  # keys each sees
    s = torch.arange(1, top + 1, **f64)[:, None]
    parts = torch.ceil(lengths / s) + overhead  # [split counts, row tiles], longest first
    ctas_s = (ctas // m_tiles) * s  # CTAs of each row tile's length
    work = (ctas_s * parts).sum(1) / sms
    longer = torch.arange(1, m_tiles + 1, **f64)  # row tiles at least this long
    waves = (parts * torch.ceil(ctas_s * longer / sms)).amax(1)
    return int(torch.argmin(torch.maximum(work, waves))) + 1  # the first minimum: the fewest splits


def tail_for(units: int, key_tiles: int, sms: int) -> tuple[int, int]:
    """(first split row tile, splits) of a TAIL launch: a grid of more than one wave of alike row
    tiles (one CTA per SM) splits its last partial wave's `r` tiles sms // r ways, as many as
    still fit one wave, at most key_tiles // 2, and no more than its contiguous shares of key
    tiles need (none empty); (0, 0) where that is fewer than 2."""
    r = units % sms
    s = min(MAX_SPLITS, sms // r, key_tiles // 2) if units > sms and r else 0
    if s >= 2:
        s = -(-key_tiles // -(-key_tiles // s))  # the splits ceil(key_tiles / s)-tile shares fill
    return (units - r, s) if s >= 2 else (0, 0)


class Plan(NamedTuple):
    """What a launch of one call shape fixes (_plan): the kernel, its grid, the split-K partial
    states per row and part's rows, and the parameter block's scalars after the pointers."""

    kernel: Kernel
    grid: tuple[int, int, int]
    parts: int  # partial states per row (1: no split-K, no combine)
    part_rows: int
    scalars: bytes


@functools.lru_cache(maxsize=4096)
def _plan(spec: AttnKLSpec, fp16: bool, device_index: int) -> Plan:
    """The launch of `spec` (a spec of at least one row and one key): the instantiation (DECODE
    for dense inputs of at most DECODE_MAX_ROWS rows), the split count (splits_for; unmasked dense
    grids of more than one wave split only their last partial wave, tail_for), the grid's head
    groups, the parameter block's scalars."""
    decode = not spec.packed and spec.nq <= DECODE_MAX_ROWS
    k = kernel(padded_dim(spec.d1), padded_dim(spec.d2), fp16, decode, device_index)
    # Packed sequences: the grid's batch runs the sequences, its row tiles the longest one.
    seqs, heads = spec.num_seqs, spec.heads
    m_tiles = -(-spec.seq_q // BM)
    key_tiles = -(-spec.seq_k // BN)
    units = m_tiles * heads * seqs  # row tiles of every batch
    sms = _sm_count(device_index)
    splits = 1
    if spec.rows < 2**31:
        shape = (spec.seq_q, spec.seq_k, BM) if spec.causal else None
        splits = splits_for(units, key_tiles, seqs, sms, BN, shape)
    hgroup = min(heads, CAUSAL_HEAD_GROUP) if spec.causal else 1
    tail0, tail_splits = 0, 0
    if not (spec.causal or decode or spec.packed):
        tail0, tail_splits = tail_for(units, key_tiles, sms)
        splits = tail_splits or splits
    parts = splits * NWG if decode else splits  # partial states per row (DECODE: per consumer)
    part_rows = (units - tail0) * BM if tail_splits else spec.rows  # TAIL: the split row tiles' rows
    if tail_splits:  # one axis over every batch's row tiles, the split ones `tail_splits` times
        grid = (tail0 + (units - tail0) * tail_splits, 1, 1)
    else:
        grid = (m_tiles * heads, 1, seqs * splits)
    scalars = _SCALARS.pack(
        heads,
        spec.nq,
        spec.nk,
        spec.group1,
        spec.group2,
        m_tiles,
        int(spec.causal),
        parts,
        part_rows if parts > 1 else 0,
        hgroup,
        spec.scale1 * LOG2E,
        spec.scale2 * LOG2E,
        tail0,
        tail_splits,
    )
    return Plan(k, grid, parts, part_rows, scalars + _PAD)


def forward(spec: AttnKLSpec, inputs: AttnKLInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kl, lse1, lse2), each (B, H, Nq) float32, of a validated call (streamkl._checks): dense or
    packed inputs (cu_seqlens int32 on the inputs' device, spec.max_seqlen resolved)."""
    q1, k1, q2, k2, cu_seqlens = inputs
    dev = q1.device
    kl = torch.empty((spec.batch, spec.heads, spec.nq), device=dev, dtype=torch.float32)
    lse1 = torch.empty_like(kl)
    lse2 = torch.empty_like(kl)
    if spec.rows == 0:
        return kl, lse1, lse2
    if spec.nk == 0:  # every row sees nothing
        return kl.zero_(), lse1.fill_(float("-inf")), lse2.fill_(float("-inf"))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    plan = _plan(spec, q1.dtype == torch.float16, index)
    k = plan.kernel
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()  # read by every CTA; it outlives the launch in stream order
    part = None
    if plan.parts > 1:
        part = torch.empty(plan.parts * plan.part_rows * PART, device=dev, dtype=torch.float32)
    block = (
        tensor_map(q1, 64)
        + tensor_map(k1, BN)
        + tensor_map(q2, 64)
        + tensor_map(k2, BN)
        + _POINTERS.pack(
            kl.data_ptr(),
            lse1.data_ptr(),
            lse2.data_ptr(),
            part.data_ptr() if part is not None else 0,
            cu_seqlens.data_ptr() if cu_seqlens is not None else 0,
        )
        + plan.scalars
    )
    params = ctypes.create_string_buffer(block, PARAMS_BYTES)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    from cuda.bindings import driver

    # torch's current stream as a raw handle (torch.cuda.current_stream builds an object: ~6 us)
    stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(index))
    (err,) = driver.cuLaunchKernel(
        k.handle, *plan.grid, THREADS, 1, 1, k.smem, stream, ctypes.addressof(argv), 0
    )
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel of {ENTRY} {k.consts} failed: {err!r}")
    if part is not None:  # part stays alive until the combine ran: the allocator reuses it in stream order
        (err,) = driver.cuLaunchKernel(
            k.combine, -(-plan.part_rows // 128), 1, 1, 128, 1, 1, 0, stream, ctypes.addressof(argv), 0
        )
        if int(err) != 0:
            raise RuntimeError(f"cuLaunchKernel of {COMBINE} {k.consts} failed: {err!r}")
    return kl, lse1, lse2
