"""CUDA C++ backend for sm_90a (Hopper): warp-specialized TMA + wgmma kernels compiled at run
time by NVRTC (_jit.py) and launched on torch's current stream (_launch.py); docs/cuda.md
describes them. Importing it needs torch alone; cuda-python is imported when a kernel runs."""

from . import attn_kl, indexer_kl

__all__ = ["attn_kl", "indexer_kl"]
