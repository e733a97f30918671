"""The ops, one module each: its custom ops (schemas, fakes, autograd) and its eager path.
Importing this package registers them under torch.ops.streamkl."""

from . import attn_kl, indexer_kl

__all__ = ["attn_kl", "indexer_kl"]
