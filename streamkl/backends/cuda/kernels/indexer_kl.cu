// indexer_kl.cu: the DSA indexer loss (docs/indexer.md) of one query row per CTA, with the row's
// H x D teacher queries resident in shared memory, as one warp-specialized TMA + wgmma kernel for
// sm_90a. Per key tile (64 keys, key-major so every per-key sum is a row sum of an accumulator):
//   S^T = K Q^T                      64 keys x 128 stacked heads (wgmma m64n128, SS), D/64 slabs
//   p_j = (1/H) sum_h 2^(c S_jh - L_h)                       the teacher's head mixture
//   z^T = KI QI^T, I_j = sum_g w_g relu(z_jg)                 64 keys x 64 indexer heads (SS)
//   log q_j = I_j - LSE2,  C += p (log p - log q),  T += p    (WRITE_KL: KL = C/T - log T)
//   dI_j = a q_j - b p_j, dz = dI w [z > 0], dw += dI relu(z)  (GRADS; a, b scaled so max(|a|,|b|) = 1,
//   dki += dz QI (RS, red.global.add.v2.f32), dqi += dz^T KI (dz^T through shared memory)
//                                                           and the sums multiplied back in float32)
// STATS first walks the row's keys once over KI alone for the student's LSE2 (online, log2 units),
// while the teacher's queries load; TLSE then walks them over K alone for the teacher's per-head
// LSE (the column log-sum-exps of S^T), when the caller gave none.
//
// Instantiations (-D macros, _indexer.py's PASSES): KL_FP16 (the 16-bit operand type); STATS
// (compute and write LSE2, else read it); TLSE (compute and write lse, else read it; only with
// STATS); WRITE_KL (KL and T); GRADS (dqi, dw written, dki added, each where asked at run time);
// REDO (the fused step's correction: see below); SPARSE (key tiles gathered from the row's key set).
//
// Grid: (Sq, B): CTA x holds row Sq - 1 - x of batch y (under the causal mask the longest rows start
//   first). __launch_bounds__(THREADS, 1): one CTA per SM (the queries take up to 144 KB).
// Block: 384 threads. Warpgroup 0 is the producer (setmaxnreg.dec to 40): its warp c < 2, lane 0,
//   feeds consumer c's ring of STAGES 64 x 64 slabs (TMA): STATS: the two KI slabs of each of its
//   key tiles; then per key tile the D/64 K slabs and the two KI slabs. SPARSE (a key tile is 64
//   entries of the row's key set, gathered: Hopper's TMA has no gather): warps 2c and 2c + 1 fill
//   consumer c's ring instead, each thread one slab row by cp.async. Warp 0 (lane 0) also loads
//   the row's QI (64 heads x 128, on qi_full) and Q (128 heads x D, on q_full) once by TMA.
//   Warpgroups 1..2 are the consumers (setmaxnreg.inc to 232): consumer c takes key tiles c, c + 2,
//   ... of the row, so the two never wait on each other inside the loop and one's GEMMs run under
//   the other's exponentials. A K slab is released (one arrive) once the GEMM reading it has
//   completed, the KI slabs after dqi's GEMM. After the loop the consumers meet once: consumer 1
//   hands its dqi and both their dw sums to consumer 0 through the (idle) ring and their KL sums
//   through the scratch; consumer 0 writes the row's outputs.
// Shared memory, 1024-byte-aligned 128-byte-swizzled slabs as TMA writes them: QI (2 slabs), dz^T of
//   each consumer (one slab, written by the consumer, read by dqi's wgmma as an MN-major A), the rings
//   (NWG x STAGES slabs), L_h (log2 units, +inf for padding heads), w_g (0 for padding heads), a
//   reduction scratch, the barriers, then Q (D/64 slabs of 128 heads).
// Reads q ({D, H, Sq, B} map, boxes 64 x 128 heads), k and ki ({D, Sk, 1, B}, boxes 64 x 64 keys), qi
//   ({Di, G, Sq, B}, boxes 64 x 64 heads; SPARSE: k and ki by pointer, and topk [B, Sq, W] int32),
//   w (strided, float32/bfloat16/float16), lse ([B, H, Sq]
//   float32), lse2 (!STATS), coef ([4][B Sq]: a, b, da, db; null: all coef_scalar). Writes lse2
//   (STATS), kl and mass (WRITE_KL), the row's dqi ([B, G, Sq, Di]) and dw ([B, G, Sq]) and adds into
//   dki ([B, Sk, Di] float32). REDO (the fused step's correction): dqi and dw are formed from (a, b) and
//   written over the first pass's, while dki receives the difference (da, db); rows with da = db = 0
//   return at once. The causal mask aligns bottom-right (mask.cuh).
#include "mask.cuh"
#include "sm90.cuh"

#if !defined(KL_FP16) || !defined(STATS) || !defined(WRITE_KL) || !defined(GRADS) || !defined(REDO) || \
    !defined(SPARSE) || !defined(TLSE)
#error "the launcher (_indexer.py) defines every instantiation constant"
#endif

constexpr int NWG = 2;  // consumer warpgroups, one key tile each at a time
constexpr int BN = 64;  // keys per tile
constexpr int NH = 128;  // teacher heads, padded (TMA fills the missing ones with zeros)
constexpr int GP = 64;  // indexer heads, padded
constexpr int STAGES = 3;  // slabs in each consumer's ring
constexpr int MAX_DCH = 9;  // teacher head dim up to 576 (MLA's absorbed key)
constexpr int THREADS = 128 * (NWG + 1);
constexpr unsigned SLAB = 64 * 128;  // 64 rows x 64 16-bit columns
constexpr unsigned Q_SLAB = NH * 128;  // 128 heads x 64 columns
constexpr unsigned OFF_QI = 0, OFF_DZ = OFF_QI + 2 * SLAB, OFF_RING = OFF_DZ + NWG * SLAB;
constexpr unsigned OFF_L = OFF_RING + NWG * STAGES * SLAB, OFF_W = OFF_L + NH * 4, OFF_RED = OFF_W + GP * 4;
constexpr unsigned OFF_BAR = OFF_RED + 32 * 4;
constexpr unsigned N_BARS = 2 + 2 * NWG * STAGES;  // qi_full, q_full, full[c][s], empty[c][s]
constexpr unsigned OFF_Q = (OFF_BAR + 8 * N_BARS + 1023) / 1024 * 1024;
constexpr unsigned SMEM_FIXED = OFF_Q + 1024;  // + dch Q slabs; + 1024: the base's alignment slack
static_assert(SMEM_FIXED + MAX_DCH * Q_SLAB <= 232448, "exceeds the 227 KB of shared memory of an sm_90 CTA");
static_assert(NWG * STAGES * SLAB >= 128 * 64 * 4 + 8 * GP * 4, "the final reductions' scratch fits the rings");
constexpr int REG_PROD = 40, REG_CONS = 232;  // SPARSE's gathering producer needs more than 24
static_assert(REG_PROD * 128 + REG_CONS * 128 * NWG <= 65536, "register budget");

struct IndexerParams {
  TensorMap q, k, qi, ki;
  float* lse;  // [B, H, Sq] natural log: read, or written (TLSE)
  float* lse2;  // [B, Sq]: written (STATS) or read
  const void* w;  // (B, G, Sq), strides below, dtype w_dtype
  const float* coef;  // [4][B Sq] (a, b, da, db), or null: each is coef_scalar
  float* kl;  // [B, Sq]
  float* mass;
  void* dqi;  // [B, G, Sq, Di]: the inputs' dtype, or float32 (dqi_f32)
  float* dki;  // [B, Sk, Di] float32, zeroed
  void* dw;  // [B, G, Sq], dtype dw_dtype
  const int* topk;  // SPARSE: [B, Sq, topk_w] each row's key set, sorted, -1 padding and repeats
  const unsigned short* kp;  // SPARSE: k and ki (16-bit), gathered row by row with cp.async
  const unsigned short* kip;
  long long swb, swg, swn, skb, skn, skib, skin;  // strides in elements
  int h, g, nq, nk, d, di, dch, causal, w_dtype, dw_dtype, dqi_f32, need_dqi, need_dki, need_dw, topk_w;
  float c_log2, inv_h, coef_scalar;
};
static_assert(sizeof(IndexerParams) == 768, "PARAMS_BYTES in _indexer.py packs this layout");

#define KL_LOG2E 1.4426950408889634f
#define KL_LN2 0.6931471805599453f
#define KL_INF __int_as_float(0x7f800000)
#define KL_IDX(j, i, k) ((j) * 4 + (i) * 2 + (k))

struct Bars {
  unsigned qi_full, q_full, full, empty;  // full / empty: + 8 (c STAGES + s)
};

KL_DEV Bars bars_at(unsigned base) {
  Bars r;
  r.qi_full = base + OFF_BAR, r.q_full = r.qi_full + 8, r.full = r.q_full + 8, r.empty = r.full + 8 * NWG * STAGES;
  return r;
}

KL_DEV unsigned ring_slab(unsigned base, int c, int s) { return base + OFF_RING + (c * STAGES + s) * SLAB; }

KL_DEV float* smem_f32(unsigned addr) { return reinterpret_cast<float*>(__cvta_shared_to_generic(addr)); }

// One element of a float32 (0), bfloat16 (1) or float16 (2) tensor as float32, and back.
KL_DEV float load_any(const void* ptr, long long at, int dtype) {
  if (dtype == 0) return static_cast<const float*>(ptr)[at];
  const unsigned short v = static_cast<const unsigned short*>(ptr)[at];
  if (dtype == 1) return __uint_as_float(static_cast<unsigned>(v) << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
  return f;
}

KL_DEV void store_any(void* ptr, long long at, int dtype, float x) {
  if (dtype == 0) {
    static_cast<float*>(ptr)[at] = x;
    return;
  }
  unsigned short v;
  if (dtype == 1)
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(v) : "f"(x));
  else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v) : "f"(x));
  static_cast<unsigned short*>(ptr)[at] = v;
}

// The CTA's row and what it does: its keys [0, key_end) in tiles of BN, its gradient coefficients.
struct Row {
  int b, row, key_end, tiles;
  long long at;  // b Sq + row: the row's (B, Sq) statistics
  float a, bc, da, db;  // dI = a q - bc p for dqi, dw; da, db for dki (the same but in REDO)
  bool work, skip;  // work: it walks its keys; skip (REDO): it writes nothing at all
};

KL_DEV Row row_of(const IndexerParams& p) {
  Row r;
  r.b = blockIdx.y, r.row = p.nq - 1 - blockIdx.x;
  r.at = (long long)r.b * p.nq + r.row;
  r.key_end = KL_KEY_END(r.row, causal_offset(p.nq, p.nk), p.nk, p.causal);
  r.tiles = r.key_end <= 0 ? 0 : ((SPARSE ? p.topk_w : r.key_end) + BN - 1) / BN;
  r.a = r.bc = r.da = r.db = p.coef_scalar;
  if (GRADS && p.coef != nullptr) {
    const long long rows = (long long)gridDim.y * p.nq;
    r.a = p.coef[r.at], r.bc = p.coef[rows + r.at], r.da = p.coef[2 * rows + r.at], r.db = p.coef[3 * rows + r.at];
  }
  r.skip = REDO && r.da == 0.f && r.db == 0.f;
  r.work = r.tiles > 0 && !r.skip && !(GRADS && !STATS && r.a == 0.f && r.bc == 0.f && r.da == 0.f && r.db == 0.f);
  return r;
}

// Key slot e of the row's key tiles: (the key's position, whether the row admits it). Dense: the
// keys in order up to key_end; SPARSE: entry e of the row's key set, admitted when it is a key
// (>= 0, < Sk) that the causal mask lets the row see; a slot not admitted reads key 0, masked.
KL_DEV int2 key_slot(const IndexerParams& p, const Row& r, int e) {
  if (!SPARSE) return make_int2(e, e < r.key_end);
  const int key = e < p.topk_w ? p.topk[r.at * p.topk_w + e] : -1;
  const bool ok = key >= 0 && key < r.key_end;  // key_end: Sk, or the causal frontier
  return make_int2(ok ? key : 0, ok);
}

// SPARSE: the 64 rows of a slab gathered by the 64 threads serving one consumer (x: the slab row,
// the key slot's key and admission), eight 16-byte cp.async each into the 128-byte-swizzled row
// TMA would write, zeros past `dim` or for a key not admitted; completion is tracked on `full`
// (every thread's cp.async.mbarrier.arrive.noinc: the barrier counts the 64 threads).
KL_DEV void gather_slab(unsigned slab, const unsigned short* row, int col0, int dim, int x, bool ok, unsigned full) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = col0 + 8 * j;
    const int bytes = ok ? 2 * max(0, min(8, dim - col)) : 0;
    const unsigned short* src = bytes > 0 ? row + col : row;
    const unsigned dst = slab + x * 128 + ((j ^ (x & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
  }
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full) : "memory");
}

KL_DEV void produce(const IndexerParams& p, const Row& r, int warp, int lane, unsigned base) {
  if (!r.work) return;
  const Bars bars = bars_at(base);
  if (SPARSE) {  // warps 2c, 2c + 1: consumer c's ring, one slab row per thread
    if (warp == 0 && lane == 0) {
      mbar_expect_tx(bars.qi_full, 2 * SLAB);
      for (int s = 0; s < 2; ++s) tma_load_4d(base + OFF_QI + s * SLAB, &p.qi, 64 * s, 0, r.row, r.b, bars.qi_full);
      mbar_expect_tx(bars.q_full, p.dch * Q_SLAB);
      for (int s = 0; s < p.dch; ++s) tma_load_4d(base + OFF_Q + s * Q_SLAB, &p.q, 64 * s, 0, r.row, r.b, bars.q_full);
    }
    const int c = warp / 2, x = (warp % 2) * 32 + lane;
    int n = 0;
    auto slot = [&](int& n) {  // the next slab of the ring, once its consumer released it
      const int s = n % STAGES;
      mbar_wait(bars.empty + 8 * (c * STAGES + s), ((n / STAGES) & 1) ^ 1);
      ++n;
      return s;
    };
    for (int phase = 0; phase < 3; ++phase) {  // LSE2 (KI), the teacher's LSE (K), the main walk (both)
      if ((phase == 0 && !STATS) || (phase == 1 && !TLSE)) continue;
      for (int t = c; t < r.tiles; t += NWG) {
        const int2 kv = key_slot(p, r, t * BN + x);
        const unsigned short* krow = p.kp + r.b * p.skb + kv.x * p.skn;
        const unsigned short* kirow = p.kip + r.b * p.skib + kv.x * p.skin;
        if (phase > 0) {
          for (int d = 0; d < p.dch; ++d) {
            const int s = slot(n);
            gather_slab(ring_slab(base, c, s), krow, 64 * d, p.d, x, kv.y, bars.full + 8 * (c * STAGES + s));
          }
        }
        if (phase != 1) {
          for (int h = 0; h < 2; ++h) {
            const int s = slot(n);
            gather_slab(ring_slab(base, c, s), kirow, 64 * h, p.di, x, kv.y, bars.full + 8 * (c * STAGES + s));
          }
        }
      }
    }
    return;
  }
  if (lane != 0 || warp >= NWG) return;
  if (warp == 0) {
    mbar_expect_tx(bars.qi_full, 2 * SLAB);
    for (int s = 0; s < 2; ++s) tma_load_4d(base + OFF_QI + s * SLAB, &p.qi, 64 * s, 0, r.row, r.b, bars.qi_full);
    mbar_expect_tx(bars.q_full, p.dch * Q_SLAB);
    for (int s = 0; s < p.dch; ++s) tma_load_4d(base + OFF_Q + s * Q_SLAB, &p.q, 64 * s, 0, r.row, r.b, bars.q_full);
  }
  const int c = warp;
  int n = 0;
  auto load = [&](const TensorMap* map, int col, int key0) {
    const int s = n % STAGES;
    const unsigned full = bars.full + 8 * (c * STAGES + s);
    mbar_wait(bars.empty + 8 * (c * STAGES + s), ((n / STAGES) & 1) ^ 1);
    mbar_expect_tx(full, SLAB);
    tma_load_4d(ring_slab(base, c, s), map, col, key0, 0, r.b, full);
    ++n;
  };
  if (STATS)
    for (int t = c; t < r.tiles; t += NWG) load(&p.ki, 0, t * BN), load(&p.ki, 64, t * BN);
  if (TLSE)
    for (int t = c; t < r.tiles; t += NWG)
      for (int s = 0; s < p.dch; ++s) load(&p.k, 64 * s, t * BN);
  for (int t = c; t < r.tiles; t += NWG) {
    for (int s = 0; s < p.dch; ++s) load(&p.k, 64 * s, t * BN);
    load(&p.ki, 0, t * BN), load(&p.ki, 64, t * BN);
  }
}

// z^T (64 keys x 64 indexer heads) = KI QI^T over the 128 (padded) indexer columns, both K-major.
KL_DEV void gemm_z(float* z, unsigned ki0, unsigned ki1, unsigned qi) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const unsigned long long a = smem_desc((kk < 4 ? ki0 : ki1) + (kk % 4) * 32);
    const unsigned long long b = smem_desc(qi + (kk / 4) * SLAB + (kk % 4) * 32);
    if (kk == 0) wgmma_m64n64k16<false>(z, a, b); else wgmma_m64n64k16<true>(z, a, b);
  }
}

// I_j = sum_g w_g relu(z_jg) of the thread's two keys (rows 16 warp + lane / 4 (+ 8)), summed over
// the quad that holds a row's 64 columns (each of its four threads ends with the row's sum).
KL_DEV void index_scores(const float* z, const float* W, int lane, float* I) {
  I[0] = I[1] = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 wg = *reinterpret_cast<const float2*>(W + 8 * j + 2 * (lane % 4));
#pragma unroll
    for (int i = 0; i < 2; ++i) I[i] += wg.x * fmaxf(z[KL_IDX(j, i, 0)], 0.f) + wg.y * fmaxf(z[KL_IDX(j, i, 1)], 0.f);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    I[i] += __shfl_xor_sync(0xffffffffu, I[i], 1);
    I[i] += __shfl_xor_sync(0xffffffffu, I[i], 2);
  }
}

// (m, l) <- the log2-domain log-sum-exp state of both (m = -inf: empty, l = 0).
KL_DEV void lse_merge(float& m, float& l, float m2, float l2) {
  const float mx = fmaxf(m, m2);
  if (mx == -KL_INF) return;
  l = l * ex2(m - mx) + l2 * ex2(m2 - mx);
  m = mx;
}

// dz = dI w [z > 0] of the thread's accumulator elements as wgmma A fragments (rows: keys), and
// (dw) dI relu(z) added to its per-column sums.
template <bool DW>
KL_DEV void score_grads(const float* z, const float* W, int lane, const float* dI, unsigned* fr, float* dwp) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 wg = *reinterpret_cast<const float2*>(W + 8 * j + 2 * (lane % 4));
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float z0 = z[KL_IDX(j, i, 0)], z1 = z[KL_IDX(j, i, 1)];
      if (DW) {
        dwp[2 * j] += dI[i] * fmaxf(z0, 0.f);
        dwp[2 * j + 1] += dI[i] * fmaxf(z1, 0.f);
      }
      fr[4 * (j / 2) + 2 * (j % 2) + i] = pack2(z0 > 0.f ? dI[i] * wg.x : 0.f, z1 > 0.f ? dI[i] * wg.y : 0.f);
    }
  }
}

KL_DEV void consume(const IndexerParams& p, const Row& r, int c, int tid, unsigned base) {
  const Bars bars = bars_at(base);
  const int warp = tid / 32, lane = tid % 32, u = c * 128 + tid;
  float* L = smem_f32(base + OFF_L);
  float* W = smem_f32(base + OFF_W);
  float* red = smem_f32(base + OFF_RED);
  if (u < NH) {
    float v = KL_INF;  // padding heads and heads that saw no key add nothing to p (TLSE: set below)
    if (u < p.h && !TLSE) {
      const float x = p.lse[((long long)r.b * p.h + u) * p.nq + r.row];
      if (x > -KL_INF) v = x * KL_LOG2E;
    }
    L[u] = v;
  } else if (u < NH + GP) {
    const int g = u - NH;
    W[g] = g < p.g ? load_any(p.w, r.b * p.swb + g * p.swg + r.row * p.swn, p.w_dtype) : 0.f;
  }
  bar_sync(1, 128 * NWG);
  auto release = [&](int n) {
    if (tid == 0) mbar_arrive(bars.empty + 8 * (c * STAGES + n % STAGES));
  };
  auto wait_full = [&](int n) { mbar_wait(bars.full + 8 * (c * STAGES + n % STAGES), (n / STAGES) & 1); };
  auto slot_of = [&](int t, int i) { return key_slot(p, r, t * BN + 16 * warp + lane / 4 + 8 * i); };
  int n = 0;
  mbar_wait(bars.qi_full, 0);
  float lse2;  // natural log
  if (STATS) {
    float m = -KL_INF, l = 0.f;
    for (int t = c; t < r.tiles; t += NWG) {
      float z[32];
      wait_full(n), wait_full(n + 1);
      wgmma_fence();
      gemm_z(z, ring_slab(base, c, n % STAGES), ring_slab(base, c, (n + 1) % STAGES), base + OFF_QI);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs<32>(z);
      release(n), release(n + 1);
      n += 2;
      float I[2];
      index_scores(z, W, lane, I);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        if (slot_of(t, i).y) lse_merge(m, l, I[i] * KL_LOG2E, 1.f);
    }
    if (lane % 4) m = -KL_INF, l = 0.f;  // a quad's four threads hold the same rows
#pragma unroll
    for (int x = 4; x < 32; x *= 2) lse_merge(m, l, __shfl_xor_sync(0xffffffffu, m, x), __shfl_xor_sync(0xffffffffu, l, x));
    if (lane == 0) red[2 * (c * 4 + warp)] = m, red[2 * (c * 4 + warp) + 1] = l;
    bar_sync(1, 128 * NWG);
    float mm = -KL_INF, ll = 0.f;
#pragma unroll
    for (int x = 0; x < 4 * NWG; ++x) lse_merge(mm, ll, red[2 * x], red[2 * x + 1]);
    lse2 = mm == -KL_INF ? -KL_INF : (mm + __log2f(ll)) * KL_LN2;
    if (u == 0) p.lse2[r.at] = lse2;
  } else {
    lse2 = p.lse2[r.at];
  }
  const float lse2_2 = lse2 * KL_LOG2E;
  // Row coefficients scaled so the larger is 1 (dz is rounded to 16 bits), the scale applied in float32.
  const float s_w = fmaxf(fabsf(r.a), fabsf(r.bc)), s_k = fmaxf(fabsf(r.da), fabsf(r.db));
  const float a1 = s_w > 0.f ? r.a / s_w : 0.f, b1 = s_w > 0.f ? r.bc / s_w : 0.f;
  const float a2 = s_k > 0.f ? r.da / s_k : 0.f, b2 = s_k > 0.f ? r.db / s_k : 0.f;
  const float s_dki = REDO ? s_k : s_w;  // dki's dz: the difference's (REDO), else dqi's
  const bool need_dqi = GRADS && p.need_dqi, need_dki = GRADS && p.need_dki, need_dw = GRADS && p.need_dw;
  const unsigned dz_slab = base + OFF_DZ + c * SLAB;
  float dqi[64], dwp[16];
#pragma unroll
  for (int x = 0; x < 64; ++x) dqi[x] = 0.f;
#pragma unroll
  for (int x = 0; x < 16; ++x) dwp[x] = 0.f;
  float mass = 0.f, ratio = 0.f;
  // S^T = K Q^T of the next key tile: the first 64 columns overwrite the accumulators, then the
  // other D/64 - 1 slabs; each slab is released once the GEMM after it completes.
  auto teacher_gemm = [&](float* s) {
    wait_full(n);
    wgmma_fence();
    {
      const unsigned long long da = smem_desc(ring_slab(base, c, n % STAGES)), db = smem_desc(base + OFF_Q);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        if (kk == 0) wgmma_m64n128k16<false>(s, da, db);
        else wgmma_m64n128k16<true>(s, smem_desc_add(da, 32 * kk), smem_desc_add(db, 32 * kk));
      }
      wgmma_commit();
      ++n;
    }
    for (int ch = 1; ch < p.dch; ++ch) {
      wait_full(n);
      const unsigned long long da = smem_desc(ring_slab(base, c, n % STAGES));
      const unsigned long long db = smem_desc(base + OFF_Q + ch * Q_SLAB);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16<true>(s, smem_desc_add(da, 32 * kk), smem_desc_add(db, 32 * kk));
      wgmma_commit();
      wgmma_wait<1>();
      release(n - 1);
      ++n;
    }
    wgmma_wait<0>();
    fence_regs<64>(s);
    release(n - 1);  // the last K slab
  };
  mbar_wait(bars.q_full, 0);
  if (TLSE) {  // the teacher's per-head LSE over the row's admitted keys: column sums of S^T
    float tm[32], tl[32];  // log2-domain state of the thread's 32 columns, over its rows
#pragma unroll
    for (int x = 0; x < 32; ++x) tm[x] = -KL_INF, tl[x] = 0.f;
    for (int t = c; t < r.tiles; t += NWG) {
      float s[64];
      teacher_gemm(s);
      const bool ok0 = slot_of(t, 0).y, ok1 = slot_of(t, 1).y;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float v0 = ok0 ? s[KL_IDX(j, 0, k)] * p.c_log2 : -KL_INF;
          const float v1 = ok1 ? s[KL_IDX(j, 1, k)] * p.c_log2 : -KL_INF;
          const float mx = fmaxf(tm[2 * j + k], fmaxf(v0, v1));
          if (mx > -KL_INF) tl[2 * j + k] = tl[2 * j + k] * ex2(tm[2 * j + k] - mx) + ex2(v0 - mx) + ex2(v1 - mx), tm[2 * j + k] = mx;
        }
      }
    }
    float2* part = reinterpret_cast<float2*>(smem_f32(base + OFF_DZ));  // [8 warps][NH]: the dz slabs, idle
#pragma unroll
    for (int x = 0; x < 32; ++x) {
#pragma unroll
      for (int o = 4; o < 32; o *= 2)
        lse_merge(tm[x], tl[x], __shfl_xor_sync(0xffffffffu, tm[x], o), __shfl_xor_sync(0xffffffffu, tl[x], o));
    }
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int k = 0; k < 2; ++k) part[(c * 4 + warp) * NH + 8 * j + 2 * lane + k] = make_float2(tm[2 * j + k], tl[2 * j + k]);
    }
    bar_sync(1, 128 * NWG);
    if (u < NH) {
      float m = -KL_INF, l = 0.f;
      for (int x = 0; x < 4 * NWG; ++x) lse_merge(m, l, part[x * NH + u].x, part[x * NH + u].y);
      const float lse_h = m == -KL_INF ? -KL_INF : m + __log2f(l);  // log2 units
      L[u] = u < p.h && lse_h > -KL_INF ? lse_h : KL_INF;
      if (u < p.h) p.lse[((long long)r.b * p.h + u) * p.nq + r.row] = lse_h * KL_LN2;
    }
    bar_sync(1, 128 * NWG);  // L is whole, and the dz slabs are free again
  }
  for (int t = c; t < r.tiles; t += NWG) {
    float s[64], z[32];
    teacher_gemm(s);
    // The mixture first, so S is dead before z's accumulators are live (the consumer's 240 registers
    // hold dqi, S and the dw sums, or dqi, z, dz and dki).
    float pj[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 lh = *reinterpret_cast<const float2*>(L + 8 * j + 2 * (lane % 4));
#pragma unroll
      for (int i = 0; i < 2; ++i)
        pj[i] += ex2(fmaf(p.c_log2, s[KL_IDX(j, i, 0)], -lh.x)) + ex2(fmaf(p.c_log2, s[KL_IDX(j, i, 1)], -lh.y));
    }
    const int n_ki = n;
    n += 2;
    wait_full(n_ki), wait_full(n_ki + 1);
    const unsigned ki0 = ring_slab(base, c, n_ki % STAGES), ki1 = ring_slab(base, c, (n_ki + 1) % STAGES);
    wgmma_fence();
    gemm_z(z, ki0, ki1, base + OFF_QI);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<32>(z);
    float I[2], qj[2];
    const int2 slots[2] = {slot_of(t, 0), slot_of(t, 1)};
    index_scores(z, W, lane, I);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      pj[i] += __shfl_xor_sync(0xffffffffu, pj[i], 1);
      pj[i] += __shfl_xor_sync(0xffffffffu, pj[i], 2);
      const bool ok = slots[i].y;
      pj[i] = ok ? pj[i] * p.inv_h : 0.f;
      qj[i] = ok ? ex2(I[i] * KL_LOG2E - lse2_2) : 0.f;
      if (WRITE_KL && lane % 4 == 0) {
        mass += pj[i];
        if (pj[i] > 0.f) ratio += pj[i] * (__logf(pj[i]) - (I[i] - lse2));
      }
    }
    if (GRADS) {
      float dI[2] = {a1 * qj[0] - b1 * pj[0], a1 * qj[1] - b1 * pj[1]};
      unsigned fr[16];
      if (need_dw) score_grads<true>(z, W, lane, dI, fr, dwp); else score_grads<false>(z, W, lane, dI, fr, dwp);
      if (need_dqi) {  // dz^T as dqi's A operand: dz's rows (keys) are its K rows, 128 bytes each
#pragma unroll
        for (int j = 0; j < 8; ++j) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int kr = 16 * warp + lane / 4 + 8 * i;
            sts32(dz_slab + kr * 128 + (((j ^ (kr & 7)) << 4) | (4 * (lane % 4))), fr[4 * (j / 2) + 2 * (j % 2) + i]);
          }
        }
        fence_proxy_async();
        bar_sync(2 + c, 128);
        wgmma_fence();
#pragma unroll
        for (int ns = 0; ns < 2; ++ns) {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_m64n64k16_ta_tb(dqi + 32 * ns, smem_desc_mn(dz_slab + kk * 2048, SLAB),
                                  smem_desc_mn((ns ? ki1 : ki0) + kk * 2048, SLAB));
        }
        wgmma_commit();
      }
      if (need_dki) {
        if (REDO) {  // dki takes the difference's dz
          float dId[2] = {a2 * qj[0] - b2 * pj[0], a2 * qj[1] - b2 * pj[1]};
          score_grads<false>(z, W, lane, dId, fr, dwp);
        }
#pragma unroll
        for (int ns = 0; ns < 2; ++ns) {
          float dk[32];
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) {
            const unsigned long long b_ = smem_desc_mn(base + OFF_QI + ns * SLAB + kk * 2048, SLAB);
            if (kk == 0) wgmma_m64n64k16_rs_tb<false>(dk, fr + 4 * kk, b_); else wgmma_m64n64k16_rs_tb<true>(dk, fr + 4 * kk, b_);
          }
          wgmma_commit();
          wgmma_wait<0>();
          fence_regs<32>(dk);
          if (ns == 0) release(n_ki), release(n_ki + 1);  // dqi's GEMM, the last reader of KI, is done
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            if (!slots[i].y) continue;  // not admitted: dz = 0
            float* row = p.dki + ((long long)r.b * p.nk + slots[i].x) * p.di;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const int col = 64 * ns + 8 * j + 2 * (lane % 4);
              if (col < p.di) red_add2(row + col, dk[KL_IDX(j, i, 0)] * s_dki, dk[KL_IDX(j, i, 1)] * s_dki);
            }
          }
        }
      } else {
        wgmma_wait<0>();
        release(n_ki), release(n_ki + 1);
      }
      fence_regs<64>(dqi);
    } else {
      release(n_ki), release(n_ki + 1);
    }
  }
  // The row's sums: every consumer's into consumer 0 (the rings are idle once both pass the barrier).
  if (WRITE_KL) {
#pragma unroll
    for (int x = 1; x < 32; x *= 2) {
      mass += __shfl_xor_sync(0xffffffffu, mass, x);
      ratio += __shfl_xor_sync(0xffffffffu, ratio, x);
    }
    if (lane == 0) red[16 + 2 * (c * 4 + warp)] = mass, red[17 + 2 * (c * 4 + warp)] = ratio;
  }
  float* scratch = smem_f32(base + OFF_RING);  // [128 threads][64]: consumer 1's dqi
  float* dw_part = scratch + 128 * 64;  // [NWG * 4 warps][64]
  bar_sync(1, 128 * NWG);
  if (GRADS) {
    if (need_dw) {
#pragma unroll
      for (int x = 0; x < 16; ++x) {
        dwp[x] += __shfl_xor_sync(0xffffffffu, dwp[x], 4);
        dwp[x] += __shfl_xor_sync(0xffffffffu, dwp[x], 8);
        dwp[x] += __shfl_xor_sync(0xffffffffu, dwp[x], 16);
      }
      if (lane < 4) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
          dw_part[(c * 4 + warp) * 64 + 8 * j + 2 * lane] = dwp[2 * j], dw_part[(c * 4 + warp) * 64 + 8 * j + 2 * lane + 1] = dwp[2 * j + 1];
      }
    }
    if (need_dqi && c == 1) {
#pragma unroll
      for (int x = 0; x < 64; x += 4)
        *reinterpret_cast<float4*>(scratch + tid * 64 + x) = make_float4(dqi[x], dqi[x + 1], dqi[x + 2], dqi[x + 3]);
    }
    bar_sync(1, 128 * NWG);
  }
  if (c != 0) return;
  if (WRITE_KL && tid == 0) {
    float tm = 0.f, tr = 0.f;
    for (int x = 0; x < 4 * NWG; ++x) tm += red[16 + 2 * x], tr += red[17 + 2 * x];
    p.kl[r.at] = tm > 0.f ? tr / tm - __logf(tm) : 0.f;
    p.mass[r.at] = tm;
  }
  if (need_dw && tid < GP && tid < p.g) {
    float v = 0.f;
    for (int x = 0; x < 4 * NWG; ++x) v += dw_part[x * 64 + tid];
    store_any(p.dw, ((long long)r.b * p.g + tid) * p.nq + r.row, p.dw_dtype, v * s_w);
  }
  if (need_dqi) {
#pragma unroll
    for (int x = 0; x < 64; x += 4) {
      const float4 o = *reinterpret_cast<const float4*>(scratch + tid * 64 + x);
      dqi[x] += o.x, dqi[x + 1] += o.y, dqi[x + 2] += o.z, dqi[x + 3] += o.w;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int g = 16 * warp + lane / 4 + 8 * i;
      if (g >= p.g) continue;
      const long long at = (((long long)r.b * p.g + g) * p.nq + r.row) * p.di;
#pragma unroll
      for (int ns = 0; ns < 2; ++ns) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int col = 64 * ns + 8 * j + 2 * (lane % 4);
          if (col >= p.di) continue;
          const float v0 = dqi[32 * ns + KL_IDX(j, i, 0)] * s_w, v1 = dqi[32 * ns + KL_IDX(j, i, 1)] * s_w;
          if (p.dqi_f32)
            *reinterpret_cast<float2*>(static_cast<float*>(p.dqi) + at + col) = make_float2(v0, v1);
          else
            reinterpret_cast<unsigned*>(static_cast<unsigned short*>(p.dqi) + at)[col / 2] = pack2(v0, v1);
        }
      }
    }
  }
}

// A row that walks no key: its defaults (lse2 = -inf, kl = mass = 0, zero dqi and dw), by the
// consumers' 256 threads.
KL_DEV void write_idle(const IndexerParams& p, const Row& r, int u) {
  if (u == 0) {
    if (STATS) p.lse2[r.at] = -KL_INF;
    if (WRITE_KL) p.kl[r.at] = 0.f, p.mass[r.at] = 0.f;
  }
  if (TLSE && u < p.h) p.lse[((long long)r.b * p.h + u) * p.nq + r.row] = -KL_INF;
  if (!GRADS) return;
  if (p.need_dw && u < p.g) store_any(p.dw, ((long long)r.b * p.g + u) * p.nq + r.row, p.dw_dtype, 0.f);
  if (p.need_dqi) {
    for (int x = u; x < p.g * p.di; x += 128 * NWG) {
      const long long at = (((long long)r.b * p.g + x / p.di) * p.nq + r.row) * p.di + x % p.di;
      store_any(p.dqi, at, p.dqi_f32 ? 0 : (KL_FP16 ? 2 : 1), 0.f);
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) indexer_kl(const __grid_constant__ IndexerParams p) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const Bars bars = bars_at(base);
  const Row r = row_of(p);
  const int tid = threadIdx.x;
  unsigned dyn_smem;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_smem));
  if (dyn_smem < SMEM_FIXED + p.dch * Q_SLAB) __trap();  // the host's copy of the layout disagrees
  if (r.skip) return;
  if (!r.work) {
    if (tid >= 128) write_idle(p, r, tid - 128);
    return;
  }
  if (tid == 0) {
    mbar_init(bars.qi_full, 1);
    mbar_init(bars.q_full, 1);
    for (int s = 0; s < NWG * STAGES; ++s) {
      mbar_init(bars.full + 8 * s, SPARSE ? 64 : 1);  // SPARSE: the 64 gathering threads
      mbar_init(bars.empty + 8 * s, 1);  // the consumer's thread 0, once the GEMMs reading it are done
    }
    mbar_init_fence();
    tma_prefetch(&p.q);
    tma_prefetch(&p.k);
    tma_prefetch(&p.qi);
    tma_prefetch(&p.ki);
  }
  __syncthreads();
  if (tid < 128) {
    regs_dec<REG_PROD>();
    produce(p, r, tid / 32, tid % 32, base);
    return;
  }
  regs_inc<REG_CONS>();
  consume(p, r, __shfl_sync(0xffffffffu, tid / 128, 0) - 1, tid % 128, base);
}
