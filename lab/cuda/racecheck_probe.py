"""Whether compute-sanitizer's racecheck follows an mbarrier hand-off of plain shared-memory
stores and loads, the pattern kernels/kl_bwd.cu uses for each query tile's row terms. One CTA, two
warps; warp 0 writes 32 floats, warp 1 reads them, twice through the same buffer (a RAW, then a
WAR and a RAW again), ordered by:

  MODE 0  mbarriers: every writer lane arrives on `full` (count 32) after its store, the reader
          waits on its parity; every reader lane arrives on `empty` after its load, the writer
          waits on that. Under the PTX memory model each arrive releases its own thread's access
          and each wait acquires them: no data race.
  MODE 1  __syncthreads() between the phases: the control racecheck must call clean.

    compute-sanitizer --tool racecheck python lab/cuda/racecheck_probe.py 0   # then 1

prints each mode's result (the values must read back) and racecheck appends its hazard count.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from streamkl.backends.cuda import _jit

SOURCE = r"""
#include "sm90.cuh"

extern "C" __global__ void handoff(float* out) {
  __shared__ __align__(8) unsigned long long bars[2];
  __shared__ float buf[32];
  const unsigned full = smem_addr(&bars[0]), empty = smem_addr(&bars[1]);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    mbar_init(full, 32);
    mbar_init(empty, 32);
    mbar_init_fence();
  }
  __syncthreads();
  for (int round = 0; round < 2; ++round) {
    if (warp == 0) {
#if MODE == 0
      mbar_wait(empty, (round & 1) ^ 1);  // the reader's loads of the last round are done
#endif
      buf[lane] = 100.f * round + lane;
#if MODE == 0
      mbar_arrive(full);
#endif
    }
#if MODE == 1
    __syncthreads();
#endif
    if (warp == 1) {
#if MODE == 0
      mbar_wait(full, round & 1);
#endif
      out[32 * round + lane] = buf[lane];
#if MODE == 0
      mbar_arrive(empty);
#endif
    }
#if MODE == 1
    __syncthreads();
#endif
  }
}
"""


def run(mode: int) -> bool:
    from cuda.bindings import driver

    build = _jit.compile_kernel(SOURCE, "handoff", {"MODE": mode})
    kernel = _jit.load(build, torch.cuda.current_device()).handle
    if not isinstance(kernel, driver.CUkernel):
        kernel = driver.CUkernel(int(kernel))
    out = torch.zeros(64, device="cuda")
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    buf = ctypes.create_string_buffer(struct.pack("<Q", out.data_ptr()), 8)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    (err,) = driver.cuLaunchKernel(kernel, 1, 1, 1, 64, 1, 1, 0, stream, ctypes.addressof(argv), 0)
    if int(err) != 0:
        raise RuntimeError(f"cuLaunchKernel: {err!r}")
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(32.0), 100 + torch.arange(32.0)]).cuda()
    return bool((out == want).all())


if __name__ == "__main__":
    import sys

    for mode in [int(a) for a in sys.argv[1:]] or [0, 1]:
        print(f"MODE {mode}: values {'ok' if run(mode) else 'WRONG'}", flush=True)
