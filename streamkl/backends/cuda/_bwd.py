"""The backward's host side: which inputs kernels/kl_bwd.cu runs (setting 1, dq2 and dk2 with the
teacher fixed; setting 2, dq1 and dk1 with the target fixed; both as one launch each at decode
shapes), its instantiation, parameter block and launch on torch's current stream, and the float32
dq buffer its adds land in (cast to the input's dtype after the launch).

A launch costs: the dq buffer (zeroed) and dk, the grad/stats copies as float32 (no-ops when they
already are), four cached tensor maps, one struct.pack, cuLaunchKernel, and the cast of dq.
"""

from __future__ import annotations

import ctypes
import functools
import struct

import torch

from ... import _env
from ..._spec import AttnKLInputs, AttnKLSpec, AttnKLStats
from . import _jit
from ._launch import LOG2E, SMEM_LIMIT, _check, padded_dim, tensor_map

SOURCE_FILE = "kl_bwd.cu"
ENTRY = "kl_bwd"
NWG = 2  # consumer warpgroups (kernels/kl_bwd.cu), 64 keys each
BN = 64 * NWG  # keys per CTA
BM = 64  # query rows per tile
THREADS = 128 * (NWG + 1)
MAX_QSTAGES = 3
BWD_PARAMS_BYTES = 640
_POINTERS = struct.Struct("<5Q")  # lse1, lse2, grad, dq, dk
_SCALARS = struct.Struct("<8i3f4xQ")  # h, nq, nk, d, g_own, g_other, causal, m_tiles, c1, c2, scale; kl
_PAD = bytes(BWD_PARAMS_BYTES - 4 * 128 - _POINTERS.size - _SCALARS.size)
SETTING1 = (False, False, True, True)  # spec.needs of setting 1: dq2 and dk2
SETTING2 = (True, True, False, False)  # spec.needs of setting 2: dq1 and dk1


def decode_shape(spec: AttnKLSpec) -> bool:
    """BM query rows or fewer: one query tile per key tile. The decode launch runs there
    (launch_plan), and so does a backward of both sides (declines): the measured rule of
    docs/cuda.md, "The backward"."""
    return spec.nq <= BM


def sides(needs) -> tuple[int, ...]:
    """The settings whose kernels form the gradients `needs` asks for: 1 for any of q2, k2 and 2
    for any of q1, k1 (one launch each)."""
    return tuple(s for s, pair in ((1, needs[2:]), (2, needs[:2])) if any(pair))


def smem_bytes(c: dict) -> int:
    """Mirrors SMEM_BYTES in kl_bwd.cu (the kernel traps if it is given less)."""
    k = c["KSTAGES"] * BN * (c["D1P"] + c["D2P"]) * 2
    q = c["QSTAGES"] * BM * (c["D1P"] + c["D2P"]) * 2
    ds = 2 * BM * BN * 2
    rows = c["QSTAGES"] * 3 * BM * 4
    return k + q + ds + rows + 8 * (2 * c["KSTAGES"] + 2 * c["QSTAGES"] + 4) + 1024


def shipped(d1p: int, d2p: int, fp16: bool, setting: int = 1, kstages: int = 1) -> dict:
    """The compile-time constants (kl_bwd.cu's header) for padded head dims (d1p, d2p), a setting
    and the K stages (2: the decode launch, several key tiles a CTA): a ring of as many query
    stages as shared memory holds, up to MAX_QSTAGES."""
    c = dict(KL_FP16=int(fp16), D1P=d1p, D2P=d2p, SETTING=setting, KSTAGES=kstages)
    c["QSTAGES"] = max(s for s in range(1, MAX_QSTAGES + 1) if smem_bytes(dict(c, QSTAGES=s)) <= SMEM_LIMIT)
    return c


def shipped_instantiations() -> list[dict]:
    """Every instantiation a supported input can select (CI compiles each of them)."""
    dims = [(a, b) for a in (64, 128) for b in (64, 128)]
    return [shipped(a, b, f, s, k) for s in (1, 2) for k in (1, 2) for f in (False, True) for a, b in dims]


def source() -> str:
    return (_jit.KERNELS / SOURCE_FILE).read_text()


def build(consts: dict) -> _jit.Build:
    return _jit.compile_kernel(source(), ENTRY, consts)


def declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    """Why this kernel does not run a backward the forward's `supports` admitted, or None (the
    triton backward then runs it). Where it runs, it is measured faster than triton's on the H200
    (docs/cuda.md, "The backward"); STREAMKL_CUDA_BWD=triton asks for triton's everywhere."""
    if _env.cuda_bwd() == "triton":
        return "STREAMKL_CUDA_BWD=triton asks for the triton backward"
    settings = sides(spec.needs)
    if len(settings) == 2 and not decode_shape(spec):
        return (
            "both sides' gradients above 64 query rows run on triton's one-pass backward (the cuda "
            "kernel's two launches, one a side, are slower there)"
        )
    if spec.packed:
        return "the cuda backward does not run packed sequences"
    # the other side's GQA group a multiple of the own side's, asked without dividing by H (may be 0)
    if 1 in settings and spec.heads_kv2 % spec.heads_kv1:
        return "the cuda backward of q2, k2 needs the teacher's GQA group to be a multiple of the student's"
    if 2 in settings and spec.heads_kv1 % spec.heads_kv2:
        return "the cuda backward of q1, k1 needs the student's GQA group to be a multiple of the teacher's"
    for s in settings:
        if (spec.d2 if s == 1 else spec.d1) % 2:
            return f"the cuda backward needs an even head dim on the side it differentiates (D{3 - s})"
    if torch.are_deterministic_algorithms_enabled():
        return "the cuda backward adds dq with atomics; deterministic mode runs triton's separate dq pass"
    return None


@functools.cache
def kernel(consts_items: tuple, device_index: int):
    from cuda.bindings import driver

    consts = dict(consts_items)
    built = build(consts)
    handle = _jit.load(built, device_index, ENTRY).handle
    if not isinstance(handle, driver.CUkernel):
        handle = driver.CUkernel(int(handle))
    smem = smem_bytes(consts)
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(
        driver.cuKernelSetAttribute(attr, smem, handle, driver.CUdevice(device_index)), "cuKernelSetAttribute"
    )
    return handle, smem


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_plan(spec: AttnKLSpec, s: int, index: int) -> tuple[int, tuple[int, int, int]]:
    """(KSTAGES, grid) of setting s's launch: per key head of its differentiated side and batch,
    one CTA per key tile of BN keys; at BM query rows or fewer (decode: one query tile per key
    tile, so the K loads, the tile and the dk stores would run in series) about one CTA per SM,
    each walking several key tiles with the next one's K loading under this one (KSTAGES 2;
    docs/cuda.md has the measured rule)."""
    key_tiles, heads = -(-spec.nk // BN), spec.heads_kv2 if s == 1 else spec.heads_kv1
    if not decode_shape(spec):
        return 1, (key_tiles, heads, spec.batch)
    per_head = max(1, _sm_count(index) // max(1, heads * spec.batch))
    return 2, (min(key_tiles, per_head), heads, spec.batch)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: torch.Tensor):
    """(dq1, dk1, dq2, dk2): the asked ones (declines() is None), contiguous in the inputs' dtype;
    None for the rest. One launch a side."""
    grads = [None] * 4
    if spec.rows and spec.nk:
        grad_kl = grad_kl.to(torch.float32).contiguous()
        stats = AttnKLStats(*(t.to(torch.float32).contiguous() for t in stats))
    for s in sides(spec.needs):
        slots = slice(2, 4) if s == 1 else slice(0, 2)
        grads[slots] = _launch(spec, inputs, stats, grad_kl, s)
    return tuple(g if need else None for g, need in zip(grads, spec.needs))


def _launch(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: torch.Tensor, s: int):
    """(dq, dk) of setting s's side from one launch (stats and grad_kl float32, contiguous)."""
    q1, k1, q2, k2, _ = inputs
    q, k = (q2, k2) if s == 1 else (q1, k1)
    if spec.rows == 0 or spec.nk == 0:
        return (torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k))
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kl, lse1, lse2 = stats
    dev = q1.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    kstages, grid = launch_plan(spec, s, index)
    consts = shipped(padded_dim(spec.d1), padded_dim(spec.d2), q1.dtype == torch.float16, s, kstages)
    handle, smem = kernel(tuple(sorted(consts.items())), index)
    g_own, g_other = (spec.group2, spec.group1) if s == 1 else (spec.group1, spec.group2)
    m_tiles = -(-spec.nq // BM)
    block = (
        tensor_map(q1, BM)
        + tensor_map(k1, BN)
        + tensor_map(q2, BM)
        + tensor_map(k2, BN)
        + _POINTERS.pack(lse1.data_ptr(), lse2.data_ptr(), grad_kl.data_ptr(), dq.data_ptr(), dk.data_ptr())
        + _SCALARS.pack(
            spec.heads,
            spec.nq,
            spec.nk,
            spec.d2 if s == 1 else spec.d1,
            g_own,
            g_other,
            int(spec.causal),
            m_tiles,
            spec.scale1 * LOG2E,
            spec.scale2 * LOG2E,
            spec.scale2 if s == 1 else spec.scale1,
            kl.data_ptr(),
        )
        + _PAD
    )
    params = ctypes.create_string_buffer(block, BWD_PARAMS_BYTES)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    from cuda.bindings import driver

    stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(index))
    (err,) = driver.cuLaunchKernel(handle, *grid, THREADS, 1, 1, smem, stream, ctypes.addressof(argv), 0)
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel of {ENTRY} {consts} failed: {err!r}")
    return dq.to(q.dtype), dk
