"""The one FLOP count every benchmark figure uses.

Work is counted as the GEMMs an attention-style kernel must do, nothing else (the
exponentials, the masking and the reductions are free on this count, as in flash-attention's
`benchmark_attn.py`). With `pairs` the number of (query row, key) pairs a row may see, summed
over batch and heads, one logits GEMM `S_t = q_t @ k_t^T` of head dim `D_t` costs
`2 * pairs * D_t`. Then:

    forward                   = S1 + S2                    = 2 * pairs * (D1 + D2)
                                (= 4*B*H*Nq*Nk*D for D1 = D2 = D, non-causal)
    backward, one setting     = recompute S1, S2 (the forward's two GEMMs)
                                + dq_t = dS_t @ k_t and dk_t = dS_t^T @ q_t
                              = 2 * pairs * (D1 + D2) + 4 * pairs * D_t
                                (four GEMMs, 2x the forward when D1 = D2)
        setting "q2k2"  (teacher fixed, grads of q2, k2)  D_t = D2
        setting "q1k1"  (target fixed, grads of q1, k1)   D_t = D1
    backward, "all"           = 2 * pairs * (D1 + D2) + 4 * pairs * (D1 + D2)
                                (six GEMMs, 3x the forward when D1 = D2)
    fwd+bwd                   = forward + backward of that setting

`pairs` is exact for bottom-right causal masks with `Nq != Nk` (flash-attn >= 2.1 alignment:
row i sees keys j <= i + Nk - Nq), so causal is "about half" only when Nq == Nk. Dense
baselines that compute the whole matrix and mask it are credited with the same useful work,
so TFLOP/s compares providers on equal terms.
"""

from __future__ import annotations

SETTINGS = ("q2k2", "q1k1", "all")
SETTING_GRADS = {"q2k2": (2, 3), "q1k1": (0, 1), "all": (0, 1, 2, 3)}  # indices into (q1,k1,q2,k2)
SETTING_DOC = {
    "q2k2": "setting 1: teacher fixed, grads of q2 and k2",
    "q1k1": "setting 2: target fixed, grads of q1 and k1",
    "all": "both settings at once, grads of all four",
}


def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """Number of (row, key) pairs one (batch, head) sees; bottom-right causal when `causal`."""
    if not causal:
        return nq * nk
    if nk >= nq:
        # row i sees i + (nk - nq) + 1 keys
        return nq * (nk - nq + 1) + nq * (nq - 1) // 2
    # the first nq - nk rows see nothing, the others 1..nk keys
    return nk * (nk + 1) // 2


def attn_kl_flops(
    b: int,
    h: int,
    nq: int,
    nk: int,
    d1: int,
    d2: int,
    causal: bool,
    mode: str = "fwd",
    setting: str | None = None,
) -> int:
    """FLOPs of one call: mode in {"fwd", "bwd", "fwd+bwd"}; setting in SETTINGS for the
    modes with a backward. See the module docstring for the count."""
    pairs = b * h * visible_pairs(nq, nk, causal)
    fwd = 2 * pairs * (d1 + d2)
    if mode == "fwd":
        return fwd
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {SETTINGS} for mode {mode!r}, got {setting!r}")
    grad_dims = {"q2k2": d2, "q1k1": d1, "all": d1 + d2}[setting]
    bwd = fwd + 4 * pairs * grad_dims
    if mode == "bwd":
        return bwd
    if mode == "fwd+bwd":
        return fwd + bwd
    raise ValueError(f"mode must be 'fwd', 'bwd' or 'fwd+bwd', got {mode!r}")


def gemm_flops(m: int, n: int, k: int) -> int:
    """A plain (m x k) @ (k x n) matrix product."""
    return 2 * m * n * k
