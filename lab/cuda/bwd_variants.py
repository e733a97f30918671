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
  offset    dQ(i - 1) issued right after S(i), so it runs under tile i's dS update; the consumers
            hand each other their dS slabs through mbarriers instead of a named barrier, so
            neither waits for the other inside a tile.
  offset-stmatrix  both.
  k1reg, k2reg     the consumer's 64 keys of K1 (K2) held as wgmma A fragments in registers from
            the start (loaded once per CTA), so S1^T (S2^T) runs RS and reads only Q from shared
            memory: an m64n64k16 SS GEMM reads 4 KB of shared memory per 32 tensor-core clocks,
            about shared memory's 128 B/clock, so the four per-tile GEMMs, the dS stores and the
            TMA writes contend for it. Both tiles at once spills 16 bytes at D1 = D2 = 128.
  k1reg-offset, k2reg-offset  with the offset schedule.
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


# offset: dQ(i - 1) issued right after S(i) and run under tile i's dS update; the consumers hand
# each other their dS slabs through mbarriers (ds_full: 128 * NWG arrivals, one per writer thread;
# ds_empty: NWG, one per reader once its dQ is done) instead of a named barrier, so neither waits
# for the other inside a tile and they may drift apart; nothing is in flight across the back edge.
OFFSET_CONSUME = r"""KL_DEV void consume(const BwdParams& p, const BwdWork& w, int c, int tid,
                        unsigned base) {
  const unsigned k_full = base + OFF_BAR, full = k_full + 8, empty = full + 8 * QSTAGES;
  const unsigned ds_full = empty + 8 * QSTAGES, ds_empty = ds_full + 16;  // per dS buffer b: + 8 b
  const int warp = tid / 32, lane = tid % 32;
  const int off = causal_offset(p.nq, p.nk);
  int key[2], seen_from[2];
  bool key_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    key[i] = w.n0 + 64 * c + 16 * warp + lane / 4 + 8 * i;
    key_ok[i] = key[i] < p.nk;
    seen_from[i] = p.causal ? key[i] - off : -2147483647;
  }
  const int last_key = w.n0 + 64 * c + 63;
  const int col0 = c * DQ_N;
  const unsigned dq_b0 = base + OFF_K2 + (col0 / 64) * SLAB_K + (col0 % 64) * 2;
  float dk[D2P / 2];
#pragma unroll
  for (int x = 0; x < D2P / 2; ++x) dk[x] = 0.f;
  float dq[DQ_NR];
  auto issue_dq = [&](int t) {  // dQ(t) from dS buffer t % 2, once both slabs are in
    const int b = t & 1;
    mbar_wait(ds_full + 8 * b, (t >> 1) & 1);
    const unsigned long long da = smem_desc(base + OFF_DS + b * DS_BYTES);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned long long a_ = smem_desc_add(da, (kk / 4) * SLAB_Q + (kk % 4) * 32);
      const unsigned long long b_ = smem_desc_mn(dq_b0 + kk * 2048, SLAB_K);
      if constexpr (DQ_N == 64) {
        if (kk == 0) wgmma_m64n64k16_tb<false>(dq, a_, b_); else wgmma_m64n64k16_tb<true>(dq, a_, b_);
      } else {
        if (kk == 0) wgmma_m64n32k16<false, 1>(dq, a_, b_); else wgmma_m64n32k16<true, 1>(dq, a_, b_);
      }
    }
  };
  auto add_dq = [&](int h, int q0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int q = q0 + 16 * warp + lane / 4 + 8 * i;
      if (q < p.nq) {
        float* row = p.dq2 + (((long long)w.b * p.h + h) * p.nq + q) * p.d2;
#pragma unroll
        for (int j = 0; j < DQ_N / 8; ++j) {
          const int col = col0 + 8 * j + 2 * (lane % 4);
          if (col < p.d2) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);
        }
      }
    }
  };
  if (w.iters > 0) mbar_wait(k_full, 0);
  int prev_h = 0, prev_q0 = 0;
  for (int it = 0; it < w.iters; ++it) {
    const int stage = it % QSTAGES, h = w.hk * p.g2 + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
    const unsigned q2_tile = base + OFF_Q2 + stage * Q2_BYTES;
    mbar_wait(full + 8 * stage, (it / QSTAGES) & 1);
    float s1[NR], s2[NR];
    unsigned a[BM / 4];
    wgmma_fence();
    gemm_kq<D1P>(s1, base + OFF_K1, base + OFF_Q1 + stage * Q1_BYTES, c);
    gemm_kq<D2P>(s2, base + OFF_K2, q2_tile, c);
    wgmma_commit();
    if (it > 0) issue_dq(it - 1);
    wgmma_commit();  // dQ(i - 1); empty on the first tile, so every tile waits on the same counts
    wgmma_wait<1>();  // S(i) is done; dQ(i - 1) runs under the dS update
    fence_regs<NR>(s1);
    fence_regs<NR>(s2);
    const float* rows =
        reinterpret_cast<const float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
    const bool masked = last_key >= p.nk || (p.causal && q0 + off < last_key);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      const float2 l1 = *reinterpret_cast<const float2*>(rows + col);
      const float2 l2 = *reinterpret_cast<const float2*>(rows + BM + col);
      const float2 g = *reinterpret_cast<const float2*>(rows + 2 * BM + col);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int x = KL_IDX(j, i, 0);
        float d0 = g.x * (ex2(fmaf(p.c2, s2[x], -l2.x)) - ex2(fmaf(p.c1, s1[x], -l1.x)));
        float d1 = g.y * (ex2(fmaf(p.c2, s2[x + 1], -l2.y)) - ex2(fmaf(p.c1, s1[x + 1], -l1.y)));
        if (masked) {
          d0 = key_ok[i] && q0 + col >= seen_from[i] ? d0 : 0.f;
          d1 = key_ok[i] && q0 + col + 1 >= seen_from[i] ? d1 : 0.f;
        }
        a[4 * (j / 2) + 2 * (j % 2) + i] = pack2(d0, d1);
      }
    }
    const int b = it & 1;
    mbar_wait(ds_empty + 8 * b, ((it >> 1) & 1) ^ 1);  // both dQ(i - 2) read this buffer
    const unsigned ds = base + OFF_DS + b * DS_BYTES;
#pragma unroll
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
    fence_proxy_async();
    mbar_arrive(ds_full + 8 * b);
    __syncwarp();
    wgmma_fence();  // dK2 reads the fragments a; nothing touches them until its wait
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
      for (int ns = 0; ns < D2P / 64; ++ns)
        wgmma_m64n64k16_rs_tb<true>(dk + 32 * ns, a + 4 * kk,
                                    smem_desc_mn(q2_tile + ns * SLAB_Q + kk * 2048, SLAB_Q));
    }
    wgmma_commit();
    wgmma_wait<1>();  // dQ(i - 1) is done; dK2(i) may run on
    if (it > 0) {
      fence_regs<DQ_NR>(dq);
      if (tid == 0) mbar_arrive(ds_empty + 8 * ((it - 1) & 1));
      add_dq(prev_h, prev_q0);
    }
    wgmma_wait<0>();
    fence_regs<D2P / 2>(dk);
    if (tid == 0) mbar_arrive(empty + 8 * stage);
    prev_h = h, prev_q0 = q0;
  }
  if (w.iters > 0) {
    wgmma_fence();
    issue_dq(w.iters - 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<DQ_NR>(dq);
    add_dq(prev_h, prev_q0);
  }
"""


def _consume_text(source: str) -> str:
    """The shipped consumer loop: from its signature to the dk2 epilogue."""
    return source[source.index("KL_DEV void consume(") : source.index("  // dk2 of the thread's two keys")]


OFFSET = [
    (
        "constexpr unsigned SMEM_BYTES = OFF_BAR + 8 * (1 + 2 * QSTAGES) + 1024;",
        "constexpr unsigned SMEM_BYTES = OFF_BAR + 8 * (1 + 2 * QSTAGES + 4) + 1024;",
    ),
    (
        """      mbar_init(empty + 8 * s, NWG);
    }
""",
        """      mbar_init(empty + 8 * s, NWG);
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(empty + 8 * QSTAGES + 8 * b, 128 * NWG);  // ds_full[b]
      mbar_init(empty + 8 * QSTAGES + 16 + 8 * b, NWG);  // ds_empty[b]
    }
""",
    ),
    (_consume_text, OFFSET_CONSUME),
]


# k1reg / k2reg: the consumer's 64 keys of K1 or K2 as wgmma A fragments in registers, loaded
# once per CTA (ld.shared, the forward's load_qfrag addressing), so S1^T or S2^T runs RS: each
# k-step reads only the 2 KB of its Q slice from shared memory instead of 4 KB (the m64n64 SS GEMMs
# are near shared memory's 128 B/clock), at D / 4 more registers (32 at D = 128).
KREG_HELPER = (
    "KL_DEV void consume(",
    """// The thread's A fragments of its consumer's 64 keys of a K tile (128-byte-swizzled 64-column
// slabs of BN rows): per k-step kk, keys 16 warp + lane / 4 (+ 8), columns 16 kk + 2 (lane % 4) (+ 8).
template <int DP>
KL_DEV void load_kfrag(unsigned* a, unsigned k, int warp, int lane) {
  const int g = lane / 4, r = 16 * warp + g;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned off = (kk / 4) * SLAB_K + ((((2 * (kk % 4) + h) ^ g) << 4) | (4 * (lane % 4)));
      a[4 * kk + 2 * h] = lds32(k + off + r * 128);
      a[4 * kk + 2 * h + 1] = lds32(k + off + (r + 8) * 128);
    }
  }
}

// S^T (64 keys x 64 rows) = K_c Q^T with K_c's fragments in registers (wgmma RS); the consumer
// index of gemm_kq is already in the fragments.
template <int DP>
KL_DEV void gemm_kq_rs(float* s, const unsigned* a, unsigned q_tile, int) {
  const unsigned long long db = smem_desc(q_tile);
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    const unsigned long long b = smem_desc_add(db, (kk / 4) * SLAB_Q + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n64k16_rs<false>(s, a + 4 * kk, b); else wgmma_m64n64k16_rs<true>(s, a + 4 * kk, b);
  }
}

KL_DEV void consume(""",
)


def _kreg(*tiles):
    """K1 and/or K2 (tiles 1, 2) in registers; the other S GEMM stays SS."""
    decl = ", ".join(f"ka{t}[D{t}P / 4]" for t in tiles)
    loads = "".join(
        f"  load_kfrag<D{t}P>(ka{t}, base + OFF_K{t} + c * 64 * 128, warp, lane);\n" for t in tiles
    )
    patches = [
        KREG_HELPER,
        (
            "  if (w.iters > 0) mbar_wait(k_full, 0);\n",
            "  if (w.iters > 0) mbar_wait(k_full, 0);\n"
            f"  unsigned {decl};  // read only after the wait (no tile: never used)\n" + loads,
        ),
    ]
    calls = [(f"gemm_kq<D{t}P>(s{t}, base + OFF_K{t}, ", f"gemm_kq_rs<D{t}P>(s{t}, ka{t}, ") for t in tiles]
    return patches + calls


K1REG, K2REG = _kreg(1), _kreg(2)  # both at once spills 16 bytes at D1 = D2 = 128


VARIANTS = {
    "stmatrix": [STMATRIX_HELPER, STMATRIX_STORE],
    "split": SPLIT,
    "both": [STMATRIX_HELPER, STMATRIX_STORE, *SPLIT],
    "offset": OFFSET,
    "offset-stmatrix": [*OFFSET, STMATRIX_HELPER, STMATRIX_STORE],
    "k1reg": K1REG,
    "k2reg": K2REG,
    "k1reg-offset": [*OFFSET, *K1REG],
    "k2reg-offset": [*OFFSET, *K2REG],
}
# shared memory a variant needs beyond _bwd.smem_bytes (the offset schedule's four mbarriers)
EXTRA_BARRIER_BYTES = {"offset": 32, "offset-stmatrix": 32, "k1reg-offset": 32, "k2reg-offset": 32}


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
