"""Backend choice. An explicitly named backend never falls back silently: if it cannot run the
inputs it raises, saying why and which backends can. `auto` takes the fastest that can
(cuda on sm_90 > triton > reference) and so never fails where the reference could run."""

from __future__ import annotations

import importlib

from . import _env

# Fastest first: the order auto tries them in.
_MODULES = {
    "cuda": "streamkl.backends.cuda",
    "triton": "streamkl.backends.triton",
    "reference": "streamkl.reference",
}


def _module(name: str):
    return importlib.import_module(_MODULES[name])


def why_not(name: str, q1, k1, q2, k2, cu_seqlens=None) -> str | None:
    """None when backend `name` can run these inputs, else the reason."""
    try:
        module = _module(name)
    except ImportError as exc:  # a backend package missing from this install
        return f"it could not be imported ({exc})"
    return module.supports(q1, k1, q2, k2, cu_seqlens)


def available_backends(q1, k1, q2, k2, cu_seqlens=None) -> dict[str, str | None]:
    """Backend name -> None if it can run these inputs, else why not."""
    return {name: why_not(name, q1, k1, q2, k2, cu_seqlens) for name in _MODULES}


def select(q1, k1, q2, k2, cu_seqlens=None, backend: str | None = None):
    """The backend module to run; `backend` overrides STREAMKL_BACKEND."""
    if backend is None or backend == "auto":
        name = _env.backend() if backend is None else "auto"
    elif backend in _env.BACKENDS:
        name = backend
    else:
        raise ValueError(f"backend={backend!r} is not a backend; expected one of {', '.join(_env.BACKENDS)}")
    if name == "auto":
        if q1.device.type == "cpu":  # triton runs CPU tensors only in its (slow) interpreter
            return _module("reference")
        for candidate in _MODULES:
            if why_not(candidate, q1, k1, q2, k2, cu_seqlens) is None:
                return _module(candidate)
        raise AssertionError("the reference backend runs every validated input")
    reason = why_not(name, q1, k1, q2, k2, cu_seqlens)
    if reason is not None:
        able = [n for n, r in available_backends(q1, k1, q2, k2, cu_seqlens).items() if r is None]
        raise ValueError(
            f"backend {name!r} cannot run these inputs: {reason}. Backends that can: {', '.join(able)}"
        )
    return _module(name)
