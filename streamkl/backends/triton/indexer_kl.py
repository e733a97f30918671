"""indexer_kl on the triton backend (streamkl/_backend.py's protocol; docs/indexer.md, "The
triton backend"): a statistics pass (the student's LSE2, and the teacher's per-head LSE when
not given) and a main pass that streams the teacher once and forms the KL, and in the same walk
the student's gradients where asked (the recompute backward, or the fused training step's
forward_with_grads). triton is imported by `forward` / `backward` (through _indexer_launch)
and probed by `supports`."""

from __future__ import annotations

import torch

from ... import _env
from ..._spec import IndexerKLInputs, IndexerKLSpec
from .attn_kl import _capability, _installed

op = "indexer_kl"
backward_backend = None
MAX_HEAD_DIM = 576  # the teacher's: MLA's absorbed key
MAX_INDEX_HEAD_DIM = 128
MAX_INDEX_HEADS = 64  # the student's G heads x rows stay in registers with their dqi
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supports(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    import importlib.util

    if not _installed(importlib.util.find_spec):
        return "triton is not installed (pip install 'streamkl[triton]')"
    q, qi, w = inputs.q, inputs.qi, inputs.w
    if any(t.dtype not in _DTYPES for t in (q, qi, w)):
        return f"triton backend runs float16/bfloat16/float32, got q {q.dtype}, qi {qi.dtype}, w {w.dtype}"
    if spec.d > MAX_HEAD_DIM:
        return f"triton backend supports teacher head dims up to {MAX_HEAD_DIM}, got D={spec.d}"
    if spec.di > MAX_INDEX_HEAD_DIM:
        return f"triton backend supports indexer head dims up to {MAX_INDEX_HEAD_DIM}, got Di={spec.di}"
    if spec.index_heads > MAX_INDEX_HEADS:
        return f"triton backend supports up to {MAX_INDEX_HEADS} indexer heads, got G={spec.index_heads}"
    sixteen = any(t.dtype == torch.bfloat16 for t in (q, qi, w))
    device = q.device
    if device.type == "cuda":
        major, _ = _capability(device)
        if major < 8 and sixteen:
            return "bfloat16 needs a GPU of compute capability 8.0 or newer"
        if major < 7:
            return "triton backend needs a GPU of compute capability 7.0 or newer"
    elif not _env.triton_interpret():
        return (
            f"triton backend runs CUDA tensors (got {device.type}; "
            "TRITON_INTERPRET=1 allows CPU tensors for tests)"
        )
    elif sixteen:  # the interpreter's bfloat16 tl.dot does not round as a GPU's does
        return "triton's interpreter (CPU tensors) runs float32/float16 only, got bfloat16"
    return None


def auto_declines(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    return None


def forward(spec: IndexerKLSpec, inputs: IndexerKLInputs):
    from . import _indexer_launch

    return _indexer_launch.forward(spec, inputs)


def backward(spec: IndexerKLSpec, inputs: IndexerKLInputs, stats, grad_kl):
    from . import _indexer_launch

    return _indexer_launch.backward(spec, inputs, stats, grad_kl)


def forward_with_grads(spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str):
    from . import _indexer_launch

    return _indexer_launch.forward_with_grads(spec, inputs, reduction)
