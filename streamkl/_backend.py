"""What a backend provides for an op: the protocol the type checker and the conformance suite
(tests/test_backends.py) hold every backend to.

A backend is a package under streamkl/backends/ (the reference lives in streamkl/reference/)
with one module per op it implements, named as the op (`<backend>/attn_kl.py`) and imported by
the package, and one line in streamkl._dispatch.BACKENDS. The module itself is the
implementation: its functions and constants are the protocol's members. Importing the package
needs torch alone: its optional dependency (triton, cuda-python) is imported inside `forward` /
`backward` and probed by `supports`.

Inputs arrive validated (streamkl._checks): shapes, dtypes and devices agree, the spec's
scales are floats and, for packed sequences, `max_seqlen` is a host int at least the longest
sequence. Any strides: a backend must not copy whole inputs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from ._spec import (
    AttnKLGrads,
    AttnKLInputs,
    AttnKLSpec,
    AttnKLStats,
    IndexerKLGrads,
    IndexerKLInputs,
    IndexerKLSpec,
    IndexerKLStats,
)


@runtime_checkable
class AttnKLBackend(Protocol):
    """attn_kl on one backend."""

    op: str  # "attn_kl"
    # The backend whose `backward` serves this one's forward where its own backward declines the
    # call (None: its own serves every call). Such a backend admits in `supports` only inputs that
    # one runs too, and its forward writes the statistics that one reads.
    backward_backend: str | None

    def supports(self, spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
        """None when this backend can run the call, else the reason it cannot."""
        ...

    def auto_declines(self, spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
        """Why `auto` passes this backend by on a call it supports (measured slower there than
        the next backend in BACKENDS), or None. A named backend still runs such calls."""
        ...

    def forward(self, spec: AttnKLSpec, inputs: AttnKLInputs) -> AttnKLStats | tuple[Tensor, Tensor, Tensor]:
        """(kl, lse1, lse2), each (B, H, Nq) float32 (float64 for float64 inputs), fresh and
        contiguous; rows that see no key: kl = 0, lse = -inf."""
        ...

    def backward_declines(self, spec: AttnKLSpec, inputs: AttnKLInputs) -> str | None:
        """Why this backend's own backward does not run a call its forward ran (backward_backend's
        then does), or None. Asked only where backward_backend is set."""
        ...

    def backward(
        self, spec: AttnKLSpec, inputs: AttnKLInputs, stats: AttnKLStats, grad_kl: Tensor
    ) -> AttnKLGrads | tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
        """(dq1, dk1, dq2, dk2) for grad_kl (B, H, Nq) in the stats' dtype, contiguous; the
        gradients spec.needs asks for have their input's shape and dtype (contiguous), the
        others are None."""
        ...


@runtime_checkable
class IndexerKLBackend(Protocol):
    """indexer_kl on one backend (docs/indexer.md): the teacher takes no gradient."""

    op: str  # "indexer_kl"
    backward_backend: str | None

    def supports(self, spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None: ...

    def auto_declines(self, spec: IndexerKLSpec, inputs: IndexerKLInputs) -> str | None: ...

    def forward(self, spec: IndexerKLSpec, inputs: IndexerKLInputs) -> IndexerKLStats:
        """The KL and what the backward reads (IndexerKLStats), fresh and contiguous."""
        ...

    def backward(
        self, spec: IndexerKLSpec, inputs: IndexerKLInputs, stats: IndexerKLStats, grad_kl: Tensor
    ) -> IndexerKLGrads:
        """(dqi, dki, dw) for grad_kl (B, Sq); None where spec.needs says so."""
        ...

    def forward_with_grads(
        self, spec: IndexerKLSpec, inputs: IndexerKLInputs, reduction: str
    ) -> tuple[IndexerKLStats, IndexerKLGrads]:
        """The training step of a reduced loss (docs/indexer.md, "One teacher pass per training
        step"): forward's statistics and the gradients of the loss reduced by `reduction` ("sum"
        or "mean": every row's upstream gradient _spec.reduced_row_weight) that spec.needs asks
        for, which the op scales by the upstream scalar. dqi and dw in their inputs' dtypes;
        dki, a sum over rows, in the statistics' dtype (float32, float64 for float64 inputs).
        A backend with a fused kernel streams the teacher once; one without runs forward, then
        backward with those row weights."""
        ...
