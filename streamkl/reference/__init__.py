"""Pure-PyTorch backend, chunked over query rows: memory O(chunk * Nk), never O(Nq * Nk).

Runs anywhere torch runs (CPU included) and imports nothing optional. Forward and backward are
the explicit formulas of docs/contract.md, Definition and Gradients, not autograd through a
materialized softmax. The default chunk keeps the working set of a forward+backward within the
two dense Nq x Nk matrices, and one chunk's temporaries within 256 MiB (docs/contract.md, Memory).
"""

from .chunked import backward, forward, supports

__all__ = ["backward", "forward", "supports"]
