"""The backward's host side: which inputs kernels/kl_bwd.cu runs (setting 1: dq2 and dk2 with the
teacher fixed), its instantiation, parameter block and launch on torch's current stream, and the
float32 dq2 buffer its adds land in (cast to dq2's dtype after the launch).

A call costs: the dq2 buffer (zeroed) and dk2, the grad/lse copies as float32 (no-ops when they
already are), four cached tensor maps, one struct.pack, cuLaunchKernel, and the cast of dq2.
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
_POINTERS = struct.Struct("<5Q")  # lse1, lse2, grad, dq2, dk2
_SCALARS = struct.Struct("<8i3f")  # h, nq, nk, d2, g1, g2, causal, m_tiles, c1, c2, scale2
_PAD = bytes(BWD_PARAMS_BYTES - 4 * 128 - _POINTERS.size - _SCALARS.size)
SETTING1 = (False, False, True, True)  # spec.needs of setting 1: dq2 and dk2


def smem_bytes(c: dict) -> int:
    """Mirrors SMEM_BYTES in kl_bwd.cu (the kernel traps if it is given less)."""
    k = BN * (c["D1P"] + c["D2P"]) * 2
    q = c["QSTAGES"] * BM * (c["D1P"] + c["D2P"]) * 2
    ds = 2 * BM * BN * 2
    rows = c["QSTAGES"] * 3 * BM * 4
    return k + q + ds + rows + 8 * (1 + 2 * c["QSTAGES"] + 4) + 1024


def shipped(d1p: int, d2p: int, fp16: bool) -> dict:
    """The compile-time constants (kl_bwd.cu's header) for padded head dims (d1p, d2p): a ring of
    as many query stages as shared memory holds, up to MAX_QSTAGES."""
    c = dict(KL_FP16=int(fp16), D1P=d1p, D2P=d2p)
    c["QSTAGES"] = max(s for s in range(1, MAX_QSTAGES + 1) if smem_bytes(dict(c, QSTAGES=s)) <= SMEM_LIMIT)
    return c


def shipped_instantiations() -> list[dict]:
    """Every instantiation a supported input can select (CI compiles each of them)."""
    return [shipped(a, b, f) for f in (False, True) for a in (64, 128) for b in (64, 128)]


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
    if spec.needs != SETTING1:
        return "the cuda backward runs setting 1 (gradients to q2 and k2 only)"
    if spec.packed:
        return "the cuda backward does not run packed sequences"
    if spec.heads_kv2 % spec.heads_kv1:  # g1 % g2 != 0, asked without dividing by H (may be 0)
        return "the cuda backward needs the teacher's GQA group to be a multiple of the student's"
    if spec.d2 % 2:
        return "the cuda backward needs an even D2"
    if torch.are_deterministic_algorithms_enabled():
        return "the cuda backward adds dq2 with atomics; deterministic mode runs triton's separate dq pass"
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


def launch_grid(spec: AttnKLSpec) -> tuple[int, int, int]:
    """One CTA per key tile of BN keys, per student key head and batch (kl_bwd.cu's grid)."""
    return (-(-spec.nk // BN), spec.heads_kv2, spec.batch)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: torch.Tensor):
    """(None, None, dq2, dk2) of setting 1 (declines() is None), contiguous in q2's and k2's dtype."""
    q1, k1, q2, k2, _ = inputs
    empty = spec.rows == 0 or spec.nk == 0
    dk2 = (torch.zeros_like if empty else torch.empty_like)(k2, memory_format=torch.contiguous_format)
    if empty:
        return None, None, torch.zeros_like(q2, memory_format=torch.contiguous_format), dk2
    dq2 = torch.zeros(q2.shape, device=q2.device, dtype=torch.float32)
    grad_kl = grad_kl.to(torch.float32).contiguous()
    _, lse1, lse2 = (t.to(torch.float32).contiguous() for t in stats)
    dev = q1.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    consts = shipped(padded_dim(spec.d1), padded_dim(spec.d2), q1.dtype == torch.float16)
    handle, smem = kernel(tuple(sorted(consts.items())), index)
    m_tiles = -(-spec.nq // BM)
    block = (
        tensor_map(q1, BM)
        + tensor_map(k1, BN)
        + tensor_map(q2, BM)
        + tensor_map(k2, BN)
        + _POINTERS.pack(lse1.data_ptr(), lse2.data_ptr(), grad_kl.data_ptr(), dq2.data_ptr(), dk2.data_ptr())
        + _SCALARS.pack(
            spec.heads,
            spec.nq,
            spec.nk,
            spec.d2,
            spec.group1,
            spec.group2,
            int(spec.causal),
            m_tiles,
            spec.scale1 * LOG2E,
            spec.scale2 * LOG2E,
            spec.scale2,
        )
        + _PAD
    )
    params = ctypes.create_string_buffer(block, BWD_PARAMS_BYTES)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    from cuda.bindings import driver

    stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(index))
    grid = launch_grid(spec)
    (err,) = driver.cuLaunchKernel(handle, *grid, THREADS, 1, 1, smem, stream, ctypes.addressof(argv), 0)
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel of {ENTRY} {consts} failed: {err!r}")
    return None, None, dq2.to(q2.dtype), dk2
