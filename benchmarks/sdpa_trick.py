"""The KL through attention calls, what a determined user runs today without streamkl: its derivation
and the ops' limits are in docs/benchmarks/README.md (The attention-call baseline)."""

from __future__ import annotations

import torch


def unsupported(q1, k1, q2, k2, causal: bool, backend: str) -> str | None:
    """None if the attention trick can run these inputs with `backend`, else why not."""
    if causal and q1.shape[2] != k1.shape[2]:
        return "attention kernels align causal masks top-left: needs Nq == Nk"
    if backend == "flash" and q1.shape[-1] != q2.shape[-1]:
        return "flash attention needs the value head dim equal to the query's (D1 == D2)"
    if backend == "cudnn" and q1.device.type != "cuda":
        return "cuDNN attention runs on CUDA only"
    if q1.dtype not in (torch.float16, torch.bfloat16) and q1.device.type == "cuda":
        return "flash and cuDNN attention take float16/bfloat16"
    return None


def _heads(q, k):
    """k with its heads repeated to q's (GQA): the attention ops here take equal head counts."""
    g = q.shape[1] // k.shape[1]
    return k if g == 1 else k.repeat_interleave(g, dim=1)


def attention(q, k, v, causal: bool, scale: float, backend: str):
    """(out, lse) with lse (B, H, Nq) float32 in natural-log units of the scaled logits."""
    if backend == "cudnn":
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    elif q.device.type == "cuda":
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def _forwards(q1, k1, q2, k2, v12, v22, causal, scale1, scale2, backend):
    """(KL per row, O12 = attn(q1, k1, v12), O22 = attn(q2, k2, v22)); k1, k2 have q's head count."""
    o11, lse1 = attention(q1, k1, k1, causal, scale1, backend)
    o12, _ = attention(q1, k1, v12, causal, scale1, backend)
    o22, lse2 = attention(q2, k2, v22, causal, scale2, backend)
    kl = scale1 * (q1.float() * o11.float()).sum(-1) - scale2 * (q2.float() * o12.float()).sum(-1)
    return kl - lse1 + lse2, o12, o22


def kl(q1, k1, q2, k2, *, causal: bool, scale1: float, scale2: float, backend: str):
    """KL per row (B, H, Nq) float32 from three attention forwards."""
    k1, k2 = _heads(q1, k1), _heads(q2, k2)
    return _forwards(q1, k1, q2, k2, k2, k2, causal, scale1, scale2, backend)[0]


def train(q1, k1, q2, k2, g, *, causal: bool, scale1: float, scale2: float, backend: str):
    """(kl, dq2, dk2): the three forwards, then both value-gradients in one autograd call."""
    hk2 = k2.shape[1]
    k1r, k2r = _heads(q1, k1).detach(), _heads(q2, k2).detach()
    q1, q2 = q1.detach(), q2.detach()
    v12, v22 = k2r.clone().requires_grad_(), k2r.clone().requires_grad_()
    kl, o12, o22 = _forwards(q1, k1r, q2, k2r, v12, v22, causal, scale1, scale2, backend)
    dq2 = (scale2 * g[..., None] * (o22.float() - o12.float())).to(q2.dtype)
    d_out = g[..., None].to(q2.dtype) * q2
    dv22, dv12 = torch.autograd.grad((o22, o12), (v22, v12), (d_out, d_out))
    dk2 = scale2 * (dv22.float() - dv12.float())
    if dk2.shape[1] != hk2:  # repeated heads: their gradients add up on the shared key head
        dk2 = dk2.reshape(dk2.shape[0], hk2, -1, *dk2.shape[2:]).sum(2)
    return kl.detach(), dq2, dk2.to(k2.dtype)
