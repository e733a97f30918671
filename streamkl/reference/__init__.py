"""Pure-PyTorch backend: runs anywhere torch runs (CPU included) and imports nothing optional.
Each op is chunked over query rows, so its memory is O(chunk * Nk), never O(Nq * Nk), and computes
the explicit formulas of docs/contract.md, not autograd through a materialized softmax."""

from . import attn_kl, indexer_kl

__all__ = ["attn_kl", "indexer_kl"]
