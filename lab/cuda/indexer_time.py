"""indexer_kl's cuda kernel (kernels/indexer_kl.cu) against the triton backend at DeepSeek-V3.2
shapes on the GPU: both on the same fresh inputs (the KL and the step's gradients compared, relative
norm errors), then the forward and the training step timed interleaved, cuda / triton / cuda, with
the bf16 GEMM yardstick before and after; JSON to --out.

    PYTHONPATH=. python lab/cuda/indexer_time.py --sizes 4096,16384 --out $OUT/indexer_time.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.testing import do_bench

import streamkl
from benchmarks.bench import gemm_yardstick
from benchmarks.indexer_providers import IndexerCase, indexer_kl_flops, make_inputs


def gemm_tflops() -> float:
    return gemm_yardstick(torch.device("cuda"), 8192)["tflops"]  # the benchmark's own yardstick


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def calls(case, inputs, backend):
    q, k, qi, ki, w, lse, topk = inputs

    def fwd():
        return streamkl.indexer_kl(
            q, k, qi, ki, w, lse=lse, scale=case.logit_scale, causal=case.causal, reduction="none",
            backend=backend,
        )  # fmt: skip

    def step():
        leaves = [t.detach().requires_grad_() for t in (qi, ki, w)]
        loss = streamkl.indexer_kl(
            q, k, *leaves, lse=lse, scale=case.logit_scale, causal=case.causal, backend=backend
        )
        return (loss.detach(), *torch.autograd.grad(loss, leaves))

    return fwd, step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--rep-ms", type=int, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = dict(gemm_start=gemm_tflops(), cases=[])
    for n in (int(x) for x in args.sizes.split(",")):
        case = IndexerCase(b=1, h=128, hk=1, g=64, nq=n, nk=n, d=576, di=128, causal=bool(args.causal),
                           dtype="bfloat16", scale=192**-0.5)  # fmt: skip
        inputs = make_inputs(case, torch.device("cuda"), seed=n)
        row = dict(n=n, causal=args.causal)
        fns = {b: calls(case, inputs, b) for b in ("cuda", "triton")}
        t0 = time.time()
        got = {b: (f[0](), f[1]()) for b, f in fns.items()}
        torch.cuda.synchronize()
        row["first_s"] = time.time() - t0
        (kl_c, step_c), (kl_t, step_t) = got["cuda"], got["triton"]
        row["rel_vs_triton"] = dict(
            kl=rel(kl_c, kl_t), loss=rel(step_c[0], step_t[0]),
            dqi=rel(step_c[1], step_t[1]), dki=rel(step_c[2], step_t[2]), dw=rel(step_c[3], step_t[3]),
        )  # fmt: skip
        row["finite"] = all(torch.isfinite(t).all().item() for t in (kl_c, *step_c))
        print(n, row["rel_vs_triton"], flush=True)
        ms = {}
        for b in ("cuda", "triton", "cuda"):
            for mode, fn in zip(("fwd", "train"), fns[b]):
                t = do_bench(fn, warmup=10, rep=args.rep_ms, return_mode="median")
                ms.setdefault(f"{b}_{mode}", []).append(t)
        row["ms"] = {key: min(v) for key, v in ms.items()}
        row["tflops"] = {
            key: indexer_kl_flops(case, key.split("_")[1]) / t / 1e9 for key, t in row["ms"].items()
        }
        print(n, row["ms"], {k: round(v) for k, v in row["tflops"].items()}, flush=True)
        result["cases"].append(row)
        del inputs, fns, got
        torch.cuda.empty_cache()
    result["gemm_end"] = gemm_tflops()
    print("gemm", result["gemm_start"], result["gemm_end"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
