"""The cuda backend's forward on this GPU, in one run: compile every variant of kernels/kl_fwd.cu
(first-call compile time, registers, spills), check each against a float64 oracle on fresh random
data (outputs poisoned first), then time each beside the triton forward and a bf16 8192^3 GEMM
(triton.testing.do_bench; the median of interleaved rounds). Prints a table last; --json writes
everything.

    python benchmarks/cuda_fwd.py --json out.json [--variants a,b,c] [--skip-bench]
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import platform
import statistics
import subprocess
import sys
import time

import torch

import streamkl
from streamkl.backends.cuda import _jit, _launch
from streamkl.testing import dense_attn_kl, make_inputs, rel_err

BASE = dict(KL_FP16=0, D1P=128, D2P=128)
# The stages of docs/cuda.md, each with today's update (the lagged running max, S2 through x2);
# f-3wg64-overlap is the shipped structure. The x- ablations of it compute wrong results and are
# timed only.
SHIPPED = dict(
    NWG=3, BN=64, STAGES=4, WS=1, PINGPONG=0, OVERLAP=1, QREGS="shipped", ISSUE_SPLIT="shipped", TAIL=1
)
VARIANTS = {
    "a-plain": dict(NWG=2, BN=128, STAGES=2, WS=0, PINGPONG=0),
    "b-ws": dict(NWG=2, BN=128, STAGES=2, WS=1, PINGPONG=0),
    "c-pingpong2": dict(NWG=2, BN=128, STAGES=2, WS=1, PINGPONG=1),
    # three consumers of 64 rows over 64-key tiles, 4 stages (128 x BN = 128 registers for them)
    "e-3wg64": dict(NWG=3, BN=64, STAGES=4, WS=1, PINGPONG=1),
    "e-3wg64-nopp": dict(NWG=3, BN=64, STAGES=4, WS=1, PINGPONG=0),
    # each consumer overlaps its own GEMMs and updates (tile i's S1 GEMM under tile i - 1's S2 update)
    "f-overlap": dict(NWG=2, BN=128, STAGES=2, WS=1, PINGPONG=0, OVERLAP=1),
    "f-3wg64-overlap": SHIPPED,
    # Q from shared memory in both GEMMs, or only Q1 or Q2 in registers (shipped: the larger
    # one, both when both are 64 wide)
    "r-qsmem": dict(SHIPPED, QREGS=0),
    "r-q1regs": dict(SHIPPED, QREGS=1),
    "r-q2regs": dict(SHIPPED, QREGS=2),
    "x-noexp": dict(SHIPPED, ABLATE=1),
    "x-onegemm": dict(SHIPPED, ABLATE=2),
    "x-2stage": dict(SHIPPED, STAGES=2),
    # each GEMM issued at once (shipped where a head dim is 128), or in two halves, the second
    # from inside the update under it (shipped at 64 / 64)
    "s-issue-whole": dict(SHIPPED, ISSUE_SPLIT=0),
    "s-issue-split": dict(SHIPPED, ISSUE_SPLIT=1),
    # at most 64 query rows without DECODE: one consumer runs every key tile's math
    "d-nodecode": dict(SHIPPED, DECODE=0),
    # unmasked grids of more than one wave without TAIL: the last partial wave's row tiles unsplit
    # (the whole grid split as splits_for says)
    "t-notail": dict(SHIPPED, TAIL=0),
}
# The shipped build launched in another grid order or split count (the launch's schedule; the head
# group applies under causal masking only).
SCHEDULES = {
    "o-causal-hg1": dict(hgroup=1),
    "o-causal-hg4": dict(hgroup=4),
    "o-causal-hg32": dict(hgroup=32),
    "o-split1": dict(splits=1),
    "o-split2": dict(splits=2),
    "o-split3": dict(splits=3),
}
VARIANTS.update(dict.fromkeys(SCHEDULES, SHIPPED))
ABLATIONS = tuple(v for v in VARIANTS if v.startswith("x-"))
TIMED_AT_D64 = tuple(v for v in VARIANTS if v != "a-plain")
# (b, h, hk1, hk2, nq, nk, d1, d2, layout, causal, dtype[, dict(std=, scale1=, scale2=, lengths=)]):
# std scales the random inputs (std 50 at D = 128: |S * scale| up to ~1e4), the scales default to
# 1 / sqrt(d); lengths packs sequences of those lengths (cu_seqlens; nq = nk = their sum).
PACKED = dict(lengths=[0, 130, 1, 300, 64, 257])
CHECKS = [
    (2, 4, 4, 4, 1000, 1000, 128, 128, "bhnd", False, torch.bfloat16),
    (2, 4, 4, 4, 1000, 1000, 128, 128, "bhnd", True, torch.bfloat16),
    (1, 8, 2, 1, 333, 777, 128, 64, "bnhd", True, torch.bfloat16),
    (1, 8, 1, 4, 515, 130, 64, 128, "bnhd", True, torch.float16),
    (1, 2, 2, 2, 37, 53, 128, 128, "bhnd", False, torch.float16),
    (1, 2, 2, 2, 1, 1, 64, 64, "bhnd", False, torch.bfloat16),
    (1, 4, 4, 4, 300, 900, 128, 128, "bhnd", False, torch.bfloat16, dict(std=50.0)),
    (1, 4, 2, 2, 300, 900, 128, 128, "bhnd", True, torch.bfloat16, dict(std=10.0)),
    (1, 4, 4, 2, 260, 700, 128, 64, "bnhd", True, torch.bfloat16, dict(std=20.0, scale1=-0.1, scale2=0.06)),
    (1, 12, 4, 3, 500, 600, 128, 128, "bhnd", True, torch.bfloat16),  # heads in groups of 8 and 4
    (1, 2, 1, 2, 3, 3000, 128, 64, "bnhd", True, torch.bfloat16),  # split-K
    (1, 2, 2, 1, 752, 752, 128, 64, "bnhd", True, torch.bfloat16, PACKED),
    (1, 32, 32, 32, 1000, 1000, 128, 128, "bhnd", False, torch.bfloat16),  # 192 row tiles: TAIL splits 60
    (2, 16, 16, 8, 1000, 700, 128, 64, "bnhd", False, torch.float16),  # the same over two batches
]


def consts_for(variant, d1, d2, dtype):
    c = dict(BASE, **VARIANTS[variant])
    c.update(D1P=_launch.padded_dim(d1), D2P=_launch.padded_dim(d2), KL_FP16=int(dtype == torch.float16))
    if c.get("QREGS") == "shipped":
        c["QREGS"] = _launch.q_in_registers(c["D1P"], c["D2P"])
    if c.get("ISSUE_SPLIT") == "shipped":
        c["ISSUE_SPLIT"] = _launch.issue_split(c["D1P"], c["D2P"])
    while _launch.smem_bytes(c) > _launch.SMEM_LIMIT:
        c["STAGES"] -= 1
    return c


def run_cuda(inputs, causal, consts, schedule=None, scale1=None, scale2=None, cu_seqlens=None):
    q1, k1, q2, k2 = inputs
    if schedule is not None and not causal:
        schedule = {k: v for k, v in schedule.items() if k != "hgroup"}
    s1 = 1 / math.sqrt(q1.shape[-1]) if scale1 is None else scale1
    s2 = 1 / math.sqrt(q2.shape[-1]) if scale2 is None else scale2
    packed = dict(cu_seqlens=cu_seqlens, max_seqlen=None)
    if cu_seqlens is not None:
        packed["max_seqlen"] = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    kw = dict(causal=causal, scale1=s1, scale2=s2, consts=consts, schedule=schedule)
    return _launch.forward(q1, k1, q2, k2, **kw, **packed)


def check(variant, log):
    worst = 0.0
    for b, h, hk1, hk2, nq, nk, d1, d2, layout, causal, dtype, *extra in CHECKS:
        opts = extra[0] if extra else {}
        consts = consts_for(variant, d1, d2, dtype)
        std = opts.get("std", 1.0)
        inputs = make_inputs(b=b, h=h, hk1=hk1, hk2=hk2, nq=nq, nk=nk, d1=d1, d2=d2, dtype=dtype,
                             device="cuda", layout=layout, seed=nq + nk, std=std)  # fmt: skip
        scales = dict(scale1=opts.get("scale1"), scale2=opts.get("scale2"))
        cu = None
        if "lengths" in opts:
            cu = torch.tensor([0, *itertools.accumulate(opts["lengths"])], dtype=torch.int32, device="cuda")
        poison = torch.full((3, b, h, nq), float("nan"), device="cuda")
        del poison  # the outputs reuse this memory
        kl, lse1, lse2 = run_cuda(inputs, causal, consts, SCHEDULES.get(variant), cu_seqlens=cu, **scales)
        torch.cuda.synchronize()
        wide = [t.double() for t in inputs]
        ref, r1, r2 = dense_attn_kl(*wide, causal=causal, return_lse=True, cu_seqlens=cu, **scales)
        finite = torch.isfinite(r1)  # rows that see a key
        ok_inf = torch.equal(torch.isneginf(lse1), torch.isneginf(r1)) and torch.equal(
            torch.isneginf(lse2), torch.isneginf(r2)
        )
        err = rel_err(kl, ref)
        lerr = (
            max(rel_err(lse1[finite], r1[finite]), rel_err(lse2[finite], r2[finite])) if finite.any() else 0.0
        )
        nan = bool(torch.isnan(kl).any() or torch.isnan(lse1).any() or torch.isnan(lse2).any())
        good = ok_inf and not nan and err < 1e-4 and lerr < 1e-5
        worst = max(worst, err if good else math.inf)
        case = str((b, h, hk1, hk2, nq, nk, d1, d2, layout, causal, str(dtype), *extra))
        verdict = "ok" if good else "FAIL"
        print(f"  check {variant} {case}: kl rel err {err:.2e} lse {lerr:.2e} nan={nan} "
              f"-inf rows ok={ok_inf} -> {verdict}", flush=True)  # fmt: skip
        log.append(dict(variant=variant, case=case, kl_rel_err=err, lse_rel_err=lerr, nan=nan, good=good))
    return worst


def bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def time_gemm():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / bench_ms(lambda: a @ b) / 1e9


def time_copy():
    """Device-to-device copy, GB/s of bytes read + written: the bound of the decode shapes."""
    src = torch.empty(2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * 2**30 / bench_ms(lambda: dst.copy_(src)) / 1e6


def time_shape(d, nq, nk, causal, variants, rounds, work, d2=None):
    """work / ms / 1e9 of the triton forward (through the op) and of each variant at B=1, H=32,
    head dims d and d2 (default d) (TFLOP/s where work is FLOPs, GB/s where it is bytes x 1000),
    with each one's median ms and spread: the median of `rounds` rounds that each time every one
    in turn, so a drift of the clock falls on all."""
    d2 = d if d2 is None else d2
    inputs = make_inputs(b=1, h=32, nq=nq, nk=nk, d1=d, d2=d2, dtype=torch.bfloat16, device="cuda", seed=1)
    ref_kl = streamkl.attn_kl(*inputs, causal=causal, backend="triton")
    row = dict(d=d if d2 == d else f"{d}x{d2}", n=nq, nk=nk, causal=causal)
    calls = {"triton": lambda: streamkl.attn_kl(*inputs, causal=causal, backend="triton")}
    for v in variants:
        c, sched = consts_for(v, d, d2, torch.bfloat16), SCHEDULES.get(v)
        kl, _, _ = run_cuda(inputs, causal, c, sched)
        if v not in ABLATIONS:
            row[v + "-vs-triton-relerr"] = rel_err(kl, ref_kl)
        calls[v] = lambda c=c, sched=sched: run_cuda(inputs, causal, c, sched)
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name].append(bench_ms(fn))
    for name, ms in times.items():
        row[name] = work / statistics.median(ms) / 1e9
        row[name + "-ms"] = statistics.median(ms)
        row[name + "-spread"] = (max(ms) - min(ms)) / statistics.median(ms)
    return row


def diagnose(variants):
    """Large grids against the float64 oracle with NaN-poisoned outputs: one wave with long key
    loops, many waves with short ones, the benchmark shape (heads compared on slices). Reads the
    outputs once before synchronizing (stream order) and once after."""
    found = []
    cases = [(2, 8192, 128, False), (264, 200, 128, True), (32, 8192, 128, False), (32, 8192, 64, True)]
    for v in variants:
        for h, n, d, causal in cases:
            inputs = make_inputs(
                b=1, h=h, nq=n, nk=n, d1=d, d2=d, dtype=torch.bfloat16, device="cuda", seed=h + n
            )
            outs = tuple(torch.full((1, h, n), float("nan"), device="cuda") for _ in range(3))
            q1, k1, q2, k2 = inputs
            s1 = s2 = 1 / math.sqrt(d)
            c = consts_for(v, d, d, torch.bfloat16)
            _launch.forward(q1, k1, q2, k2, causal=causal, scale1=s1, scale2=s2, consts=c, out=outs)
            nan_in_order = bool(torch.isnan(outs[0]).any())  # stream-ordered after the kernel
            torch.cuda.synchronize()
            nan_after = bool(torch.isnan(outs[0]).any())
            heads = [0, 1] if h <= 2 else [0, h - 1]
            errs = []
            for hh in heads:
                sl = [t[:, hh : hh + 1].double() for t in inputs]
                ref = dense_attn_kl(*sl, causal=causal)
                errs.append(rel_err(outs[0][:, hh : hh + 1], ref))
            tri = streamkl.attn_kl(*inputs, causal=causal, backend="triton")
            vs_triton = rel_err(outs[0], tri)
            row = dict(variant=v, h=h, n=n, d=d, causal=causal, nan_in_order=nan_in_order,
                       nan_after=nan_after, rel_err_f64=max(errs), vs_triton=vs_triton)  # fmt: skip
            print(row, flush=True)
            found.append(row)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--sizes", default="8192,16384")
    ap.add_argument("--dims", help="head dims timed at every size (default: 128, and 64 at the first size); "
                    "--decode also takes D1xD2")  # fmt: skip
    ap.add_argument("--decode", help="time only these NQxNK shapes (non-causal), e.g. 1x32768,64x131072")
    ap.add_argument("--causal", choices=["0", "1", "both"], default="both", help="the masks timed")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per shape (the median is kept)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--small", action="store_true", help="the small checks only (for compute-sanitizer)")
    ap.add_argument(
        "--diagnose", action="store_true", help="multi-wave and long-key checks, poisoned outputs"
    )
    ap.add_argument("--commit", help="the commit measured, where the copy's .git is missing or stale")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if args.small:
        CHECKS[:] = [(1, 2, 1, 2, 200, 333, 128, 64, "bnhd", True, torch.bfloat16),
                     (1, 2, 2, 1, 77, 64, 64, 128, "bhnd", False, torch.float16),
                     (1, 10, 5, 2, 150, 150, 64, 64, "bhnd", True, torch.bfloat16),  # groups of 8 and 2
                     (1, 2, 1, 1, 3, 1200, 64, 128, "bnhd", False, torch.bfloat16),  # split-K
                     (1, 2, 2, 1, 300, 300, 128, 64, "bnhd", True, torch.bfloat16,
                      dict(lengths=[0, 70, 1, 129, 100])),
                     # TAIL: 144 row tiles, the last 12 split
                     (1, 24, 24, 12, 1000, 300, 128, 64, "bhnd", False, torch.bfloat16)]  # fmt: skip
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    import cuda.bindings
    import cuda.core
    import triton

    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes")
    env = dict(
        gpu=torch.cuda.get_device_name(), date=now,
        commit=commit or "(not a git checkout)", torch=torch.__version__, triton=triton.__version__,
        cuda_core=cuda.core.__version__, cuda_bindings=cuda.bindings.__version__,
        nvrtc=".".join(map(str, _jit.nvrtc_version())), python=platform.python_version(),
    )  # fmt: skip
    print(env, flush=True)
    out = dict(env=env, builds={}, checks=[], timings=[])

    for v in variants:  # compile first: the build report is useful even if a check hangs
        for d in (128, 64):
            c = consts_for(v, d, d, torch.bfloat16)
            t0 = time.perf_counter()
            b = _jit.compile_kernel(_launch.source(), _launch.ENTRY, c)
            secs, smem = round(time.perf_counter() - t0, 2), _launch.smem_bytes(c)
            # ptxas serializing the wgmma (C7514-C7519) slows the loop several percent: a variant
            # measured so measures its build, not its idea
            serialized = "serialized" in b.log
            out["builds"][f"{v}-d{d}"] = dict(
                consts=c, registers=b.registers, spill_bytes=b.spill_bytes, compile_s=secs, smem=smem,
                wgmma_serialized=serialized,
            )  # fmt: skip
            print(
                f"build {v} d{d}: {b.registers} regs, {b.spill_bytes} B spills, smem {smem}, {secs} s"
                + (", WGMMA SERIALIZED" if serialized else ""),
                flush=True,
            )

    if args.diagnose:
        out["diagnose"] = diagnose(variants)
        if args.json:
            json.dump(out, open(args.json, "w"), indent=1)
        return
    good = []
    for v in variants:
        if v in ABLATIONS or check(v, out["checks"]) < 1e-4:
            good.append(v)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)
    if args.skip_bench:
        return

    # host cost of one small call (the GPU runs behind)
    x = make_inputs(b=1, h=1, nq=128, nk=128, d1=64, d2=64, dtype=torch.bfloat16, device="cuda")
    for name in ("cuda", "triton"):
        for _ in range(20):
            streamkl.attn_kl(*x, backend=name)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            streamkl.attn_kl(*x, backend=name)
        host = (time.perf_counter() - t0) / 500 * 1e6
        torch.cuda.synchronize()
        out["timings"].append(dict(what=f"host-us-per-call-{name}", us=host))
        print(f"host cost per small call, {name}: {host:.1f} us", flush=True)

    if args.decode:
        cols = ["triton", *good]
        head = f"{'D':>7} {'Nq':>4} {'Nk':>7} " + " ".join(f"{c:>16}" for c in cols)
        copy = time_copy()
        out["timings"].append(dict(what="copy-gbps", gbps=copy))
        print(head + f"   (GB/s of keys read; device copy {copy:.0f} GB/s)")
        for shape in args.decode.split(","):
            nq, nk = (int(x) for x in shape.split("x"))
            for dims in args.dims.split(",") if args.dims else ["128"]:
                d1, d2 = (int(x) for x in (dims.split("x") * 2)[:2])  # "64" or "64x128"
                key_bytes = 32 * nk * (d1 + d2) * 2  # both key tensors, read once
                row = time_shape(d1, nq, nk, False, good, args.rounds, key_bytes * 1e3, d2)
                out["timings"].append(row)
                print(f"{dims:>7} {nq:>4} {nk:>7} " + " ".join(f"{row[c]:>16.0f}" for c in cols), flush=True)
        copy_end = time_copy()
        out["timings"].append(dict(what="copy-gbps-end", gbps=copy_end))
        print(f"(device copy at the end {copy_end:.0f} GB/s)")
        if args.json:
            json.dump(out, open(args.json, "w"), indent=1)
        return
    gemm = time_gemm()
    out["timings"].append(dict(what="gemm-bf16-8192", tflops=gemm))
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    dims = [int(d) for d in args.dims.split(",")] if args.dims else [128, 64]
    for d in dims:
        for n in sizes if d == 128 or args.dims else sizes[:1]:
            for causal in {"0": [False], "1": [True], "both": [False, True]}[args.causal]:
                timed = good if d == 128 else [v for v in good if v in TIMED_AT_D64]
                flops = 4 * 32 * n * n * d / (2 if causal else 1)
                row = time_shape(d, n, n, causal, timed, args.rounds, flops)
                rows.append(row)
                out["timings"].append(row)
                print(row, flush=True)
    gemm_end = time_gemm()
    out["timings"].append(dict(what="gemm-bf16-8192-end", tflops=gemm_end))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)
    print(f"\n{env['gpu']}  commit {env['commit']}  {env['date']}  GEMM bf16 8192^3: {gemm:.0f} TFLOP/s")
    cols = ["triton", *[v for v in good]]
    print(f"{'D':>4} {'N':>6} {'causal':>6} " + " ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(f"{r['d']:>4} {r['n']:>6} {str(r['causal']):>6} " + " ".join(
            f"{r[c]:>12.0f}" if c in r else f"{'-':>12}" for c in cols))  # fmt: skip
    spread = max((v for r in rows for k, v in r.items() if k.endswith("-spread")), default=0.0)
    print(f"(TFLOP/s on 4*B*H*N*N*D, half when causal; B=1 H=32 bf16; the median of {args.rounds} rounds, "
          f"largest spread {spread:.1%}; GEMM at the end {gemm_end:.0f})")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
