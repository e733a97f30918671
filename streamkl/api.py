"""The public entry points."""

from __future__ import annotations

from torch import Tensor

from . import _checks, _dispatch
from ._spec import AttnKLInputs
from .ops import attn_kl as _attn_kl
from .ops import indexer_kl as _indexer_kl


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


def indexer_kl(
    q: Tensor,
    k: Tensor,
    qi: Tensor,
    ki: Tensor,
    w: Tensor,
    *,
    lse: Tensor | None = None,
    scale: float | None = None,
    causal: bool = True,
    topk: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    reduction: str = "mean",
    backend: str | None = None,
) -> Tensor:
    """KL(p || softmax(I)) per query row, the DeepSeek-V3.2 (DSA) indexer loss: the teacher is
    the head mixture p_j = (1/H) sum_h softmax_j(scale q_h . k_j), the student the index scores
    I_j = sum_g w_g relu(qi_g . ki_j), both over the keys the row admits.

    Teacher (fixed: no gradient): q (B, H, Sq, D), k (B, H_kv, Sk, D), H_kv dividing H (1: MLA's
    absorbed MQA key, also accepted as (B, Sk, D); H: MHA). Indexer: qi (B, G, Sq, Di), its one
    key ki (B, 1, Sk, Di) or (B, Sk, Di), weights w (B, G, Sq) in any float dtype (the caller
    folds G^-0.5 Di^-0.5 into w). Any strides: (B, S, heads, D) storage passes as
    .transpose(1, 2); Megatron's [S, B, heads, D] as .permute(1, 2, 0, 3), its indexer key
    [Sk, B, Di] as .transpose(0, 1) and its weights [Sq, B, G] as .permute(1, 2, 0).
    lse: the teacher's per-head log-sum-exp (B, H, Sq), float32 or float64, natural log, over
    the keys each row admits (the attention forward's softmax LSE); None: computed here, which
    costs the streaming backends a first pass over the keys (docs/indexer.md, When to pass lse).
    scale: the teacher's logit scale, default 1/sqrt(D) (DeepSeek-V3.2's MQA: 192**-0.5, D = 576).
    causal: bottom-right aligned (row i sees keys j <= i + Sk - Sq).
    topk: (B, Sq, K) int32/int64 key indices, -1 for padding: sparse mode. A row admits only its
    set (within what the causal mask and its packed sequence let it see; an index repeated counts
    once) and each teacher head's softmax is renormalized over it. An index outside [0, Sk)
    other than -1 raises (read on the host: one sync per call).
    cu_seqlens, max_seqlen: packed sequences, as attn_kl (B == 1, Sq == Sk); topk indices are
    positions on the packed key axis.
    reduction: "mean" (default) over the rows that see a key, "sum", or "none" -> (B, Sq).
    With "mean" or "sum" and a gradient needed, the gradients are formed in the forward and the
    backward scales them (the triton backend streams the teacher once per training step).
    Rows that see no key (causal, all-padding topk, Sk = 0) give 0 and a zero gradient.
    backend: "reference", "triton" (CUDA; float16/bfloat16/float32) or "auto" (triton on CUDA,
    else the reference); default: STREAMKL_BACKEND, else auto. Returns float32 (float64 when
    q, qi or w is float64); differentiable once (reverse mode) in qi, ki and w. The same op is
    torch.ops.streamkl.indexer_kl; docs/indexer.md states the math and the whole contract.
    """
    return _indexer_kl.indexer_kl(
        q, k, qi, ki, w, lse=lse, scale=scale, causal=causal, topk=topk, cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen, reduction=reduction, backend=backend,
    )  # fmt: skip
