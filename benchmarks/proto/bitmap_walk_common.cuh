// Helpers both bitmap-walk kernels share (bitmap_walk.cu, bitmap_walk_transposed.cu): the compile-time knobs
// (NT tokens, C values a chunk, PF chunks in flight, MAXT threads a block, PMAX bitmap words a lane), the chunk
// and staged-x types, 16-bit value conversions (fp16, or bf16 with -DBF16), and the steps every entry takes
// alike: staging a row's bitmap words, finding where a lane's run starts, storing the row's sums, and the
// kernel that writes split rows' workspace out.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef NT
#define NT 1
#endif
#ifndef C
#define C 8
#endif
#ifndef PF
#define PF 2
#endif
#ifndef MAXT
#define MAXT 512
#endif
#define FULL 0xffffffffu

#if C == 8
typedef uint4 chunk_t;
#elif C == 4
typedef uint2 chunk_t;
#else
typedef unsigned int chunk_t;
#endif

#ifdef XHALF
typedef __half xs_t;
__device__ __forceinline__ float xs_float(xs_t v) { return __half2float(v); }
__device__ __forceinline__ xs_t to_xs(float v) { return __float2half(v); }
#else
typedef float xs_t;
__device__ __forceinline__ float xs_float(xs_t v) { return v; }
__device__ __forceinline__ xs_t to_xs(float v) { return v; }
#endif

__device__ __forceinline__ unsigned pair_of(const chunk_t& v, int i) {
#if C == 8
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
#elif C == 4
  return i == 0 ? v.x : v.y;
#else
  return v;
#endif
}

__device__ __forceinline__ float value_of(unsigned pair, int hi) {
#ifdef BF16
  return __uint_as_float(hi ? (pair & 0xffff0000u) : (pair << 16));
#else
  __half2 h = *reinterpret_cast<__half2*>(&pair);
  return hi ? __high2float(h) : __low2float(h);
#endif
}

__device__ __forceinline__ float in_float(unsigned short raw) {
#ifdef BF16
  return __uint_as_float(((unsigned)raw) << 16);
#else
  return __half2float(__ushort_as_half(raw));
#endif
}

__device__ __forceinline__ unsigned short out_raw(float v) {
#ifdef BF16
  return __bfloat16_as_ushort(__float2bfloat16(v));
#else
  return __half_as_ushort(__float2half(v));
#endif
}

__device__ __forceinline__ chunk_t load_chunk(const chunk_t* p) { return __ldg(p); }

#ifndef PMAX
#define PMAX 16
#endif

// A warp stages its lanes' bitmap words of a row (lane l holds words l P .. l P + P - 1) into its slice of
// shared memory; each lane's count of set bits.
__device__ __forceinline__ int stage_words(unsigned* mybm, const unsigned (&words)[PMAX], int lane, int P, int W) {
  int cnt = 0;
#pragma unroll
  for (int k = 0; k < PMAX; ++k) {
    const int wi = lane * P + k;
    if (k < P && wi < W) mybm[wi] = words[k];
    cnt += __popc(words[k]);
  }
  return cnt;
}

// Where a lane's run of nonzeros (from nonzero t0 of the row) starts: the first lane whose words' inclusive
// count passes t0 (a warp scan, then a binary search by shuffles), and in ex the nonzeros before that lane's
// words.
__device__ __forceinline__ int run_start(int cnt, int t0, int lane, int& ex) {
  int incl = cnt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_up_sync(FULL, incl, d);
    if (lane >= d) incl += o;
  }
  int o = 0;
#pragma unroll
  for (int step = 16; step >= 1; step >>= 1) {
    const int iv = __shfl_sync(FULL, incl, o + step - 1);
    if (iv <= t0) o += step;
  }
  o = min(o, 31);
  ex = __shfl_sync(FULL, incl - cnt, o);
  return o;
}

// The row's sums over the warp's lanes; lane t writes token t's (into y, or added into the fp32 workspace when
// the row is split into segments).
__device__ __forceinline__ void store_row(float (&acc)[NT], int lane, int n, int nseg, unsigned short* y, float* ws,
                                          int rows, int row) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) acc[t] += __shfl_xor_sync(FULL, acc[t], d);
  }
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    if (lane == t && t < n) {
      if (nseg == 1)
        y[(size_t)t * rows + row] = out_raw(acc[t]);
      else
        atomicAdd(ws + (size_t)t * rows + row, acc[t]);
    }
  }
}

// Segments summed by atomics into an fp32 workspace: written out here, and the workspace zeroed for the next call.
extern "C" __global__ void bitmap_walk_finish(float* __restrict__ ws, unsigned short* __restrict__ y, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) {
    y[i] = out_raw(ws[i]);
    ws[i] = 0.f;
  }
}
