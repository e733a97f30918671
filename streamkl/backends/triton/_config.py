"""Launch configurations and the two selection rules (split-K forward, fused backward).

Configs are fixed tables keyed on (head-dim bucket, fp32 or not, and causal for the forward or
both gradient settings for the backward), measured on an H200 with lab/triton/triton_tune.py
(numbers in docs/triton.md): nothing is tuned at run time, so a training loop compiles each
specialization once and never re-times anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

H200_SMS = 132


@dataclass(frozen=True)
class Cfg:
    """One kernel's tiles and launch options.

    qrows: the key-major backward kernel's tile layout: queries x keys (per-query statistics
    along rows; dS^T reaches the dk GEMM through shared memory) instead of keys x queries.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    qrows: bool = False


def pow2_dim(d: int) -> int:
    """Head dim padded to the next power of two, at least 16 (tl.dot's minimum)."""
    p = 16
    while p < d:
        p *= 2
    return p


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


# Forward: (max(D1P, D2P) bucket, is fp32, causal) -> Cfg. BLOCK_M shrinks for small Nq at launch.
# The D = 128 16-bit rows are the fastest tiles of the H200 sweep at N=8K/16K (docs/triton.md,
# "Selection rules and configs"): non-causal (128, 64, 8 warps, 3 stages), causal (128, 128, 8, 2).
# The other rows pass the GPU tests but are not timed; the fp32 ones (true-fp32 dots, no tensor
# cores) spill registers at D=128 and are slow.
_FWD = {
    (64, False, False): Cfg(128, 64, 4, 3),
    (64, False, True): Cfg(128, 64, 4, 3),
    (128, False, False): Cfg(128, 64, 8, 3),
    (128, False, True): Cfg(128, 128, 8, 2),
    (256, False, False): Cfg(64, 32, 4, 2),
    (256, False, True): Cfg(64, 32, 4, 2),
    (64, True, False): Cfg(64, 32, 4, 2),
    (64, True, True): Cfg(64, 32, 4, 2),
    (128, True, False): Cfg(64, 32, 4, 2),
    (128, True, True): Cfg(64, 32, 4, 2),
    (256, True, False): Cfg(32, 32, 4, 1),
    (256, True, True): Cfg(32, 32, 4, 1),
}
# Backward, query-major (dq) and key-major (dk / fused): (bucket, is fp32, both settings) -> Cfg.
# D <= 128 16-bit: the key-major kernel lays its tiles out queries x keys (qrows) at (64, 64) with
# 4 warps, two programs per SM: 320-339 TFLOP/s at N=16K on the H200 in every setting, against at
# most 269 for the keys x queries tiles (docs/triton.md, "Where the backward's time goes"). The
# D <= 64 rows follow the D = 128 measurement; dq keeps (128, 64, 8, 3) / (128, 64, 8, 2).
_BWD_Q = {
    (64, False, False): Cfg(128, 64, 8, 2),
    (64, False, True): Cfg(128, 64, 8, 2),
    (128, False, False): Cfg(128, 64, 8, 3),
    (128, False, True): Cfg(128, 64, 8, 2),
    (256, False, False): Cfg(64, 32, 4, 1),
    (256, False, True): Cfg(64, 32, 4, 1),
    (64, True, False): Cfg(64, 32, 4, 1),
    (64, True, True): Cfg(64, 32, 4, 1),
    (128, True, False): Cfg(64, 32, 4, 1),
    (128, True, True): Cfg(64, 32, 4, 1),
    (256, True, False): Cfg(32, 16, 4, 1),
    (256, True, True): Cfg(32, 16, 4, 1),
}
_BWD_K = {
    (64, False, False): Cfg(64, 64, 4, 2, qrows=True),
    (64, False, True): Cfg(64, 64, 4, 2, qrows=True),
    (128, False, False): Cfg(64, 64, 4, 2, qrows=True),
    (128, False, True): Cfg(64, 64, 4, 2, qrows=True),
    (256, False, False): Cfg(32, 64, 4, 1),
    (256, False, True): Cfg(32, 64, 4, 1),
    (64, True, False): Cfg(32, 64, 4, 1),
    (64, True, True): Cfg(32, 64, 4, 1),
    (128, True, False): Cfg(32, 64, 4, 1),
    (128, True, True): Cfg(32, 64, 4, 1),
    (256, True, False): Cfg(16, 32, 4, 1),
    (256, True, True): Cfg(16, 32, 4, 1),
}

INTERPRET_CFG = Cfg(16, 16, 4, 1)  # tiny tiles, so the CPU tests cross tile boundaries
INTERPRET_BWD_K_CFG = Cfg(16, 16, 4, 1, qrows=True)  # the layout the GPU table picks


def _key(d1p: int, d2p: int, dtype: torch.dtype) -> tuple[int, bool]:
    d = max(d1p, d2p, 64)
    return (min(d, 256), dtype == torch.float32)


def fwd_cfg(d1p: int, d2p: int, dtype: torch.dtype, causal: bool, nq: int, interpret: bool) -> Cfg:
    """The forward's config: the table's, with BLOCK_M fitted to Nq."""
    cfg = INTERPRET_CFG if interpret else _FWD[(*_key(d1p, d2p, dtype), bool(causal))]
    # Decode-sized Nq: a BLOCK_M no larger than Nq (at least 16, tl.dot's minimum).
    bm = max(16, min(cfg.block_m, _next_pow2(nq)))
    return Cfg(bm, cfg.block_n, cfg.num_warps if bm >= 64 else 4, cfg.num_stages)


def bwd_cfgs(
    d1p: int, d2p: int, dtype: torch.dtype, causal: bool, interpret: bool, both: bool = False
) -> tuple[Cfg, Cfg]:
    """(dq kernel, key-major kernel) configs; `both`: gradients of both settings requested."""
    if interpret:
        return INTERPRET_CFG, INTERPRET_BWD_K_CFG
    key = (*_key(d1p, d2p, dtype), bool(both))
    return _BWD_Q[key], _BWD_K[key]


def split_count(n_ctas: int, nk_tiles: int, num_sms: int, forced: int | None, block_m: int = 128) -> int:
    """Key-axis splits for the forward. `forced` (STREAMKL_TRITON_SPLIT_K=N) wins; 1 = off.

    The plain grid has n_ctas = B*H*cdiv(Nq, BLOCK_M) programs. Split only when it fills at most
    half the SMs (n_ctas <= num_sms/2), into about one wave of programs (two waves when
    BLOCK_M < 64, whose programs are light), keeping >= MIN_TILES key tiles per split: on the
    H200 at Nk=32K that runs decode-sized Nq 3.6-4.8x faster, and a (nearly) full wave gains
    nothing from a split (docs/triton.md, "Split-K").
    """
    if forced is not None:
        return max(1, min(forced, nk_tiles))
    if 2 * n_ctas > num_sms:
        return 1
    target = num_sms * (2 if block_m < 64 else 1)
    splits = min(target // n_ctas, nk_tiles // MIN_TILES, 256)
    return splits if splits >= 2 else 1


MIN_TILES = 4
