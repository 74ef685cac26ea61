// Decode at N = 1 with one row a lane: a warp owns 32 rows and one K-slice; every lane takes its row's
// values in lockstep with the others (value i of every lane at step i) and walks its own bitmap to find
// each value's column.
//
// Why this mapping (the nonzero-driven walk, bitmap_walk.cu, paid ~7 us of per-row latency and a start
// search per lane; walking positions instead leaves each lane a dynamic cursor into its values):
// - values: the rows of a group are stored ELL-interleaved in quads (4 fp16 = 8 bytes), quad q of lane l at
//   [group][q][l], each (row, slice) run starting at a quad; step i reads quad i of every lane's run: static
//   halves, 256-byte segments per warp load, PF quads in flight (a ring in registers).
// - bitmap: the warp's slice of its 32 rows' bitmaps in shared memory, word w of lane l at [w][l]: a lane's
//   next word is one conflict-free LDS whatever word each lane is on.
// - x: the block's slice of x in shared memory (fp32); lanes on different words may share a bank (a few
//   wavefronts a load; shared memory has the headroom at these rates).
// - per value: the next set bit (FLO), clear it, one LDS of x, convert, FMA; a word is fetched when the
//   lane's bits run out. Past its own run a lane walks sentinel bits over zeros of x (no end test a value).
// - split K: M / 32 groups x S slices of warps; partial sums added atomically into an fp32 workspace,
//   rounded into y by the last block of each row block (one launch a call).
//
// Format (rowlane_walk_bench.py pack): bm uint32 [G][K/32][32], column 32 w + j at bit 31 - j of word w;
// vals uint2 [sum_g Q_g + pad][32] from quad row gbase[g]; off uint16 [G][S][32]: the quad where slice s
// starts in its row's run (each (row, slice) run padded to whole quads).
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef WARPS
#define WARPS 4
#endif
#ifndef PF
#define PF 4
#endif

#ifdef BF16
typedef __nv_bfloat16 elem_t;
__device__ __forceinline__ float lo_half(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_half(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float to_float(elem_t v) { return __bfloat162float(v); }
__device__ __forceinline__ unsigned short out_raw(float v) { return __bfloat16_as_ushort(__float2bfloat16(v)); }
#else
typedef __half elem_t;
__device__ __forceinline__ float lo_half(unsigned w) { return __low2float(*(__half2*)&w); }
__device__ __forceinline__ float hi_half(unsigned w) { return __high2float(*(__half2*)&w); }
__device__ __forceinline__ float to_float(elem_t v) { return __half2float(v); }
__device__ __forceinline__ unsigned short out_raw(float v) { return __half_as_ushort(__float2half(v)); }
#endif

// One value: its column is the lane's next set bit (the highest: bit 31 - j is column j of the word). bw points
// at the lane's current word in shared memory, xw at that word's 32 values of x (reversed: xw[31 - j] is
// column j). Past its run a lane meets sentinel words (every bit set) over zeros of x, so the lockstep needs
// no per-value test of the run's end.
__device__ __forceinline__ float take(float acc, float v, unsigned& bits, const unsigned*& bw, const float*& xw) {
  if (bits == 0) {
    bw += 32;
    xw += 32;
    bits = *bw;
    while (bits == 0) {  // an empty word: rare where the bitmap is not very sparse
      bw += 32;
      xw += 32;
      bits = *bw;
    }
  }
  const int hb = 31 - __clz(bits);
  bits ^= 1u << hb;
  return fmaf(v, xw[hb], acc);
}

// The lane's row over this warp's slice: the values of its run in lockstep with the warp (module header).
__device__ __forceinline__ float walk_run(const uint2* __restrict__ vq, int count, const unsigned* bw,
                                          const float* xw) {
  int steps = count;  // the warp walks as many quads as its longest run
  for (int d = 16; d; d >>= 1) steps = max(steps, __shfl_xor_sync(0xffffffffu, steps, d));
  const int quads = (steps + 3) >> 2;
  // a lane loads only its own run's quads: past it the lockstep multiplies zeros (no other slice's bytes read)
  const int own = (count + 3) >> 2;
  uint2 ring[PF];
#pragma unroll
  for (int k = 0; k < PF; ++k) ring[k] = k < own ? __ldg(vq + 32 * k) : make_uint2(0u, 0u);
  float acc = 0.f;
  unsigned bits = *bw;
  for (int i = 0; i < quads; i += PF) {
#pragma unroll
    for (int k = 0; k < PF; ++k) {
      const uint2 q = ring[k];
      ring[k] = i + k + PF < own ? __ldg(vq + 32 * (i + k + PF)) : make_uint2(0u, 0u);
      if (i + k < quads) {
        acc = take(acc, lo_half(q.x), bits, bw, xw);
        acc = take(acc, hi_half(q.x), bits, bw, xw);
        acc = take(acc, lo_half(q.y), bits, bw, xw);
        acc = take(acc, hi_half(q.y), bits, bw, xw);
      }
    }
  }
  return acc;
}

// y (M elements) = W x: grid (row blocks of WARPS groups, S slices). Each slice's partial sums are added into
// the fp32 workspace; the last block of a row block to finish (a counter per row block, reset by it) rounds
// its rows into y and zeroes them in the workspace, so a call is one launch (a second kernel costs ~2 us in a
// graph, more than the whole call at 90%).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
rowlane_walk(const unsigned* __restrict__ bm, const uint2* __restrict__ vals, const long long* __restrict__ gbase,
             const unsigned short* __restrict__ off, const elem_t* __restrict__ x, float* __restrict__ ws,
             unsigned short* __restrict__ y, unsigned* __restrict__ done, int M, int K, int S, int slice) {
  extern __shared__ float smem[];
  float* xs = smem;                                           // 2 x slice: x's slice (words reversed), then zeros
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int nw = slice >> 5;
  unsigned* bs = (unsigned*)(smem + 2 * slice) + warp * 2 * nw * 32;  // this warp's words [w][lane], then sentinels
  const int s = blockIdx.y, c0 = s * slice;
  for (int i = threadIdx.x; i < 2 * slice; i += blockDim.x) {
    const int c = c0 + (i & ~31) + (31 - (i & 31));
    xs[i] = i < slice && c < K ? to_float(x[c]) : 0.f;
  }
  const int g = blockIdx.x * WARPS + warp;
  const int groups = (M + 31) >> 5, words_k = (K + 31) >> 5;
  const bool active = g < groups;
  int count = 0;
  if (active) {
    const unsigned* src = bm + ((size_t)g * words_k + (c0 >> 5)) * 32 + lane;
    for (int w = 0; w < nw; ++w) {
      const unsigned word = (c0 >> 5) + w < words_k ? __ldg(src + 32 * w) : 0u;
      bs[32 * w + lane] = word;
      bs[32 * (nw + w) + lane] = 0xffffffffu;
      count += __popc(word);
    }
  }
  __syncthreads();
  if (active) {
    const uint2* vq = vals + (gbase[g] + off[((size_t)g * S + s) * 32 + lane]) * 32 + lane;  // quad i: vq[32 i]
    const float acc = walk_run(vq, count, bs + lane, xs);
    const int row = g * 32 + lane;
    if (row < M) atomicAdd(ws + row, acc);
  }
  __threadfence();  // this block's sums visible before its arrival is counted
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(done + blockIdx.x, 1u) == (unsigned)S - 1;
  __syncthreads();
  if (last) {
    const int row = blockIdx.x * WARPS * 32 + threadIdx.x;
    if (row < M) {
      y[row] = out_raw(__ldcg(ws + row));  // from L2, where the atomics landed
      ws[row] = 0.f;
    }
    if (threadIdx.x == 0) done[blockIdx.x] = 0u;
  }
}
