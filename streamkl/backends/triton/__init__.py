"""Triton backend: fused kernels on CUDA GPUs (CPU tensors only under TRITON_INTERPRET=1).
Importing it needs torch alone; docs/triton.md describes the kernels and their selection rules."""

from . import attn_kl, indexer_kl

__all__ = ["attn_kl", "indexer_kl"]
