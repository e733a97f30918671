// kl_fwd.cu: the fused forward, KL(softmax(s1 Q1 K1^T) || softmax(s2 Q2 K2^T)) per query row.
//
// Grid: (cdiv(Nq, BM) * H, 1, B * splits), BM = 64 * NWG query rows per CTA; x walks the heads
// in groups of hgroup, and inside a group the row tiles from the last to the first with the
// group's heads fastest, so under causal masking the longest CTAs of hgroup heads start first
// (hgroup = 1: one head's row tiles after another's, the order that shares keys in L2 best). Packed
// sequences (cu != null): B is the number of sequences, Nq of the grid the longest one; a CTA
// works inside sequence b (Span) and one whose row tile lies past that sequence's end exits
// before any load. Rows of its last tile past the end read the next sequence's queries and are
// never written; keys past the end are masked like the ragged last tile of a dense row. Split-K
// (splits > 1, when the row tiles alone would leave SMs idle: decode, few query rows): split s of
// z = b * splits + s runs its share of the row tile's key tiles and writes the rows' merged
// states to part; kl_combine (at the end of this file) merges them. TAIL (below): a 1-D grid over
// every batch's row tiles, the last partial wave's split.
// Block: 128 * (NWG + 1) threads, one CTA per SM (__launch_bounds__(.., 1)). Warpgroup 0 is the
//   producer (setmaxnreg.dec; one thread issues every TMA: q1, q2 of the CTA once, then the k1, k2
//   tiles of each key tile into a STAGES-deep ring); warpgroups 1..NWG are consumers
//   (setmaxnreg.inc).
// Consumer warpgroup c owns query rows [m0 + 64c, m0 + 64c + 64) and, per key tile of BN keys,
//   computes S1 = Q1 K1^T and S2 = Q2 K2^T (64 x BN fp32 each, wgmma m64nBNk16, K from shared
//   memory, Q from shared memory or, QREGS, from registers it loaded once) as two commit groups,
//   runs the online update of S1 while the S2 GEMM is in flight, then releases the stage (one
//   thread arrives on its "empty" barrier) and runs the update of S2. A consumer issues tile i's
//   S1 GEMM, runs tile i - 1's S2 update under it, issues tile i's S2 GEMM and runs tile i's S1
//   update under that, so its own exponentials run under its own GEMMs; no wgmma is in flight
//   across the loop's back edge.
// Online update (log2 units, t = S * log2(e) * scale; see docs/math.md): every thread keeps, for
//   each of its two rows and over its own quarter of the columns, m1, l1, m2, l2 and the sums
//   aa = sum e1 * S1raw, ab = sum e1 * t2; the four threads of a row merge these once, after the
//   last tile (no shuffle per tile). acc = c1 * aa - ab = sum e1 * (t1 - t2). S2 enters the update
//   as x2 = t2 - ref(m2) (scores2: one FFMA per element, which the exponential needs anyway), in
//   registers no wgmma writes, so the next tile's S1 GEMM can run under the S2 update.
// Lagged running max: a thread's m1 / m2 are references, not maxima: l = sum 2^(t - m) over the
//   thread's columns so far (aa, ab alike), and finish() merges any references exactly
//   (w = 2^(m - M)), so lse = M + log2 L and the KL do not depend on which m a thread holds, only
//   rounding does. From the second tile on, a row's exponentials use the m it had before the
//   tile, so they need not wait for the tile's max, and no max is computed: the tile's own sum of
//   e is the test. sum <= LAG_SUM = 2^16: as e >= 0, every e <= 2^16; the tile's sums add on and
//   m stays. Otherwise (a larger e, +inf, NaN): the row's tile is redone exactly (m = max(m, tile
//   max) first, row1 / row2), for both of the thread's rows, from s1 (raw) and x2, which stay
//   until the decision (e1 is written to its own registers). Why that is exact for every input:
//   - Overflow: the invariant "every t seen so far is <= m + 16" holds after either side (the
//     exact side only raises m), so e <= 2^16, l <= 2^16 Nk / 4 and aa, ab <= that times max |S|:
//     finite while Nk max |S| < 2^112. A jump of any size inside a tile (|S| ~ 1e4, a one-hot row
//     whose hot key comes late) takes the exact side before any sum is kept; the fast side's
//     exponentials and sums (+inf or NaN there) are discarded.
//   - Underflow: m is a value some t reached, so m <= the running max: an e flushes to zero
//     (t - m < -126) only where it would in an exact update too.
//   - Empty and masked: invalid keys give e = 0, as in the exact update; a thread that sees no key
//     in a tile sums 0 (fast side, sums + 0), one that sees none at all keeps m = -inf, l = 0
//     (kl = 0, lse = -inf); m1 = -inf with a visible key gives e1 = +inf, m2 = -inf with one is
//     tested (x2 is relative to 0 there): both take the exact side. So does the first tile.
//   - Negative scales: the fast side uses t = c S itself, so it needs no min/max swap; the exact
//     side keeps row_max's.
// Tiles: Q of a consumer 64 x D (D padded to DP = 64 or 128 by TMA's zero fill), K tiles BN x D,
//   all stored as 1024-byte-aligned slabs of 64 columns, 128-byte swizzled (the wgmma K-major
//   SW128 layout). Keys past Nk and rows past Nq arrive as zeros; masked tiles (the ragged last
//   key tile and the causal frontier) exclude their invalid keys explicitly.
// Barriers: q_full (count 1, tx = Q bytes), full[s] (count 1, tx = K1 + K2 tile bytes),
//   empty[s] (count NWG: one arrival per consumer warpgroup; DECODE: its one reader arrives NWG
//   times at once).
// Reads q1, k1, q2, k2 through 4-D tensor maps {D, N, heads, B} built from the tensors' strides
//   (query head h reads key head h / g); writes kl, lse1, lse2 ([B, H, Nq] float32) of its rows,
//   kl = 0 and lse = -inf on rows that see no key (splits > 1: part, [splits, rows, 6], rows
//   B * H * Nq or, TAIL, the split row tiles' rows).
// A consumer whose 64 rows all lie past Nq (without DECODE: in the last row tile of an input or
//   packed sequence whose rows end within its first 128) runs no GEMM and no update, keeping only
//   its barrier duties.
#include "sm90.cuh"

constexpr int NWG = 3;  // consumer warpgroups
constexpr int BN = 64;  // keys per tile
// ISSUE_SPLIT (shipped where both head dims are 64): each GEMM's k-steps are issued
// in two halves, the first row of the update that runs under it between them, so a warp held by a
// full tensor queue has less MUFU work waiting behind its wgmma.
// DECODE (the launch's choice for dense inputs of at most 64 query rows, one row tile): every
// consumer takes the tile's first 64 rows and every NWG-th key tile of the CTA's share (consumer
// c: tiles c, c + NWG, ...), releasing each stage alone, and writes its rows' state as part
// split * NWG + c for kl_combine (p.splits counts the parts). Otherwise one consumer would run
// every key tile's math while the ring waits on it. STAGES is a multiple of NWG, so stage s is
// only ever read by consumer s % NWG: a parity wait cannot tell phase k from phase k - 2, and a
// consumer that had not itself waited out the stage's previous load could pass on the phase
// before it (the previous load still in flight) and read a tile that is not there yet.
// TAIL: with p.tail_splits > 0 (dense unmasked grids over one wave whose last wave is partial),
// the grid is one-dimensional over the B * H * m_tiles row tiles of every batch, and the row tiles
// from p.tail0 on, the last partial wave, run split p.tail_splits ways (parts for kl_combine),
// so that wave's SMs all work for a shorter time instead of few for a whole CTA's.
// QREGS: bit 1 keeps Q1, bit 2 Q2 of the consumer's rows in registers (wgmma's A fragments), read
// once from shared memory, so their GEMM reads only K per key tile (fewer shared-memory bytes and
// no A descriptors to issue).
#if !defined(KL_FP16) || !defined(D1P) || !defined(D2P) || !defined(STAGES) || !defined(DECODE) || \
    !defined(QREGS) || !defined(ISSUE_SPLIT)
#error "the launcher (_launch.py) defines every instantiation constant"
#endif
static_assert(!DECODE || STAGES % NWG == 0, "DECODE: each stage read by one consumer");
static_assert(D1P == 64 || D1P == 128, "D1P: 64 or 128");
static_assert(D2P == 64 || D2P == 128, "D2P: 64 or 128");

constexpr int BM = 64 * NWG;
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

#define KL_INF __int_as_float(0x7f800000)
#define KL_LN2 0.6931471805599453f

struct Params {
  TensorMap q1, k1, q2, k2;  // {D, N, heads, B}; q boxes {64, 64, 1, 1}, k boxes {64, BN, 1, 1}
  float* kl;
  float* lse1;
  float* lse2;
  float* part;  // splits > 1: [splits][rows][PART] partial row states, for kl_combine
  const int* cu;  // packed sequences: B + 1 offsets into the one packed batch (else null)
  int h, nq, nk, g1, g2, m_tiles, causal, splits, rows;  // rows: part's, B * H * Nq or (TAIL) fewer
  int hgroup;  // heads per group of the grid's order (the header)
  float c1, c2;  // scale * log2(e)
  int tail0, tail_splits;  // TAIL: the first split row tile, its splits (rows: the split tiles' rows)
};

static_assert(sizeof(Params) == 640, "PARAMS_BYTES in _launch.py packs this layout");

// A row's state after its four threads merge: M1, L1, M2, L2, AA, AB (log2 units).
constexpr int PART = 6;

// The problem one CTA's rows belong to: queries [row0, row0 + nq) and keys [row0, row0 + nk) of
// batch bq of the tensor maps, its row r written at out0 + r. Dense: batch b. Packed sequences:
// sequence b of the one packed batch (nq = nk = its length).
struct Span {
  int nq, nk, row0, bq;
  long long out0;
};

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

// The thread's A fragments of a consumer's 64 x DP Q tile (at q, 128-byte-swizzled 64-column
// slabs): per k-step kk, rows 16 w + lane / 4 (+ 8) and columns 16 kk + 2 (lane % 4) (+ 8).
template <int DP>
KL_DEV void load_qfrag(unsigned* a, unsigned q, int warp, int lane) {
  const int g = lane / 4, r = 16 * warp + g;
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // columns 16 kk + 8 h + 2 (lane % 4): chunk 2 (kk % 4) + h of the row
      const unsigned off = (kk / 4) * SLAB + ((((2 * (kk % 4) + h) ^ g) << 4) | (4 * (lane % 4)));
      a[4 * kk + 2 * h] = lds32(q + off + r * 128);
      a[4 * kk + 2 * h + 1] = lds32(q + off + (r + 8) * 128);
    }
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

// Element (j, i, k) of a thread's accumulator: row 8 i of its two, column 8 j + 2 (lane % 4) + k.
#define KL_IDX(j, i, k) ((j) * 4 + (i) * 2 + (k))

// c * the max over the row's visible elements of c * s (the max of s when c >= 0, its min
// otherwise); -inf when none is visible. lim: visible iff 8 j + k < lim.
template <bool MASK>
KL_DEV float row_max(const float* s, int i, float c, int lim) {
  float e0, e1, e2, e3;
  if (c >= 0.f) {
    e0 = e1 = e2 = e3 = -KL_INF;
#pragma unroll
    for (int j = 0; j < BN / 8; j += 2) {
      float a = s[KL_IDX(j, i, 0)], b = s[KL_IDX(j, i, 1)];
      float x = s[KL_IDX(j + 1, i, 0)], y = s[KL_IDX(j + 1, i, 1)];
      if (MASK) {
        a = 8 * j < lim ? a : -KL_INF;
        b = 8 * j + 1 < lim ? b : -KL_INF;
        x = 8 * j + 8 < lim ? x : -KL_INF;
        y = 8 * j + 9 < lim ? y : -KL_INF;
      }
      e0 = fmaxf(e0, a), e1 = fmaxf(e1, b), e2 = fmaxf(e2, x), e3 = fmaxf(e3, y);
    }
  } else {
    e0 = e1 = e2 = e3 = KL_INF;
#pragma unroll
    for (int j = 0; j < BN / 8; j += 2) {
      float a = s[KL_IDX(j, i, 0)], b = s[KL_IDX(j, i, 1)];
      float x = s[KL_IDX(j + 1, i, 0)], y = s[KL_IDX(j + 1, i, 1)];
      if (MASK) {
        a = 8 * j < lim ? a : KL_INF;
        b = 8 * j + 1 < lim ? b : KL_INF;
        x = 8 * j + 8 < lim ? x : KL_INF;
        y = 8 * j + 9 < lim ? y : KL_INF;
      }
      e0 = fminf(e0, a), e1 = fminf(e1, b), e2 = fminf(e2, x), e3 = fminf(e3, y);
    }
    e0 = -e0, e1 = -e1, e2 = -e2, e3 = -e3;
  }
  const float ext = fmaxf(fmaxf(e0, e1), fmaxf(e2, e3));  // max of sign(c) * s
  if (MASK && ext == -KL_INF) return -KL_INF;
  return fabsf(c) * ext;
}

// Zeroes a thread's exponentials of columns 8 j and 8 j + 1 on invalid keys (visible iff
// 8 j + k < lim) when MASK.
template <bool MASK>
KL_DEV void mask_pair(int j, int lim, float& ex, float& ey) {
  if (MASK) {
    ex = 8 * j < lim ? ex : 0.f;
    ey = 8 * j + 1 < lim ? ey : 0.f;
  }
}

// The exponentials 2^(c s - m) (nm = -m) of a thread's columns 8 j and 8 j + 1 of row i, zero on
// invalid keys (MASK: visible iff 8 j + k < lim).
template <bool MASK>
KL_DEV void exp_pair(const float* s, int i, int j, float c, float nm, int lim, float& ex, float& ey) {
  ex = ex2(fmaf(s[KL_IDX(j, i, 0)], c, nm)), ey = ex2(fmaf(s[KL_IDX(j, i, 1)], c, nm));
  mask_pair<MASK>(j, lim, ex, ey);
}

struct Row {
  float m1, l1, m2, l2, aa, ab;
  float lt;  // the current tile's sum of e1 over the thread's columns (for ab's reference term)
};

// m as an exponent reference: 0 while the row has seen nothing (m = -inf), so no -inf - -inf.
KL_DEV float ref(float m) { return m == -KL_INF ? 0.f : m; }

// Raises row i's m to the tile's max: returns the rescale alpha = 2^(m_old - m_new) and sets nm
// to -m_new (0 while the row has seen nothing).
template <bool MASK>
KL_DEV float raise_max(const float* s, float& m, float c, int lim, int i, float& nm) {
  const float mnew = fmaxf(m, row_max<MASK>(s, i, c, lim));
  const float alpha = ex2(m - ref(mnew));
  m = mnew;
  nm = -ref(mnew);
  return alpha;
}

// The exact S1 half of row i's update: m1, l1, aa (and ab's rescale), e1 = 2^(t1 - m1), lt.
template <bool MASK>
KL_DEV void row1(const float* s1, float* e1, Row& r, float c1, int lim, int i) {
  float nm;
  const float alpha = raise_max<MASK>(s1, r.m1, c1, lim, i, nm);
  float l0 = 0.f, l1 = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int x = KL_IDX(j, i, 0), y = KL_IDX(j, i, 1);
    float ex, ey;
    exp_pair<MASK>(s1, i, j, c1, nm, lim, ex, ey);
    l0 += ex, l1 += ey;
    a0 = fmaf(ex, s1[x], a0), a1 = fmaf(ey, s1[y], a1);
    e1[x] = ex, e1[y] = ey;
  }
  r.lt = l0 + l1;
  r.l1 = fmaf(r.l1, alpha, r.lt);
  r.aa = fmaf(r.aa, alpha, a0 + a1);
  r.ab *= alpha;
}

// The exact S2 half of row i's update from x2 = t2 - ref(m2) (scores2): m2, l2, ab.
template <bool MASK>
KL_DEV void row2(const float* e1, const float* x2, Row& r, int lim, int i) {
  const float xref = ref(r.m2);
  const float mnew = fmaxf(r.m2, xref + row_max<MASK>(x2, i, 1.f, lim));
  const float d = ref(mnew) - xref;  // e2 = 2^(x2 - d) = 2^(t2 - m2_new)
  const float alpha = ex2(r.m2 - ref(mnew));
  float l0 = 0.f, l1 = 0.f, a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    const int x = KL_IDX(j, i, 0), y = KL_IDX(j, i, 1);
    float ex, ey;
    exp_pair<MASK>(x2, i, j, 1.f, -d, lim, ex, ey);
    l0 += ex, l1 += ey;
    a0 = fmaf(e1[x], x2[x], a0), a1 = fmaf(e1[y], x2[y], a1);
  }
  r.m2 = mnew;
  r.l2 = fmaf(r.l2, alpha, l0 + l1);
  r.ab += fmaf(xref, r.lt, a0 + a1);  // sum e1 t2 = sum e1 x2 + ref(m2) sum e1
}

// The lagged running max (the header comment: what it does and why it is exact). Past the first
// tile, a thread's two rows run on the references m from before the tile (the fast side) and keep
// them when each row's own sum of e over the tile is at most LAG_SUM; otherwise row1 / row2 redo
// both rows' tile exactly.
constexpr float LAG_SUM = 65536.f;

// The S1 half of a tile's update: e1 = 2^(t1 - m1) into e1 (s1 keeps the raw scores for the
// exact side), l1, aa, lt.
// mid() runs once, after the first row's fast side (ISSUE_SPLIT: the rest of a GEMM's issue).
template <bool MASK, class Mid>
KL_DEV void update1(const float* s1, float* e1, Row* r, float c1, const int* lim, bool first, Mid&& mid) {
  bool exact = true;
  if (first) {
    mid();
  } else {
    float sums[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // per row: l1 and aa, twice for ILP
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float nm = -r[i].m1;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int x = KL_IDX(j, i, 0), y = KL_IDX(j, i, 1);
        float ex, ey;
        exp_pair<MASK>(s1, i, j, c1, nm, lim[i], ex, ey);
        sums[4 * i] += ex, sums[4 * i + 1] += ey;
        sums[4 * i + 2] = fmaf(ex, s1[x], sums[4 * i + 2]), sums[4 * i + 3] = fmaf(ey, s1[y], sums[4 * i + 3]);
        e1[x] = ex, e1[y] = ey;
      }
      if (i == 0) mid();
    }
    fence_regs<8>(sums);  // computed before the decision, not sunk into its fast side
    exact = !(sums[0] + sums[1] <= LAG_SUM && sums[4] + sums[5] <= LAG_SUM);  // NaN, +inf: exact
    if (!exact) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        r[i].lt = sums[4 * i] + sums[4 * i + 1];
        r[i].l1 += r[i].lt, r[i].aa += sums[4 * i + 2] + sums[4 * i + 3];
      }
    }
  }
  if (exact) {
#pragma unroll
    for (int i = 0; i < 2; ++i) row1<MASK>(s1, e1, r[i], c1, lim[i], i);
  }
}

// x2 = t2 - ref(m2) = c2 S2 - ref(m2): S2's exponent arguments against the references the S2
// update will start from, in registers no wgmma writes.
KL_DEV void scores2(const float* s2, float* x2, const Row* r, float c2) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float nm = -ref(r[i].m2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int k = 0; k < 2; ++k) x2[KL_IDX(j, i, k)] = fmaf(s2[KL_IDX(j, i, k)], c2, nm);
  }
}

// The S2 half of a tile's update from x2 and e1: l2, ab (sum e1 t2, relative to m1), m2.
template <bool MASK, class Mid>
KL_DEV void update2(const float* e1, const float* x2, Row* r, const int* lim, bool first, Mid&& mid) {
  bool exact = true;
  if (first) {
    mid();
  } else {
    float sums[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // per row: l2 and ab, twice for ILP
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int x = KL_IDX(j, i, 0), y = KL_IDX(j, i, 1);
        float ex, ey;
        ex = ex2(x2[x]), ey = ex2(x2[y]);
        mask_pair<MASK>(j, lim[i], ex, ey);
        sums[4 * i] += ex, sums[4 * i + 1] += ey;
        sums[4 * i + 2] = fmaf(e1[x], x2[x], sums[4 * i + 2]), sums[4 * i + 3] = fmaf(e1[y], x2[y], sums[4 * i + 3]);
      }
      if (i == 0) mid();
    }
    fence_regs<8>(sums);
    // x2 is relative to 0 while m2 = -inf: a row's first visible keys take the exact side.
    const float l0 = sums[0] + sums[1], l1 = sums[4] + sums[5];
    exact = !(l0 <= LAG_SUM && l1 <= LAG_SUM) || (r[0].m2 == -KL_INF && l0 > 0.f) ||
            (r[1].m2 == -KL_INF && l1 > 0.f);
    if (!exact) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        r[i].l2 += sums[4 * i] + sums[4 * i + 1];
        r[i].ab += fmaf(ref(r[i].m2), r[i].lt, sums[4 * i + 2] + sums[4 * i + 3]);
      }
    }
  }
  if (exact) {
#pragma unroll
    for (int i = 0; i < 2; ++i) row2<MASK>(e1, x2, r[i], lim[i], i);
  }
}

// update2 on a masked (ragged or causal-frontier) tile or an unmasked one.
template <class Mid>
KL_DEV void update2_tile(bool masked, const float* e1, const float* x2, Row* r, const int* lim, bool first,
                         Mid&& mid) {
  if (masked)
    update2<true>(e1, x2, r, lim, first, mid);
  else
    update2<false>(e1, x2, r, lim, first, mid);
}

KL_DEV float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
KL_DEV float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Writes row o's kl, lse1, lse2 from its merged state; a row that saw no key gets 0, -inf, -inf.
KL_DEV void write_row(const Params& p, long long o, float M1, float L1, float M2, float L2, float AA, float AB) {
  float kl = 0.f, lse1 = -KL_INF, lse2 = -KL_INF;
  if (L1 > 0.f) {
    const float g1 = log2f(L1), g2 = log2f(L2);
    kl = ((p.c1 * AA - AB) / L1 + (M2 - M1) + g2 - g1) * KL_LN2;
    lse1 = (M1 + g1) * KL_LN2;
    lse2 = (M2 + g2) * KL_LN2;
  }
  p.kl[o] = kl;
  p.lse1[o] = lse1;
  p.lse2[o] = lse2;
}

// Merges the four threads of each row (log-sum-exp of their partial states) and writes row r to
// out0 + r, or (to_part) its state as part `split` of part row part0 + r, for kl_combine.
KL_DEV void finish(const Params& p, const Row* r, const int* rows, int nq, int lane, long long out0, int split,
                   bool to_part, long long part0) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float M1 = quad_max(r[i].m1), M2 = quad_max(r[i].m2);
    const float M1u = M1 == -KL_INF ? 0.f : M1, M2u = M2 == -KL_INF ? 0.f : M2;
    const float w1 = ex2(r[i].m1 - M1u), w2 = ex2(r[i].m2 - M2u);
    const float L1 = quad_sum(r[i].l1 * w1), L2 = quad_sum(r[i].l2 * w2);
    const float AA = quad_sum(r[i].aa * w1), AB = quad_sum(r[i].ab * w1);
    if ((lane & 3) == 0 && rows[i] < nq) {
      if (to_part) {
        float* q = p.part + ((long long)split * p.rows + part0 + rows[i]) * PART;
        q[0] = M1, q[1] = L1, q[2] = M2, q[3] = L2, q[4] = AA, q[5] = AB;
      } else {
        write_row(p, out0 + rows[i], M1, L1, M2, L2, AA, AB);
      }
    }
  }
}

// The work of grid slot (x, z): its problem, first row, head, split and key tiles [t0, t0 + n).
struct Work {
  Span sp;
  int m0, h, h1, h2, split, t0, n;
  bool to_part;  // its rows' states go to part (split-K), not to the outputs
  long long part0;  // row r's part row: part0 + r
};

// Head and row tile of slot x of a batch's H * m_tiles (the grid's order, the header). Groups
// before this slot's are full (hgroup heads); the last may hold fewer.
KL_DEV void slot_of(const Params& p, unsigned x, int& h, int& mt) {
  const int group = x / (p.hgroup * p.m_tiles), g0 = group * p.hgroup;
  const int in_group = min(p.hgroup, p.h - g0), r = x - g0 * p.m_tiles;
  mt = p.m_tiles - 1 - r / in_group, h = g0 + r % in_group;
}

// False for a row tile past its packed sequence's end: no rows, no loads.
KL_DEV bool work_of(const Params& p, unsigned x, unsigned z, Work& w) {
  unsigned slot = x;
  int b, split, splits, tail_tile = 0;  // TAIL: the index of a split row tile among them
  if (p.tail_splits > 0) {  // x runs the row tiles of every batch, the tail's split
    int unit = x;
    split = 0, splits = 1;
    if (unit >= p.tail0) {
      const int t = unit - p.tail0;
      tail_tile = t / p.tail_splits, split = t % p.tail_splits, splits = p.tail_splits;
      unit = p.tail0 + tail_tile;
    }
    b = unit / (p.h * p.m_tiles), slot = unit % (p.h * p.m_tiles);
  } else {
    splits = DECODE ? p.splits / NWG : p.splits;  // the CTAs' splits of the key tiles
    b = z / splits, split = z % splits;
  }
  int h, mt;
  slot_of(p, slot, h, mt);
  const int m0 = mt * BM;
  Span sp{p.nq, p.nk, 0, b, ((long long)b * p.h + h) * p.nq};
  if (p.cu != nullptr) {
    const int s0 = p.cu[b], len = p.cu[b + 1] - s0;
    sp = Span{len, len, s0, 0, (long long)h * p.nq + s0};
  }
  if (m0 >= sp.nq) return false;
  const int hi = p.causal ? min(sp.nk, m0 + BM + sp.nk - sp.nq) : sp.nk;  // keys this slot sees
  const int n_tiles = hi > 0 ? (hi + BN - 1) / BN : 0;
  // Split-K: split s runs key tiles [t0, t0 + n) of the row tile's n_tiles.
  const int per = (n_tiles + splits - 1) / splits;
  const int t0 = min(n_tiles, split * per), n = min(n_tiles, t0 + per) - t0;
  const bool tail = p.tail_splits > 0;  // part rows: the split row tiles' rows, in order
  const long long part0 = tail ? (long long)tail_tile * BM - m0 : sp.out0;
  w = Work{sp, m0, h, h / p.g1, h / p.g2, split, t0, n, tail ? splits > 1 : p.splits > 1, part0};
  return true;
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
  const int diag = sp.nk - sp.nq;  // bottom-right causal: row i sees keys j <= i + diag
  int rows[2], lim[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    rows[i] = r0 + 16 * warp + lane / 4 + 8 * i;
    lim[i] = p.causal ? min(sp.nk, rows[i] + diag + 1) : sp.nk;
  }
  // Tiles [0, n_full) are visible to every row of the warpgroup; the rest are masked.
  const int full_end = p.causal ? min(sp.nk, r0 + diag + 1) : sp.nk;
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
  load_qfrag<D1P>(qa1, base + OFF_Q1 + qc * Q1_WG, warp, lane);
#endif
#if QREGS & 2
  unsigned qa2[D2P / 4];
  load_qfrag<D2P>(qa2, base + OFF_Q2 + qc * Q2_WG, warp, lane);
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


// kl_combine: the split-K epilogue. Grid cdiv(p.rows, 128), 128 threads, one part row each (TAIL:
// mapped back to its output row): merges the row's `splits` partial states (any references:
// w = 2^(M_s - M)) and writes kl, lse1, lse2 as kl_fwd does without splits. Reads part; writes
// kl, lse1, lse2.
extern "C" __global__ void __launch_bounds__(128) kl_combine(const __grid_constant__ Params p) {
  const long long o = (long long)blockIdx.x * 128 + threadIdx.x;  // the part row
  if (o >= p.rows) return;
  long long out = o;
  if (p.tail_splits > 0) {  // part row o: row o % BM of the split row tile o / BM
    const int unit = p.tail0 + (int)(o / BM), r = (int)(o % BM);
    int h, mt;
    slot_of(p, unit % (p.h * p.m_tiles), h, mt);
    if (mt * BM + r >= p.nq) return;  // past Nq: never written
    out = ((long long)(unit / (p.h * p.m_tiles)) * p.h + h) * p.nq + mt * BM + r;
  }
  float M1 = -KL_INF, M2 = -KL_INF;
  for (int s = 0; s < p.splits; ++s) {
    const float* q = p.part + ((long long)s * p.rows + o) * PART;
    M1 = fmaxf(M1, q[0]), M2 = fmaxf(M2, q[2]);
  }
  const float M1u = M1 == -KL_INF ? 0.f : M1, M2u = M2 == -KL_INF ? 0.f : M2;
  float L1 = 0.f, L2 = 0.f, AA = 0.f, AB = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float* q = p.part + ((long long)s * p.rows + o) * PART;
    const float w1 = ex2(q[0] - M1u), w2 = ex2(q[2] - M2u);
    L1 = fmaf(q[1], w1, L1), AA = fmaf(q[4], w1, AA), AB = fmaf(q[5], w1, AB), L2 = fmaf(q[3], w2, L2);
  }
  write_row(p, out, M1, L1, M2, L2, AA, AB);
}
