"""Host cost per call of each piece of the cuda backend's eager path at a tiny shape (B=1, H=1,
N=128, D=64, causal, bf16; the best and the median of 5 repeats of 2,000 calls), then cProfile's
hottest functions of the eager op, forward and forward + backward (docs/overhead.md).

    python benchmarks/overhead_cuda_pieces.py
"""

import cProfile
import io
import pstats
import time

import torch

import streamkl
from streamkl import _checks, _dispatch, _env
from streamkl.backends import cuda
from streamkl.backends.cuda import _launch
from streamkl.testing import make_inputs


def per_call(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return min(best), sorted(best)[2]


def main():
    if not torch.cuda.is_available():
        raise SystemExit("overhead_cuda_pieces.py: needs a CUDA GPU (sm_90) with cuda-python")
    x = make_inputs(b=1, h=1, nq=128, nk=128, d1=64, d2=64, dtype=torch.bfloat16, device="cuda")
    q1, k1, q2, k2 = x
    g = [t.detach().clone().requires_grad_(i >= 2) for i, t in enumerate(x)]

    from cuda.bindings import driver

    _launch._shipped_kernel(64, 64, False, False, 0)  # built and loaded before any timing
    stream_ptr = torch.cuda.current_stream().cuda_stream
    rows = {
        "torch.empty (1,1,128) f32": lambda: torch.empty((1, 1, 128), device="cuda", dtype=torch.float32),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(q1.device),
        "driver.CUstream(ptr)": lambda: driver.CUstream(stream_ptr),
        "tensor_map(q1)": lambda: _launch.tensor_map(q1, 64),
        "splits_for": lambda: _launch.splits_for(2, 2, 1, 132, 64, (128, 128, 192)),
        "_launch.forward": lambda: _launch.forward(q1, k1, q2, k2, causal=True, scale1=0.125, scale2=0.125),
        "cuda.supports": lambda: cuda.supports(q1, k1, q2, k2),
        "_dispatch.select cuda": lambda: _dispatch.select(q1, k1, q2, k2, None, "cuda"),
        "_checks.check_call": lambda: _checks.check_call(
            q1,
            k1,
            q2,
            k2,
            causal=True,
            scale1=None,
            scale2=None,
            reduction="none",
            cu_seqlens=None,
            max_seqlen=None,
        ),
        "_env.check_all": _env.check_all,
        "attn_kl cuda": lambda: streamkl.attn_kl(q1, k1, q2, k2, causal=True, backend="cuda"),
        "attn_kl triton": lambda: streamkl.attn_kl(q1, k1, q2, k2, causal=True, backend="triton"),
        "attn_kl auto": lambda: streamkl.attn_kl(q1, k1, q2, k2, causal=True),
        "attn_kl cuda, grad, sum+backward": lambda: streamkl.attn_kl(
            *g, causal=True, backend="cuda", reduction="sum"
        ).backward(),
        "attn_kl triton, grad, sum+backward": lambda: streamkl.attn_kl(
            *g, causal=True, backend="triton", reduction="sum"
        ).backward(),
        "cudnn attention": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            q1, k1, k1, None, True, 0.0, True, False, scale=0.125
        ),
    }
    for name, fn in rows.items():
        lo, med = per_call(fn, 500 if "backward" in name else 2000)
        print(f"{name:>40}: {lo:7.1f} us (median of 5: {med:.1f})", flush=True)
    for name in ("attn_kl cuda", "attn_kl cuda, grad, sum+backward"):
        pr = cProfile.Profile()
        fn = rows[name]
        pr.enable()
        for _ in range(2000):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
        print(f"== cProfile {name}, 2000 calls\n" + s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
