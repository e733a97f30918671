"""Every STREAMKL_* environment variable, read when a call uses it (never frozen at import).

Each reader raises ValueError naming the variable when its value is not one it accepts;
`check_all` runs every reader but STREAMKL_BACKEND's (checked by the dispatch, which reads it
only when no backend= is given), so a call rejects a bad value even of a variable that only
another backend reads.
"""

from __future__ import annotations

import os


def _read(name: str, default: str) -> str:
    return os.environ.get(name, default).strip().lower() or default


def backend() -> str:
    """STREAMKL_BACKEND: auto (default) or a backend name; streamkl._dispatch checks the name."""
    return _read("STREAMKL_BACKEND", "auto")


def reference_chunk() -> int | None:
    """STREAMKL_REFERENCE_CHUNK: query rows per chunk of the reference backend (default: sized
    from the problem, docs/contract.md, Memory)."""
    value = os.environ.get("STREAMKL_REFERENCE_CHUNK", "").strip()
    if value == "":
        return None
    try:
        chunk = int(value)
    except ValueError:
        chunk = 0
    if chunk < 1:
        raise ValueError(f"STREAMKL_REFERENCE_CHUNK must be a positive integer, got {value!r}")
    return chunk


def cache_dir() -> str | None:
    """STREAMKL_CACHE_DIR: where the cuda backend keeps compiled kernels (default: the user's
    cache directory, streamkl/backends/cuda/_jit.py)."""
    value = os.environ.get("STREAMKL_CACHE_DIR", "").strip()
    return value or None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 lets the triton backend run on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_split_k() -> int | None:
    """STREAMKL_TRITON_SPLIT_K: auto (default: the measured rule) | off | N (force N key splits
    in the triton forward and the backward's dq kernel; 1 and off mean no split)."""
    value = _read("STREAMKL_TRITON_SPLIT_K", "auto")
    if value == "auto":
        return None
    if value in ("off", "0", "none"):
        return 1
    try:
        splits = int(value)
    except ValueError:
        splits = 0
    if splits < 1:
        raise ValueError(f"STREAMKL_TRITON_SPLIT_K must be auto, off or a positive integer, got {value!r}")
    return splits


def triton_bwd() -> str:
    """STREAMKL_TRITON_BWD: auto (default: the measured rule) | fused | separate."""
    value = _read("STREAMKL_TRITON_BWD", "auto")
    if value not in ("auto", "fused", "separate"):
        raise ValueError(f"STREAMKL_TRITON_BWD must be auto, fused or separate, got {value!r}")
    return value


def cuda_bwd() -> str:
    """STREAMKL_CUDA_BWD: cuda (default: the cuda backend's own backward, kernels/kl_bwd.cu, on the
    calls it runs, measured faster; triton's on the rest) | triton (triton's backward on every call)."""
    value = _read("STREAMKL_CUDA_BWD", "cuda")
    if value not in ("triton", "cuda"):
        raise ValueError(f"STREAMKL_CUDA_BWD must be cuda or triton, got {value!r}")
    return value


def check_all() -> None:
    """Reads every variable, so a bad value fails the call before any kernel runs."""
    reference_chunk()
    triton_split_k()
    triton_bwd()
    cuda_bwd()
