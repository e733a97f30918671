"""CUDA C++ backend (NVRTC + cuda-python, TMA and wgmma on sm_90). Not built yet: it reports
itself unavailable so that naming it raises a clear error and `auto` skips it."""

from __future__ import annotations


def supports(q1, k1, q2, k2, cu_seqlens=None) -> str | None:
    return "the cuda backend is not implemented yet in this version of streamkl"


def forward(*args, **kwargs):
    raise NotImplementedError(supports(None, None, None, None))


def backward(*args, **kwargs):
    raise NotImplementedError(supports(None, None, None, None))
