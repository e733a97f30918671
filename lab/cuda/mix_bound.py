"""The cuda forward's work per key tile with nothing tying its tensor work to its exponentials:
an upper bound, at the board's power limit, on what any schedule of that work reaches
(docs/cuda.md, "The bound of the work itself").

One CTA per SM, 512 threads, `steps` steps. Per step, warpgroup 0 issues the tensor work of one
64-key tile of the kernel's three consumers (each: S1 with Q from registers, S2 with Q from shared
memory, `D / 16` wgmma m64n64k16 apiece; `tensor = 2`: both with Q from registers) as two
accumulation chains, one step in flight; warpgroups 1-3 run, per thread, the update of 32
elements (the kernel's per consumer thread and tile) on values of their own: with `exps = 2` both
sides (per element FFMA, EX2, FADD and two FFMA for S1, FFMA, EX2, FADD for S2), with `exps = 1`
the S2 side alone (an attention forward's softmax). The two loops share no data, so the tensor
pipe and the exponential unit overlap as far as the chip lets them. clocks.py times it beside the
kernels, with the SM clock and board power:

    python lab/cuda/clocks.py --dims 128 --mix 128,64
"""

from __future__ import annotations

import ctypes
import struct

import torch

from streamkl.backends.cuda import _jit

# Grid: one CTA per SM; 512 threads (128 registers each: one CTA fills an SM's register file).
# Shared memory: a 64 x DP Q tile and a 64 x DP K tile of pseudo-random bf16 in [-1, 1) (values
# that toggle like real operands), each as 64-column slabs; wgmma reads them through the
# kernel's descriptors. Writes one float per thread to out, so no work is dead.
SOURCE = r"""
#include "sm90.cuh"
struct Args { float* out; int steps; int tensor; int exps; };  // tensor: 0, 1 RS + SS, 2 RS only
constexpr unsigned TILE = 64 * DP * 2;  // bytes of one 64 x DP bf16 tile
constexpr int ELEMS = 32;  // elements per thread and step, both sides (the kernel's per tile)

KL_DEV float rnd(unsigned i) {  // a hash to [-1, 1)
  i ^= i >> 16; i *= 0x7feb352du; i ^= i >> 15; i *= 0x846ca68bu; i ^= i >> 16;
  return (float)(i & 0xffffu) / 32768.f - 1.f;
}

template <int EXPS>
KL_DEV float update(int steps, unsigned seed) {
  float xs[ELEMS], ys[ELEMS];
#pragma unroll
  for (int j = 0; j < ELEMS; ++j) xs[j] = 4.f * rnd(seed + 2 * j), ys[j] = 4.f * rnd(seed + 2 * j + 1);
  float sums[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // l1, aa, ab, l2, twice for ILP
  const float c1 = 1.4426950f, c2 = 1.2f;
  for (int it = 0; it < steps; ++it) {
    const float nm1 = -6.f - 1e-6f * it, nm2 = -5.f - 1e-6f * it;  // the references, moving
#pragma unroll
    for (int j = 0; j < ELEMS; ++j) {
      const int k = j & 1;
      const float x2 = fmaf(ys[j], c2, nm2);
      const float e2 = ex2(x2);
      sums[6 + k] += e2;
      if (EXPS == 2) {
        const float e1 = ex2(fmaf(xs[j], c1, nm1));
        sums[k] += e1;
        sums[2 + k] = fmaf(e1, xs[j], sums[2 + k]);
        sums[4 + k] = fmaf(e1, x2, sums[4 + k]);
      }
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += sums[i];
  return s;
}

extern "C" __global__ void __launch_bounds__(512, 1) mix_bound(const __grid_constant__ Args a) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  unsigned short* tiles = (unsigned short*)(smem_raw + (base - smem_addr(smem_raw)));
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  for (int i = tid; i < 2 * TILE / 2; i += 512)
    tiles[i] = (unsigned short)(__float_as_uint(rnd(i + 7919u * blockIdx.x)) >> 16);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  float r = 0.f;
  if (wg == 0) {
    if (a.tensor) {
      unsigned qa[DP / 4];
#pragma unroll
      for (int i = 0; i < DP / 4; ++i) qa[i] = lds32(base + 4 * ((tid * (DP / 4) + i) % (TILE / 4)));
      float s1[32], s2[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s1[i] = 0.f, s2[i] = 0.f;
      const unsigned long long dq = smem_desc(base), dk = smem_desc(base + TILE);
      const bool rs2 = __shfl_sync(0xffffffffu, a.tensor, 0) == 2;  // S2 with A from registers too
      for (int it = 0; it < a.steps; ++it) {
        wgmma_fence();
#pragma unroll
        for (int c = 0; c < 3; ++c) {
#pragma unroll
          for (int kk = 0; kk < DP / 16; ++kk)
            wgmma_m64n64k16_rs<true>(s1, qa + 4 * kk, smem_desc_add(dk, (kk / 4) * 8192 + (kk % 4) * 32));
#pragma unroll
          for (int kk = 0; kk < DP / 16; ++kk) {
            const unsigned long long db = smem_desc_add(dk, (kk / 4) * 8192 + (kk % 4) * 32);
            if (rs2)  // uniform: the whole warpgroup takes one side
              wgmma_m64n64k16_rs<true>(s2, qa + 4 * kk, db);
            else
              wgmma_m64n64k16<true>(s2, smem_desc_add(dq, (kk / 4) * 8192 + (kk % 4) * 32), db);
          }
        }
        wgmma_commit();
        wgmma_wait<1>();
      }
      wgmma_wait<0>();
      fence_regs<32>(s1);
      fence_regs<32>(s2);
#pragma unroll
      for (int i = 0; i < 32; ++i) r += s1[i] + s2[i];
    }
  } else if (a.exps == 2) {
    r = update<2>(a.steps, 977u * (blockIdx.x * 512 + tid));
  } else if (a.exps == 1) {
    r = update<1>(a.steps, 977u * (blockIdx.x * 512 + tid));
  }
  a.out[blockIdx.x * 512 + tid] = r;
}
"""


class MixBound:
    """The mix kernel at head dim `dp` (64 or 128) on the current GPU: `call(tensor, exps)` runs
    one launch of `steps` steps on every SM (tensor: 0 none, 1 the kernel's operands, 2 both Qs
    from registers); `flops` is the attention forward's FLOP count the launch's tensor work
    stands for (three consumers' 64 rows x 64 keys x 4 * dp per step)."""

    def __init__(self, dp: int, steps: int = 4000):
        from cuda.bindings import driver

        self.driver, self.steps = driver, steps
        build = _jit.compile_kernel(SOURCE, "mix_bound", {"DP": dp})
        kernel = _jit.load(build, torch.cuda.current_device()).handle
        self.kernel = kernel if isinstance(kernel, driver.CUkernel) else driver.CUkernel(int(kernel))
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        self.sms = props.multi_processor_count
        self.out = torch.empty(self.sms * 512, device="cuda")
        self.smem = 2 * 64 * dp * 2 + 1024  # under 48 KB: no opt-in needed
        self.flops = self.sms * steps * 3 * 64 * 64 * 4 * dp

    def call(self, tensor: int, exps: int) -> None:
        d = self.driver
        args = struct.pack("<Q3i", self.out.data_ptr(), self.steps, int(tensor), exps)
        buf = ctypes.create_string_buffer(args, 32)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        stream = d.CUstream(torch.cuda.current_stream().cuda_stream)
        grid, block = (self.sms, 1, 1), (512, 1, 1)
        (err,) = d.cuLaunchKernel(self.kernel, *grid, *block, self.smem, stream, ctypes.addressof(argv), 0)
        if int(err) != 0:
            raise RuntimeError(f"cuLaunchKernel: {err!r}")


# (name, tensor work, exponential sides): the bound's workloads for clocks.py
# tensor: 0 none, 1 the kernel's (S1 from registers, S2 from shared memory), 2 both from registers
MIXES = (
    ("tensor", 1, 0),
    ("exp2", 0, 2),
    ("tensor+exp2", 1, 2),
    ("tensor+exp1", 1, 1),
    ("tensor-rs", 2, 0),
    ("tensor-rs+exp2", 2, 2),
)
