"""indexer_kl on the cuda backend (streamkl/_backend.py's protocol; docs/indexer.md, "The cuda
backend"): one CTA per query row with the row's teacher queries resident in shared memory
(kernels/indexer_kl.cu), dense or top-k sparse, with an MQA teacher;
`supports` names what it leaves to triton."""

from __future__ import annotations

from ..._spec import IndexerKLInputs, IndexerKLSpec
from .attn_kl import runtime_reason

op = "indexer_kl"
backward_backend = None


def supports(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    q = inputs.q
    if q.device.type != "cuda":
        return "the cuda backend runs CUDA tensors only"
    from . import _indexer

    named = dict(zip(("q", "k", "qi", "ki"), inputs[:4]))
    return _indexer.supports(spec, inputs) or runtime_reason(q.device, named)


# The kernel stacks a row's teacher heads as one 128-wide GEMM operand, missing heads zero: below
# this many heads it does 128 / H times the teacher's work, about twice as fast a unit as the
# triton backend's (docs/indexer.md, Measured on one H200), so triton, whose tiles follow H, is
# expected faster there (a work model: small H is not yet measured).
AUTO_MIN_HEADS = 64


def auto_declines(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
    if spec.heads < AUTO_MIN_HEADS:
        return (
            f"{spec.heads} teacher heads: the cuda kernel pads them to 128 and does {128 / spec.heads:.3g}x "
            "the teacher's work; auto takes triton below 64 heads"
        )
    return None


def forward(spec: IndexerKLSpec, inputs: IndexerKLInputs):
    from . import _indexer

    return _indexer.forward(spec, inputs)


def backward(spec: IndexerKLSpec, inputs: IndexerKLInputs, stats, grad_kl):
    from . import _indexer

    return _indexer.backward(spec, inputs, stats, grad_kl)


def forward_with_grads(spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str):
    from . import _indexer

    return _indexer.forward_with_grads(spec, inputs, reduction)
