// params.cuh: what the host gives the forward's kernels (kl_fwd, kl_combine) and the tile shape
// every other file builds on: the instantiation's compile-time constants, the fixed shape
// (NWG, BN, BM), the parameter block Params, and PART, the layout of a row's partial state.
// _launch.py mirrors each of them (shipped(), NWG, BN, PARAMS_BYTES, PART).
//
// Compile-time constants, -D macros _launch.py (shipped) chooses per call shape:
//   KL_FP16      1: float16 inputs, 0: bfloat16 (the wgmma operand type, sm90.cuh).
//   D1P, D2P     the head dims padded to 64 or 128 (TMA fills the columns past D with zeros).
//   STAGES       depth of the key-tile ring: as many as shared memory holds, up to 4 (DECODE: 2 NWG
//                where they fit, else NWG).
//   DECODE       dense inputs of at most 64 query rows (one row tile): every consumer takes the
//                tile's first 64 rows and every NWG-th key tile of the CTA's share (consumer c:
//                tiles c, c + NWG, ...), releasing each stage alone, and writes its rows' state as
//                part split * NWG + c for kl_combine (p.splits counts the parts); otherwise one
//                consumer would run every key tile's math while the ring waits on it. STAGES is
//                then a multiple of NWG, so stage s is only ever read by consumer s % NWG: a parity
//                wait cannot tell phase k from phase k - 2, and a consumer that had not itself
//                waited out the stage's previous load could pass on the phase before it (the
//                previous load still in flight) and read a tile that is not there yet.
//   QREGS        bit 1 keeps Q1, bit 2 Q2 of a consumer's rows in registers (wgmma's A fragments),
//                read once from shared memory, so their GEMM reads only K per key tile (fewer
//                shared-memory bytes, no A descriptors to issue): both where D1P + D2P = 128, else
//                the wider one (a consumer's 160 registers hold 128 query columns beside the rest).
//   ISSUE_SPLIT  1 (where both head dims are 64): each GEMM's k-steps are issued in two halves, the
//                first row of the update that runs under it between them, so a warp held by a full
//                tensor queue has less MUFU work waiting behind its wgmma.
#pragma once
#include "sm90.cuh"

#if !defined(KL_FP16) || !defined(D1P) || !defined(D2P) || !defined(STAGES) || !defined(DECODE) || \
    !defined(QREGS) || !defined(ISSUE_SPLIT)
#error "the launcher (_launch.py) defines every instantiation constant"
#endif
static_assert(D1P == 64 || D1P == 128, "D1P: 64 or 128");
static_assert(D2P == 64 || D2P == 128, "D2P: 64 or 128");

constexpr int NWG = 3;  // consumer warpgroups, 64 query rows each
constexpr int BN = 64;  // keys per tile
constexpr int BM = 64 * NWG;  // query rows per CTA (a row tile)
static_assert(!DECODE || STAGES % NWG == 0, "DECODE: each stage read by one consumer");

struct Params {
  TensorMap q1, k1, q2, k2;  // {D, N, heads, B}; q boxes {64, 64, 1, 1}, k boxes {64, BN, 1, 1}
  float* kl;  // [B, H, Nq] float32 outputs
  float* lse1;
  float* lse2;
  float* part;  // splits > 1: [splits][rows][PART] partial row states, for kl_combine
  const int* cu;  // packed sequences: B + 1 offsets into the one packed batch (else null)
  int h, nq, nk, g1, g2, m_tiles, causal, splits, rows;  // rows: part's, B * H * Nq or (TAIL) fewer
  int hgroup;  // heads per group of the grid's order (schedule.cuh)
  float c1, c2;  // scale * log2(e)
  int tail0, tail_splits;  // TAIL: the first split row tile, its splits (rows: the split tiles' rows)
};

static_assert(sizeof(Params) == 640, "PARAMS_BYTES in _launch.py packs this layout");

// A row's state after its four threads merge (online_kl.cuh): M1, L1, M2, L2, AA, AB, log2 units.
constexpr int PART = 6;
