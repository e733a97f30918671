"""The backward's host side: which inputs kernels/kl_bwd.cu runs (one setting a call: setting 1,
dq2 and dk2 with the teacher fixed, or setting 2, dq1 and dk1 with the target fixed), its
instantiation, parameter block and launch on torch's current stream, and the float32 dq buffer its
adds land in (cast to the input's dtype after the launch).

A call costs: the dq buffer (zeroed) and dk, the grad/stats copies as float32 (no-ops when they
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


def setting(needs) -> int | None:
    """The setting whose kernel forms every gradient `needs` asks for (1: q2/k2, 2: q1/k1), or
    None when it asks for both sides' (or none)."""
    if any(needs[2:]) and not any(needs[:2]):
        return 1
    if any(needs[:2]) and not any(needs[2:]):
        return 2
    return None


def smem_bytes(c: dict) -> int:
    """Mirrors SMEM_BYTES in kl_bwd.cu (the kernel traps if it is given less)."""
    k = BN * (c["D1P"] + c["D2P"]) * 2
    q = c["QSTAGES"] * BM * (c["D1P"] + c["D2P"]) * 2
    ds = 2 * BM * BN * 2
    rows = c["QSTAGES"] * 3 * BM * 4
    return k + q + ds + rows + 8 * (1 + 2 * c["QSTAGES"] + 4) + 1024


def shipped(d1p: int, d2p: int, fp16: bool, setting: int = 1) -> dict:
    """The compile-time constants (kl_bwd.cu's header) for padded head dims (d1p, d2p) and a
    setting: a ring of as many query stages as shared memory holds, up to MAX_QSTAGES."""
    c = dict(KL_FP16=int(fp16), D1P=d1p, D2P=d2p, SETTING=setting)
    c["QSTAGES"] = max(s for s in range(1, MAX_QSTAGES + 1) if smem_bytes(dict(c, QSTAGES=s)) <= SMEM_LIMIT)
    return c


def shipped_instantiations() -> list[dict]:
    """Every instantiation a supported input can select (CI compiles each of them)."""
    return [shipped(a, b, f, s) for s in (1, 2) for f in (False, True) for a in (64, 128) for b in (64, 128)]


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
    s = setting(spec.needs)
    if s is None:
        return "the cuda backward runs one side's gradients a call (q2 and k2, or q1 and k1), not both"
    if spec.packed:
        return "the cuda backward does not run packed sequences"
    # the other side's GQA group a multiple of the own side's, asked without dividing by H (may be 0)
    if s == 1 and spec.heads_kv2 % spec.heads_kv1:
        return "the cuda backward of q2, k2 needs the teacher's GQA group to be a multiple of the student's"
    if s == 2 and spec.heads_kv1 % spec.heads_kv2:
        return "the cuda backward of q1, k1 needs the student's GQA group to be a multiple of the teacher's"
    if (spec.d2 if s == 1 else spec.d1) % 2:
        return f"the cuda backward needs an even head dim on the side it differentiates (D{3 - s})"
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
    """One CTA per key tile of BN keys, per key head of the differentiated side and batch
    (kl_bwd.cu's grid)."""
    heads = spec.heads_kv2 if setting(spec.needs) == 1 else spec.heads_kv1
    return (-(-spec.nk // BN), heads, spec.batch)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: torch.Tensor):
    """(dq1, dk1, dq2, dk2): the asked ones of the setting's pair (declines() is None), contiguous
    in the inputs' dtype; None for the rest."""
    q1, k1, q2, k2, _ = inputs
    s = setting(spec.needs)
    q, k = (q2, k2) if s == 1 else (q1, k1)
    empty = spec.rows == 0 or spec.nk == 0
    dk = (torch.zeros_like if empty else torch.empty_like)(k, memory_format=torch.contiguous_format)
    if empty:
        return _asked(spec, s, torch.zeros_like(q, memory_format=torch.contiguous_format), dk)
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    grad_kl = grad_kl.to(torch.float32).contiguous()
    kl, lse1, lse2 = (t.to(torch.float32).contiguous() for t in stats)
    dev = q1.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    consts = shipped(padded_dim(spec.d1), padded_dim(spec.d2), q1.dtype == torch.float16, s)
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
    grid = launch_grid(spec)
    (err,) = driver.cuLaunchKernel(handle, *grid, THREADS, 1, 1, smem, stream, ctypes.addressof(argv), 0)
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel of {ENTRY} {consts} failed: {err!r}")
    return _asked(spec, s, dq.to(q.dtype), dk)


def _asked(spec: AttnKLSpec, s: int, dq: torch.Tensor, dk: torch.Tensor) -> tuple:
    """The four gradient slots: the setting's pair where spec.needs asks for it, None elsewhere."""
    grads = (None, None, dq, dk) if s == 1 else (dq, dk, None, None)
    return tuple(g if need else None for g, need in zip(grads, spec.needs))
