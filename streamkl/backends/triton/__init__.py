"""Triton backend: fused one-pass forward (optionally split over the key axis), recompute
backward (separate dq / dk kernels or one fused kernel with dq atomics).

Importing this package needs torch alone; triton is imported by `forward` / `backward` (through
`_launch`) and probed by `supports`. See docs/triton.md for the kernels, configs and the
measured selection rules.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ... import _env

MAX_HEAD_DIM = 256


@functools.cache
def _installed(find_spec) -> bool:
    # Keyed on the finder, so one replaced in a test is asked anew; otherwise asked once.
    return find_spec("triton") is not None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def supports(q1, k1, q2, k2, cu_seqlens) -> str | None:
    """None when this backend can run the (validated) inputs, else the reason it cannot."""
    if not _installed(importlib.util.find_spec):
        return "triton is not installed (pip install 'streamkl[triton]')"
    tensors = (q1, k1, q2, k2)
    if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) for t in tensors):
        return f"triton backend runs float16/bfloat16/float32, got {q1.dtype}/{q2.dtype}"
    if q1.dtype != q2.dtype:
        # One tile config and one product precision per launch: fp32 products must not run as TF32.
        return f"triton backend needs both pairs in one dtype, got {q1.dtype} and {q2.dtype}"
    if q1.shape[-1] > MAX_HEAD_DIM or q2.shape[-1] > MAX_HEAD_DIM:
        return (
            f"triton backend supports head dims up to {MAX_HEAD_DIM}, "
            f"got D1={q1.shape[-1]}, D2={q2.shape[-1]}"
        )
    device = q1.device
    if device.type == "cuda":
        major, _ = _capability(device)
        if major < 8 and any(t.dtype == torch.bfloat16 for t in tensors):
            return "bfloat16 needs a GPU of compute capability 8.0 or newer"
        if major < 7:
            return "triton backend needs a GPU of compute capability 7.0 or newer"
    elif not _env.triton_interpret():
        return (
            f"triton backend runs CUDA tensors (got {device.type}; "
            "TRITON_INTERPRET=1 allows CPU tensors for tests)"
        )
    if cu_seqlens is not None and cu_seqlens.device != device:
        return "cu_seqlens must be on the inputs' device"
    return None


def forward(q1, k1, q2, k2, *, causal, scale1, scale2, cu_seqlens, max_seqlen):
    """(kl, lse1, lse2), each (B, H, Nq) float32 contiguous. Rows that see no key: 0, -inf, -inf."""
    from . import _launch

    return _launch.forward(
        q1,
        k1,
        q2,
        k2,
        causal=causal,
        scale1=scale1,
        scale2=scale2,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )


def backward(
    grad_kl, q1, k1, q2, k2, kl, lse1, lse2, *, causal, scale1, scale2, cu_seqlens, max_seqlen, needs
):
    """(dq1, dk1, dq2, dk2); None where `needs` is False."""
    from . import _launch

    return _launch.backward(
        grad_kl,
        q1,
        k1,
        q2,
        k2,
        kl,
        lse1,
        lse2,
        causal=causal,
        scale1=scale1,
        scale2=scale2,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        needs=needs,
    )
