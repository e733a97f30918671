"""Pure-PyTorch backend, chunked over query rows: memory O(chunk * Nk), never O(Nq * Nk).

Runs anywhere torch runs (CPU included) and imports nothing optional. Forward and backward are
the explicit formulas of SPEC sections 1-2, not autograd through a materialized softmax.
"""

from .chunked import backward, forward, supports

__all__ = ["backward", "forward", "supports"]
