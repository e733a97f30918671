// schedule.cuh: which work a CTA of kl_fwd does, and where its rows' results go. Decodes the grid
// slot (x, z) into a problem (Span), a row tile of one head and a share of its key tiles (Work),
// and says where its rows' results go (the outputs, or part rows under split-K).
//
// Grid (default): (m_tiles * H, 1, B * splits), m_tiles = cdiv(Nq, BM). x walks the heads in groups
//   of hgroup and, inside a group, the row tiles from the last to the first with the group's heads
//   fastest, so under causal masking the longest CTAs of hgroup heads start first and the short
//   ones fill the last wave (hgroup = 1 without the mask: one head's row tiles after another's, the
//   order that shares keys in L2 best).
// Packed sequences (cu != null): B is the number of sequences and Nq of the grid the longest one;
//   a CTA works inside sequence b (Span: its rows and keys, the causal alignment inside it) and one
//   whose row tile lies past that sequence's end has no work (no barrier, no load). Rows of its
//   last tile past the end read the next sequence's queries and are never written; keys past the
//   end are masked like the ragged last tile of a dense row.
// Split-K (splits > 1, when the row tiles alone would leave SMs idle: decode, few query rows):
//   split s of z = b * splits + s runs its contiguous share of the row tile's key tiles and writes
//   its rows' merged states to part; kl_combine (combine.cuh) merges them. DECODE: the CTA's share
//   is divided among its consumers again (kl_fwd.cu), p.splits counting NWG parts per CTA split.
// TAIL (p.tail_splits > 0: dense unmasked grids of more than one wave whose last wave is partial):
//   the grid is one-dimensional over the B * H * m_tiles row tiles of every batch, and the row tiles
//   from p.tail0 on, the last partial wave, run split p.tail_splits ways (parts for kl_combine,
//   whose rows are the split row tiles' rows only), so that wave's SMs all work for a shorter time
//   instead of a few for a whole CTA's.
#pragma once
#include "mask.cuh"
#include "params.cuh"

// The problem one CTA's rows belong to: queries [row0, row0 + nq) and keys [row0, row0 + nk) of
// batch bq of the tensor maps, its row r written at out0 + r. Dense: batch b. Packed sequences:
// sequence b of the one packed batch (nq = nk = its length).
struct Span {
  int nq, nk, row0, bq;
  long long out0;
};

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
  const int hi = KL_KEY_END(m0 + BM - 1, causal_offset(sp.nq, sp.nk), sp.nk, p.causal);  // its last row's
  const int n_tiles = hi > 0 ? (hi + BN - 1) / BN : 0;
  // Split-K: split s runs key tiles [t0, t0 + n) of the row tile's n_tiles.
  const int per = (n_tiles + splits - 1) / splits;
  const int t0 = min(n_tiles, split * per), n = min(n_tiles, t0 + per) - t0;
  const bool tail = p.tail_splits > 0;  // part rows: the split row tiles' rows, in order
  const long long part0 = tail ? (long long)tail_tile * BM - m0 : sp.out0;
  w = Work{sp, m0, h, h / p.g1, h / p.g2, split, t0, n, tail ? splits > 1 : p.splits > 1, part0};
  return true;
}

