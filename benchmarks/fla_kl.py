"""flash-linear-attention's fused KL (`fla.modules.fused_kl_div.fused_kl_div_loss`, the `fla-core`
package) run as a user would run it for attention: the paper's third baseline.

FLA computes KL(softmax(target_x @ target_weight^T) || softmax(x @ weight^T)) per row over a
"vocabulary" axis, chunked over rows, with the student's gradients formed in the forward, and
returns one scalar: the per-row KLs summed and divided by the number of rows ("batchmean", its
only reduction). For attention that is one call per (batch, head), the keys as the vocabulary:

    x = s2 q2[b, h],  weight = k2[b, h // G2],  target_x = s1 q1[b, h],  target_weight = k1[b, h // G1]

so a head's loss is the mean over its query rows of attn_kl's per-row KL. There is no mask: causal
cases are refused, not emulated. GQA indexes the shared key head (no repeat; autograd sums the
heads' dk). Its training step can only take one upstream gradient for the whole loss, so the step
timed here is the gradient of the sum of the heads' losses (every row weighted 1/Nq), where the
other providers take a per-row g; the work is the same.
"""

from __future__ import annotations

import importlib.metadata
import os

import torch

import streamkl
from streamkl.testing import rel_err


def version() -> str | None:
    try:
        return importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def unsupported(case, inputs) -> str | None:
    """Why FLA's op cannot run the case, or None."""
    if case.causal:
        return "FLA's fused KL has no mask: non-causal only (a causal case is refused, not emulated)"
    if version() is None:
        return "fla-core is not installed (pip install 'streamkl[bench]')"
    if inputs[0].device.type == "cpu" and (
        os.environ.get("TRITON_INTERPRET") != "1" or inputs[0].dtype != torch.float32
    ):
        return "on a CPU FLA's kernels run only under the Triton interpreter (TRITON_INTERPRET=1), float32"
    return None


def head_losses(q1, k1, q2, k2, scale1: float, scale2: float) -> torch.Tensor:
    """(B, H): each head's FLA loss, the mean over its query rows of KL(teacher || student)."""
    from fla.modules.fused_kl_div import fused_kl_div_loss

    b, h = q1.shape[:2]
    g1, g2 = h // k1.shape[1], h // k2.shape[1]
    losses = [
        fused_kl_div_loss(
            x=scale2 * q2[i, j],
            target_x=scale1 * q1[i, j],
            weight=k2[i, j // g2],
            target_weight=k1[i, j // g1],
            reduction="batchmean",
        )
        for i in range(b)
        for j in range(h)
    ]
    return torch.stack(losses).view(b, h)


def _scales(case):
    return case.d1**-0.5, case.d2**-0.5


def fwd(case):
    s1, s2 = _scales(case)
    return lambda q1, k1, q2, k2: head_losses(q1, k1, q2, k2, s1, s2)


def train(case):
    """(losses, dq2, dk2) of the sum of the heads' losses; the per-row g is not FLA's to take."""
    s1, s2 = _scales(case)

    def step(q1, k1, q2, k2, g):
        q2, k2 = q2.detach().requires_grad_(), k2.detach().requires_grad_()
        losses = head_losses(q1, k1, q2, k2, s1, s2)
        return losses.detach(), *torch.autograd.grad(losses.sum(), (q2, k2))

    return step


def check(case, inputs, mode: str, rows: int) -> dict:
    """FLA on the last `rows` query rows (non-causal: rows are independent) against the reference
    backend in float64 (the inputs' dtype where float64 keys would pass 8 GiB), the same quantity:
    each head's mean KL over those rows and, in train, the gradients of their sum."""
    q1, k1, q2, k2 = inputs
    r = max(1, min(rows, case.nq))
    s1, s2 = _scales(case)
    dtype = torch.float64 if (k1.numel() + k2.numel()) * 8 <= 2**33 else q1.dtype
    x = (q1[:, :, -r:], k1, q2[:, :, -r:], k2)
    ref_x = [t.detach().to(dtype).requires_grad_(i >= 2) for i, t in enumerate(x)]
    kl = streamkl.attn_kl(*ref_x, scale1=s1, scale2=s2, backend="reference").mean(-1)
    step = train(case)(*x, None) if mode == "train" else None
    got = step[0] if mode == "train" else fwd(case)(*x)
    errors = {
        "reference": f"streamkl-reference in {str(dtype)[6:]}, last {r} rows, per-head mean",
        "kl": ((got.double() - kl.double()).abs() / kl.double().abs().clamp_min(1.0)).max().item(),
    }
    if mode == "train":
        dq2, dk2 = torch.autograd.grad(kl.sum(), ref_x[2:])
        errors["dq2"] = rel_err(step[1], dq2)
        errors["dk2"] = rel_err(step[2], dk2)
    return errors
