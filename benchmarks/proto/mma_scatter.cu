// Design prototype (16-bit decode on tensor cores), not library code: the "scatter" decode kernel on tensor cores, in CUDA C so that
// its variants can be timed in one device call before the design is generated as PTX (codegen/mma.py).
//
// W (M x K, fp16) in 16 x 16 tiles. Per tile, its nonzeros as (position byte, value) entries, padded to a
// multiple of 4 by repeating the last entry (a repeated store of the same value is harmless). A lane takes 4
// entries with one 32-bit and one 64-bit load and stores each value at its position in the warp's zeroed
// 16 x 16 buffer in shared memory (positions are stored pre-swizzled so that ldmatrix reads without bank
// conflicts); ldmatrix.x4 then gives the A fragment of mma.m16n8k16 and the tensor cores multiply it with X's
// 16 x 8 slice. The buffer is zeroed again (one 16-byte store a lane) two tiles later.
// header[tile] = (first entry / 4) << 7 | (entries / 4).
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t* a, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

__device__ __forceinline__ void st_u16(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;" :: "r"(addr), "h"((unsigned short)v));
}

__device__ __forceinline__ void scatter4(uint32_t base, uint32_t p4, uint2 v) {
  st_u16(base + ((p4 & 0xffu) << 1), v.x);
  st_u16(base + (((p4 >> 8) & 0xffu) << 1), v.x >> 16);
  st_u16(base + (((p4 >> 16) & 0xffu) << 1), v.y);
  st_u16(base + ((p4 >> 24) << 1), v.y >> 16);
}

template <int NT, int WARPS, int D, bool ATOMIC>
__device__ __forceinline__ void mma_scatter(const uint32_t* __restrict__ hdr, const uint32_t* __restrict__ pos,
                                            const uint2* __restrict__ vals, const __half* __restrict__ X,
                                            void* out, int M, int K, int N, int T, int TB) {
  __shared__ __align__(16) __half buf[WARPS][3][256];
  __shared__ float red[WARPS][16][8 * NT + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = blockIdx.x;
  const int t0 = blockIdx.y * TB, t1 = min(T, t0 + TB);
  uint4* mine = reinterpret_cast<uint4*>(&buf[warp][0][0]);
  for (int i = lane; i < 96; i += 32) mine[i] = make_uint4(0, 0, 0, 0);
  __syncwarp();
  float acc[NT][4];
#pragma unroll
  for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const int first = t0 + warp;
  const int cnt = first < t1 ? (t1 - first + WARPS - 1) / WARPS : 0;
  const uint32_t* H = hdr + (size_t)s * T;
  const int g = lane >> 2, tq = lane & 3;
  const int q = lane >> 3, r = lane & 7, arow = r + 8 * (q & 1), achunk = q >> 1;
  const uint32_t a_off = arow * 32 + ((achunk ^ ((arow >> 2) & 1)) << 4);
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(&buf[warp][0][0]);

  uint32_t hn[D], h[D], p4[D], bx[D][NT][2];
  uint2 v4[D];
  auto header = [&](int j) -> uint32_t { return j < cnt ? __ldg(H + first + WARPS * j) : 0u; };
  auto load = [&](int j, int d) {
    h[d] = hn[d];
    const uint32_t L = h[d] & 127u, start = (h[d] >> 7);
    if (lane < L) { p4[d] = __ldg(pos + start + lane); v4[d] = __ldg(vals + start + lane); }
    const int k0 = (first + WARPS * j) * 16 + 2 * tq;
#pragma unroll
    for (int n = 0; n < NT; n++) {
      const int col = 8 * n + g;
      const bool ok = j < cnt && col < N;
      const uint32_t* xr = reinterpret_cast<const uint32_t*>(X + (size_t)col * K + k0);
      bx[d][n][0] = ok ? __ldg(xr) : 0u;
      bx[d][n][1] = ok ? __ldg(xr + 4) : 0u;
    }
  };
#pragma unroll
  for (int d = 0; d < D; d++) hn[d] = header(d);
#pragma unroll
  for (int d = 0; d < D; d++) { load(d, d); hn[d] = header(d + D); }
  for (int j0 = 0; j0 < cnt; j0 += D) {
#pragma unroll
    for (int d = 0; d < D; d++) {
      const int j = j0 + d;
      if (j < cnt) {
        const uint32_t cur = base + (j % 3) * 512;
        const uint32_t L = h[d] & 127u, start = h[d] >> 7;
        if (lane < L) scatter4(cur, p4[d], v4[d]);
        for (uint32_t rr = 32; rr < L; rr += 32)  // tiles over 50% dense: further rounds of 128 entries
          if (lane + rr < L) scatter4(cur, __ldg(pos + start + rr + lane), __ldg(vals + start + rr + lane));
        uint32_t b[NT][2];
#pragma unroll
        for (int n = 0; n < NT; n++) { b[n][0] = bx[d][n][0]; b[n][1] = bx[d][n][1]; }
        load(j + D, d);
        hn[d] = header(j + 2 * D);
        __syncwarp();
        uint32_t a[4];
        ldmatrix_x4(a, cur + a_off);
#pragma unroll
        for (int n = 0; n < NT; n++) mma16816(acc[n], a, b[n][0], b[n][1]);
        asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};" :: "r"(base + ((j + 2) % 3) * 512 + lane * 16), "r"(0));
      }
    }
  }
#pragma unroll
  for (int n = 0; n < NT; n++) {
    red[warp][g][8 * n + 2 * tq] = acc[n][0];
    red[warp][g][8 * n + 2 * tq + 1] = acc[n][1];
    red[warp][g + 8][8 * n + 2 * tq] = acc[n][2];
    red[warp][g + 8][8 * n + 2 * tq + 1] = acc[n][3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < 16 * N; e += WARPS * 32) {
    const int n = e >> 4, row = e & 15, m = 16 * s + row;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) sum += red[w][row][n];
    if (m < M) {
      if (ATOMIC) atomicAdd(reinterpret_cast<float*>(out) + (size_t)n * M + m, sum);
      else reinterpret_cast<__half*>(out)[(size_t)n * M + m] = __float2half_rn(sum);
    }
  }
}

#define INSTANCE(NT, W, D, A)                                                                                   \
  extern "C" __global__ void __launch_bounds__(W * 32) mma_scatter_n##NT##_w##W##_d##D##_a##A(                  \
      const uint32_t* hdr, const uint32_t* pos, const uint2* vals, const __half* X, void* out, int M, int K,    \
      int N, int T, int TB) {                                                                                   \
    mma_scatter<NT, W, D, A>(hdr, pos, vals, X, out, M, K, N, T, TB);                                          \
  }
INSTANCE(1, 4, 2, 0) INSTANCE(1, 4, 4, 0) INSTANCE(1, 8, 2, 0) INSTANCE(1, 8, 4, 0) INSTANCE(1, 16, 2, 0)
INSTANCE(1, 4, 4, 1) INSTANCE(1, 8, 4, 1) INSTANCE(1, 8, 2, 1)
INSTANCE(2, 4, 4, 0) INSTANCE(2, 8, 2, 0) INSTANCE(2, 8, 4, 0) INSTANCE(2, 8, 4, 1) INSTANCE(2, 4, 4, 1)

// The floor: read `words` 16-byte words once (as the decode kernels stream their weight) and keep a value.
extern "C" __global__ void stream_read(const uint4* __restrict__ p, size_t words, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = __ldg(p + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x12345678u) sink[0] = x;
}
