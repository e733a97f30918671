"""attn_kl on the cuda backend (streamkl/_backend.py's protocol): the forward is a
warp-specialized TMA + wgmma kernel (kernels/kl_fwd.cu); the backward of either setting is
another (kernels/kl_bwd.cu, _bwd.declines says which calls it runs), and the triton backend's
backward, run on this forward's (kl, lse1, lse2), serves the rest, so `supports` admits only
inputs triton runs too."""

from __future__ import annotations

import functools

import torch

from ..._spec import AttnKLInputs, AttnKLSpec

op = "attn_kl"
backward_backend = "triton"  # for the backwards kernels/kl_bwd.cu does not run
_DTYPES = (torch.bfloat16, torch.float16)
_MAX_GRID_YZ = 65535  # grid z holds the batch times the splits; heads keep the same bound


@functools.cache
def _toolchain() -> str | None:
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.core  # noqa: F401

        from . import _jit

        _jit.nvrtc_version()
    except Exception as exc:  # missing package or no NVRTC library
        return f"cuda-python with NVRTC is not usable here ({exc}); install streamkl[cuda]"
    return None


@functools.cache
def _arch_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return f"the cuda backend's kernels are built for sm_90a (Hopper); this GPU is sm_{major}{minor}"
    return None


def supports(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    q1, k1, q2, k2, _ = inputs
    if q1.device.type != "cuda":
        return "the cuda backend runs CUDA tensors only"
    dtypes = {t.dtype for t in (q1, k1, q2, k2)}
    if len(dtypes) != 1 or q1.dtype not in _DTYPES:
        got = ", ".join(sorted(str(d) for d in dtypes))
        return f"the cuda backend takes one dtype, float16 or bfloat16, for all four inputs; got {got}"
    from ._launch import MAX_D

    if spec.d1 > MAX_D or spec.d2 > MAX_D:
        return f"the cuda backend runs head dims up to {MAX_D}; got D1={spec.d1}, D2={spec.d2}"
    if spec.heads > _MAX_GRID_YZ or spec.num_seqs > _MAX_GRID_YZ:
        return f"the cuda backend runs at most {_MAX_GRID_YZ} heads and batches (or packed sequences)"
    return runtime_reason(q1.device, dict(q1=q1, k1=k1, q2=q2, k2=k2))


def runtime_reason(device: torch.device, tma_inputs: dict) -> str | None:
    """What every op of this backend needs beyond its own limits: cuda-python with NVRTC, an sm_90
    GPU, and TMA able to address each named input in place; the first missing, or None."""
    from ._launch import tma_reason

    reason = _toolchain() or _arch_reason(device.index or 0)
    for name, t in tma_inputs.items():
        reason = reason or tma_reason(t, name)
    return reason


def auto_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    # auto takes this backend wherever it runs. At 16 query rows or fewer with a head dim over 64
    # triton's split-K forward is 5-9% faster, but this backend's training step is 1.3-1.6x
    # triton's there (its own backward; docs/cuda.md, Dispatch), and distillation trains.
    return None


def forward(spec: AttnKLSpec, inputs: AttnKLInputs):
    from ._launch import forward as launch

    return launch(spec, inputs)


def backward_declines(spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
    from ._bwd import declines

    return declines(spec, inputs)


def backward(spec: AttnKLSpec, inputs: AttnKLInputs, stats, grad_kl):
    from ._bwd import backward as launch
    from ._bwd import declines

    reason = declines(spec, inputs)
    if reason is not None:  # the dispatcher asked backward_declines and took triton's; a direct call
        raise NotImplementedError(reason)
    return launch(spec, inputs, stats, grad_kl)
