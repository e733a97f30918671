// mask.cuh: the causal alignment, the one rule the forward's files use for which keys a query
// row sees. Masks align bottom-right: row i of a problem of nq query rows and nk keys sees the keys
// j <= i + (nk - nq) (streamkl/_spec.py's causal_offset states the same rule for Python); inside a
// packed sequence nq == nk and this is the plain diagonal. A row's visible keys are [0, KL_KEY_END);
// online_kl.cuh masks a tile's elements against that bound (visible iff column < the end).
#pragma once
#include "sm90.cuh"

// Bottom-right alignment: row i sees keys j <= i + causal_offset(nq, nk).
KL_DEV int causal_offset(int nq, int nk) { return nk - nq; }

// The end of the keys row `row` sees, [0, KL_KEY_END) with off = causal_offset(nq, nk): nk without
// the mask; with it at most nk, and zero or less where the row sees no key (callers test `> 0`
// where that matters). A macro, not a function: as an inline function it compiles to an
// equivalent but reordered prologue of the consumers' loop; this keeps the measured machine code.
#define KL_KEY_END(row, off, nk, causal) ((causal) ? min((nk), (row) + (off) + 1) : (nk))
