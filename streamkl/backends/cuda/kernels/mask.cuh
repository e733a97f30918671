// mask.cuh: the causal alignment, the one rule the forward's files use for which keys a query
// row sees. Masks align bottom-right: row i of a problem of nq query rows and nk keys sees the keys
// j <= i + (nk - nq) (streamkl/_spec.py's causal_offset states the same rule for Python); inside a
// packed sequence nq == nk and this is the plain diagonal. A row's visible keys are [0, key_end);
// online_kl.cuh masks a tile's elements against that bound (visible iff column < key_end).
#pragma once
#include "sm90.cuh"

// Bottom-right alignment: row i sees keys j <= i + causal_offset(nq, nk).
KL_DEV int causal_offset(int nq, int nk) { return nk - nq; }

// The end of the keys row `row` sees, [0, key_end): nk without the mask; with it at most nk, and
// zero or less where the row sees no key (not clamped: callers test `> 0` where that matters).
KL_DEV int key_end(int row, int nq, int nk, bool causal) {
  return causal ? min(nk, row + causal_offset(nq, nk) + 1) : nk;
}
