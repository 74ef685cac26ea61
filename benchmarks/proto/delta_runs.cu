// Decode at N = 1 over 8-bit column deltas: a warp a row, each lane one run of the row's nonzeros.
//
// Why: the bitmap designs measured on the H200 pay per position (tensor-core fragments) or walk bits in a
// serial chain per lane (1.1-1.3 TB/s); padded CSR streams at 2.4 TB/s but costs 4 bytes a nonzero, as many
// as dense fp16 at 50%. Here a nonzero costs 3 bytes (its value and an 8-bit gap to the lane's previous
// nonzero) and 5 instructions (extract, add, shared load of x, convert, FMA), with no chain longer than an add.
//
// Format (delta_runs_bench.py pack()), per row r with Q_r quads of 4 entries (its nonzeros in column order,
// a zero-valued filler wherever a gap exceeds 255, the last quad padded with zero values at the last column):
// - the row's quads are split into 32 runs of consecutive quads, c = Q_r / 32 each and one more for the first
//   Q_r % 32 lanes; lane l takes run l;
// - quad i of lane l is stored at rows[r].x + 32 i + l (the warp's loads of one step are contiguous);
// - gaps[q]: 4 bytes, entry k's column minus the previous entry's of its run (0 for a run's first entry);
//   vals[q]: the 4 values (fp16 / bf16); bases[r][l]: the column of run l's first entry.
// A block stages x as fp32 in shared memory; each warp takes rows blockIdx.x * WARPS + warp; fp32 sums, a
// butterfly over the lanes, lane 0 stores.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef unsigned int uint32_t;
typedef unsigned short uint16_t;

#ifndef WARPS
#define WARPS 8
#endif
#ifndef AHEAD
#define AHEAD 4  // quads a lane loads before it uses them
#endif

#ifdef BF16
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float lo_f(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float to_f(elem_t v) { return __bfloat162float(v); }
__device__ __forceinline__ elem_t from_f(float v) { return __float2bfloat16(v); }
#else
typedef __half elem_t;
__device__ __forceinline__ float lo_f(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w & 0xffff))); }
__device__ __forceinline__ float hi_f(uint32_t w) { return __half2float(__ushort_as_half((unsigned short)(w >> 16))); }
__device__ __forceinline__ float to_f(elem_t v) { return __half2float(v); }
__device__ __forceinline__ elem_t from_f(float v) { return __float2half(v); }
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
delta_runs(const uint32_t* __restrict__ gaps, const uint2* __restrict__ vals, const int2* __restrict__ rows,
           const uint16_t* __restrict__ bases, const elem_t* __restrict__ x, elem_t* __restrict__ y, int M, int K) {
  extern __shared__ float xs[];
  for (int i = threadIdx.x; i < K; i += WARPS * 32) xs[i] = to_f(x[i]);
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * WARPS + warp;
  if (row >= M) return;
  const int2 info = rows[row];
  const int c = info.y >> 5, rem = info.y & 31;
  const int n = c + (lane < rem);
  const uint32_t* pg = gaps + info.x + lane;
  const uint2* pv = vals + info.x + lane;
  uint32_t col = bases[row * 32 + lane];
  float acc0 = 0.f, acc1 = 0.f;
  // the group of AHEAD quads after the one being summed is in flight (two register sets): an unconditional
  // load (past its run a lane reloads its last quad, then zeroes it), so no branch holds a load back
  uint32_t g[AHEAD], gn[AHEAD];
  uint2 v[AHEAD], vn[AHEAD];
#define LOAD_GROUP(G, V, I)                                                   \
  _Pragma("unroll") for (int u = 0; u < AHEAD; ++u) {                         \
    const int at = max(min((I) + u, n - 1), 0);                               \
    const bool live = (I) + u < n;                                            \
    const uint32_t gw = __ldg(pg + 32 * at);                                  \
    const uint2 vw = __ldg(pv + 32 * at);                                     \
    G[u] = live ? gw : 0u;                                                    \
    V[u] = make_uint2(live ? vw.x : 0u, live ? vw.y : 0u);                    \
  }
  if (n > 0) {
    LOAD_GROUP(g, v, 0)
  }
  for (int i = 0; i < n; i += AHEAD) {
    if (i + AHEAD < n) {
      LOAD_GROUP(gn, vn, i + AHEAD)
    }
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) {
      col += g[u] & 255;
      acc0 = fmaf(lo_f(v[u].x), xs[col], acc0);
      col += (g[u] >> 8) & 255;
      acc1 = fmaf(hi_f(v[u].x), xs[col], acc1);
      col += (g[u] >> 16) & 255;
      acc0 = fmaf(lo_f(v[u].y), xs[col], acc0);
      col += g[u] >> 24;
      acc1 = fmaf(hi_f(v[u].y), xs[col], acc1);
    }
#pragma unroll
    for (int u = 0; u < AHEAD; ++u) {
      g[u] = gn[u];
      v[u] = vn[u];
    }
  }
  float acc = acc0 + acc1;
#pragma unroll
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) y[row] = from_f(acc);
}
