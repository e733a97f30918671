// kl_fwd.cu: the fused forward, KL(softmax(s1 Q1 K1^T) || softmax(s2 Q2 K2^T)) per query row, as
// one warp-specialized TMA + wgmma kernel for sm_90a: this file holds its main loop (the producer,
// the consumers, their barriers, the TMA loads and the GEMMs). The other roles have their own
// files: params.cuh (the compile-time constants and the parameter block), online_kl.cuh (the row
// state and its update), mask.cuh (the causal alignment), schedule.cuh (which work a CTA does),
// combine.cuh (the split-K epilogue, kl_combine), sm90.cuh (the PTX wrappers).
//
// Grid: schedule.cuh; one CTA per SM (__launch_bounds__(THREADS, 1)), one row tile of BM = 192
//   query rows of one head, and its share of the row tile's key tiles of BN = 64 keys.
// Block: 128 * (NWG + 1) = 512 threads. Warpgroup 0 is the producer (setmaxnreg.dec to 32
//   registers; one thread issues every TMA: q1, q2 of the CTA once, then the k1, k2 tiles of each
//   key tile into a STAGES-deep ring); warpgroups 1..NWG are consumers (setmaxnreg.inc to 160).
// Consumer warpgroup c owns query rows [m0 + 64c, m0 + 64c + 64) (DECODE: every consumer the first
//   64 rows, and every NWG-th key tile) and, per key tile, computes S1 = Q1 K1^T and S2 = Q2 K2^T
//   (64 x 64 fp32 each, wgmma m64n64k16, K from shared memory, Q from shared memory or, QREGS,
//   from registers it loaded once) as two commit groups. It issues tile i's S1 GEMM, runs tile
//   i - 1's S2 update under it, issues tile i's S2 GEMM and runs tile i's S1 update under that, so
//   its own exponentials run under its own GEMMs; it releases the stage (one thread arrives on its
//   "empty" barrier) once both GEMMs are done. No wgmma is in flight across the loop's back edge.
//   After the last tile the four threads of each row merge their states (online_kl.cuh).
// Tiles: Q of a consumer 64 x DP (DP = D1P or D2P: TMA fills the columns past D with zeros), K tiles
//   64 x DP, all stored as 1024-byte-aligned slabs of 64 columns, 128-byte swizzled (the wgmma
//   K-major SW128 layout). Keys past Nk and rows past Nq arrive as zeros; masked tiles (the ragged
//   last key tile and the causal frontier) exclude their invalid keys explicitly (mask.cuh).
// Shared memory: the CTA's Q tiles (NWG, DECODE: 1) of Q1 and Q2, STAGES K1 and K2 tiles, the
//   barriers: q_full (count 1, tx = Q bytes), full[s] (count 1, tx = K1 + K2 tile bytes), empty[s]
//   (count NWG: one arrival per consumer warpgroup; DECODE: its one reader arrives NWG times at
//   once). SMEM_BYTES, which _launch.py's smem_bytes mirrors.
// Reads q1, k1, q2, k2 through 4-D tensor maps {D, N, heads, B} built from the tensors' strides
//   (query head h reads key head h / g); writes kl, lse1, lse2 ([B, H, Nq] float32) of its rows,
//   kl = 0 and lse = -inf on rows that see no key, or with split-K their states to part
//   ([splits, rows, PART]; rows B * H * Nq or, TAIL, the split row tiles' rows).
// A consumer whose 64 rows all lie past Nq (without DECODE: in the last row tile of an input or
//   packed sequence whose rows end within its first 128) runs no GEMM and no update, keeping only
//   its barrier duties.
#include "mask.cuh"
#include "online_kl.cuh"
#include "params.cuh"
#include "schedule.cuh"
#include "sm90.cuh"

constexpr int THREADS = 128 * (NWG + 1);
constexpr int NR = BN / 2;  // accumulator registers per thread per 64 x BN tile
constexpr unsigned SLAB = 64 * 128;  // one 64-row, 64-column (128-byte) slab
constexpr unsigned Q1_WG = 64 * D1P * 2, Q2_WG = 64 * D2P * 2;
constexpr unsigned K1_ST = BN * D1P * 2, K2_ST = BN * D2P * 2;
constexpr unsigned OFF_Q1 = 0;
constexpr int Q_TILES = DECODE ? 1 : NWG;  // 64-row Q tiles the CTA loads
constexpr unsigned OFF_Q2 = OFF_Q1 + Q_TILES * Q1_WG;
constexpr unsigned OFF_K1 = OFF_Q2 + Q_TILES * Q2_WG;
constexpr unsigned OFF_K2 = OFF_K1 + STAGES * K1_ST;
constexpr unsigned OFF_BAR = OFF_K2 + STAGES * K2_ST;
// 1024 bytes of slack: the dynamic shared memory base is aligned up to 1024 in the kernel.
constexpr unsigned SMEM_BYTES = OFF_BAR + 8 * (1 + 2 * STAGES) + 1024;
static_assert(SMEM_BYTES <= 232448, "exceeds the 227 KB of shared memory of an sm_90 CTA");
// setmaxnreg moves registers inside the CTA's launch allocation (THREADS x the per-thread count
// __launch_bounds__ allows, 65536 / THREADS rounded down to 8); an increase beyond it never returns.
constexpr int REG_PROD = 32;
constexpr int REG_CONS = 160;
static_assert(REG_PROD * 128 + REG_CONS * 128 * NWG <= THREADS * (65536 / THREADS / 8 * 8), "register budget");

// Query rows [q0, q0 + BM) of head h, batch b (DECODE: [q0, q0 + 64), which every consumer reads).
KL_DEV void load_q(const Params& p, unsigned base, unsigned bar, int q0, int h, int b) {
  mbar_expect_tx(bar, Q_TILES * (Q1_WG + Q2_WG));
#pragma unroll
  for (int c = 0; c < Q_TILES; ++c) {
#pragma unroll
    for (int s = 0; s < D1P / 64; ++s)
      tma_load_4d(base + OFF_Q1 + c * Q1_WG + s * SLAB, &p.q1, 64 * s, q0 + 64 * c, h, b, bar);
#pragma unroll
    for (int s = 0; s < D2P / 64; ++s)
      tma_load_4d(base + OFF_Q2 + c * Q2_WG + s * SLAB, &p.q2, 64 * s, q0 + 64 * c, h, b, bar);
  }
}

// Key tile t (rows k0 + t BN onwards) into the stage of the CTA's i-th load.
KL_DEV void load_k(const Params& p, unsigned base, unsigned full, int k0, int t, int i, int h1, int h2, int b) {
  const int stage = i % STAGES;
  const unsigned bar = full + 8 * stage;
  mbar_expect_tx(bar, K1_ST + K2_ST);
#pragma unroll
  for (int s = 0; s < D1P / 64; ++s)
    tma_load_4d(base + OFF_K1 + stage * K1_ST + s * (BN * 128), &p.k1, 64 * s, k0 + t * BN, h1, b, bar);
#pragma unroll
  for (int s = 0; s < D2P / 64; ++s)
    tma_load_4d(base + OFF_K2 + stage * K2_ST + s * (BN * 128), &p.k2, 64 * s, k0 + t * BN, h2, b, bar);
}

// S (64 x BN) = Q (64 x DP, descriptor dq) . K^T (BN x DP, descriptor dk), as DP / 16 wgmma
// k-steps. A k-step's descriptors are the tile's plus a constant (smem_desc_add), so issuing one
// costs an add, not the descriptor's masks and shifts.
template <int DP, int K0 = 0, int K1 = DP / 16>
KL_DEV void gemm(float* s, unsigned long long dq, unsigned long long dk) {
#pragma unroll
  for (int kk = K0; kk < K1; ++kk) {
    const unsigned long long da = smem_desc_add(dq, (kk / 4) * SLAB + (kk % 4) * 32);
    const unsigned long long db = smem_desc_add(dk, (kk / 4) * (BN * 128) + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n64k16<false>(s, da, db); else wgmma_m64n64k16<true>(s, da, db);
  }
}

// S (64 x 64) = Q (A fragments a) . K^T (descriptor dk), k-steps [K0, K1).
template <int DP, int K0 = 0, int K1 = DP / 16>
KL_DEV void gemm_rs(float* s, const unsigned* a, unsigned long long dk) {
#pragma unroll
  for (int kk = K0; kk < K1; ++kk) {
    const unsigned long long db = smem_desc_add(dk, (kk / 4) * (BN * 128) + (kk % 4) * 32);
    if (kk == 0)
      wgmma_m64n64k16_rs<false>(s, a + 4 * kk, db);
    else
      wgmma_m64n64k16_rs<true>(s, a + 4 * kk, db);
  }
}

// Merges the four threads of each row and writes row r to out0 + r, or (to_part) its state as
// part `split` of part row part0 + r, for kl_combine.
KL_DEV void finish(const Params& p, const Row* r, const int* rows, int nq, int lane, long long out0, int split,
                   bool to_part, long long part0) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const State s = merge_quad(r[i]);
    if ((lane & 3) == 0 && rows[i] < nq) {
      if (to_part) {
        float* q = p.part + ((long long)split * p.rows + part0 + rows[i]) * PART;
        q[0] = s.m1, q[1] = s.l1, q[2] = s.m2, q[3] = s.l2, q[4] = s.aa, q[5] = s.ab;
      } else {
        write_row(p, out0 + rows[i], s.m1, s.l1, s.m2, s.l2, s.aa, s.ab);
      }
    }
  }
}

// Runs key tiles [t0, t0 + n) of its rows (all of them: n_tiles, split 0, without split-K); the
// ring's stages from the first on.
KL_DEV void consume(const Params& p, const Work& w, int c, int tid, unsigned base) {
  const Span& sp = w.sp;
  const int m0 = w.m0, t0 = w.t0, n = w.n;
  const unsigned bar_q = base + OFF_BAR, full = bar_q + 8, empty = full + 8 * STAGES;
  const int warp = tid / 32, lane = tid % 32;
  const int qc = DECODE ? 0 : c;  // the Q tile this warpgroup reads
  const int r0 = m0 + 64 * qc;  // this warpgroup's first row
  const int diag = causal_offset(sp.nq, sp.nk);
  int rows[2], lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    rows[i] = r0 + 16 * warp + lane / 4 + 8 * i;
    lim[i] = KL_KEY_END(rows[i], diag, sp.nk, p.causal);
  }
  // Tiles [0, n_full) are visible to every row of the warpgroup; the rest are masked.
  const int full_end = KL_KEY_END(r0, diag, sp.nk, p.causal);
  const int n_full = full_end > 0 ? full_end / BN : 0;
  Row r[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) r[i] = Row{-KL_INF, 0.f, -KL_INF, 0.f, 0.f, 0.f, 0.f};
  float s1[NR], s2[NR];  // wgmma accumulators: the raw scores of the current tile
  float e1[NR], x2[NR];  // e1 = 2^(t1 - m1); x2 = t2 - ref(m2) (scores2)
  const unsigned long long dq1 = smem_desc(base + OFF_Q1 + qc * Q1_WG), dq2 = smem_desc(base + OFF_Q2 + qc * Q2_WG);
  const unsigned long long dk1 = smem_desc(base + OFF_K1), dk2 = smem_desc(base + OFF_K2);
  mbar_wait(bar_q, 0);
  if (r0 >= sp.nq) {  // every row past Nq (a last row tile's spare rows): barrier duties only
    for (int i = 0; i < n; ++i) {
      // The one thread that releases a stage waits for it: a warp that waited for nothing it
      // reads could fall a whole phase of the ring behind the releases and never see its parity.
      if (tid == 0) mbar_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);
      if (tid == 0) mbar_arrive(empty + 8 * (i % STAGES));
    }
    return;
  }
#if QREGS & 1
  unsigned qa1[D1P / 4];
  load_afrag<D1P, SLAB>(qa1, base + OFF_Q1 + qc * Q1_WG, warp, lane);
#endif
#if QREGS & 2
  unsigned qa2[D2P / 4];
  load_afrag<D2P, SLAB>(qa2, base + OFF_Q2 + qc * Q2_WG, warp, lane);
#endif
  // Tile i - 1's S2 update runs under tile i's S1 GEMM: prev_* are its mask and limits.
  bool prev_masked = false;
  int prev_rel[2] = {0, 0};
  // This warpgroup's key tiles: i = first + STEP j of [0, n), `own` of them.
  constexpr int STEP = DECODE ? NWG : 1;
  const int first = DECODE ? c : 0, own = DECODE ? (n > c ? (n - c + NWG - 1) / NWG : 0) : n;
  for (int j = 0; j < own; ++j) {
    const int i = first + STEP * j;
    const int t = t0 + i, stage = i % STAGES;
    const unsigned phase = (i / STAGES) & 1;
    mbar_wait(full + 8 * stage, phase);
#if QREGS & 1
#define KL_GEMM1(K0, K1) gemm_rs<D1P, K0, K1>(s1, qa1, smem_desc_add(dk1, stage * K1_ST))
#else
#define KL_GEMM1(K0, K1) gemm<D1P, K0, K1>(s1, dq1, smem_desc_add(dk1, stage * K1_ST))
#endif
#if QREGS & 2
#define KL_GEMM2(K0, K1) gemm_rs<D2P, K0, K1>(s2, qa2, smem_desc_add(dk2, stage * K2_ST))
#else
#define KL_GEMM2(K0, K1) gemm<D2P, K0, K1>(s2, dq2, smem_desc_add(dk2, stage * K2_ST))
#endif
    // ISSUE_SPLIT: a GEMM's second half of k-steps (rest1, rest2) is issued from inside the update
    // that runs under the GEMM, after that update's first row; otherwise they issue nothing.
    constexpr int SPLIT1 = ISSUE_SPLIT ? D1P / 32 : D1P / 16, SPLIT2 = ISSUE_SPLIT ? D2P / 32 : D2P / 16;
    auto rest1 = [&] {
#if ISSUE_SPLIT
      KL_GEMM1(SPLIT1, D1P / 16);
      wgmma_commit();
#endif
    };
    auto rest2 = [&] {
#if ISSUE_SPLIT
      KL_GEMM2(SPLIT2, D2P / 16);
      wgmma_commit();
#endif
    };
    wgmma_fence();
    KL_GEMM1(0, SPLIT1);
#if !ISSUE_SPLIT
    wgmma_commit();
#endif
    if (j > 0)
      update2_tile(prev_masked, e1, x2, r, prev_rel, j == 1, rest1);
    else
      rest1();
    __syncwarp();  // the per-thread fast / exact choice reconverges before wgmma (.aligned)
    wgmma_fence();
    KL_GEMM2(0, SPLIT2);
#undef KL_GEMM1
#undef KL_GEMM2
    wgmma_commit();
    const bool masked = t >= n_full;
    const int cb = t * BN + 2 * (lane & 3);  // this thread's first column in the tile
    const int rel[2] = {lim[0] - cb, lim[1] - cb};
    wgmma_wait<1>();  // S1 is done (ISSUE_SPLIT: S2's first half may still run)
    fence_regs<NR>(s1);
    if (masked)
      update1<true>(s1, e1, r, p.c1, rel, j == 0, rest2);
    else
      update1<false>(s1, e1, r, p.c1, rel, j == 0, rest2);
    __syncwarp();  // the per-thread fast / exact choice reconverges before wgmma.wait (.aligned)
    wgmma_wait<0>();
    fence_regs<NR>(s2);
    if (tid == 0) mbar_arrive(empty + 8 * stage, STEP);  // DECODE: no other warpgroup reads it
    scores2(s2, x2, r, p.c2);
    prev_masked = masked, prev_rel[0] = rel[0], prev_rel[1] = rel[1];
  }
  if (own > 0) {
    update2_tile(prev_masked, e1, x2, r, prev_rel, own == 1, [] {});
  }
  finish(p, r, rows, sp.nq, lane, sp.out0, DECODE ? w.split * NWG + c : w.split, w.to_part, w.part0);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kl_fwd(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned bar_q = base + OFF_BAR, full = bar_q + 8, empty = full + 8 * STAGES;
  Work w;
  if (!work_of(p, blockIdx.x, blockIdx.z, w)) return;
  const int tid = threadIdx.x;
  unsigned dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < SMEM_BYTES) __trap();  // the host's copy of SMEM_BYTES disagrees
  if (tid == 0) {
    mbar_init(bar_q, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + 8 * s, 1);
      mbar_init(empty + 8 * s, NWG);
    }
    mbar_init_fence();
    tma_prefetch(&p.q1);
    tma_prefetch(&p.k1);
    tma_prefetch(&p.q2);
    tma_prefetch(&p.k2);
  }
  __syncthreads();
  if (tid < 128) {
    regs_dec<REG_PROD>();
    if (tid == 0) {
      load_q(p, base, bar_q, w.sp.row0 + w.m0, w.h, w.sp.bq);
      for (int i = 0; i < w.n; ++i) {
        mbar_wait(empty + 8 * (i % STAGES), ((i / STAGES) & 1) ^ 1);
        load_k(p, base, full, w.sp.row0, w.t0 + i, i, w.h1, w.h2, w.sp.bq);
      }
    }
    return;
  }
  regs_inc<REG_CONS>();
  // Read through a shuffle, the warpgroup index is warp-uniform to the compiler, so the
  // descriptors built from it stay in uniform registers.
  consume(p, w, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);
}

#include "combine.cuh"  // kl_combine, the second entry point of this module
