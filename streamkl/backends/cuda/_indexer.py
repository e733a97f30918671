"""indexer_kl's host side on the cuda backend: the instantiations of kernels/indexer_kl.cu (one per
pass and dtype), its parameter block, tensor maps and launches on torch's current stream, and the
three entry points of streamkl/_backend.py built from them (no input copied; the teacher's lse is
copied to a contiguous float32 one, which the statistics return).

    forward             STATS + WRITE_KL: LSE2 (and TLSE: the teacher's LSE, when not given),
                        then the KL and T, in one launch (SPARSE: the rows' deduplicated key
                        sets, _indexer_host.key_sets, gathered)
    backward            GRADS with a = g [T > 0], b = g / T per row (the recompute backward)
    forward_with_grads  STATS + WRITE_KL + GRADS with a = b = every row's weight in the reduced loss
                        (T = 1; the teacher streams once, twice with TLSE), then, with a given
                        lse, REDO on the rows whose T is not 1
                        (docs/indexer.md, "One teacher pass per training step")
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import struct

import torch

from ..._indexer_host import backward_coefs, correction_coefs, empty, empty_stats, grad_outputs, key_sets
from ..._spec import IndexerKLGrads, IndexerKLInputs, IndexerKLSpec, IndexerKLStats, causal_offset
from . import _jit
from ._launch import LOG2E, _check, head_map, tensor_map

SOURCE_FILE = "indexer_kl.cu"
ENTRY = "indexer_kl"
THREADS = 384
MAX_HEADS = 128  # the teacher's heads of a row stack as one 128-wide GEMM operand
MAX_INDEX_HEADS = 64
MAX_D = 576  # the teacher's head dim (MLA's absorbed key): nine 64-column slabs
MAX_DI = 128
PARAMS_BYTES = 768  # sizeof(IndexerParams)
_POINTERS = struct.Struct("<12Q")  # lse, lse2, w, coef, kl, mass, dqi, dki, dw, topk, k, ki
_STRIDES = struct.Struct("<7q")  # w's (B, G, Sq), k's (B, Sk), ki's (B, Sk)
_SCALARS = struct.Struct("<15i3f")
_PAD = bytes(PARAMS_BYTES - 4 * 128 - _POINTERS.size - _STRIDES.size - _SCALARS.size)
# The layout of kernels/indexer_kl.cu: its fixed part (QI, the dz^T slabs, the rings, L, w, the
# scratch, the barriers, the alignment slack) and one Q slab of 128 heads x 64 columns per 64 of D.
SMEM_FIXED = 83968
Q_SLAB = 128 * 64 * 2
PASSES = {
    "forward": dict(STATS=1, WRITE_KL=1, GRADS=0, REDO=0),
    "step": dict(STATS=1, WRITE_KL=1, GRADS=1, REDO=0),
    "backward": dict(STATS=0, WRITE_KL=0, GRADS=1, REDO=0),
    "redo": dict(STATS=0, WRITE_KL=0, GRADS=1, REDO=1),
}
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def instantiation(pass_name: str, fp16: bool, sparse: bool, teacher_lse: bool = False) -> dict:
    """TLSE (the forward and the step of a call without a given lse): the kernel walks the row's
    keys once more over the teacher alone for its per-head LSE, and writes it."""
    tlse = teacher_lse and PASSES[pass_name]["STATS"]
    return dict(PASSES[pass_name], KL_FP16=int(fp16), SPARSE=int(sparse), TLSE=int(tlse))


def shipped_instantiations() -> list[dict]:
    """Every instantiation a supported input can select (CI compiles each of them)."""
    out = []
    for name, f, s, t in itertools.product(PASSES, (False, True), (False, True), (False, True)):
        if t and not PASSES[name]["STATS"]:
            continue
        out.append(instantiation(name, f, s, t))
    return out


def smem_bytes(d: int) -> int:
    return SMEM_FIXED + -(-d // 64) * Q_SLAB


def source() -> str:
    return (_jit.KERNELS / SOURCE_FILE).read_text()


def build(consts: dict) -> _jit.Build:
    return _jit.compile_kernel(source(), ENTRY, consts)


@functools.cache
def kernel(consts_items: tuple, device_index: int):
    """The loaded instantiation, its shared memory limit raised to the largest layout (D = 576)."""
    from cuda.bindings import driver

    handle = _jit.load(build(dict(consts_items)), device_index, ENTRY).handle
    if not isinstance(handle, driver.CUkernel):
        handle = driver.CUkernel(int(handle))
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(
        driver.cuKernelSetAttribute(attr, smem_bytes(MAX_D), handle, driver.CUdevice(device_index)),
        "cuKernelSetAttribute",
    )
    return handle


def _launch(pass_name: str, spec: IndexerKLSpec, inputs: IndexerKLInputs, out: dict, coef=None, scalar=0.0):
    """One launch of `pass_name` over every row: `out` holds lse (float32 contiguous), lse2, kl,
    mass and, where asked, dqi, dki, dw; `coef` ([4, B, Sq] float32: a, b, da, db) or every
    coefficient `scalar`."""
    q, k, qi, ki, w = inputs[:5]
    dev = q.device
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    consts = instantiation(pass_name, q.dtype == torch.float16, spec.sparse, inputs.lse is None)
    handle = kernel(tuple(sorted(consts.items())), index)

    def ptr(name):
        t = out.get(name)
        return 0 if t is None else t.data_ptr()

    dqi, dw = out.get("dqi"), out.get("dw")
    block = (
        head_map(q, 128)
        + tensor_map(k, 64)
        + head_map(qi, 64)
        + tensor_map(ki, 64)
        + _POINTERS.pack(
            ptr("lse"),
            ptr("lse2"),
            w.data_ptr(),
            0 if coef is None else coef.data_ptr(),
            ptr("kl"),
            ptr("mass"),
            ptr("dqi"),
            ptr("dki"),
            ptr("dw"),
            ptr("topk"),
            k.data_ptr(),
            ki.data_ptr(),
        )  # fmt: skip
        + _STRIDES.pack(*w.stride(), k.stride(0), k.stride(2), ki.stride(0), ki.stride(2))
        + _SCALARS.pack(
            spec.heads,
            spec.index_heads,
            spec.nq,
            spec.nk,
            spec.d,
            spec.di,
            -(-spec.d // 64),
            int(spec.causal),
            _DTYPE_CODE[w.dtype],
            _DTYPE_CODE[dw.dtype] if dw is not None else 0,
            int(dqi is not None and dqi.dtype == torch.float32),
            int(dqi is not None),
            int(out.get("dki") is not None),
            int(dw is not None),
            spec.topk_width if spec.sparse else 0,
            spec.scale * LOG2E,
            1.0 / spec.heads,
            scalar,
        )  # fmt: skip
        + _PAD
    )
    params = ctypes.create_string_buffer(block, PARAMS_BYTES)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    from cuda.bindings import driver

    stream = driver.CUstream(torch._C._cuda_getCurrentRawStream(index))
    grid = (spec.nq, spec.batch, 1)
    (err,) = driver.cuLaunchKernel(
        handle, *grid, THREADS, 1, 1, smem_bytes(spec.d), stream, ctypes.addressof(argv), 0
    )
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel of {ENTRY} {consts} failed: {err!r}")


def _teacher_lse(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> torch.Tensor:
    """The given lse as float32 contiguous (a copy), or the buffer the kernel writes it into."""
    if inputs.lse is None:
        return torch.empty((spec.batch, spec.heads, spec.nq), device=inputs.q.device, dtype=torch.float32)
    return inputs.lse.to(dtype=torch.float32, copy=True).contiguous()


def _row_stats(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> dict:
    kl = torch.empty((spec.batch, spec.nq), device=inputs.q.device, dtype=torch.float32)
    out = dict(lse=_teacher_lse(spec, inputs), lse2=torch.empty_like(kl), kl=kl, mass=torch.empty_like(kl))
    if spec.sparse:
        out["topk"] = key_sets(inputs.topk)
    return out


def forward(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
    if empty(spec):
        return empty_stats(spec, inputs)
    out = _row_stats(spec, inputs)
    _launch("forward", spec, inputs, out)
    return IndexerKLStats(out["kl"], out["lse"], out["lse2"], out["mass"])


def backward(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl: torch.Tensor
) -> IndexerKLGrads:
    """dI = g (softmax(I) [T > 0] - p / T), the teacher recomputed."""
    dqi, dki, dw = grad_outputs(spec, inputs)
    if not empty(spec) and any(spec.needs):
        kl, lse, lse2, mass = (t.to(torch.float32).contiguous() for t in stats)
        coef_a, coef_b = backward_coefs(mass, grad_kl)
        coef = torch.stack((coef_a, coef_b, coef_a, coef_b)).contiguous()
        out = dict(lse=lse, lse2=lse2, dqi=dqi, dki=dki, dw=dw)
        if spec.sparse:
            out["topk"] = key_sets(inputs.topk)
        _launch("backward", spec, inputs, out, coef=coef)
    return IndexerKLGrads(dqi, None if dki is None else dki.to(inputs.ki.dtype), dw)


def row_weight(spec: IndexerKLSpec, reduction: str, sets: torch.Tensor | None):
    """Every row's gradient in the reduced loss, known before the launch: 1 for "sum"; for "mean",
    1 / the rows that admit a key: a dense call's from the shapes (all rows but, under the causal
    mask with Sq > Sk, the first Sq - Sk), a float; a sparse call's from its key sets (an entry
    that is a key the row's mask admits), a 0-d tensor on the device (no host sync)."""
    if reduction == "sum":
        return 1.0
    off = causal_offset(spec.nq, spec.nk)
    if sets is None:
        seen = 0 if spec.nk == 0 else spec.nq if not spec.causal else max(0, spec.nq - max(0, -off))
        return 1.0 / max(1, spec.batch * seen)
    end = torch.arange(spec.nq, device=sets.device, dtype=torch.int32)[:, None] + (off + 1)
    end = end.clamp(max=spec.nk) if spec.causal else torch.full_like(end, spec.nk)
    seen = ((sets >= 0) & (sets < end)).any(-1).sum()
    return seen.clamp_min(1).to(torch.float32).reciprocal()


def forward_with_grads(
    spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str
) -> tuple[IndexerKLStats, IndexerKLGrads]:
    """The fused step: dI = w_r (q - p), every row's weight w_r known before the launch (a dense
    call's rows that see a key are known from the shapes), exact where T = 1; then the
    correction pass on the rows whose given lse leaves T != 1 (its CTAs of other rows exit)."""
    dqi, dki, dw = grad_outputs(spec, inputs, held=True)
    if empty(spec):
        return empty_stats(spec, inputs), IndexerKLGrads(dqi, dki, dw)
    out = dict(_row_stats(spec, inputs), dqi=dqi, dki=dki, dw=dw)
    weight = row_weight(spec, reduction, out.get("topk"))
    if isinstance(weight, float):
        _launch("step", spec, inputs, out, scalar=weight)
    else:  # every row's coefficients the device's 0-d weight
        _launch("step", spec, inputs, out, coef=weight.expand(4, *out["kl"].shape).contiguous())
    if inputs.lse is not None and any(spec.needs):  # a computed lse leaves T = 1 to rounding
        kl = out["kl"]
        weights = torch.full_like(kl, weight) if isinstance(weight, float) else weight.expand_as(kl)
        whole, delta = correction_coefs(weights, out["mass"], out["lse2"])
        _launch("redo", spec, inputs, out, coef=torch.stack((*whole, *delta)).contiguous())
    stats = IndexerKLStats(out["kl"], out["lse"], out["lse2"], out["mass"])
    return stats, IndexerKLGrads(dqi, dki, dw)


def supports(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    """Why kernels/indexer_kl.cu cannot run this call (beyond the device checks of
    indexer_kl.supports), or None."""
    q, k, qi, ki, w = inputs[:5]
    if q.dtype not in (torch.bfloat16, torch.float16) or {k.dtype, qi.dtype, ki.dtype} != {q.dtype}:
        got = ", ".join(str(t.dtype) for t in (q, k, qi, ki))
        return f"the cuda backend's indexer_kl takes q, k, qi, ki in one 16-bit dtype; got {got}"
    if w.dtype not in _DTYPE_CODE:
        return f"the cuda backend's indexer_kl takes w in float32, bfloat16 or float16; got {w.dtype}"
    if spec.packed:
        return "the cuda backend's indexer_kl does not run packed sequences"
    if spec.heads_kv != 1:
        return "the cuda backend's indexer_kl runs an MQA teacher (one key head, MLA's absorbed mode)"
    if spec.heads > MAX_HEADS or spec.index_heads > MAX_INDEX_HEADS:
        return (
            f"the cuda backend's indexer_kl runs up to {MAX_HEADS} teacher and {MAX_INDEX_HEADS} indexer "
            f"heads; got H={spec.heads}, G={spec.index_heads}"
        )
    if spec.d > MAX_D or spec.di > MAX_DI or spec.di % 2:
        return (
            f"the cuda backend's indexer_kl runs teacher head dims up to {MAX_D} and even indexer head "
            f"dims up to {MAX_DI}; got D={spec.d}, Di={spec.di}"
        )
    if spec.batch > 65535 or spec.nq >= 2**31:
        return "the cuda backend's indexer_kl runs at most 65535 batches of fewer than 2^31 rows"
    if torch.are_deterministic_algorithms_enabled():
        return "the cuda backend's indexer_kl adds dki with atomics (deterministic mode runs triton's)"
    if not math.isfinite(spec.scale):
        return "the cuda backend's indexer_kl needs a finite scale"
    return None
