"""Backend choice, for every op. An explicitly named backend never falls back silently: if it
cannot run the call it raises, saying why and which backends can. `auto` takes the fastest that
can and so never fails where the reference could run (docs/contract.md, Backends)."""

from __future__ import annotations

import importlib

from . import _env

# The one list of backends, fastest first: the order auto tries them in. A backend is a package
# with one module per op it implements, named as the op (streamkl/_backend.py), and a line here.
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


def implementation(name: str, op: str):
    """Backend `name`'s implementation of `op` (streamkl/_backend.py), or None if it has none."""
    return getattr(module(name), op, None)


def why_not(name: str, op: str, spec, inputs) -> str | None:
    """None when backend `name` can run this call of `op`, else the reason."""
    try:
        impl = implementation(name, op)
    except ImportError as exc:  # a backend package missing from this install
        return f"it could not be imported ({exc})"
    if impl is None:
        return f"it does not implement {op}"
    return impl.supports(spec, inputs)


def available(op: str, spec, inputs) -> dict[str, str | None]:
    """Backend name -> None if it can run this call of `op`, else why not."""
    return {name: why_not(name, op, spec, inputs) for name in BACKENDS}


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


def first_for_auto(op: str, spec, inputs):
    """The implementation of the first backend in BACKENDS that runs the call and does not
    decline it (a backend measured slower than the next one on part of what it runs says where
    in its `auto_declines`)."""
    for name in BACKENDS:
        if why_not(name, op, spec, inputs) is None:
            impl = implementation(name, op)
            if impl.auto_declines(spec, inputs) is None:
                return impl
    raise AssertionError("the reference backend runs every validated call")


def select(op: str, spec, inputs, backend: str | None = None):
    """The implementation of `op` to run; `backend` overrides STREAMKL_BACKEND."""
    name = check_name(backend)
    if name == "auto":
        if inputs[0].device.type == "cpu":  # triton runs CPU tensors only in its (slow) interpreter
            return implementation("reference", op)
        return first_for_auto(op, spec, inputs)
    reason = why_not(name, op, spec, inputs)
    if reason is not None:
        able = [n for n, r in available(op, spec, inputs).items() if r is None]
        raise ValueError(
            f"backend {name!r} cannot run these inputs: {reason}. Backends that can: {', '.join(able)}"
        )
    return implementation(name, op)


def backward_of(impl, spec, inputs):
    """The implementation whose `backward` serves `impl`'s forward on this call: itself, or the
    backend it names in `backward_backend` where its own backward declines the call (a backend
    whose backward covers only part of what its forward runs)."""
    name = impl.backward_backend
    if name is None or impl.backward_declines(spec, inputs) is None:
        return impl
    return implementation(name, impl.op)
