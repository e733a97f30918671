"""The public entry points."""

from __future__ import annotations

from torch import Tensor

from . import _checks, _dispatch
from ._spec import AttnKLInputs
from .ops import attn_kl as _attn_kl


def attn_kl(
    q1: Tensor,
    k1: Tensor,
    q2: Tensor,
    k2: Tensor,
    *,
    causal: bool = False,
    scale1: float | None = None,
    scale2: float | None = None,
    reduction: str = "none",
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    backend: str | None = None,
) -> Tensor:
    """KL(softmax(scale1 q1 k1^T) || softmax(scale2 q2 k2^T)) per query row, in one fused pass.

    q1 (B, H, Nq, D1), k1 (B, H_kv1, Nk, D1): the teacher.  q2 (B, H, Nq, D2), k2 (B, H_kv2, Nk,
    D2): the student. H_kv divides H (GQA); D1 and D2, Nq and Nk may differ; any strides.
    causal: bottom-right aligned (row i sees keys j <= i + Nk - Nq); rows that see no key give 0.
    scale1/scale2: default 1/sqrt(D). reduction: "none" -> (B, H, Nq), "sum", or "mean" over the
    rows that see a key. cu_seqlens: int32 (num_seqs + 1,) offsets of packed sequences (B == 1,
    shared by queries and keys); max_seqlen: at least the longest one. The offsets are read on the
    host once per cu_seqlens tensor (docs/contract.md, Packed sequences).
    backend: "reference", "triton", "cuda" or "auto"; default: STREAMKL_BACKEND, else auto.
    Returns float32 (float64 for float64 inputs); differentiable once (reverse mode) in all four
    inputs. The same op is torch.ops.streamkl.attn_kl; docs/contract.md states the whole contract.
    """
    return _attn_kl.attn_kl(
        q1, k1, q2, k2, causal=causal, scale1=scale1, scale2=scale2, reduction=reduction,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, backend=backend,
    )  # fmt: skip


def available_backends(
    q1: Tensor, k1: Tensor, q2: Tensor, k2: Tensor, cu_seqlens: Tensor | None = None, *, causal: bool = False
) -> dict[str, str | None]:
    """Backend name -> None if it can run attn_kl on these inputs, else why not. The inputs are
    validated first, as attn_kl would (a ValueError/TypeError names what is wrong)."""
    spec = _checks.attn_kl_spec(
        q1, k1, q2, k2, causal=causal, scale1=None, scale2=None, cu_seqlens=cu_seqlens
    )
    return _dispatch.available("attn_kl", spec, AttnKLInputs(q1, k1, q2, k2, cu_seqlens))
