"""attn_kl on the triton backend (streamkl/_backend.py's protocol): a fused one-pass forward
(split over the key axis for few query rows) and a recompute backward (separate dq / key-major
kernels, or one fused kernel with dq atomics); docs/triton.md describes them. triton is imported
by `forward` / `backward` (through _launch) and probed by `supports`."""

from __future__ import annotations

import functools
import importlib.util

import torch

from ... import _env
from ..._spec import AttnKLInputs, AttnKLSpec

op = "attn_kl"
backward_backend = None
MAX_HEAD_DIM = 256


@functools.cache
def _installed(find_spec) -> bool:
    # Keyed on the finder, so one replaced in a test is asked anew; otherwise asked once.
    return find_spec("triton") is not None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def supports(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    if not _installed(importlib.util.find_spec):
        return "triton is not installed (pip install 'streamkl[triton]')"
    q1, k1, q2, k2, _ = inputs
    if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) for t in (q1, q2)):
        return f"triton backend runs float16/bfloat16/float32, got {q1.dtype}/{q2.dtype}"
    if q1.dtype != q2.dtype:
        # One tile config and one product precision per launch: fp32 products must not run as TF32.
        return f"triton backend needs both pairs in one dtype, got {q1.dtype} and {q2.dtype}"
    if spec.d1 > MAX_HEAD_DIM or spec.d2 > MAX_HEAD_DIM:
        return f"triton backend supports head dims up to {MAX_HEAD_DIM}, got D1={spec.d1}, D2={spec.d2}"
    device = q1.device
    if device.type == "cuda":
        major, _ = _capability(device)
        if major < 8 and q1.dtype == torch.bfloat16:
            return "bfloat16 needs a GPU of compute capability 8.0 or newer"
        if major < 7:
            return "triton backend needs a GPU of compute capability 7.0 or newer"
    elif not _env.triton_interpret():
        return (
            f"triton backend runs CUDA tensors (got {device.type}; "
            "TRITON_INTERPRET=1 allows CPU tensors for tests)"
        )
    elif q1.dtype == torch.bfloat16:  # the interpreter's bfloat16 tl.dot does not round as a GPU's does
        return "triton's interpreter (CPU tensors) runs float32/float16 only, got bfloat16"
    return None


def auto_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    return None


def backward_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    return None  # its own backward runs every call its forward does


def forward(spec: AttnKLSpec, inputs: AttnKLInputs):
    from . import _launch

    return _launch.forward(spec, inputs)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats, grad_kl):
    from . import _launch

    return _launch.backward(spec, inputs, stats, grad_kl)
