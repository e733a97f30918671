"""The cuda backward (kernels/kl_bwd.cu, setting 1) on an H200, in one call: its dq2 and dk2
against the float64 reference beside the triton backward's error on the same inputs, then
backward times of both, interleaved, with a bf16 GEMM yardstick in the same run.

    PYTHONPATH=. python lab/cuda/bwd_check.py --out $OUT/bwd.json [--skip-time]

It sets STREAMKL_CUDA_BWD=cuda for itself (the kernel is opt-in).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

import streamkl
from streamkl import _checks
from streamkl._spec import AttnKLInputs, AttnKLStats
from streamkl.backends.cuda import _bwd
from streamkl.backends.cuda import _launch as fwd_launch
from streamkl.backends.triton import _launch as triton_launch
from streamkl.testing import make_inputs

CASES = [  # b, h, hk1, hk2, nq, nk, d1, d2, causal
    (1, 2, 2, 2, 128, 128, 64, 64, False),
    (1, 2, 2, 2, 128, 128, 128, 128, True),
    (2, 4, 1, 2, 200, 333, 128, 64, True),
    (1, 4, 2, 4, 77, 1000, 96, 128, False),
    (1, 4, 1, 1, 1, 4096, 64, 128, True),
    (1, 2, 2, 2, 1000, 130, 128, 72, True),
    (1, 3, 3, 3, 513, 513, 40, 128, True),
    (1, 8, 8, 8, 2048, 2048, 128, 128, True),
    (1, 8, 8, 8, 2048, 2048, 64, 64, False),
]


def _case(b, h, hk1, hk2, nq, nk, d1, d2, causal, dtype):
    q1, k1, q2, k2 = make_inputs(b, h, nq, nk, d1, d2, hk1, hk2, dtype=dtype, device="cuda", seed=nq + nk)
    inputs = AttnKLInputs(q1, k1, q2, k2, None)
    spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=causal, scale1=None, scale2=None)
    return spec.with_needs(_bwd.SETTING1), inputs


def _err(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def check(dtype) -> list[dict]:
    out = []
    for case in CASES:
        spec, inputs = _case(*case, dtype)
        assert _bwd.declines(spec, inputs) is None, case
        stats = AttnKLStats(*fwd_launch.forward(spec, inputs))
        grad = torch.randn(stats.kl.shape, device="cuda")
        q64 = [t.double().requires_grad_(i >= 2) for i, t in enumerate(inputs[:4])]
        kl64 = streamkl.attn_kl(*q64, causal=spec.causal, reduction="none", backend="reference")
        ref = torch.autograd.grad(kl64, q64[2:], grad.double())
        tri = triton_launch.backward(spec, inputs, stats, grad)
        rec = dict(case=case, dtype=str(dtype), triton=[_err(tri[2], ref[0]), _err(tri[3], ref[1])])
        got = _bwd.backward(spec, inputs, stats, grad)
        torch.cuda.synchronize()
        rec["cuda"] = [_err(got[2], ref[0]), _err(got[3], ref[1])]
        print(rec, flush=True)
        out.append(rec)
    return out


def _time(fn, reps=20):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def timing() -> list[dict]:
    out = []
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: a @ a  # noqa: E731
    for n in (8192, 16384):
        for causal in (False, True):
            spec, inputs = _case(1, 32, 32, 32, n, n, 128, 128, causal, torch.bfloat16)
            stats = AttnKLStats(*fwd_launch.forward(spec, inputs))
            grad = torch.randn(stats.kl.shape, device="cuda")
            call = (spec, inputs, stats, grad)
            fns = {
                "triton": functools.partial(triton_launch.backward, *call),
                "cuda": functools.partial(_bwd.backward, *call),
                "gemm": gemm,
            }
            for f in fns.values():
                f()
            times = {k: [] for k in fns}
            for _ in range(3):
                for k, f in fns.items():
                    times[k].append(_time(f, 10))
            best = {k: min(v) for k, v in times.items()}
            pairs = 0.5 * n * n + n / 2 if causal else n * n
            flop = 4 * 2 * 32 * pairs * 128  # four GEMMs per pair
            rec = dict(n=n, causal=causal, ms=best, gemm_tflops=2 * 8192**3 / best["gemm"] / 1e9)
            rec["tflops"] = {k: flop / best[k] / 1e9 for k in ("triton", "cuda")}
            print(rec, flush=True)
            out.append(rec)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-time", action="store_true")
    args = ap.parse_args()
    os.environ["STREAMKL_CUDA_BWD"] = "cuda"
    t0 = time.time()
    res = {"check": check(torch.bfloat16) + check(torch.float16)[:3]}
    res["check_s"] = time.time() - t0
    if not args.skip_time:
        res["timing"] = timing()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
