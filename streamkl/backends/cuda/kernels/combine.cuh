// combine.cuh: kl_combine, the split-K epilogue, a second entry point of kl_fwd.cu's module (it
// shares its Params block and launch).
//
// Grid cdiv(p.rows, 128), 128 threads, one part row each (TAIL: mapped back to its output row
// through the grid's order, schedule.cuh). Merges the row's p.splits partial states as merge_quad
// (online_kl.cuh) merges a row's threads: M = the largest reference, each part's sums rescaled by
// w = 2^(M_s - ref(M)); then writes kl, lse1, lse2 as kl_fwd does without splits. Reads part;
// writes kl, lse1, lse2.
#pragma once
#include "online_kl.cuh"
#include "params.cuh"
#include "schedule.cuh"

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
  const float M1u = ref(M1), M2u = ref(M2);
  float L1 = 0.f, L2 = 0.f, AA = 0.f, AB = 0.f;
  for (int s = 0; s < p.splits; ++s) {
    const float* q = p.part + ((long long)s * p.rows + o) * PART;
    const float w1 = ex2(q[0] - M1u), w2 = ex2(q[2] - M2u);
    L1 = fmaf(q[1], w1, L1), AA = fmaf(q[4], w1, AA), AB = fmaf(q[5], w1, AB), L2 = fmaf(q[3], w2, L2);
  }
  write_row(p, out, M1, L1, M2, L2, AA, AB);
}
