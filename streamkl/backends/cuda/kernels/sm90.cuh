// sm90.cuh: the few Hopper (sm_90a) instructions the kernels use, as inline PTX: mbarriers,
// TMA tensor loads, wgmma and setmaxnreg. No CUTLASS/CuTe; each wrapper is one
// instruction (or a wait loop around one), so what the kernel asks of the hardware stays visible.
#pragma once

#define KL_DEV __device__ __forceinline__

#if KL_FP16
#define KL_AB "f16"
#else
#define KL_AB "bf16"
#endif

// A CUtensorMap as the driver encodes it: 128 opaque bytes, 64-byte aligned (NVRTC has no
// cuda.h to take the real type from).
struct __align__(64) TensorMap {
  unsigned long long opaque[16];
};

KL_DEV unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- mbarrier (shared::cta, 64-bit) ----
KL_DEV void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the async (TMA) proxy and to the other threads.
KL_DEV void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

KL_DEV void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

KL_DEV void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// `count` arrivals at once (count 1 issues the plain arrive, the one-argument form's instruction).
KL_DEV void mbar_arrive(unsigned bar, unsigned count) {
  if (count == 1)
    mbar_arrive(bar);
  else
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Spins until the barrier's phase of parity `parity` has completed (a fresh barrier counts the
// phase before its first as complete, so waiting on parity 1 returns at once).
KL_DEV void mbar_wait(unsigned bar, unsigned parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- TMA ----
KL_DEV void tma_prefetch(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

// One box of a 4-D tensor map (coordinates innermost first) into shared memory, completing as
// transaction bytes on `bar`. Out-of-bounds elements arrive as zeros.
KL_DEV void tma_load_4d(unsigned dst, const TensorMap* map, int c0, int c1, int c2, int c3, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// ---- registers ----
template <int N>
KL_DEV void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N>
KL_DEV void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// ---- wgmma ----
// Shared-memory matrix descriptor of a K-major tile stored as 128-byte-swizzled 8-row atoms
// (what a TMA box of 64 16-bit columns with SWIZZLE_128B writes): start address >> 4, leading
// byte offset 16 (unused with this swizzle), stride byte offset 1024 (one 8-row atom), 128B
// swizzle. The start must sit in a 1024-byte-aligned atom; stepping k by 16 elements adds 32 B.
KL_DEV unsigned long long smem_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// The descriptor of addr + bytes from addr's (bytes a multiple of 16): the start address field
// holds (addr & 0x3FFFF) >> 4, and shared addresses stay below 2^18, so the fields just add.
KL_DEV unsigned long long smem_desc_add(unsigned long long desc, unsigned bytes) { return desc + (bytes >> 4); }

KL_DEV void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
KL_DEV void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
KL_DEV void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Pins accumulator registers: the compiler may neither move their reads or writes across an
// in-flight wgmma nor assume their values survive it.
template <int N>
KL_DEV void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

KL_DEV float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// wgmma m64n64k16 with fp32 accumulators d[32]: D[64 x 64] (+)= A[64 x 16] * B[64 x 16]^T, both
// operands K-major in shared memory. ACC = false overwrites D (scale-d 0) and declares d written,
// not read, so the compiler may keep other values in those registers until the GEMM is issued.
#define KL_RW(x) "+f"(x)
#define KL_WO(x) "=f"(x)
#define KL_OPS8(M, b) M(d[b]), M(d[b + 1]), M(d[b + 2]), M(d[b + 3]), M(d[b + 4]), M(d[b + 5]), M(d[b + 6]), M(d[b + 7])
#define KL_OPS32(M) KL_OPS8(M, 0), KL_OPS8(M, 8), KL_OPS8(M, 16), KL_OPS8(M, 24)
#define KL_D32                                                                                              \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22," \
  " %23, %24, %25, %26, %27, %28, %29, %30, %31}"
template <bool ACC>
KL_DEV void wgmma_m64n64k16(float* d, unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (ACC)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32 ", %32, %33, 1, 1, 1, 0, 0;\n"
                 : KL_OPS32(KL_RW)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32 ", %32, %33, 0, 1, 1, 0, 0;\n"
                 : KL_OPS32(KL_WO)
                 : "l"(desc_a), "l"(desc_b));
}

// wgmma m64n64k16 with A from registers: a[4] holds the thread's four bf16/f16 pairs of the 64 x 16
// A tile in the mma.m16n8k16 A-fragment layout (warp w: rows 16 w + lane / 4 (+ 8), columns
// 2 (lane % 4) (+ 8)), B as above. The registers of a must not change while the GEMM is in flight.
template <bool ACC>
KL_DEV void wgmma_m64n64k16_rs(float* d, const unsigned* a, unsigned long long desc_b) {
  if constexpr (ACC)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
                 : KL_OPS32(KL_RW)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32
                 ", {%32, %33, %34, %35}, %36, 0, 1, 1, 0;\n"
                 : KL_OPS32(KL_WO)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// One 32-bit word of shared memory (a thread's wgmma A fragments, loaded once).
KL_DEV unsigned lds32(unsigned addr) {
  unsigned v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}

// A warpgroup's wgmma A fragments of a 64 x COLS 16-bit tile at `tile`, stored as TMA writes it:
// 128-byte-swizzled 64-column slabs, SLAB_STRIDE bytes apart. Per k-step kk the thread holds rows
// 16 warp + lane / 4 (+ 8), columns 16 kk + 8 h + 2 (lane % 4): chunk 2 (kk % 4) + h of the row.
template <int COLS, unsigned SLAB_STRIDE>
KL_DEV void load_afrag(unsigned* a, unsigned tile, int warp, int lane) {
  const int g = lane / 4, r = 16 * warp + g;
#pragma unroll
  for (int kk = 0; kk < COLS / 16; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const unsigned off = (kk / 4) * SLAB_STRIDE + ((((2 * (kk % 4) + h) ^ g) << 4) | (4 * (lane % 4)));
      a[4 * kk + 2 * h] = lds32(tile + off + r * 128);
      a[4 * kk + 2 * h + 1] = lds32(tile + off + (r + 8) * 128);
    }
  }
}

// ---- the backward's extra instructions (kl_bwd.cu) ----

// Descriptor of an MN-major operand (the GEMM's M or N dimension runs along the 128-byte rows: a
// K x N tile stored as TMA writes a row-major N-wide tile, one K row per 128 bytes): stride byte
// offset 1024 (eight K rows, one swizzle atom), leading byte offset `lbo` (the next 64 M/N columns,
// one slab on), 128B swizzle. Stepping k by 16 rows adds 2048 B.
KL_DEV unsigned long long smem_desc_mn(unsigned addr, unsigned lbo) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16) | (64ull << 32) |
         (1ull << 62);
}

// wgmma m64n64k16, B transposed (MN-major): D[64 x 64] (+)= A[64 x 16] * B[16 x 64], A K-major in
// shared memory (desc_a) or from registers (a[4], the layout of wgmma_m64n64k16_rs).
template <bool ACC>
KL_DEV void wgmma_m64n64k16_tb(float* d, unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (ACC)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32 ", %32, %33, 1, 1, 1, 0, 1;\n"
                 : KL_OPS32(KL_RW)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32 ", %32, %33, 0, 1, 1, 0, 1;\n"
                 : KL_OPS32(KL_WO)
                 : "l"(desc_a), "l"(desc_b));
}

template <bool ACC>
KL_DEV void wgmma_m64n64k16_rs_tb(float* d, const unsigned* a, unsigned long long desc_b) {
  if constexpr (ACC)
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32
                 ", {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : KL_OPS32(KL_RW)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32
                 ", {%32, %33, %34, %35}, %36, 0, 1, 1, 1;\n"
                 : KL_OPS32(KL_WO)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}

// wgmma m64n32k16: d[16], D[64 x 32] (+)= A[64 x 16] * B, both in shared memory, A K-major, B
// K-major (TB = 0, B[32 x 16]^T) or MN-major (TB = 1, B[16 x 32]).
#define KL_OPS16(M) KL_OPS8(M, 0), KL_OPS8(M, 8)
#define KL_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KL_N32(SCALE_D, TB, OPS) \
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32." KL_AB "." KL_AB " " KL_D16 ", %16, %17, " SCALE_D \
               ", 1, 1, 0, " TB ";\n"                                                                          \
               : KL_OPS16(OPS)                                                                                 \
               : "l"(desc_a), "l"(desc_b))
template <bool ACC, int TB>
KL_DEV void wgmma_m64n32k16(float* d, unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (ACC && TB)
    KL_N32("1", "1", KL_RW);
  else if constexpr (ACC)
    KL_N32("1", "0", KL_RW);
  else if constexpr (TB)
    KL_N32("0", "1", KL_WO);
  else
    KL_N32("0", "0", KL_WO);
}
#undef KL_N32

// Two floats as the wgmma operand type, packed: lo in the low half (the lower column).
KL_DEV unsigned pack2(float lo, float hi) {
  unsigned r;
#if KL_FP16
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
  return r;
}

KL_DEV void sts16(unsigned addr, unsigned short v) { asm volatile("st.shared.b16 [%0], %1;" ::"r"(addr), "h"(v)); }

// Orders this thread's generic-proxy shared-memory writes before later async-proxy (wgmma) reads.
KL_DEV void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Named barrier `id` over `count` threads (whole warps); id 0 is __syncthreads'.
KL_DEV void bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory"); }

KL_DEV void red_add2(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// ---- indexer_kl.cu's extra instructions ----

// wgmma m64n128k16 with fp32 accumulators d[64]: D[64 x 128] (+)= A[64 x 16] * B[128 x 16]^T, both
// K-major in shared memory (the key-major teacher GEMM: 64 keys against 128 stacked heads).
#define KL_OPS64(M) KL_OPS32(M), KL_OPS8(M, 32), KL_OPS8(M, 40), KL_OPS8(M, 48), KL_OPS8(M, 56)
#define KL_D64                                                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22," \
  " %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43,"  \
  " %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
template <bool ACC>
KL_DEV void wgmma_m64n128k16(float* d, unsigned long long desc_a, unsigned long long desc_b) {
  if constexpr (ACC)
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." KL_AB "." KL_AB " " KL_D64 ", %64, %65, 1, 1, 1, 0, 0;\n"
                 : KL_OPS64(KL_RW)
                 : "l"(desc_a), "l"(desc_b));
  else
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." KL_AB "." KL_AB " " KL_D64 ", %64, %65, 0, 1, 1, 0, 0;\n"
                 : KL_OPS64(KL_WO)
                 : "l"(desc_a), "l"(desc_b));
}

// wgmma m64n64k16 accumulating, both operands MN-major in shared memory (smem_desc_mn): D[64 x 64]
// += A[64 x 16] * B[16 x 64] with A stored K rows of 64 M columns (a transposed tile, as dz^T).
KL_DEV void wgmma_m64n64k16_ta_tb(float* d, unsigned long long desc_a, unsigned long long desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." KL_AB "." KL_AB " " KL_D32 ", %32, %33, 1, 1, 1, 1, 1;\n"
               : KL_OPS32(KL_RW)
               : "l"(desc_a), "l"(desc_b));
}

KL_DEV void sts32(unsigned addr, unsigned v) { asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v)); }
