// kl_bwd.cu: the backward of setting 1 (teacher fixed), dq2 and dk2 of
// KL(softmax(s1 Q1 K1^T) || softmax(s2 Q2 K2^T)), as one warp-specialized TMA + wgmma kernel for
// sm_90a. It recomputes S1, S2 tile by tile from the forward's lse1, lse2 (nothing quadratic kept):
//   P_t = 2^(c_t S_t - L_t)  (c_t = scale_t log2 e, L_t = lse_t log2 e),  dS = g s2 (P2 - P1),
//   dk2 = dS^T Q2,  dq2 = dS K2   (s2 = scale2 is folded into G, so both come out scaled).
//
// Grid: (cdiv(Nk, BN), Hk2, B): one CTA per key tile of BN = 128 keys of one student key head,
//   which walks every query head of that head's GQA group and, per head, the query tiles of
//   BM = 64 rows that see any of its keys (under the causal mask, from the first such row on).
//   __launch_bounds__(THREADS, 1): one CTA per SM.
// Block: 128 * (NWG + 1) = 384 threads. Warpgroup 0 is the producer (setmaxnreg.dec to 24): its
//   thread 0 loads the CTA's K1 and K2 tiles once and then each query tile's Q1 and Q2 into a
//   QSTAGES-deep ring (TMA); its warps 2-3 (64 threads, one per row) write each tile's row terms
//   L1, L2 (+inf for rows past Nq or that saw no key) and G = g s2 (0 there) into the stage.
//   Warpgroups 1..NWG are consumers (setmaxnreg.inc to 240); consumer c owns keys
//   [64 c, 64 c + 64) of the tile and per query tile:
//     S1^T = K1_c Q1^T, S2^T = K2_c Q2^T      (64 keys x 64 rows in two halves of 32, wgmma SS,
//                                              both operands K-major)
//     dS^T = G (P2 - P1), masked               (registers; the A operand of the next GEMM as is)
//     dK2_c += dS^T Q2                         (wgmma RS, Q2 MN-major: registers accumulate dk2)
//     dS -> shared memory (K-major, 16-bit, double-buffered), a named barrier between the
//       consumers, then dQ[:, its D2P / 2 columns] = dS K2[:, those columns] over all BN keys
//       (wgmma SS, K2 MN-major), added into the float32 dq2 buffer with red.global.add.v2.f32
//       (rows < Nq, columns < D2) one tile later.
//   consume orders the GEMMs so that each runs under work it does not feed (dQ(i) is issued with
//   tile i + 1's scores and runs under its dS update), with no wgmma in flight across the loop's
//   back edge.
//   After the last tile it writes its keys' dk2 rows (keys < Nk, columns < D2) in the inputs'
//   dtype; a CTA with no query tile writes zeros.
// Tiles in shared memory, all 1024-byte-aligned slabs of 64 columns, 128-byte swizzled as TMA
//   writes them: K1, K2 (BN x D1P, BN x D2P), QSTAGES stages of Q1, Q2 (BM x D1P, BM x D2P) and the
//   row terms (3 x BM floats), two dS buffers (BM x BN, 16-bit). Barriers: k_full (count 1, tx),
//   full[s] (count 1 + 64: the TMA thread's expect_tx and the 64 row-term writers), empty[s]
//   (count NWG). The causal mask aligns bottom-right (mask.cuh).
// Reads q1, k1, q2, k2 (4-D tensor maps {D, N, heads, B}; query head h reads key heads h / g1,
//   h / g2: the K1 head is one per CTA because g1 is a multiple of g2), lse1, lse2, grad ([B, H, Nq]
//   float32); writes dq2 (adds into [B, H, Nq, D2] float32) and dk2 ([B, Hk2, Nk, D2]).
#include "mask.cuh"
#include "sm90.cuh"

#if !defined(KL_FP16) || !defined(D1P) || !defined(D2P) || !defined(QSTAGES)
#error "the launcher (_bwd.py) defines every instantiation constant"
#endif
static_assert(D1P == 64 || D1P == 128, "D1P: 64 or 128");
static_assert(D2P == 64 || D2P == 128, "D2P: 64 or 128");

constexpr int NWG = 2;  // consumer warpgroups, 64 keys each
constexpr int BN = 64 * NWG;  // keys per CTA
constexpr int BM = 64;  // query rows per tile
constexpr int THREADS = 128 * (NWG + 1);
constexpr int NR = BM / 2;  // accumulator registers per thread of a 64 x 64 tile
constexpr unsigned SLAB_K = BN * 128, SLAB_Q = BM * 128;  // one 64-column slab of a K / Q tile
constexpr unsigned K1_BYTES = D1P / 64 * SLAB_K, K2_BYTES = D2P / 64 * SLAB_K;
constexpr unsigned Q1_BYTES = D1P / 64 * SLAB_Q, Q2_BYTES = D2P / 64 * SLAB_Q;
constexpr unsigned DS_BYTES = NWG * SLAB_Q;  // dS of a query tile: BM rows x BN keys
constexpr unsigned ROW_BYTES = 3 * BM * 4;  // L1, L2, G of a query tile's rows
constexpr unsigned OFF_K1 = 0, OFF_K2 = OFF_K1 + K1_BYTES;
constexpr unsigned OFF_Q1 = OFF_K2 + K2_BYTES, OFF_Q2 = OFF_Q1 + QSTAGES * Q1_BYTES;
constexpr unsigned OFF_DS = OFF_Q2 + QSTAGES * Q2_BYTES;
constexpr unsigned OFF_ROWS = OFF_DS + 2 * DS_BYTES;
constexpr unsigned OFF_BAR = OFF_ROWS + QSTAGES * ROW_BYTES;
constexpr unsigned SMEM_BYTES = OFF_BAR + 8 * (1 + 2 * QSTAGES) + 1024;  // + the base's alignment slack
static_assert(SMEM_BYTES <= 232448, "exceeds the 227 KB of shared memory of an sm_90 CTA");
constexpr int REG_PROD = 24, REG_CONS = 240;
static_assert(REG_PROD * 128 + REG_CONS * 128 * NWG <= THREADS * (65536 / THREADS / 8 * 8), "register budget");
// dQ of one consumer: its share of the columns, over all BN keys of the CTA.
constexpr int DQ_N = D2P / NWG;
constexpr int DQ_NR = DQ_N / 2;  // its accumulator registers per thread

struct BwdParams {
  TensorMap q1, k1, q2, k2;  // q boxes {64, BM, 1, 1}, k boxes {64, BN, 1, 1}
  const float* lse1;  // [B, H, Nq], natural log
  const float* lse2;
  const float* grad;  // dLoss / dKL per row
  float* dq2;  // [B, H, Nq, D2] float32, zeroed: the adds land here
  void* dk2;  // [B, Hk2, Nk, D2], the inputs' dtype
  int h, nq, nk, d2, g1, g2, causal, m_tiles;
  float c1, c2, scale2;  // c_t = scale_t log2(e)
};
static_assert(sizeof(BwdParams) == 640, "BWD_PARAMS_BYTES in _bwd.py packs this layout");

#define KL_IDX(j, i, k) ((j) * 4 + (i) * 2 + (k))
#define KL_LOG2E 1.4426950408889634f
#define KL_INF __int_as_float(0x7f800000)

// The CTA's work: key tile n0, student key head hk (teacher key head h1), batch b; its query
// tiles run m0 .. m_tiles - 1 for each of the g2 heads of the group, `per_head` of them.
struct BwdWork {
  int n0, hk, h1, b, mt0, per_head, iters;
};

KL_DEV BwdWork bwd_work(const BwdParams& p) {
  BwdWork w;
  w.n0 = blockIdx.x * BN, w.hk = blockIdx.y, w.b = blockIdx.z;
  w.h1 = w.hk * p.g2 / p.g1;
  // Causal: row i sees key j iff j <= i + off, so the first row that sees key n0 is n0 - off.
  const int first = p.causal ? max(0, w.n0 - causal_offset(p.nq, p.nk)) : 0;
  w.mt0 = first / BM;
  w.per_head = first < p.nq ? p.m_tiles - w.mt0 : 0;
  w.iters = w.per_head * p.g2;
  return w;
}

// S^T (64 keys x 32 rows) = K_c . Q[rows 32 half ..]^T, k-steps over DP: the K tile's consumer-c rows
// (64 c into each slab) as A, half `half` of the query tile (32 rows, 4096 bytes on) as B.
template <int DP>
KL_DEV void gemm_kq(float* s, unsigned k_tile, unsigned q_tile, int c, int half) {
  const unsigned long long da = smem_desc(k_tile + c * 64 * 128), db = smem_desc(q_tile + half * 32 * 128);
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    const unsigned long long a = smem_desc_add(da, (kk / 4) * SLAB_K + (kk % 4) * 32);
    const unsigned long long b = smem_desc_add(db, (kk / 4) * SLAB_Q + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n32k16<false, 0>(s, a, b); else wgmma_m64n32k16<true, 0>(s, a, b);
  }
}

KL_DEV void produce(const BwdParams& p, const BwdWork& w, int tid, unsigned base) {
  const unsigned k_full = base + OFF_BAR, full = k_full + 8, empty = full + 8 * QSTAGES;
  if (w.iters == 0) return;  // no query tile: nothing to load (the consumers write zeros)
  if (tid == 0) {
    mbar_expect_tx(k_full, K1_BYTES + K2_BYTES);
#pragma unroll
    for (int s = 0; s < D1P / 64; ++s) tma_load_4d(base + OFF_K1 + s * SLAB_K, &p.k1, 64 * s, w.n0, w.h1, w.b, k_full);
#pragma unroll
    for (int s = 0; s < D2P / 64; ++s) tma_load_4d(base + OFF_K2 + s * SLAB_K, &p.k2, 64 * s, w.n0, w.hk, w.b, k_full);
    for (int it = 0; it < w.iters; ++it) {
      const int stage = it % QSTAGES, h = w.hk * p.g2 + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
      mbar_wait(empty + 8 * stage, ((it / QSTAGES) & 1) ^ 1);
      const unsigned bar = full + 8 * stage;
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
      const int stage = it % QSTAGES, h = w.hk * p.g2 + it / w.per_head, q = (w.mt0 + it % w.per_head) * BM + r;
      float l1 = KL_INF, l2 = KL_INF, g = 0.f;  // rows past Nq or that saw no key: P = 0, dS = 0
      if (q < p.nq) {
        const long long row = ((long long)w.b * p.h + h) * p.nq + q;
        const float a = p.lse1[row];
        if (a > -KL_INF) l1 = a * KL_LOG2E, l2 = p.lse2[row] * KL_LOG2E, g = p.grad[row] * p.scale2;
      }
      mbar_wait(empty + 8 * stage, ((it / QSTAGES) & 1) ^ 1);
      float* rows = reinterpret_cast<float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
      rows[r] = l1, rows[BM + r] = l2, rows[2 * BM + r] = g;
      mbar_arrive(full + 8 * stage);  // release: the consumers' wait on full[s] sees the writes
    }
  }
}

// dS (rows x keys) of this consumer's keys from its A fragments a (keys x rows) into dS buffer ds,
// K-major and 128B-swizzled: row q at q * 128 bytes, key column kc of slab c.
KL_DEV void store_ds(const unsigned* a, unsigned ds, int c, int warp, int lane) {
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
}

// dQ (BM rows x DQ_N columns from c * DQ_N) = dS (rows x BN keys, buffer ds) . K2 (keys x columns).
KL_DEV void gemm_dq(float* dq, unsigned ds, unsigned k2_tile, int c) {
  const unsigned long long da = smem_desc(ds);
  const int col0 = c * DQ_N;
  const unsigned b0 = k2_tile + (col0 / 64) * SLAB_K + (col0 % 64) * 2;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    const unsigned long long a = smem_desc_add(da, (kk / 4) * SLAB_Q + (kk % 4) * 32);
    const unsigned long long b = smem_desc_mn(b0 + kk * 2048, SLAB_K);
    if constexpr (DQ_N == 64) {
      if (kk == 0) wgmma_m64n64k16_tb<false>(dq, a, b); else wgmma_m64n64k16_tb<true>(dq, a, b);
    } else {
      if (kk == 0) wgmma_m64n32k16<false, 1>(dq, a, b); else wgmma_m64n32k16<true, 1>(dq, a, b);
    }
  }
}

// Adds a finished dQ tile (rows q0.., head h) into dq2: rows < Nq, columns < D2.
KL_DEV void add_dq(const BwdParams& p, const BwdWork& w, const float* dq, int h, int q0, int c, int warp, int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int q = q0 + 16 * warp + lane / 4 + 8 * i;
    if (q < p.nq) {
      float* row = p.dq2 + (((long long)w.b * p.h + h) * p.nq + q) * p.d2;
#pragma unroll
      for (int j = 0; j < DQ_N / 8; ++j) {
        const int col = c * DQ_N + 8 * j + 2 * (lane % 4);
        if (col < p.d2) red_add2(row + col, dq[KL_IDX(j, i, 0)], dq[KL_IDX(j, i, 1)]);
      }
    }
  }
}

// dS^T = G (P2 - P1) of half `half` of the tile (keys x rows 32 half ..) from its scores s1, s2
// (64 x 32 accumulators), packed as A fragments: element (j, i, k) is key row 8 i, query row
// 32 half + 8 j + 2 (lane % 4) + k, and the pair k = 0, 1 goes to a[4 (J / 2) + 2 (J % 2) + i] with
// J = 4 half + j (k-step J / 2 covers rows 16 (J / 2) ..). Masked where a key is past Nk or the
// row does not see it (`masked`: some element of the tile may be).
KL_DEV void tile_ds(unsigned* a, const float* s1, const float* s2, const float* rows, const BwdParams& p,
                    int half, int q0, bool masked, const bool* key_ok, const int* seen_from, int lane) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int col = 32 * half + 8 * j + 2 * (lane % 4);
    const float2 l1 = *reinterpret_cast<const float2*>(rows + col);
    const float2 l2 = *reinterpret_cast<const float2*>(rows + BM + col);
    const float2 g = *reinterpret_cast<const float2*>(rows + 2 * BM + col);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int x = KL_IDX(j, i, 0), J = 4 * half + j;
      float d0 = g.x * (ex2(fmaf(p.c2, s2[x], -l2.x)) - ex2(fmaf(p.c1, s1[x], -l1.x)));
      float d1 = g.y * (ex2(fmaf(p.c2, s2[x + 1], -l2.y)) - ex2(fmaf(p.c1, s1[x + 1], -l1.y)));
      if (masked) {
        d0 = key_ok[i] && q0 + col >= seen_from[i] ? d0 : 0.f;
        d1 = key_ok[i] && q0 + col + 1 >= seen_from[i] ? d1 : 0.f;
      }
      a[4 * (J / 2) + 2 * (J % 2) + i] = pack2(d0, d1);
    }
  }
}

// dK2_c += dS^T (k-steps [K0, K1) of the A fragments) . Q2 (MN-major) of the stage.
template <int K0, int K1>
KL_DEV void gemm_dk(float* dk, const unsigned* a, unsigned q2_tile) {
#pragma unroll
  for (int kk = K0; kk < K1; ++kk) {
#pragma unroll
    for (int ns = 0; ns < D2P / 64; ++ns)
      wgmma_m64n64k16_rs_tb<true>(dk + 32 * ns, a + 4 * kk, smem_desc_mn(q2_tile + ns * SLAB_Q + kk * 2048, SLAB_Q));
  }
}

// The consumer's loop. Each tile's scores come in two halves of 32 rows so that each GEMM runs
// under work it does not feed, and no wgmma is in flight across the loop's back edge:
//   issue S(half 0), S(half 1), dQ(i - 1) | wait S(0): dS of half 0 under S(1) and dQ(i - 1) |
//   wait S(1), issue dK2 of half 0: dS of half 1 under it | issue dK2 of half 1: dS stores under it |
//   wait dQ(i - 1): its dq2 adds | barrier | wait the dK2 GEMMs, release the stage.
// wgmma groups complete in order, so wait_group N leaves the N most recent in flight.
KL_DEV void consume(const BwdParams& p, const BwdWork& w, int c, int tid, unsigned base) {
  const unsigned k_full = base + OFF_BAR, full = k_full + 8, empty = full + 8 * QSTAGES;
  const int warp = tid / 32, lane = tid % 32;
  const int off = causal_offset(p.nq, p.nk);
  int key[2], seen_from[2];  // the thread's two keys; the first query row that sees each
  bool key_ok[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    key[i] = w.n0 + 64 * c + 16 * warp + lane / 4 + 8 * i;
    key_ok[i] = key[i] < p.nk;
    seen_from[i] = p.causal ? key[i] - off : -2147483647;
  }
  const int last_key = w.n0 + 64 * c + 63;  // this consumer's
  float dk[D2P / 2];
#pragma unroll
  for (int x = 0; x < D2P / 2; ++x) dk[x] = 0.f;
  float dq[DQ_NR];
  if (w.iters > 0) mbar_wait(k_full, 0);
  int prev_h = 0, prev_q0 = 0;
  for (int it = 0; it < w.iters; ++it) {
    const int stage = it % QSTAGES, h = w.hk * p.g2 + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
    const unsigned q1_tile = base + OFF_Q1 + stage * Q1_BYTES, q2_tile = base + OFF_Q2 + stage * Q2_BYTES;
    mbar_wait(full + 8 * stage, (it / QSTAGES) & 1);
    float s1a[NR / 2], s2a[NR / 2], s1b[NR / 2], s2b[NR / 2];
    unsigned a[BM / 4];
    wgmma_fence();
    gemm_kq<D1P>(s1a, base + OFF_K1, q1_tile, c, 0);
    gemm_kq<D2P>(s2a, base + OFF_K2, q2_tile, c, 0);
    wgmma_commit();
    gemm_kq<D1P>(s1b, base + OFF_K1, q1_tile, c, 1);
    gemm_kq<D2P>(s2b, base + OFF_K2, q2_tile, c, 1);
    wgmma_commit();
    // dQ(i - 1) from its dS buffer, which the last barrier saw written (an empty group on the
    // first tile, so every tile waits on the same group counts).
    if (it > 0) gemm_dq(dq, base + OFF_DS + ((it - 1) & 1) * DS_BYTES, base + OFF_K2, c);
    wgmma_commit();
    wgmma_wait<2>();
    fence_regs<NR / 2>(s1a);
    fence_regs<NR / 2>(s2a);
    const float* rows = reinterpret_cast<const float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
    const bool masked = last_key >= p.nk || (p.causal && q0 + off < last_key);
    tile_ds(a, s1a, s2a, rows, p, 0, q0, masked, key_ok, seen_from, lane);
    wgmma_wait<1>();
    fence_regs<NR / 2>(s1b);
    fence_regs<NR / 2>(s2b);
    __syncwarp();  // the masked / unmasked choice reconverges before wgmma (.aligned)
    wgmma_fence();
    gemm_dk<0, BM / 32>(dk, a, q2_tile);
    wgmma_commit();
    tile_ds(a, s1b, s2b, rows, p, 1, q0, masked, key_ok, seen_from, lane);
    __syncwarp();
    wgmma_fence();
    gemm_dk<BM / 32, BM / 16>(dk, a, q2_tile);
    wgmma_commit();
    // dS(i) into buffer i % 2: dQ(i - 2), its last reader, finished before the last barrier.
    store_ds(a, base + OFF_DS + (it & 1) * DS_BYTES, c, warp, lane);
    wgmma_wait<2>();  // dQ(i - 1) is done; the dK2 GEMMs may run on
    if (it > 0) {
      fence_regs<DQ_NR>(dq);
      add_dq(p, w, dq, prev_h, prev_q0, c, warp, lane);
    }
    fence_proxy_async();
    bar_sync(1, 128 * NWG);  // every consumer's dS(i) slab is written
    wgmma_wait<0>();
    fence_regs<D2P / 2>(dk);
    if (tid == 0) mbar_arrive(empty + 8 * stage);  // the S and dK2 GEMMs read it
    prev_h = h, prev_q0 = q0;
  }
  if (w.iters > 0) {
    wgmma_fence();
    gemm_dq(dq, base + OFF_DS + ((w.iters - 1) & 1) * DS_BYTES, base + OFF_K2, c);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<DQ_NR>(dq);
    add_dq(p, w, dq, prev_h, prev_q0, c, warp, lane);
  }
  // dk2 of the thread's two keys: columns 64 ns + 8 j + 2 (lane % 4) (+1) of accumulator ns.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!key_ok[i]) continue;
    unsigned* row = reinterpret_cast<unsigned*>(
        static_cast<unsigned short*>(p.dk2) + (((long long)w.b * (p.h / p.g2) + w.hk) * p.nk + key[i]) * p.d2);
#pragma unroll
    for (int ns = 0; ns < D2P / 64; ++ns) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 64 * ns + 8 * j + 2 * (lane % 4);
        if (col < p.d2) row[col / 2] = pack2(dk[32 * ns + KL_IDX(j, i, 0)], dk[32 * ns + KL_IDX(j, i, 1)]);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kl_bwd(const __grid_constant__ BwdParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const unsigned k_full = base + OFF_BAR, full = k_full + 8, empty = full + 8 * QSTAGES;
  const BwdWork w = bwd_work(p);
  const int tid = threadIdx.x;
  unsigned dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < SMEM_BYTES) __trap();  // the host's copy of SMEM_BYTES disagrees
  if (tid == 0) {
    mbar_init(k_full, 1);
    for (int s = 0; s < QSTAGES; ++s) {
      mbar_init(full + 8 * s, 1 + 64);
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
    produce(p, w, tid, base);
    return;
  }
  regs_inc<REG_CONS>();
  consume(p, w, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);
}
