"""streamkl: the KL divergence between two attention distributions, fused, O(Nq) memory
(attn_kl), and the DSA indexer loss against a head mixture (indexer_kl).

Importing streamkl registers torch.ops.streamkl.attn_kl and .indexer_kl and needs torch alone;
triton and cuda-python are imported only when their backend runs.
"""

from ._dispatch import BACKENDS
from .api import attn_kl, available_backends, indexer_kl

__all__ = ["BACKENDS", "attn_kl", "available_backends", "indexer_kl"]
__version__ = "0.1.0"
