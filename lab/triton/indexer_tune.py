"""Check and time indexer_kl's triton tile configs on one GPU, in one run.

    PYTHONPATH=. python3 lab/triton/indexer_tune.py [--cases dense:4096,sparse:16384] [--variants JSON]

A variant is an IndexerCfg (bm, bn, bd, hb, gp, num_warps, num_stages; hb/gp None: the shipped
rule), put in place of `_indexer_launch.indexer_cfg` for its run (the cached plans and launch
entries dropped before and after). For every variant and case: the forward's KL and the training
step's loss and gradients (reduction "mean", autograd of qi, ki, w) against the first variant's on
the same inputs (the shipped config, itself checked against float64 by the GPU tests), then
do_bench medians of the forward, the training step and the step without dki (qi, w only: what the
dki atomics cost). Registers and spills of each compiled main-pass kernel are read off Triton's
cache. A bf16 8192^3 GEMM at the start and the end is the yardstick. JSON to --out.

Cases are DeepSeek-V3.2 shapes (benchmarks/indexer_providers.py): H = 128 MQA teacher, D = 576,
scale 192^-0.5, G = 64 x 128 indexer, causal, bf16, the teacher's lse given; sparse: top-2048.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
import traceback

import torch
from triton.testing import do_bench

import streamkl
from benchmarks.indexer_providers import IndexerCase, indexer_kl_flops, make_inputs
from streamkl.backends.triton import _indexer_launch, _launch
from streamkl.backends.triton._indexer_launch import IndexerCfg

SHIPPED = None
VARIANTS = [  # the shipped tiles, then the next candidates (lab/notes/indexer_log.md, "Next")
    SHIPPED,
    [1, 64, 64, 128, None, 4, 4],
    [1, 64, 64, 128, None, 4, 2],
    [1, 64, 32, 128, None, 4, 4],
]


def log(msg: str) -> None:
    print(msg, flush=True)


def gemm_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / do_bench(lambda: a @ b, warmup=50, rep=500, return_mode="median") / 1e9


def _drop_caches() -> None:
    _indexer_launch.plan.cache_clear()
    _launch._SEEN.clear()


@contextlib.contextmanager
def config(variant):
    """indexer_cfg replaced by the variant (None: the shipped rule)."""
    shipped = _indexer_launch.indexer_cfg
    if variant is not None:
        bm, bn, bd, hb, gp, warps, stages = variant

        def cfg(spec, dtype, interpret):
            base = shipped(spec, dtype, interpret)
            least = 16 // bm
            return IndexerCfg(
                bm, bn, min(bd, base.bd), hb or base.hb, gp or max(base.gp, least), warps, stages
            )  # fmt: skip

        _indexer_launch.indexer_cfg = cfg
    _drop_caches()
    try:
        yield
    finally:
        _indexer_launch.indexer_cfg = shipped
        _drop_caches()


_SEEN_KERNELS: set[int] = set()


def compiled_stats() -> list[dict]:
    """Registers and spills of the main-pass and stats-pass kernels compiled since the last call."""
    out = []
    for kernel in (_indexer_launch._indexer_main_kernel, _indexer_launch._indexer_lse_kernel):
        try:
            for caches in kernel.device_caches.values():
                for compiled in caches[0].values():
                    if id(compiled) in _SEEN_KERNELS:
                        continue
                    _SEEN_KERNELS.add(id(compiled))
                    out.append(dict(kernel=kernel.__name__, regs=compiled.n_regs, spills=compiled.n_spills))
        except Exception as exc:  # the cache's layout is Triton's own
            out.append(dict(kernel=kernel.__name__, error=repr(exc)))
    return out


def run_case(case: IndexerCase, inputs, variant, reps_ms: int) -> dict:
    q, k, qi, ki, w, lse, topk = inputs

    def kl():
        return streamkl.indexer_kl(
            q, k, qi, ki, w, lse=lse, scale=case.logit_scale, causal=True, topk=topk, backend="triton"
        )

    def step(leaves=("qi", "ki", "w")):
        xs = {"qi": qi, "ki": ki, "w": w}
        xs = {n: (t.detach().requires_grad_() if n in leaves else t) for n, t in xs.items()}
        loss = streamkl.indexer_kl(
            q, k, xs["qi"], xs["ki"], xs["w"], lse=lse, scale=case.logit_scale, causal=True, topk=topk,
            reduction="mean", backend="triton",
        )  # fmt: skip
        return (loss.detach(), *torch.autograd.grad(loss, [xs[n] for n in leaves]))

    t0 = time.time()
    out = dict(kl=kl(), step=step())
    torch.cuda.synchronize()
    first_s = time.time() - t0
    times = dict(
        fwd=do_bench(kl, warmup=20, rep=reps_ms, return_mode="median"),
        train=do_bench(step, warmup=20, rep=reps_ms, return_mode="median"),
        train_no_dki=do_bench(lambda: step(("qi", "w")), warmup=20, rep=reps_ms, return_mode="median"),
    )
    row = dict(ms=times, first_s=first_s, kernels=compiled_stats())
    work = {m: indexer_kl_flops(case, "fwd" if m == "fwd" else "train") for m in times}
    row["tflops"] = {m: work[m] / t / 1e9 for m, t in times.items()}
    return row, out


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="dense:4096,sparse:16384")
    ap.add_argument("--variants", default=None, help="JSON list of [bm,bn,bd,hb,gp,warps,stages] or null")
    ap.add_argument("--reps-ms", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=420)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "indexer_tune.json"))
    args = ap.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    start = time.time()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=[])
    result["gemm_start"] = gemm_tflops()
    log(f"GEMM {result['gemm_start']:.0f} TFLOP/s")
    for spec in args.cases.split(","):
        mode, n = spec.split(":")
        case = IndexerCase(
            b=1, h=128, hk=1, g=64, nq=int(n), nk=int(n), d=576, di=128, causal=True, dtype="bfloat16",
            topk=2048 if mode == "sparse" else 0, scale=192**-0.5,
        )  # fmt: skip
        inputs = make_inputs(case, "cuda", seed=1)
        first = None
        for variant in variants:
            if time.time() - start > args.max_seconds:
                log(f"{mode} {n} {variant}: not started (--max-seconds)")
                continue
            try:
                with config(variant):
                    row, out = run_case(case, inputs, variant, args.reps_ms)
                if first is None:
                    first = out
                names = ("loss", "dqi", "dki", "dw")
                row["err_vs_first"] = dict(kl=rel(out["kl"], first["kl"]))
                pairs = zip(names, out["step"], first["step"])
                row["err_vs_first"].update({n: rel(a, b) for n, a, b in pairs})
            except Exception:
                row = dict(error=traceback.format_exc(limit=3))
            row.update(case=f"{mode}:{n}", variant=variant)
            result["rows"].append(row)
            ms = row.get("ms", {})
            tf = row.get("tflops", {})
            log(
                f"{mode} {n} {variant}: "
                + (
                    " ".join(f"{m} {ms[m]:.2f} ms ({tf[m]:.0f})" for m in ms)
                    + f" err {max(row['err_vs_first'].values()):.1e} "
                    + " ".join(f"{s.get('regs')}/{s.get('spills')}" for s in row["kernels"])
                    if "ms" in row
                    else row["error"][-400:]
                )
            )
            torch.cuda.empty_cache()
    result["gemm_end"] = gemm_tflops()
    log(f"GEMM {result['gemm_end']:.0f} TFLOP/s")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
