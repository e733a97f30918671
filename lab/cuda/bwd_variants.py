"""Variants of the cuda backward (kernels/kl_bwd.cu), built as patches of the shipped source, so
one device call can check each against float64 and time them beside the shipped kernel and the
triton backward (interleaved rounds, bf16 GEMM yardstick in the same run).

    python lab/cuda/bwd_variants.py --compile-only          # here: every variant's ptxas report
    PYTHONPATH=. python lab/cuda/bwd_variants.py --out $OUT/variants.json [--variants a,b]

Variants (each a list of (anchor, replacement) patches; every anchor must occur exactly once):
  stmatrix  dS goes to shared memory with four stmatrix.m8n8.x4.trans per thread (the A
            fragments are 8x8 blocks in the mma layout; .trans writes each block's columns as
            the 16-byte rows of the K-major dS tile) instead of 32 st.shared.b16.
  split     S1 and S2 as two commit groups: P1 = 2^(c1 S1 - L1) of every element is formed under
            the S2 GEMM, the rest after it (32 more registers hold P1).
  both      stmatrix and split.
A variant that wins moves into kernels/kl_bwd.cu; its numbers go to lab/notes/cuda_backward_log.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

STMATRIX_HELPER = (
    "KL_DEV void consume(",
    """// Four 8x8 16-bit blocks (registers r[m], the mma fragment layout) stored transposed: lane t
// gives the address of row t % 8 of block t / 8.
KL_DEV void stmatrix_x4_trans(unsigned addr, const unsigned* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

KL_DEV void consume(""",
)

STMATRIX_STORE = (
    """#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const unsigned v = a[4 * (j / 2) + 2 * (j % 2) + i];
        const int kc = 16 * warp + lane / 4 + 8 * i;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int q = 8 * j + 2 * (lane % 4) + k;
          const unsigned addr = ds + c * SLAB_Q + q * 128 + ((((kc >> 3) ^ (q & 7)) << 4) | ((kc & 7) << 1));
          sts16(addr, (unsigned short)(k ? v >> 16 : v & 0xFFFF));
        }
      }
    }
""",
    """    {
      // Block m = 2 h + i of k-step kk holds keys 16 warp + 8 i .., rows 16 kk + 8 h ..; lane t
      // addresses row 16 kk + 8 (m / 2) + t % 8 of the tile at its 16-byte chunk 2 warp + m % 2,
      // swizzled by the row's low three bits (t % 8).
      const int m = lane / 8, r = lane % 8;
      const unsigned row0 = ds + c * SLAB_Q + (8 * (m / 2) + r) * 128 + (((2 * warp + m % 2) ^ r) << 4);
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) stmatrix_x4_trans(row0 + kk * 16 * 128, a + 4 * kk);
    }
""",
)

SPLIT = [
    (
        """    gemm_kq<D1P>(s1, base + OFF_K1, base + OFF_Q1 + stage * Q1_BYTES, c);
    gemm_kq<D2P>(s2, base + OFF_K2, base + OFF_Q2 + stage * Q2_BYTES, c);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<NR>(s1);
    fence_regs<NR>(s2);
""",
        """    gemm_kq<D1P>(s1, base + OFF_K1, base + OFF_Q1 + stage * Q1_BYTES, c);
    wgmma_commit();
    gemm_kq<D2P>(s2, base + OFF_K2, base + OFF_Q2 + stage * Q2_BYTES, c);
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs<NR>(s1);
""",
    ),
    (
        """    const bool masked = last_key >= p.nk || (p.causal && q0 + off < last_key);
""",
        """    const bool masked = last_key >= p.nk || (p.causal && q0 + off < last_key);
    float e1[NR];  // P1, formed under the S2 GEMM
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const float l1 = rows[8 * j + 2 * (lane % 4) + k];
#pragma unroll
        for (int i = 0; i < 2; ++i) e1[KL_IDX(j, i, k)] = ex2(fmaf(p.c1, s1[KL_IDX(j, i, k)], -l1));
      }
    }
    wgmma_wait<0>();
    fence_regs<NR>(s2);
""",
    ),
    (
        """        const float l1 = rows[col], l2 = rows[BM + col], g = rows[2 * BM + col];""",
        """        const float l2 = rows[BM + col], g = rows[2 * BM + col];""",
    ),
    (
        """          float d = g * (ex2(fmaf(p.c2, s2[x], -l2)) - ex2(fmaf(p.c1, s1[x], -l1)));""",
        """          float d = g * (ex2(fmaf(p.c2, s2[x], -l2)) - e1[x]);""",
    ),
]

VARIANTS = {
    "stmatrix": [STMATRIX_HELPER, STMATRIX_STORE],
    "split": SPLIT,
    "both": [STMATRIX_HELPER, STMATRIX_STORE, *SPLIT],
}


def patched(source: str, patches) -> str:
    for anchor, replacement in patches:
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


def use(name: str) -> None:
    """Makes the cuda backend's backward launch variant `name` ("shipped": the tree's source)."""
    from streamkl.backends.cuda import _bwd

    base = (_bwd._jit.KERNELS / _bwd.SOURCE_FILE).read_text()
    src = base if name == "shipped" else patched(base, VARIANTS[name])
    _bwd.source = lambda: src
    _bwd.kernel.cache_clear()


def run(names, out):
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
            use(name)
            got = _bwd.backward(spec, inputs, stats, grad)
            rec[name] = [err(got[2], ref[0]), err(got[3], ref[1])]
        print(rec, flush=True)
        res["check"].append(rec)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for n in (8192, 16384):
        for causal in (False, True):
            call = case(1, 32, 32, 32, n, n, 128, 128, causal)
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
            pairs = n * n / 2 + n / 2 if causal else n * n
            rec = {"n": n, "causal": causal, "ms": best, "gemm_tflops": 2 * 8192**3 / best["gemm"] / 1e9}
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
    ap.add_argument("--out", default="variants.json")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.compile_only:
        compile_report(names)
    else:
        run(names, args.out)


if __name__ == "__main__":
    main()
