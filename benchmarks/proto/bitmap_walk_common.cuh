// Helpers both bitmap-walk kernels share (bitmap_walk.cu, bitmap_walk_transposed.cu): the compile-time knobs
// (NT tokens, C values a chunk, PF chunks in flight, MAXT threads a block, PMAX bitmap words a lane), the chunk
// and staged-x types, and 16-bit value conversions (fp16, or bf16 with -DBF16).
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
