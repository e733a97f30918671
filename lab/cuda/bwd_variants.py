"""Variants of the cuda backward (kernels/kl_bwd.cu), built as patches of the shipped source, so
one device call can check each against float64 and time them beside the shipped kernel and the
triton backward (interleaved rounds, bf16 GEMM yardstick in the same run).

    python lab/cuda/bwd_variants.py --compile-only          # here: every variant's ptxas report
    PYTHONPATH=. python lab/cuda/bwd_variants.py --out $OUT/variants.json [--variants a,b]
    PYTHONPATH=. python lab/cuda/bwd_variants.py --settings --out $OUT/settings.json

Variants: each a list of (anchor, replacement) patches; every anchor must occur exactly once.
  persistent  about one CTA per SM (GRIDS), each walking several key tiles of its key head with
            the next one's K tiles loading under the current one (two K stages; two query
            stages at D = 128): for decode, where one key tile has one query tile.
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

# persistent: gridDim.x below the key tiles, each CTA walks key tiles x, x + gridDim.x, ... of its
# key head and batch (launch_grid: about one CTA per SM), with KSTAGES = 2 K tiles so the next key
# tile loads under this one; the query-tile counters (stages, dS buffers) run on across key
# tiles. For decode, where a CTA's key tile has one query tile and the loads, the tile and the dk2
# stores ran in series (about 2 TB/s of the 4 the device moves). Two K stages leave room for two
# query stages at D = 128.
PERSISTENT_PRODUCE = r"""KL_DEV void produce(const BwdParams& p, int tid, unsigned base) {
  const BwdBars bars = bwd_bars(base);
  const int key_tiles = (p.nk + BN - 1) / BN;
  int kit = 0, git = 0;  // the key tiles and query tiles this CTA has loaded before this one
  for (int x = blockIdx.x; x < key_tiles; x += gridDim.x) {
    const BwdWork w = bwd_work(p, x);
    if (w.iters == 0) continue;  // no query tile: nothing to load (the consumers write zeros)
    if (tid == 0) {
      const int ks = kit % KSTAGES;
      mbar_wait(bars.k_empty + 8 * ks, ((kit / KSTAGES) & 1) ^ 1);  // its last key tile is done
      const unsigned kb = bars.k_full + 8 * ks, k1 = base + OFF_K1 + ks * K_STAGE;
      const unsigned k2 = base + OFF_K2 + ks * K_STAGE;
      mbar_expect_tx(kb, K1_BYTES + K2_BYTES);
#pragma unroll
      for (int s = 0; s < D1P / 64; ++s) tma_load_4d(k1 + s * SLAB_K, &p.k1, 64 * s, w.n0, w.kh1, w.b, kb);
#pragma unroll
      for (int s = 0; s < D2P / 64; ++s) tma_load_4d(k2 + s * SLAB_K, &p.k2, 64 * s, w.n0, w.kh2, w.b, kb);
      for (int it = 0; it < w.iters; ++it) {
        const int g = git + it, stage = g % QSTAGES;
        const int h = w.hk * p.g_own + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
        mbar_wait(bars.empty + 8 * stage, ((g / QSTAGES) & 1) ^ 1);
        const unsigned bar = bars.full + 8 * stage;
        mbar_expect_tx(bar, Q1_BYTES + Q2_BYTES);
#pragma unroll
        for (int s = 0; s < D1P / 64; ++s)
          tma_load_4d(base + OFF_Q1 + stage * Q1_BYTES + s * SLAB_Q, &p.q1, 64 * s, q0, h, w.b, bar);
#pragma unroll
        for (int s = 0; s < D2P / 64; ++s)
          tma_load_4d(base + OFF_Q2 + stage * Q2_BYTES + s * SLAB_Q, &p.q2, 64 * s, q0, h, w.b, bar);
      }
    } else if (tid >= 64) {  // one thread per row of the tile: its L1, L2, G
      const int r = tid - 64;
      for (int it = 0; it < w.iters; ++it) {
        const int g = git + it, stage = g % QSTAGES;
        const int h = w.hk * p.g_own + it / w.per_head, q = (w.mt0 + it % w.per_head) * BM + r;
        float l1 = KL_INF, l2 = KL_INF, gr = 0.f;  // rows past Nq or that saw no key: P = 0, dS = 0
        if (q < p.nq) {
          const long long row = ((long long)w.b * p.h + h) * p.nq + q;
          const float a = p.lse1[row];
          if (a > -KL_INF) l1 = a * KL_LOG2E, l2 = p.lse2[row] * KL_LOG2E, gr = p.grad[row] * p.scale;
        }
        mbar_wait(bars.empty + 8 * stage, ((g / QSTAGES) & 1) ^ 1);
        float* rows = reinterpret_cast<float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
        rows[r] = l1, rows[BM + r] = l2, rows[2 * BM + r] = gr;
        mbar_arrive(bars.full + 8 * stage);  // release: the consumers' wait on full[s] sees the writes
      }
    }
    ++kit, git += w.iters;
  }
}
"""

PERSISTENT_CONSUME = r"""KL_DEV void consume(const BwdParams& p, int c, int tid, unsigned base) {
  const BwdBars bars = bwd_bars(base);
  const unsigned full = bars.full, empty = bars.empty, ds_full = bars.ds_full, ds_empty = bars.ds_empty;
  const int warp = tid / 32, lane = tid % 32;
  const int off = causal_offset(p.nq, p.nk);
  const int key_tiles = (p.nk + BN - 1) / BN;
  const int col0 = c * DQ_N;
  int kit = 0, git = 0;  // as the producer counts them
  for (int x = blockIdx.x; x < key_tiles; x += gridDim.x) {
    const BwdWork w = bwd_work(p, x);
    int key[2], seen_from[2];  // the thread's two keys; the first query row that sees each
    bool key_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      key[i] = w.n0 + 64 * c + 16 * warp + lane / 4 + 8 * i;
      key_ok[i] = key[i] < p.nk;
      seen_from[i] = p.causal ? key[i] - off : -2147483647;
    }
    const int last_key = w.n0 + 64 * c + 63;
    const int ks = kit % KSTAGES;
    const unsigned k1_tile = base + OFF_K1 + ks * K_STAGE, k2_tile = base + OFF_K2 + ks * K_STAGE;
    const unsigned dq_b0 = k2_tile + (col0 / 64) * SLAB_K + (col0 % 64) * 2;
    float dk[D2P / 2];
#pragma unroll
    for (int y = 0; y < D2P / 2; ++y) dk[y] = 0.f;
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
          float* row = p.dq + (((long long)w.b * p.h + h) * p.nq + q) * p.d;
#pragma unroll
          for (int j = 0; j < DQ_N / 8; ++j) {
            const int col = col0 + 8 * j + 2 * (lane % 4);
            if (col < p.d) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);
          }
        }
      }
    };
    if (w.iters > 0) {
      unsigned ka1[D1P / 4];  // the consumer's K1 rows, the A operand of every S1 GEMM
      mbar_wait(bars.k_full + 8 * ks, (kit / KSTAGES) & 1);
      load_afrag<D1P, SLAB_K>(ka1, k1_tile + c * 64 * 128, warp, lane);
      int prev_h = 0, prev_q0 = 0;
      for (int it = 0; it < w.iters; ++it) {
        const int g = git + it, stage = g % QSTAGES;
        const int h = w.hk * p.g_own + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
        const unsigned q2_tile = base + OFF_Q2 + stage * Q2_BYTES;
        mbar_wait(full + 8 * stage, (g / QSTAGES) & 1);
        float s1[NR], s2[NR];
        unsigned a[BM / 4];
        wgmma_fence();
        gemm_kq_rs<D1P>(s1, ka1, base + OFF_Q1 + stage * Q1_BYTES);
        gemm_kq<D2P>(s2, k2_tile, q2_tile, c);
        wgmma_commit();
        if (it > 0) issue_dq(g - 1);
        wgmma_commit();  // dQ(i - 1); empty on an item's first tile, so every tile waits on the same counts
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
          const float2 gr = *reinterpret_cast<const float2*>(rows + 2 * BM + col);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int y = KL_IDX(j, i, 0);
            float d0 = gr.x * (ex2(fmaf(p.c2, s2[y], -l2.x)) - ex2(fmaf(p.c1, s1[y], -l1.x)));
            float d1 = gr.y * (ex2(fmaf(p.c2, s2[y + 1], -l2.y)) - ex2(fmaf(p.c1, s1[y + 1], -l1.y)));
            if (masked) {
              d0 = key_ok[i] && q0 + col >= seen_from[i] ? d0 : 0.f;
              d1 = key_ok[i] && q0 + col + 1 >= seen_from[i] ? d1 : 0.f;
            }
            a[4 * (j / 2) + 2 * (j % 2) + i] = pack2(d0, d1);
          }
        }
        const int b = g & 1;
        mbar_wait(ds_empty + 8 * b, ((g >> 1) & 1) ^ 1);  // both dQ(g - 2) read this buffer
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
              const unsigned addr =
                  ds + c * SLAB_Q + q * 128 + ((((kc >> 3) ^ (q & 7)) << 4) | ((kc & 7) << 1));
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
          if (tid == 0) mbar_arrive(ds_empty + 8 * ((g - 1) & 1));
          add_dq(prev_h, prev_q0);
        }
        wgmma_wait<0>();
        fence_regs<D2P / 2>(dk);
        mbar_arrive(empty + 8 * stage);  // every thread: each releases its own reads of the row terms
        prev_h = h, prev_q0 = q0;
      }
      wgmma_fence();
      issue_dq(git + w.iters - 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<DQ_NR>(dq);
      if (tid == 0) mbar_arrive(ds_empty + 8 * ((git + w.iters - 1) & 1));  // the next item reuses it
      mbar_arrive(bars.k_empty + 8 * ks);  // every thread: its K fragment loads and GEMMs are done
      add_dq(prev_h, prev_q0);
      ++kit, git += w.iters;
    }
    // dk2 of the thread's two keys: columns 64 ns + 8 j + 2 (lane % 4) (+1) of accumulator ns.
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!key_ok[i]) continue;
      unsigned* row = reinterpret_cast<unsigned*>(
          static_cast<unsigned short*>(p.dk) +
          (((long long)w.b * (p.h / p.g_own) + w.hk) * p.nk + key[i]) * p.d);
#pragma unroll
      for (int ns = 0; ns < D2P / 64; ++ns) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 64 * ns + 8 * j + 2 * (lane % 4);
          if (col < p.d) row[col / 2] = pack2(dk[32 * ns + KL_IDX(j, i, 0)], dk[32 * ns + KL_IDX(j, i, 1)]);
        }
      }
    }
  }
}

"""


def _between(start: str, end: str):
    """An anchor: the source from `start` up to (not including) `end`."""
    return lambda source: source[source.index(start) : source.index(end)]


PERSISTENT = [
    (
        """constexpr unsigned OFF_K1 = 0, OFF_K2 = OFF_K1 + K1_BYTES;
constexpr unsigned OFF_Q1 = OFF_K2 + K2_BYTES,""",
        """constexpr int KSTAGES = 2;  // K tiles in flight: the next key tile loads under this one
constexpr unsigned K_STAGE = K1_BYTES + K2_BYTES;
constexpr unsigned OFF_K1 = 0, OFF_K2 = OFF_K1 + K1_BYTES;  // + ks K_STAGE for K stage ks
constexpr unsigned OFF_Q1 = KSTAGES * K_STAGE,""",
    ),
    (
        "constexpr unsigned N_BARS = 1 + 2 * QSTAGES + 4;  // k_full,",
        "constexpr unsigned N_BARS = 2 * KSTAGES + 2 * QSTAGES + 4;  // k_full[ks], k_empty[ks],",
    ),
    (
        _between("struct BwdBars {", "#define KL_IDX"),
        """struct BwdBars {
  unsigned k_full, k_empty, full, empty, ds_full, ds_empty;
};

KL_DEV BwdBars bwd_bars(unsigned base) {
  BwdBars r;
  r.k_full = base + OFF_BAR, r.k_empty = r.k_full + 8 * KSTAGES, r.full = r.k_empty + 8 * KSTAGES;
  r.empty = r.full + 8 * QSTAGES, r.ds_full = r.empty + 8 * QSTAGES, r.ds_empty = r.ds_full + 16;
  return r;
}

""",
    ),
    (
        """KL_DEV BwdWork bwd_work(const BwdParams& p) {
  BwdWork w;
  w.n0 = blockIdx.x * BN,""",
        """KL_DEV BwdWork bwd_work(const BwdParams& p, int x) {
  BwdWork w;
  w.n0 = x * BN,""",
    ),
    (_between("KL_DEV void produce(", "// S^T (64 keys x 64 rows) = K_c Q^T"), PERSISTENT_PRODUCE + "\n"),
    (_between("KL_DEV void consume(", 'extern "C"'), PERSISTENT_CONSUME),
    ("  const BwdWork w = bwd_work(p);\n", ""),
    (
        """    mbar_init(bars.k_full, 1);
""",
        """    for (int ks = 0; ks < KSTAGES; ++ks) {
      mbar_init(bars.k_full + 8 * ks, 1);
      mbar_init(bars.k_empty + 8 * ks, 128 * NWG);  // every consumer thread, after its key tile
    }
""",
    ),
    ("    produce(p, w, tid, base);", "    produce(p, tid, base);"),
    (
        "  consume(p, w, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);",
        "  consume(p, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);",
    ),
]


def _persistent_grid(spec):
    """About one CTA per SM: the key tiles of each (key head, batch) split over gridDim.x CTAs."""
    import torch

    from streamkl.backends.cuda import _bwd

    key_tiles, heads, batch = -(-spec.nk // _bwd.BN), spec.heads_kv2, spec.batch
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return (max(1, min(key_tiles, sms // (heads * batch))), heads, batch)


VARIANTS = {
    "persistent": PERSISTENT,
    "no-red": NO_RED,
    "no-exp": NO_EXP,
    "no-dsstore": NO_DSSTORE,
}
ABLATIONS = {"no-red", "no-exp", "no-dsstore"}  # timed, never checked
# shared memory a variant needs beyond _bwd.smem_bytes, per instantiation (the second K stage and
# its two barriers less the one k_full it replaces)
EXTRA_SMEM_BYTES = {
    "persistent": lambda c: 128 * (c["D1P"] + c["D2P"]) * 2 + 8 * 3,
}
GRIDS = {"persistent": _persistent_grid}  # a variant's launch grid, where it is not _bwd.launch_grid


def patched(source: str, patches) -> str:
    for anchor, replacement in patches:
        if callable(anchor):
            anchor = anchor(source)
        if source.count(anchor) != 1:
            raise RuntimeError(f"anchor found {source.count(anchor)} times:\n{anchor}")
        source = source.replace(anchor, replacement)
    return source


def instantiation(name: str, d1p: int, d2p: int, fp16: bool) -> dict:
    """_bwd.shipped's constants for variant `name`: as many query stages as its shared memory
    leaves room for."""
    from streamkl.backends.cuda import _bwd
    from streamkl.backends.cuda._launch import SMEM_LIMIT

    smem, extra = _SMEM_BYTES or _bwd.smem_bytes, EXTRA_SMEM_BYTES.get(name, lambda c: 0)
    c = dict(KL_FP16=int(fp16), D1P=d1p, D2P=d2p, SETTING=1)  # the variants are of setting 1
    stages = range(1, _bwd.MAX_QSTAGES + 1)
    fits = [s for s in stages if smem(dict(c, QSTAGES=s)) + extra(dict(c, QSTAGES=s)) <= SMEM_LIMIT]
    return dict(c, QSTAGES=max(fits))


def compile_report(names):
    from streamkl.backends.cuda import _bwd, _jit

    base = _bwd.source()
    for name in ["shipped", *names]:
        src = base if name == "shipped" else patched(base, VARIANTS[name])
        for shipped in [c for c in _bwd.shipped_instantiations() if c["SETTING"] == 1]:
            consts = instantiation(name, shipped["D1P"], shipped["D2P"], shipped["KL_FP16"])
            b = _jit.compile_kernel(src, _bwd.ENTRY, consts)
            serial = [line.strip()[:90] for line in b.log.splitlines() if "serial" in line.lower()]
            print(name, consts, f"regs {b.registers} spill {b.spill_bytes} stack {b.stack_bytes}", serial)


_SMEM_BYTES = None  # the shipped _bwd.smem_bytes, kept by use() before it wraps it
_LAUNCH_GRID = None  # the shipped _bwd.launch_grid, likewise


def use(name: str) -> None:
    """Makes the cuda backend's backward launch variant `name` ("shipped": the tree's source)."""
    global _SMEM_BYTES, _LAUNCH_GRID
    from streamkl.backends.cuda import _bwd

    _SMEM_BYTES = _SMEM_BYTES or _bwd.smem_bytes
    _LAUNCH_GRID = _LAUNCH_GRID or _bwd.launch_grid
    base = (_bwd._jit.KERNELS / _bwd.SOURCE_FILE).read_text()
    src = base if name == "shipped" else patched(base, VARIANTS[name])
    _bwd.source = lambda: src
    extra = EXTRA_SMEM_BYTES.get(name, lambda c: 0)
    _bwd.smem_bytes = lambda c: _SMEM_BYTES(c) + extra(c)
    _bwd.launch_grid = GRIDS.get(name, _LAUNCH_GRID)
    _bwd.kernel.cache_clear()


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
              # the persistent grid walks several key tiles a CTA on these (4 CTAs a head at 32 heads)
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
            fns[name] = functools.partial(_launch_with, loaded, _bwd.launch_grid, call)
        rec = _timed(torch, fns, nq, nk, causal)
        best = rec["ms"]
        off = nk - nq  # bottom-right: row i sees keys j <= i + off
        pairs = sum(min(nk, i + off + 1) for i in range(nq)) if causal else nq * nk
        rec["tflops"] = {k: 4 * 2 * 32 * pairs * 128 / v / 1e9 for k, v in best.items() if k != "gemm"}
        print(rec, flush=True)
        res["timing"].append(rec)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def run_settings(out, timing=True, small=False):
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


def _launch_with(loaded, grid, call):
    """The shipped host path with one variant's loaded kernel ((handle, smem) of _bwd.kernel) and
    launch grid."""
    from streamkl.backends.cuda import _bwd

    saved = _bwd.kernel, _bwd.launch_grid
    _bwd.kernel, _bwd.launch_grid = (lambda *args: loaded), grid
    try:
        return _bwd.backward(*call)
    finally:
        _bwd.kernel, _bwd.launch_grid = saved


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
    ap.add_argument("--out", default="variants.json")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.settings:
        run_settings(args.out, timing=not args.check_only, small=args.small)
    elif args.compile_only:
        compile_report(names)
    else:
        run(names, args.out, timing=not args.check_only, small=args.small)


if __name__ == "__main__":
    main()
