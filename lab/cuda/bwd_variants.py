"""Variants of the cuda backward (kernels/kl_bwd.cu), built as patches of the shipped source, so
one device call can check each against float64 and time them beside the shipped kernel and the
triton backward (interleaved rounds, bf16 GEMM yardstick in the same run).

    python lab/cuda/bwd_variants.py --compile-only          # here: every variant's ptxas report
    PYTHONPATH=. python lab/cuda/bwd_variants.py --out $OUT/variants.json [--variants a,b]

Variants: each a list of (anchor, replacement) patches; every anchor must occur exactly once.
Ablations (timing only, wrong results by design; what a stage costs is the difference):
  no-red    the dq adds are never issued (the dQ GEMM still runs and its result stays live).
  no-exp    dS = G (c2 S2 - L2 - c1 S1 + L1): no exponential (the MUFU's share).
  no-dsstore  dS never reaches shared memory (dQ reads whatever the buffer holds).
The schedules measured before (stmatrix, split, the named-barrier dQ, offset, k1reg, k2reg, one
lane per warp releasing the stage) are in lab/notes/cuda_backward_log.md with their numbers.
A variant that wins moves into kernels/kl_bwd.cu; its numbers go to lab/notes/cuda_backward_log.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

NO_RED = [
    (
        "if (col < p.d2) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);",
        "if (col < p.d2 && p.nq < 0) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);",
    )
]

NO_EXP = [
    (
        "float d0 = g.x * (ex2(fmaf(p.c2, s2[x], -l2.x)) - ex2(fmaf(p.c1, s1[x], -l1.x)));",
        "float d0 = g.x * (fmaf(p.c2, s2[x], -l2.x) - fmaf(p.c1, s1[x], -l1.x));",
    ),
    (
        "float d1 = g.y * (ex2(fmaf(p.c2, s2[x + 1], -l2.y)) - ex2(fmaf(p.c1, s1[x + 1], -l1.y)));",
        "float d1 = g.y * (fmaf(p.c2, s2[x + 1], -l2.y) - fmaf(p.c1, s1[x + 1], -l1.y));",
    ),
]

NO_DSSTORE = [
    (
        "          sts16(addr, (unsigned short)(k ? v >> 16 : v & 0xFFFF));\n",
        "          (void)addr, (void)v;\n",
    )
]

VARIANTS = {"no-red": NO_RED, "no-exp": NO_EXP, "no-dsstore": NO_DSSTORE}
ABLATIONS = {"no-red", "no-exp", "no-dsstore"}  # timed, never checked
EXTRA_BARRIER_BYTES: dict[str, int] = {}  # shared memory a variant needs beyond _bwd.smem_bytes


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
        for consts in _bwd.shipped_instantiations():
            b = _jit.compile_kernel(src, _bwd.ENTRY, consts)
            serial = [line.strip()[:90] for line in b.log.splitlines() if "serial" in line.lower()]
            print(name, consts, f"regs {b.registers} spill {b.spill_bytes} stack {b.stack_bytes}", serial)


_SMEM_BYTES = None  # the shipped _bwd.smem_bytes, kept by use() before it wraps it


def use(name: str) -> None:
    """Makes the cuda backend's backward launch variant `name` ("shipped": the tree's source)."""
    global _SMEM_BYTES
    from streamkl.backends.cuda import _bwd

    _SMEM_BYTES = _SMEM_BYTES or _bwd.smem_bytes
    base = (_bwd._jit.KERNELS / _bwd.SOURCE_FILE).read_text()
    src = base if name == "shipped" else patched(base, VARIANTS[name])
    _bwd.source = lambda: src
    extra = EXTRA_BARRIER_BYTES.get(name, 0)
    _bwd.smem_bytes = lambda c: _SMEM_BYTES(c) + extra
    _bwd.kernel.cache_clear()


def run(names, out, timing=True):
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
              (1, 4, 2, 4, 77, 1000, 96, 128, False), (1, 8, 8, 8, 2048, 2048, 128, 128, True)]  # fmt: skip
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
            use(name)
            got = _bwd.backward(spec, inputs, stats, grad)
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
            use(name)  # compiles and loads the variant; its partial keeps that kernel
            loaded = _bwd.kernel(tuple(sorted(_bwd.shipped(128, 128, False).items())), 0)
            fns[name] = functools.partial(_launch_with, loaded, call)
        times = {k: [] for k in fns}
        for _ in range(3):
            for k, f in fns.items():
                times[k].append(_time(torch, f))
        best = {k: min(v) for k, v in times.items()}
        off = nk - nq  # bottom-right: row i sees keys j <= i + off
        pairs = sum(min(nk, i + off + 1) for i in range(nq)) if causal else nq * nk
        rec = {
            "nq": nq,
            "nk": nk,
            "causal": causal,
            "ms": best,
            "gemm_tflops": 2 * 8192**3 / best["gemm"] / 1e9,
        }
        rec["tflops"] = {k: 4 * 2 * 32 * pairs * 128 / v / 1e9 for k, v in best.items() if k != "gemm"}
        print(rec, flush=True)
        res["timing"].append(rec)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def _launch_with(loaded, call):
    """The shipped host path with one variant's loaded kernel ((handle, smem) of _bwd.kernel)."""
    from streamkl.backends.cuda import _bwd

    saved = _bwd.kernel
    _bwd.kernel = lambda *args: loaded
    try:
        return _bwd.backward(*call)
    finally:
        _bwd.kernel = saved


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
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--check-only", action="store_true", help="no timing (for compute-sanitizer)")
    ap.add_argument("--out", default="variants.json")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.compile_only:
        compile_report(names)
    else:
        run(names, args.out, timing=not args.check_only)


if __name__ == "__main__":
    main()
