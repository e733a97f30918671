"""Backend choice. An explicitly named backend never falls back silently: if it cannot run the
inputs it raises, saying why and which backends can. `auto` takes the fastest that can and so
never fails where the reference could run (docs/contract.md, Backends)."""

from __future__ import annotations

import importlib

from . import _env

# The one list of backends, fastest first: the order auto tries them in. A new backend is a
# package with supports/forward/backward (streamkl/backends/__init__.py) and a line here.
BACKENDS = {
    "cuda": "streamkl.backends.cuda",
    "triton": "streamkl.backends.triton",
    "reference": "streamkl.reference",
}
CHOICES = ("auto", *BACKENDS)


_MODULES: dict = {}


def module(name: str):
    """The backend package `name` (imported on first use; a dict lookup after that)."""
    found = _MODULES.get(name)
    if found is None:
        found = _MODULES[name] = importlib.import_module(BACKENDS[name])
    return found


def backward_of(backend):
    """The module whose `backward` serves `backend`'s forward: a backend whose own backward does
    not exist yet names another in BACKWARD (its `supports` then admits only inputs that one
    runs too, and its forward writes the statistics that one reads)."""
    name = getattr(backend, "BACKWARD", None)
    return backend if name is None else module(name)


def auto_declines(name: str, q1, k1, q2, k2, cu_seqlens=None) -> str | None:
    """Why `auto` passes backend `name` by on inputs it supports, or None: a backend that is
    measured slower than the next one on part of what it runs says where in `auto_declines`
    (it still runs those inputs when named)."""
    try:
        declines = getattr(module(name), "auto_declines", None)
    except ImportError:  # a backend package missing from this install: why_not says so
        return None
    return None if declines is None else declines(q1, k1, q2, k2, cu_seqlens)


def why_not(name: str, q1, k1, q2, k2, cu_seqlens=None) -> str | None:
    """None when backend `name` can run these inputs, else the reason."""
    try:
        backend = module(name)
    except ImportError as exc:  # a backend package missing from this install
        return f"it could not be imported ({exc})"
    return backend.supports(q1, k1, q2, k2, cu_seqlens)


def available_backends(q1, k1, q2, k2, cu_seqlens=None) -> dict[str, str | None]:
    """Backend name -> None if it can run these inputs, else why not."""
    return {name: why_not(name, q1, k1, q2, k2, cu_seqlens) for name in BACKENDS}


def check_name(backend: str | None) -> str:
    """The backend a call asks for: `backend`, else STREAMKL_BACKEND; a clear error if unknown."""
    if backend is None:
        name = _env.backend()
        if name not in CHOICES:
            raise ValueError(
                f"STREAMKL_BACKEND={name!r} is not a backend; expected one of {', '.join(CHOICES)}"
            )
        return name
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    if backend not in CHOICES:
        raise ValueError(f"backend={backend!r} is not a backend; expected one of {', '.join(CHOICES)}")
    return backend


def first_for_auto(q1, k1, q2, k2, cu_seqlens=None):
    """The first backend in BACKENDS that runs these inputs and does not decline them."""
    inputs = (q1, k1, q2, k2, cu_seqlens)
    for name in BACKENDS:
        if why_not(name, *inputs) is None and auto_declines(name, *inputs) is None:
            return module(name)
    raise AssertionError("the reference backend runs every validated input")


def select(q1, k1, q2, k2, cu_seqlens=None, backend: str | None = None):
    """The backend module to run; `backend` overrides STREAMKL_BACKEND."""
    name = check_name(backend)
    if name == "auto":
        if q1.device.type == "cpu":  # triton runs CPU tensors only in its (slow) interpreter
            return module("reference")
        return first_for_auto(q1, k1, q2, k2, cu_seqlens)
    reason = why_not(name, q1, k1, q2, k2, cu_seqlens)
    if reason is not None:
        able = [n for n, r in available_backends(q1, k1, q2, k2, cu_seqlens).items() if r is None]
        raise ValueError(
            f"backend {name!r} cannot run these inputs: {reason}. Backends that can: {', '.join(able)}"
        )
    return module(name)
