// kl_bwd.cu: the backward of KL(softmax(s1 Q1 K1^T) || softmax(s2 Q2 K2^T)) for one setting, as
// one warp-specialized TMA + wgmma kernel for sm_90a: SETTING 1 (teacher fixed) forms dq2, dk2;
// SETTING 2 (target fixed) forms dq1, dk1. "Own" below names the side whose gradients it forms
// (2 in setting 1, 1 in setting 2). It recomputes S1, S2 tile by tile from the forward's lse1,
// lse2 (and KL in setting 2; nothing quadratic kept), P_t = 2^(c_t S_t - L_t) with
// c_t = scale_t log2 e, L_t = lse_t log2 e:
//   setting 1: dS = G (P2 - P1),                        G = g s2
//   setting 2: dS = P1 (GL (c1 S1 - L1 - c2 S2) + B),   GL = g s1 ln 2, B = g s1 (lse2 - KL)
//     (= g s1 P1 (ln P1 - ln P2 - KL) from the logits, never the log of a probability; one
//     exponential per element, the row terms folded into GL and B)
//   dk_own = dS^T Q_own,  dq_own = dS K_own   (scale_own is folded into the row terms).
//
// Grid: (X, Hk_own, B). CTA x of a key head walks the key tiles x, x + X, ... of BN = 128 keys
//   of that key head of the own side (X = cdiv(Nk, BN): one tile a CTA; decode launches fewer,
//   about one CTA per SM, with KSTAGES = 2 so the next tile's K loads under this one). Per key
//   tile it walks every query head of the key head's GQA group (g_own heads) and, per head, the
//   query tiles of BM = 64 rows that see any of its keys (under the causal mask, from the first
//   such row on). The other side's key head is one per tile: g_other is a multiple of g_own.
//   __launch_bounds__(THREADS, 1): one CTA per SM.
// Block: 128 * (NWG + 1) = 384 threads. Warpgroup 0 is the producer (setmaxnreg.dec to 24): its
//   thread 0 loads each key tile's K1 and K2 into one of KSTAGES stages and then each query
//   tile's Q1 and Q2 into a QSTAGES-deep ring (TMA; the ring's and the dS buffers' counters run on
//   across key tiles); its warps 2-3 (64 threads, one per row) write each tile's three row
//   terms into the stage (setting 1: L1, L2, G; setting 2: L1, GL, B; rows past Nq or that saw no
//   key get terms that make dS = 0 there).
//   Warpgroups 1..NWG are consumers (setmaxnreg.inc to 240); consumer c owns keys
//   [64 c, 64 c + 64) of the tile, holds its 64 K1 rows as wgmma A fragments in registers (loaded
//   once), and per query tile i:
//     S1^T = K1_c Q1^T (wgmma RS), S2^T = K2_c Q2^T (SS)   (64 keys x 64 rows, K-major operands)
//     dQ(i - 1) issued behind them, so it runs under this tile's dS update (below)
//     dS^T, masked                             (registers; packed 16-bit, the A operand of dK)
//     dS -> its 64-key slab of dS buffer i % 2 (K-major, 16-bit), once both consumers' dQ(i - 2)
//       have read that buffer (ds_empty), then announced (ds_full: every writer thread arrives)
//     dK_c += dS^T Q_own                       (wgmma RS, Q MN-major: registers accumulate dk)
//     dQ(i - 1) done: ds_empty released, its rows added into the float32 dq buffer with
//       red.global.add.v2.f32 (rows < Nq, columns < D_own); dK done: every consumer thread
//       releases the stage (an mbarrier arrive releases only its own thread's reads of the row terms)
//   where dQ(i) = dS(i) K_own[:, the consumer's DOP / 2 columns] over all BN keys (wgmma SS, K
//   MN-major) waits for both consumers' slabs of tile i. The consumers meet only through the dS
//   buffers' barriers, never all at once, so one's GEMMs run under the other's exponentials; no
//   wgmma is in flight across the loop's back edge, and dQ of a key tile's last query tile runs
//   after its loop, before the K stage is released. Each consumer then writes its keys' dk rows
//   (keys < Nk, columns < D_own) in the inputs' dtype; a key tile with no query tile gets zeros.
// Tiles in shared memory, all 1024-byte-aligned slabs of 64 columns, 128-byte swizzled as TMA
//   writes them: KSTAGES stages of K1, K2 (BN x D1P, BN x D2P), QSTAGES stages of Q1, Q2 (BM x D1P,
//   BM x D2P) and the row terms (3 x BM floats), two dS buffers (BM x BN, 16-bit). Barriers
//   (BwdBars): k_full[ks] (count 1, tx), k_empty[ks] (128 NWG: every consumer thread, after its
//   last use of the K stage), full[s] (1 + 64: the TMA thread's expect_tx and the 64 row-term writers),
//   empty[s] (128 NWG: every consumer thread, after its last read of the stage), ds_full[b] (128 NWG),
//   ds_empty[b] (NWG). The causal mask aligns bottom-right (mask.cuh).
// Reads q1, k1, q2, k2 (4-D tensor maps {D, N, heads, B}; query head h reads key heads h / g1,
//   h / g2), lse1, lse2, grad and in setting 2 kl ([B, H, Nq] float32); writes dq_own (adds into
//   [B, H, Nq, D_own] float32) and dk_own ([B, Hk_own, Nk, D_own]).
#include "mask.cuh"
#include "sm90.cuh"

#if !defined(KL_FP16) || !defined(D1P) || !defined(D2P) || !defined(QSTAGES) || !defined(SETTING) || \
    !defined(KSTAGES)
#error "the launcher (_bwd.py) defines every instantiation constant"
#endif
static_assert(SETTING == 1 || SETTING == 2, "SETTING: 1 (dq2, dk2) or 2 (dq1, dk1)");
static_assert(KSTAGES == 1 || KSTAGES == 2, "KSTAGES: 1 (a tile a CTA) or 2 (several a CTA)");
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
constexpr unsigned ROW_BYTES = 3 * BM * 4;  // three row terms of a query tile's rows
constexpr unsigned K_STAGE = K1_BYTES + K2_BYTES;
constexpr unsigned OFF_K1 = 0, OFF_K2 = OFF_K1 + K1_BYTES;  // + ks K_STAGE for K stage ks
constexpr unsigned OFF_Q1 = KSTAGES * K_STAGE, OFF_Q2 = OFF_Q1 + QSTAGES * Q1_BYTES;
constexpr unsigned OFF_DS = OFF_Q2 + QSTAGES * Q2_BYTES;
constexpr unsigned OFF_ROWS = OFF_DS + 2 * DS_BYTES;
constexpr unsigned OFF_BAR = OFF_ROWS + QSTAGES * ROW_BYTES;
constexpr int DOP = SETTING == 1 ? D2P : D1P;  // the own side's padded head dim
constexpr unsigned OFF_KO = SETTING == 1 ? OFF_K2 : OFF_K1;  // the own side's K tile (dQ's B operand)
// k_full[ks], k_empty[ks], full[s], empty[s], ds_full[2], ds_empty[2]
constexpr unsigned N_BARS = 2 * KSTAGES + 2 * QSTAGES + 4;
constexpr unsigned SMEM_BYTES = OFF_BAR + 8 * N_BARS + 1024;  // + the base's alignment slack
static_assert(SMEM_BYTES <= 232448, "exceeds the 227 KB of shared memory of an sm_90 CTA");
constexpr int REG_PROD = 24, REG_CONS = 240;
static_assert(REG_PROD * 128 + REG_CONS * 128 * NWG <= THREADS * (65536 / THREADS / 8 * 8), "register budget");
// dQ of one consumer: its share of the columns, over all BN keys of the CTA.
constexpr int DQ_N = DOP / NWG;
constexpr int DQ_NR = DQ_N / 2;  // its accumulator registers per thread

struct BwdParams {
  TensorMap q1, k1, q2, k2;  // q boxes {64, BM, 1, 1}, k boxes {64, BN, 1, 1}
  const float* lse1;  // [B, H, Nq], natural log
  const float* lse2;
  const float* grad;  // dLoss / dKL per row
  float* dq;  // [B, H, Nq, D_own] float32, zeroed: the adds land here
  void* dk;  // [B, Hk_own, Nk, D_own], the inputs' dtype
  int h, nq, nk, d, g_own, g_other, causal, m_tiles;  // d = D_own
  float c1, c2, scale;  // c_t = scale_t log2(e); scale = scale_own
  const float* kl;  // [B, H, Nq] the forward's KL (setting 2)
};
static_assert(sizeof(BwdParams) == 640, "BWD_PARAMS_BYTES in _bwd.py packs this layout");

// The mbarriers' shared-memory addresses (8 bytes each; index s for a stage, b for a dS buffer).
struct BwdBars {
  unsigned k_full, k_empty, full, empty, ds_full, ds_empty;
};

KL_DEV BwdBars bwd_bars(unsigned base) {
  BwdBars r;
  r.k_full = base + OFF_BAR, r.k_empty = r.k_full + 8 * KSTAGES, r.full = r.k_empty + 8 * KSTAGES;
  r.empty = r.full + 8 * QSTAGES, r.ds_full = r.empty + 8 * QSTAGES, r.ds_empty = r.ds_full + 16;
  return r;
}

#define KL_IDX(j, i, k) ((j) * 4 + (i) * 2 + (k))
#define KL_LOG2E 1.4426950408889634f
#define KL_INF __int_as_float(0x7f800000)
#define KL_LN2 0.6931471805599453f

// The CTA's work: key tile n0, own key head hk (K1, K2 heads kh1, kh2), batch b; its query tiles
// run m0 .. m_tiles - 1 for each of the g_own heads of the group, `per_head` of them.
struct BwdWork {
  int n0, hk, kh1, kh2, b, mt0, per_head, iters;
};

KL_DEV BwdWork bwd_work(const BwdParams& p, int x) {
  BwdWork w;
  w.n0 = x * BN, w.hk = blockIdx.y, w.b = blockIdx.z;
  const int other = w.hk * p.g_own / p.g_other;
  w.kh1 = SETTING == 1 ? other : w.hk, w.kh2 = SETTING == 1 ? w.hk : other;
  // Causal: row i sees key j iff j <= i + off, so the first row that sees key n0 is n0 - off.
  const int first = p.causal ? max(0, w.n0 - causal_offset(p.nq, p.nk)) : 0;
  w.mt0 = first / BM;
  w.per_head = first < p.nq ? p.m_tiles - w.mt0 : 0;
  w.iters = w.per_head * p.g_own;
  return w;
}

// The K tile's consumer-c rows as the A operand, k-step kk of a 64 x DP GEMM: 64 c rows into each slab.
template <int DP>
KL_DEV void gemm_kq(float* s, unsigned k_tile, unsigned q_tile, int c) {
  const unsigned long long da = smem_desc(k_tile + c * 64 * 128), db = smem_desc(q_tile);
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    const unsigned long long a = smem_desc_add(da, (kk / 4) * SLAB_K + (kk % 4) * 32);
    const unsigned long long b = smem_desc_add(db, (kk / 4) * SLAB_Q + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n64k16<false>(s, a, b); else wgmma_m64n64k16<true>(s, a, b);
  }
}

// The loads and row terms of one key tile (counters kit, git: the key tiles and query tiles this
// CTA loaded before it).
KL_DEV void produce_tile(const BwdParams& p, const BwdWork& w, int tid, unsigned base, int kit, int git) {
  const BwdBars bars = bwd_bars(base);
  if (tid == 0) {
    const int ks = kit % KSTAGES;
    if constexpr (KSTAGES > 1) mbar_wait(bars.k_empty + 8 * ks, ((kit / KSTAGES) & 1) ^ 1);  // its last tile is done
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
  } else if (tid >= 64) {  // one thread per row of the tile: its three row terms
    const int r = tid - 64;
    for (int it = 0; it < w.iters; ++it) {
      const int g = git + it, stage = g % QSTAGES;
      const int h = w.hk * p.g_own + it / w.per_head, q = (w.mt0 + it % w.per_head) * BM + r;
      // Rows past Nq or that saw no key: P = 0 and dS = 0. Setting 2 takes a finite L1 there,
      // so that its GL (c1 S1 - L1 - c2 S2) is 0 x finite, not 0 x inf.
      float t0 = SETTING == 1 ? KL_INF : 1e30f, t1 = SETTING == 1 ? KL_INF : 0.f, t2 = 0.f;
      if (q < p.nq) {
        const long long row = ((long long)w.b * p.h + h) * p.nq + q;
        const float a = p.lse1[row];
        if (a > -KL_INF) {
          const float gr = p.grad[row] * p.scale;
          t0 = a * KL_LOG2E;
          if constexpr (SETTING == 1) t1 = p.lse2[row] * KL_LOG2E, t2 = gr;
          else t1 = gr * KL_LN2, t2 = gr * (p.lse2[row] - p.kl[row]);
        }
      }
      mbar_wait(bars.empty + 8 * stage, ((g / QSTAGES) & 1) ^ 1);
      float* rows = reinterpret_cast<float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
      rows[r] = t0, rows[BM + r] = t1, rows[2 * BM + r] = t2;
      mbar_arrive(bars.full + 8 * stage);  // release: the consumers' wait on full[s] sees the writes
    }
  }
}

KL_DEV void produce(const BwdParams& p, const BwdWork& w0, int tid, unsigned base) {
  if constexpr (KSTAGES == 1) {  // one key tile a CTA (w0): the counters are compile-time zeros
    if (w0.iters > 0) produce_tile(p, w0, tid, base, 0, 0);
    return;
  }
  const int key_tiles = (p.nk + BN - 1) / BN;
  int kit = 0, git = 0;
  for (int x = blockIdx.x; x < key_tiles; x += gridDim.x) {
    const BwdWork w = bwd_work(p, x);
    if (w.iters == 0) continue;  // no query tile: nothing to load (the consumers write zeros)
    produce_tile(p, w, tid, base, kit, git);
    ++kit, git += w.iters;
  }
}

// S^T (64 keys x 64 rows) = K_c Q^T with K_c's fragments in registers (wgmma RS).
template <int DP>
KL_DEV void gemm_kq_rs(float* s, const unsigned* a, unsigned q_tile) {
  const unsigned long long db = smem_desc(q_tile);
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    const unsigned long long b = smem_desc_add(db, (kk / 4) * SLAB_Q + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n64k16_rs<false>(s, a + 4 * kk, b); else wgmma_m64n64k16_rs<true>(s, a + 4 * kk, b);
  }
}

// One key tile of consumer c: every query tile of it (counters kit, git as the producer counts
// them), then its keys' dk rows.
KL_DEV void consume_tile(const BwdParams& p, const BwdWork& w, int c, int tid, unsigned base, int kit, int git) {
  const BwdBars bars = bwd_bars(base);
  const unsigned full = bars.full, empty = bars.empty, ds_full = bars.ds_full, ds_empty = bars.ds_empty;
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
  const int last_key = w.n0 + 64 * c + 63;
  const int ks = kit % KSTAGES;
  const int col0 = c * DQ_N;
  const unsigned k_stage = base + ks * K_STAGE;
  const unsigned dq_b0 = k_stage + OFF_KO + (col0 / 64) * SLAB_K + (col0 % 64) * 2;
  float dk[DOP / 2];
#pragma unroll
  for (int x = 0; x < DOP / 2; ++x) dk[x] = 0.f;
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
  unsigned ka1[D1P / 4];  // the consumer's K1 rows, the A operand of every S1 GEMM
  if (w.iters > 0) {
    mbar_wait(bars.k_full + 8 * ks, (kit / KSTAGES) & 1);
    load_afrag<D1P, SLAB_K>(ka1, k_stage + OFF_K1 + c * 64 * 128, warp, lane);
  }
  int prev_h = 0, prev_q0 = 0;
  for (int it = 0; it < w.iters; ++it) {
    const int g = git + it, stage = g % QSTAGES;
    const int h = w.hk * p.g_own + it / w.per_head, q0 = (w.mt0 + it % w.per_head) * BM;
    const unsigned q1_tile = base + OFF_Q1 + stage * Q1_BYTES, q2_tile = base + OFF_Q2 + stage * Q2_BYTES;
    const unsigned qo_tile = SETTING == 1 ? q2_tile : q1_tile;
    mbar_wait(full + 8 * stage, (g / QSTAGES) & 1);
    float s1[NR], s2[NR];
    unsigned a[BM / 4];
    wgmma_fence();
    gemm_kq_rs<D1P>(s1, ka1, q1_tile);
    gemm_kq<D2P>(s2, k_stage + OFF_K2, q2_tile, c);
    wgmma_commit();
    if (it > 0) issue_dq(g - 1);
    wgmma_commit();  // dQ(i - 1); empty on a key tile's first, so every tile waits on the same counts
    wgmma_wait<1>();  // S(i) is done; dQ(i - 1) runs under the dS update
    fence_regs<NR>(s1);
    fence_regs<NR>(s2);
    const float* rows =
        reinterpret_cast<const float*>(__cvta_shared_to_generic(base + OFF_ROWS + stage * ROW_BYTES));
    const bool masked = last_key >= p.nk || (p.causal && q0 + off < last_key);
#pragma unroll
    for (int j = 0; j < BM / 8; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      const float2 t0 = *reinterpret_cast<const float2*>(rows + col);
      const float2 t1 = *reinterpret_cast<const float2*>(rows + BM + col);
      const float2 t2 = *reinterpret_cast<const float2*>(rows + 2 * BM + col);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int x = KL_IDX(j, i, 0);
        float d0, d1;
        if constexpr (SETTING == 1) {  // t0, t1, t2 = L1, L2, G
          d0 = t2.x * (ex2(fmaf(p.c2, s2[x], -t1.x)) - ex2(fmaf(p.c1, s1[x], -t0.x)));
          d1 = t2.y * (ex2(fmaf(p.c2, s2[x + 1], -t1.y)) - ex2(fmaf(p.c1, s1[x + 1], -t0.y)));
        } else {  // t0, t1, t2 = L1, GL, B
          const float e0 = fmaf(p.c1, s1[x], -t0.x), e1 = fmaf(p.c1, s1[x + 1], -t0.y);
          d0 = ex2(e0) * fmaf(t1.x, fmaf(-p.c2, s2[x], e0), t2.x);
          d1 = ex2(e1) * fmaf(t1.y, fmaf(-p.c2, s2[x + 1], e1), t2.y);
        }
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
          const unsigned addr = ds + c * SLAB_Q + q * 128 + ((((kc >> 3) ^ (q & 7)) << 4) | ((kc & 7) << 1));
          sts16(addr, (unsigned short)(k ? v >> 16 : v & 0xFFFF));
        }
      }
    }
    fence_proxy_async();
    mbar_arrive(ds_full + 8 * b);
    __syncwarp();
    wgmma_fence();  // dK reads the fragments a; nothing touches them until its wait
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
      for (int ns = 0; ns < DOP / 64; ++ns)
        wgmma_m64n64k16_rs_tb<true>(dk + 32 * ns, a + 4 * kk,
                                    smem_desc_mn(qo_tile + ns * SLAB_Q + kk * 2048, SLAB_Q));
    }
    wgmma_commit();
    wgmma_wait<1>();  // dQ(i - 1) is done; dK(i) may run on
    if (it > 0) {
      fence_regs<DQ_NR>(dq);
      // one thread: dQ's reads of the buffer are the wgmma's (async proxy), complete for the
      // whole warpgroup once wait_group returns; this thread releases no plain loads of it
      if (tid == 0) mbar_arrive(ds_empty + 8 * ((g - 1) & 1));
      add_dq(prev_h, prev_q0);
    }
    wgmma_wait<0>();
    fence_regs<DOP / 2>(dk);
    mbar_arrive(empty + 8 * stage);  // every thread: each releases its own reads of the row terms
    prev_h = h, prev_q0 = q0;
  }
  if (w.iters > 0) {
    wgmma_fence();
    issue_dq(git + w.iters - 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<DQ_NR>(dq);
    if constexpr (KSTAGES > 1) {  // the next key tile reuses the dS buffer and, later, the K stage
      if (tid == 0) mbar_arrive(ds_empty + 8 * ((git + w.iters - 1) & 1));
      mbar_arrive(bars.k_empty + 8 * ks);  // every thread: its K fragment loads and GEMMs are done
    }
    add_dq(prev_h, prev_q0);
  }
  // dk of the thread's two keys: columns 64 ns + 8 j + 2 (lane % 4) (+1) of accumulator ns.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!key_ok[i]) continue;
    unsigned* row = reinterpret_cast<unsigned*>(
        static_cast<unsigned short*>(p.dk) + (((long long)w.b * (p.h / p.g_own) + w.hk) * p.nk + key[i]) * p.d);
#pragma unroll
    for (int ns = 0; ns < DOP / 64; ++ns) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 64 * ns + 8 * j + 2 * (lane % 4);
        if (col < p.d) row[col / 2] = pack2(dk[32 * ns + KL_IDX(j, i, 0)], dk[32 * ns + KL_IDX(j, i, 1)]);
      }
    }
  }
}

KL_DEV void consume(const BwdParams& p, const BwdWork& w0, int c, int tid, unsigned base) {
  if constexpr (KSTAGES == 1) {  // one key tile a CTA (w0): the counters are compile-time zeros
    consume_tile(p, w0, c, tid, base, 0, 0);
    return;
  }
  const int key_tiles = (p.nk + BN - 1) / BN;
  int kit = 0, git = 0;
  for (int x = blockIdx.x; x < key_tiles; x += gridDim.x) {
    const BwdWork w = bwd_work(p, x);
    consume_tile(p, w, c, tid, base, kit, git);
    if (w.iters > 0) ++kit, git += w.iters;
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kl_bwd(const __grid_constant__ BwdParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const BwdBars bars = bwd_bars(base);
  const BwdWork w0 = bwd_work(p, blockIdx.x);
  const int tid = threadIdx.x;
  unsigned dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < SMEM_BYTES) __trap();  // the host's copy of SMEM_BYTES disagrees
  if (tid == 0) {
    for (int ks = 0; ks < KSTAGES; ++ks) {
      mbar_init(bars.k_full + 8 * ks, 1);
      mbar_init(bars.k_empty + 8 * ks, 128 * NWG);  // every consumer thread, after its key tile
    }
    for (int s = 0; s < QSTAGES; ++s) {
      mbar_init(bars.full + 8 * s, 1 + 64);
      mbar_init(bars.empty + 8 * s, 128 * NWG);  // every consumer thread
    }
    for (int b = 0; b < 2; ++b) {
      mbar_init(bars.ds_full + 8 * b, 128 * NWG);  // one per dS writer thread
      mbar_init(bars.ds_empty + 8 * b, NWG);  // one per consumer, once its dQ has read the buffer
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
    produce(p, w0, tid, base);
    return;
  }
  regs_inc<REG_CONS>();
  consume(p, w0, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);
}
