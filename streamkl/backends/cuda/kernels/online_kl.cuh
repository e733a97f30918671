// online_kl.cuh: the per-row state of the forward and its math. One consumer thread holds, for
// each of its two rows and over its own quarter of each key tile's columns, the running state of
// Row; the update folds in a tile of raw scores S1, S2; merge_quad joins a row's four threads;
// write_row turns a merged state into kl, lse1, lse2. kl_combine merges split-K parts with the
// same rule.
//
// The state (log2 units: t = c S with c = scale * log2(e), folded into one FFMA per element, so
// every exponential is one ex2.approx). Over the keys j a row has seen:
//   l1 = sum 2^(t1 - m1),  l2 = sum 2^(t2 - m2),  aa = sum e1 S1,  ab = sum e1 t2,  e1 = 2^(t1 - m1).
// m1, m2 are references (below); l1, aa, ab carry the factor 2^(-m1), l2 carries 2^(-m2), so
// moving a reference m -> m' multiplies them by alpha = 2^(m - m'). With P1 = e1 / l1 and
// LSE_t = m_t + log2 l_t (log2 units), KL = sum P1 (t1 - t2) - LSE1 + LSE2, and
// sum P1 (t1 - t2) = (c1 aa - ab) / l1 (aa sums the raw S1: c1 applied once, at the end), so
//   kl = ln 2 ((c1 aa - ab) / l1 + (m2 + log2 l2) - (m1 + log2 l1)),   lse_t = ln 2 (m_t + log2 l_t).
// S2 enters the update as x2 = t2 - ref(m2) (scores2: the one FFMA its exponential needs anyway),
// in registers no wgmma writes, so the next tile's S1 GEMM can run under the S2 update; ab gathers
// sum e1 x2 and adds ref(m2) sum e1 (lt) to keep sum e1 t2.
// Lagged running max: a thread's m1 / m2 are references, not maxima. merge_quad and kl_combine
//   merge any references exactly (w = 2^(m - M)), so lse and the KL do not depend on which m a
//   thread holds, only rounding does. From the second tile on, a row's exponentials use the m it
//   had before the tile, so they need not wait for the tile's max, and no max is computed: the
//   tile's own sum of e is the test. sum <= LAG_SUM = 2^16: as e >= 0, every e <= 2^16; the tile's
//   sums add on and m stays. Otherwise (a larger e, +inf, NaN): the row's tile is redone exactly
//   (m = max(m, tile max) first, row1 / row2), for both of the thread's rows, from s1 (raw) and
//   x2, which stay until the decision (e1 is written to its own registers). Why that is exact for
//   every input:
//   - Overflow: the invariant "every t seen so far is <= m + 16" holds after either side (the
//     exact side only raises m), so e <= 2^16, l <= 2^16 Nk / 4 and aa, ab <= that times max |S|:
//     finite while Nk max |S| < 2^112. A jump of any size inside a tile (|S| ~ 1e4, a one-hot row
//     whose hot key comes late) takes the exact side before any sum is kept; the fast side's
//     exponentials and sums (+inf or NaN there) are discarded.
//   - Underflow: m is a value some t reached, so m <= the running max: an e flushes to zero
//     (t - m < -126, ex2.approx.ftz) only where it would in an exact update too.
//   - Empty and masked: invalid keys give e = 0, as in the exact update; a thread that sees no key
//     in a tile sums 0 (fast side, sums + 0), one that sees none at all keeps m = -inf, l = 0
//     (kl = 0, lse = -inf); m1 = -inf with a visible key gives e1 = +inf, m2 = -inf with one is
//     tested (x2 is relative to 0 there): both take the exact side. So does the first tile.
//   - Negative scales: the fast side uses t = c S itself, so it needs no min/max swap; the exact
//     side keeps row_max's.
// The accumulator layout is wgmma m64nBNk16's: a thread holds 2 rows x BN / 4 columns (KL_IDX).
#pragma once
#include "params.cuh"

#define KL_INF __int_as_float(0x7f800000)
#define KL_LN2 0.6931471805599453f

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
  if (MASK && ext == -KL_INF) return -KL_INF;  // none visible: -inf even for c = 0 (0 * -inf is NaN)
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
// invalid keys (MASK: visible iff 8 j + k < lim). One FFMA applies the scale and the reference, so
// an element costs FFMA + MUFU.EX2; the masked e is zeroed after the exponential (a select), not by
// feeding -inf into it.
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
  const float alpha = ex2(m - ref(mnew));  // m = -inf (nothing seen yet): alpha = 0, never NaN
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

// A row's state over all its columns, every thread's reference merged into one (part holds it
// as PART floats: M1, L1, M2, L2, AA, AB).
struct State {
  float m1, l1, m2, l2, aa, ab;
};

// Merges the four threads of a row (each with its own references): M = the largest m, each
// thread's sums rescaled by w = 2^(m - ref(M)) (ref: no -inf - -inf where no thread saw a key).
KL_DEV State merge_quad(const Row& r) {
  const float M1 = quad_max(r.m1), M2 = quad_max(r.m2);
  const float w1 = ex2(r.m1 - ref(M1)), w2 = ex2(r.m2 - ref(M2));
  const float L1 = quad_sum(r.l1 * w1), L2 = quad_sum(r.l2 * w2);
  const float AA = quad_sum(r.aa * w1), AB = quad_sum(r.ab * w1);
  return State{M1, L1, M2, L2, AA, AB};
}

// Writes row o's kl, lse1, lse2 from its merged state (the header's formula, natural-log units);
// a row that saw no key (L1 = 0) gets 0, -inf, -inf.
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
