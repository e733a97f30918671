"""Variants of the cuda backward (kernels/kl_bwd.cu), built as patches of the shipped source, so
one device call can check each against float64 and time them beside the shipped kernel and the
triton backward (interleaved rounds, bf16 GEMM yardstick in the same run).

    python lab/cuda/bwd_variants.py --compile-only          # here: every variant's ptxas report
    PYTHONPATH=. python lab/cuda/bwd_variants.py --out $OUT/variants.json [--variants a,b]
    PYTHONPATH=. python lab/cuda/bwd_variants.py --settings --out $OUT/settings.json

Variants: each a list of (anchor, replacement) patches; every anchor must occur exactly once;
each runs through the shipped host path (its launch plan: the decode shapes launch KSTAGES 2).
Ablations (timing only, wrong results by design; what a stage costs is the difference):
  no-red    the dq adds are never issued (the dQ GEMM still runs and its result stays live).
  no-exp    dS = G (c2 S2 - L2 - c1 S1 + L1): no exponential (the MUFU's share).
  no-dsstore  dS never reaches shared memory (dQ reads whatever the buffer holds).
The schedules measured before (stmatrix, split, the named-barrier dQ, offset, k1reg, k2reg, one
lane per warp releasing the stage, the persistent decode launch and setting 2, both shipped since)
are in lab/notes/cuda_backward_log.md with their numbers.
A variant that wins moves into kernels/kl_bwd.cu; its numbers go to lab/notes/cuda_backward_log.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

NO_RED = [
    (
        "if (col < p.d) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);",
        "if (col < p.d && p.nq < 0) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);",
    )
]

NO_EXP = [
    (
        "d0 = t2.x * (ex2(fmaf(p.c2, s2[x], -t1.x)) - ex2(fmaf(p.c1, s1[x], -t0.x)));",
        "d0 = t2.x * (fmaf(p.c2, s2[x], -t1.x) - fmaf(p.c1, s1[x], -t0.x));",
    ),
    (
        "d1 = t2.y * (ex2(fmaf(p.c2, s2[x + 1], -t1.y)) - ex2(fmaf(p.c1, s1[x + 1], -t0.y)));",
        "d1 = t2.y * (fmaf(p.c2, s2[x + 1], -t1.y) - fmaf(p.c1, s1[x + 1], -t0.y));",
    ),
]

NO_DSSTORE = [
    (
        "          sts16(addr, (unsigned short)(k ? v >> 16 : v & 0xFFFF));\n",
        "          (void)addr, (void)v;\n",
    )
]


def _between(start: str, end: str):
    """An anchor: the source from `start` up to (not including) `end`."""
    return lambda source: source[source.index(start) : source.index(end)]


VARIANTS = {
    "no-red": NO_RED,
    "no-exp": NO_EXP,
    "no-dsstore": NO_DSSTORE,
}
ABLATIONS = {"no-red", "no-exp", "no-dsstore"}  # timed, never checked


def patched(source: str, patches) -> str:
    for anchor, replacement in patches:
        if callable(anchor):
            anchor = anchor(source)
        if source.count(anchor) != 1:
            raise RuntimeError(f"anchor found {source.count(anchor)} times:\n{anchor}")
        source = source.replace(anchor, replacement)
    return source


def compile_report(names):
    from streamkl.backends.cuda import _bwd, _jit

    base = _bwd.source()
    for name in ["shipped", *names]:
        src = base if name == "shipped" else patched(base, VARIANTS[name])
        for consts in [c for c in _bwd.shipped_instantiations() if c["SETTING"] == 1]:
            b = _jit.compile_kernel(src, _bwd.ENTRY, consts)
            serial = [line.strip()[:90] for line in b.log.splitlines() if "serial" in line.lower()]
            print(name, consts, f"regs {b.registers} spill {b.spill_bytes} stack {b.stack_bytes}", serial)


_LOADERS = {}  # variant name: its (consts, device) -> (handle, smem) loader, as _bwd.kernel
_SHIPPED_KERNEL = None  # _bwd.kernel's uncached function


def _loader(name: str):
    """_bwd.kernel for variant `name` ("shipped": the tree's source), cached per instantiation."""
    from streamkl.backends.cuda import _bwd

    global _SHIPPED_KERNEL
    _SHIPPED_KERNEL = _SHIPPED_KERNEL or _bwd.kernel.__wrapped__  # before any swap of _bwd.kernel
    if name not in _LOADERS:
        base = _bwd.source()
        src = base if name == "shipped" else patched(base, VARIANTS[name])

        @functools.cache
        def load(consts_items, device_index):
            saved = _bwd.source
            _bwd.source = lambda: src
            try:
                return _SHIPPED_KERNEL(consts_items, device_index)
            finally:
                _bwd.source = saved

        _LOADERS[name] = load
    return _LOADERS[name]


def _launch_with(name, call):
    """The shipped host path (its launch plan included) with variant `name`'s kernels."""
    from streamkl.backends.cuda import _bwd

    saved = _bwd.kernel
    _bwd.kernel = _loader(name)
    try:
        return _bwd.backward(*call)
    finally:
        _bwd.kernel = saved


SMALL_PAIRS = 1_000_000  # --small keeps the check cases of at most this many (row, key) pairs


def run(names, out, timing=True, small=False):
    import torch

    import streamkl
    from streamkl import _checks
    from streamkl._spec import AttnKLInputs, AttnKLStats
    from streamkl.backends.cuda import _bwd
    from streamkl.backends.cuda import _launch as fwd_launch
    from streamkl.backends.triton import _launch as triton_launch
    from streamkl.testing import make_inputs

    os.environ["STREAMKL_CUDA_BWD"] = "cuda"
    names = ["shipped", *names]

    def case(b, h, hk1, hk2, nq, nk, d1, d2, causal):
        q1, k1, q2, k2 = make_inputs(
            b, h, nq, nk, d1, d2, hk1, hk2, dtype=torch.bfloat16, device="cuda", seed=nq
        )
        inputs = AttnKLInputs(q1, k1, q2, k2, None)
        spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=causal, scale1=None, scale2=None)
        spec = spec.with_needs(_bwd.SETTING1)
        stats = AttnKLStats(*fwd_launch.forward(spec, inputs))
        return spec, inputs, stats, torch.randn(stats.kl.shape, device="cuda")

    def err(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    res = {"check": [], "timing": []}
    shapes = [(2, 4, 1, 2, 200, 333, 128, 64, True), (1, 3, 3, 3, 513, 513, 40, 128, True),
              (1, 4, 2, 4, 77, 1000, 96, 128, False), (1, 8, 8, 8, 2048, 2048, 128, 128, True),
              # the decode launch walks several key tiles a CTA on these (4 CTAs a head at 32 heads)
              (1, 32, 32, 32, 1, 131072, 128, 128, True),
              (1, 32, 16, 32, 1000, 3000, 128, 128, True),
              (1, 32, 16, 32, 64, 3000, 128, 128, True)]  # fmt: skip
    shapes = [s for s in shapes if not small or s[4] * s[5] <= SMALL_PAIRS]
    for shape in shapes:
        spec, inputs, stats, grad = case(*shape)
        q64 = [t.double().requires_grad_(i >= 2) for i, t in enumerate(inputs[:4])]
        kl64 = streamkl.attn_kl(*q64, causal=spec.causal, reduction="none", backend="reference")
        ref = torch.autograd.grad(kl64, q64[2:], grad.double())
        tri = triton_launch.backward(spec, inputs, stats, grad)
        rec = {"case": shape, "triton": [err(tri[2], ref[0]), err(tri[3], ref[1])]}
        for name in names:
            if name in ABLATIONS:
                continue
            got = _launch_with(name, (spec, inputs, stats, grad))
            rec[name] = [err(got[2], ref[0]), err(got[3], ref[1])]
        print(rec, flush=True)
        res["check"].append(rec)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    timed = [] if not timing else [(n, n, c) for n in (4096, 8192, 16384) for c in (False, True)]
    timed += [] if not timing else [(1, 131072, True), (16, 32768, True), (64, 32768, False)]  # decode shapes
    for nq, nk, causal in timed:
        call = case(1, 32, 32, 32, nq, nk, 128, 128, causal)
        fns = {"triton": functools.partial(triton_launch.backward, *call), "gemm": lambda: a @ a}
        for name in names:
            fns[name] = functools.partial(_launch_with, name, call)
        rec = _timed(torch, fns, nq, nk, causal)
        best = rec["ms"]
        off = nk - nq  # bottom-right: row i sees keys j <= i + off
        pairs = sum(min(nk, i + off + 1) for i in range(nq)) if causal else nq * nk
        rec["tflops"] = {k: 4 * 2 * 32 * pairs * 128 / v / 1e9 for k, v in best.items() if k != "gemm"}
        print(rec, flush=True)
        res["timing"].append(rec)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def run_settings(out, timing=True, small=False, quick=False):
    """The shipped kernel's setting 2 (dq1, dk1) against float64 beside the triton backward's, on
    tile edges, D1 != D2, GQA, MQA, decode; then each setting timed beside triton's at 4K-16K and
    decode shapes, and both settings (triton's one pass against the cuda kernel's two launches)."""
    import torch

    import streamkl
    from streamkl import _checks
    from streamkl._spec import AttnKLInputs, AttnKLStats
    from streamkl.backends.cuda import _bwd
    from streamkl.backends.cuda import _launch as fwd_launch
    from streamkl.backends.triton import _launch as triton_launch
    from streamkl.testing import make_inputs

    os.environ["STREAMKL_CUDA_BWD"] = "cuda"

    def case(b, h, hk, nq, nk, d1, d2, causal, needs=_bwd.SETTING2):
        q1, k1, q2, k2 = make_inputs(
            b, h, nq, nk, d1, d2, hk, hk, dtype=torch.bfloat16, device="cuda", seed=nq
        )
        inputs = AttnKLInputs(q1, k1, q2, k2, None)
        spec = _checks.attn_kl_spec(q1, k1, q2, k2, causal=causal, scale1=None, scale2=None).with_needs(needs)
        stats = AttnKLStats(*fwd_launch.forward(spec, inputs))
        return spec, inputs, stats, torch.randn(stats.kl.shape, device="cuda")

    def err(got, ref):
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    res = {"check": [], "timing": []}
    shapes = [(2, 4, 2, 200, 333, 128, 64, True), (1, 3, 3, 513, 513, 40, 128, True),
              (1, 4, 4, 77, 1000, 96, 128, False), (1, 8, 8, 2048, 2048, 128, 128, True),
              (1, 32, 32, 16, 8192, 128, 128, True), (1, 4, 1, 65, 63, 64, 64, True)]  # fmt: skip
    shapes = [s for s in shapes if not small or s[3] * s[4] <= SMALL_PAIRS]
    for shape in shapes:
        spec, inputs, stats, grad = case(*shape)
        q64 = [t.double().requires_grad_(i < 2) for i, t in enumerate(inputs[:4])]
        kl64 = streamkl.attn_kl(*q64, causal=spec.causal, reduction="none", backend="reference")
        ref = torch.autograd.grad(kl64, q64[:2], grad.double())
        tri = triton_launch.backward(spec, inputs, stats, grad)
        got = _bwd.backward(spec, inputs, stats, grad)
        rec = {"case": shape, "triton": [err(tri[0], ref[0]), err(tri[1], ref[1])],
               "cuda": [err(got[0], ref[0]), err(got[1], ref[1])],
               "finite": bool(torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all())}  # fmt: skip
        print(rec, flush=True)
        res["check"].append(rec)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    timed = [(n, n, c) for n in (4096, 8192, 16384) for c in (False, True)] if timing else []
    timed += [(1, 131072, True), (16, 32768, True), (64, 32768, False)] if timing else []
    if quick:
        timed = [t for t in timed if t[0] != 16384 and (t[0] < 4096 or not t[2])]
    for nq, nk, causal in timed:
        spec, inputs, stats, grad = case(1, 32, 32, nq, nk, 128, 128, causal)
        s1, s2, both = (spec.with_needs(n) for n in (_bwd.SETTING1, _bwd.SETTING2, (True,) * 4))
        fns = {
            "triton-s1": functools.partial(triton_launch.backward, s1, inputs, stats, grad),
            "cuda-s1": functools.partial(_bwd.backward, s1, inputs, stats, grad),
            "triton-s2": functools.partial(triton_launch.backward, s2, inputs, stats, grad),
            "cuda-s2": functools.partial(_bwd.backward, s2, inputs, stats, grad),
            "triton-both": functools.partial(triton_launch.backward, both, inputs, stats, grad),
            "cuda-s1+s2": functools.partial(_both_launches, _bwd.backward, s1, s2, inputs, stats, grad),
            "gemm": lambda: a @ a,
        }
        rec = _timed(torch, fns, nq, nk, causal)
        print(rec, flush=True)
        res["timing"].append(rec)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def _both_launches(backward, s1, s2, *call):
    return backward(s1, *call), backward(s2, *call)


def _timed(torch, fns, nq, nk, causal) -> dict:
    """Each of `fns` (one of them "gemm", the 8192^3 yardstick) timed in three interleaved
    rounds, the best of each kept."""
    times = {k: [] for k in fns}
    for _ in range(3):
        for k, f in fns.items():
            times[k].append(_time(torch, f))
    best = {k: min(v) for k, v in times.items()}
    return {"nq": nq, "nk": nk, "causal": causal, "ms": best, "gemm_tflops": 2 * 8192**3 / best["gemm"] / 1e9}


def _time(torch, fn, reps=10):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--settings", action="store_true", help="the shipped kernel's settings against triton's")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="no timing (for compute-sanitizer)")
    ap.add_argument("--small", action="store_true", help="check cases small enough for compute-sanitizer")
    ap.add_argument(
        "--quick", action="store_true", help="--settings: 4K, 8K without the mask and decode only"
    )
    ap.add_argument("--out", default="variants.json")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.settings:
        run_settings(args.out, timing=not args.check_only, small=args.small, quick=args.quick)
    elif args.compile_only:
        compile_report(names)
    else:
        run(names, args.out, timing=not args.check_only, small=args.small)


if __name__ == "__main__":
    main()
