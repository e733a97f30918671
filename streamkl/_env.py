"""Every STREAMKL_* environment variable, read when used (never frozen at import)."""

from __future__ import annotations

import os

BACKENDS = ("auto", "reference", "triton", "cuda")


def backend() -> str:
    """STREAMKL_BACKEND: auto (default) | reference | triton | cuda."""
    name = os.environ.get("STREAMKL_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"STREAMKL_BACKEND={name!r} is not a backend; expected one of {', '.join(BACKENDS)}")
    return name


def reference_chunk() -> int | None:
    """STREAMKL_REFERENCE_CHUNK: query rows per chunk of the reference backend (default: sized
    so that one chunk's logits take about 64 MiB)."""
    value = os.environ.get("STREAMKL_REFERENCE_CHUNK")
    if value is None or value == "":
        return None
    chunk = int(value)
    if chunk < 1:
        raise ValueError(f"STREAMKL_REFERENCE_CHUNK must be a positive integer, got {value!r}")
    return chunk


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 lets the triton backend run on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_split_k() -> int | None:
    """STREAMKL_TRITON_SPLIT_K: auto (default: the measured rule) | off | N (force N key splits
    in the triton forward; 1 and off mean no split)."""
    value = os.environ.get("STREAMKL_TRITON_SPLIT_K", "auto").strip().lower()
    if value in ("", "auto"):
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
    value = os.environ.get("STREAMKL_TRITON_BWD", "auto").strip().lower() or "auto"
    if value not in ("auto", "fused", "separate"):
        raise ValueError(f"STREAMKL_TRITON_BWD must be auto, fused or separate, got {value!r}")
    return value
