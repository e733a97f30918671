"""How fast the H200's L2 takes the dq reduction a fused CUDA backward would issue (docs/cuda.md,
"Not done yet"): CTA (key tile kt, head h) adds a 64 x 128 float32 tile (32 KB) into each query
tile of its head with one bulk reduce (`cp.reduce.async.bulk ... .add.f32`) from shared memory,
as the key-major backward would once per (query tile, key tile) pair. Patterns: every CTA walks
the query tiles in the same order (the CTAs running together add into the same tile), or from
its own offset (kt); beside them the same adds as `red.global.add.v4.f32` from every thread's
registers, and the same bytes as plain bulk stores. Checks the sums, then
prints GB/s of tile bytes and what the backward's tensor work needs per second.

    python lab/cuda/tma_reduce.py [--n 8192] [--heads 32] [--in-flight 4]
"""

from __future__ import annotations

import argparse
import ctypes
import struct
import sys

import torch

from streamkl.backends.cuda import _jit

# Grid (key tiles, heads), 128 threads; thread 0 fills the 32 KB tile once and issues every bulk
# operation, at most IN_FLIGHT unread at a time. Reads nothing; writes (adds into) dq.
SOURCE = r"""
#include "sm90.cuh"
struct Args { float* dq; int q_tiles; int stagger; int reduce; };
extern "C" __global__ void __launch_bounds__(128, 1) dq_reduce(const __grid_constant__ Args a) {
  extern __shared__ __align__(128) float tile[];
  for (int i = threadIdx.x; i < 64 * 128; i += 128) tile[i] = 1.0f;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int kt = blockIdx.x, h = blockIdx.y;
  if (a.reduce == 2) {  // each thread adds its 64 values from registers, 16 x red.v4
    for (int i = 0; i < a.q_tiles; ++i) {
      const int qt = a.stagger ? (i + kt) % a.q_tiles : i;
      float* dst = a.dq + ((long long)h * a.q_tiles + qt) * 64 * 128 + 4 * threadIdx.x;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        asm volatile("red.global.add.v4.f32 [%0], {%1, %1, %1, %1};"
                     :: "l"(dst + 512 * j), "f"(1.0f) : "memory");
    }
    return;
  }
  if (threadIdx.x != 0) return;
  const unsigned src = smem_addr(tile);
  for (int i = 0; i < a.q_tiles; ++i) {
    const int qt = a.stagger ? (i + kt) % a.q_tiles : i;
    float* dst = a.dq + ((long long)h * a.q_tiles + qt) * 64 * 128;
    if (a.reduce)
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], 32768;"
                   :: "l"(dst), "r"(src) : "memory");
    else
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 32768;"
                   :: "l"(dst), "r"(src) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(IN_FLIGHT - 1) : "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""
TILE_BYTES = 64 * 128 * 4


def run(n: int, heads: int, in_flight: int, reps: int) -> list[dict]:
    from cuda.bindings import driver

    build = _jit.compile_kernel(SOURCE, "dq_reduce", {"IN_FLIGHT": in_flight})
    kernel = _jit.load(build, torch.cuda.current_device()).handle
    if not isinstance(kernel, driver.CUkernel):
        kernel = driver.CUkernel(int(kernel))
    q_tiles, key_tiles = n // 64, n // 128  # 64-row query tiles, 128-key CTAs
    dq = torch.zeros(heads * q_tiles * 64 * 128, device="cuda")
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)

    def launch(stagger: int, reduce: int) -> None:
        buf = ctypes.create_string_buffer(struct.pack("<Q3i", dq.data_ptr(), q_tiles, stagger, reduce), 32)
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        (err,) = driver.cuLaunchKernel(
            kernel, key_tiles, heads, 1, 128, 1, 1, TILE_BYTES, stream, ctypes.addressof(argv), 0
        )
        if int(err) != 0:
            raise RuntimeError(f"cuLaunchKernel: {err!r}")

    rows = []
    patterns = [("bulk reduce, same order", 0, 1), ("bulk reduce, staggered", 1, 1),
                ("red.v4, same order", 0, 2), ("red.v4, staggered", 1, 2),
                ("bulk store, same order", 0, 0), ("bulk store, staggered", 1, 0)]  # fmt: skip
    for name, stagger, reduce in patterns:
        dq.zero_()
        launch(stagger, reduce)
        torch.cuda.synchronize()
        want = float(key_tiles if reduce else 1)
        ok = bool((dq == want).all())
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launch(stagger, reduce)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        ms = sorted(times)[len(times) // 2]
        gbps = key_tiles * heads * q_tiles * TILE_BYTES / ms / 1e6
        rows.append(dict(pattern=name, ok=ok, ms=ms, gbps=gbps))
        print(f"{name:>24}: {ms:8.3f} ms  {gbps:8.0f} GB/s  sums {'ok' if ok else 'WRONG'}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python lab/cuda/tma_reduce.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=8192, help="Nq = Nk")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--in-flight", type=int, default=4, help="bulk operations a CTA keeps unread")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--tflops", type=float, default=500.0, help="the backward's rate, for what it needs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (sm_90)")
    run(args.n, args.heads, args.in_flight, args.reps)
    # per (64-query, 128-key) pair the backward's 4 GEMMs do 4 * 2 * 64 * 128 * 128 FLOP and add
    # one 32 KB dq tile
    need = args.tflops * 1e12 / (8 * 64 * 128 * 128) * TILE_BYTES / 1e9
    print(f"a backward at {args.tflops:g} TFLOP/s (D = 128, 128-key CTAs) adds {need:,.0f} GB/s of dq tiles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
