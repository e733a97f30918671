"""What one call is, fixed once: validation builds a spec, every layer below takes (spec, inputs).

A spec holds the call's sizes and options, resolved (scales as floats, the packed sequences'
count and longest length as host ints), so no layer re-derives them from tensors or re-reads the
environment. Specs are NamedTuples: built in well under a microsecond, immutable, hashable (a
launcher may key its plan cache on one).

The causal rule, once for Python (triton/_tiles.py and the cuda kernels' mask.cuh hold the same
rule for their languages): masks align bottom-right, so query row i of Nq sees the keys
j <= i + (Nk - Nq); inside a packed sequence Nq == Nk and this is the plain diagonal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

NO_GRADS = (False, False, False, False)


def causal_offset(nq: int, nk: int) -> int:
    """Bottom-right alignment: row i sees keys j <= i + causal_offset(nq, nk)."""
    return nk - nq


def visible_keys(row: int, nq: int, nk: int, causal: bool) -> int:
    """How many keys query row `row` (of nq, against nk keys) sees."""
    if not causal:
        return nk
    return max(0, min(nk, row + causal_offset(nq, nk) + 1))


def reduced_row_weight(lse2: Tensor, reduction: str) -> Tensor:
    """Every row's upstream gradient in indexer_kl's reduced loss, a 0-d tensor in lse2's dtype:
    1 for "sum", 1 / the rows that see a key (their student LSE finite; at least 1) for "mean".
    A tensor, not a host int: with topk it depends on the indices' values."""
    if reduction == "sum":
        return lse2.new_ones(())
    return torch.isneginf(lse2).logical_not_().sum().clamp_min(1).to(lse2.dtype).reciprocal_()


class AttnKLInputs(NamedTuple):
    """The tensors of one attn_kl call: q1 (B, H, Nq, D1), k1 (B, H_kv1, Nk, D1), q2 (B, H, Nq, D2),
    k2 (B, H_kv2, Nk, D2), cu_seqlens: int32 (num_seqs + 1,) offsets of packed sequences or None."""

    q1: Tensor
    k1: Tensor
    q2: Tensor
    k2: Tensor
    cu_seqlens: Tensor | None = None


class AttnKLStats(NamedTuple):
    """What the forward returns and the backward reads, each (B, H, Nq), float32 (float64 for
    float64 inputs), contiguous: the KL and both log-sum-exps (-inf on rows that see no key)."""

    kl: Tensor
    lse1: Tensor
    lse2: Tensor


class AttnKLGrads(NamedTuple):
    """(dq1, dk1, dq2, dk2): each in its input's shape and dtype, contiguous, or None if not needed."""

    dq1: Tensor | None
    dk1: Tensor | None
    dq2: Tensor | None
    dk2: Tensor | None


class AttnKLSpec(NamedTuple):
    """One validated attn_kl call (docs/contract.md states what each field means for the op)."""

    batch: int
    heads: int
    heads_kv1: int
    heads_kv2: int
    nq: int
    nk: int
    d1: int
    d2: int
    causal: bool
    scale1: float
    scale2: float
    # Packed sequences: how many, and the longest one the kernels must cover (None when the
    # offsets have not been read: only a fake/traced call, which launches nothing).
    num_seqs: int
    max_seqlen: int | None
    packed: bool
    # Which of (dq1, dk1, dq2, dk2) the backward returns.
    needs: tuple[bool, bool, bool, bool] = NO_GRADS

    @property
    def group1(self) -> int:
        """Query heads per teacher key head (GQA)."""
        return self.heads // self.heads_kv1

    @property
    def group2(self) -> int:
        """Query heads per student key head (GQA)."""
        return self.heads // self.heads_kv2

    @property
    def rows(self) -> int:
        """(b, h, i) rows of the output."""
        return self.batch * self.heads * self.nq

    @property
    def seq_q(self) -> int:
        """Query rows of the longest sequence: Nq, or max_seqlen when packed."""
        return self.max_seqlen if self.packed else self.nq

    @property
    def seq_k(self) -> int:
        """Keys of the longest sequence: Nk, or max_seqlen when packed."""
        return self.max_seqlen if self.packed else self.nk

    def visible_rows(self) -> int:
        """How many (b, h, i) rows see at least one key: the divisor of reduction='mean'
        (inside packed sequences every row sees its own token)."""
        if self.nk == 0:
            return 0
        rows = min(self.nq, self.nk) if self.causal and not self.packed else self.nq
        return self.batch * self.heads * rows

    def with_needs(self, needs) -> AttnKLSpec:
        return self._replace(needs=tuple(bool(n) for n in needs))


# --- indexer_kl -------------------------------------------------------------------------------

INDEXER_NO_GRADS = (False, False, False)


class IndexerKLInputs(NamedTuple):
    """The tensors of one indexer_kl call (docs/indexer.md): the teacher q (B, H, Sq, D) and
    k (B, H_kv, Sk, D); the indexer qi (B, G, Sq, Di), its one key head ki (B, 1, Sk, Di) and its
    weights w (B, G, Sq); the teacher's per-head log-sum-exp lse (B, H, Sq) or None; the per-row
    key set topk (B, Sq, K) int32/int64 with -1 padding, or None (dense); cu_seqlens: int32
    (num_seqs + 1,) offsets of packed sequences or None."""

    q: Tensor
    k: Tensor
    qi: Tensor
    ki: Tensor
    w: Tensor
    lse: Tensor | None = None
    topk: Tensor | None = None
    cu_seqlens: Tensor | None = None


class IndexerKLStats(NamedTuple):
    """What the forward returns and the backward reads, float32 (float64 for float64 inputs),
    contiguous: the KL (B, Sq); the teacher's per-head log-sum-exp the target was formed with
    (B, H, Sq: the given lse, or the one computed over the admitted keys); the student's
    log-sum-exp (B, Sq); the teacher's mass T = sum_j p_j over the admitted keys (B, Sq). Rows
    that see no key: kl = 0, lse2 = -inf, mass = 0."""

    kl: Tensor
    lse: Tensor
    lse2: Tensor
    mass: Tensor


class IndexerKLGrads(NamedTuple):
    """(dqi, dki, dw): each in its input's shape and dtype, contiguous, or None if not needed.
    The teacher (q, k, lse) receives no gradient."""

    dqi: Tensor | None
    dki: Tensor | None
    dw: Tensor | None


class IndexerKLSpec(NamedTuple):
    """One validated indexer_kl call (docs/indexer.md states what each field means)."""

    batch: int
    heads: int  # H: teacher query heads, the heads of the mixture
    heads_kv: int  # H_kv: teacher key heads (1: MQA, H: MHA)
    index_heads: int  # G: indexer heads
    nq: int
    nk: int
    d: int  # teacher head dim
    di: int  # indexer head dim
    causal: bool
    scale: float  # teacher logit scale
    topk_width: int  # K, the width of topk; 0 when dense
    sparse: bool  # a topk set restricts each row's keys
    given_lse: bool  # the teacher's lse was passed (else the forward computes it)
    # Packed sequences, as AttnKLSpec: how many, and the longest (None on fake/traced calls).
    num_seqs: int
    max_seqlen: int | None
    packed: bool
    # Which of (dqi, dki, dw) the backward returns.
    needs: tuple[bool, bool, bool] = INDEXER_NO_GRADS

    @property
    def group(self) -> int:
        """Teacher query heads per teacher key head (GQA)."""
        return self.heads // self.heads_kv

    @property
    def seq_q(self) -> int:
        """Query rows of the longest sequence: Sq, or max_seqlen when packed."""
        return self.max_seqlen if self.packed else self.nq

    @property
    def seq_k(self) -> int:
        """Keys of the longest sequence: Sk, or max_seqlen when packed."""
        return self.max_seqlen if self.packed else self.nk

    def with_needs(self, needs) -> IndexerKLSpec:
        return self._replace(needs=tuple(bool(n) for n in needs))
