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


def auto_declines(spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None:
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
