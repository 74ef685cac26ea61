// Nonzero-driven decode of a row bitmap on CUDA cores, for N = 1..8 tokens: cost per nonzero, not per
// position.
//
// Format (benchmarks/proto/bitmap_walk_bench.py packs it on the GPU), per virtual row v (a row's columns cut
// into segments of SEG; v = segment * rows + row):
//   bm[v][W]    W = SEG / 32 words, column j of a word at bit 31 - j (a walk finds the next column by clz)
//   coff[v]     the row's first chunk; coff[v + 1] - coff[v] = nch = ceil(nnz / C) chunks of C values
//   vals        chunk (r, lane) of row v at coff[v] + 32 r + lane: lane l owns the chunks
//               [l (qc - 1) + min(l, e), ...) of the row's nonzeros in column order (qc = ceil(nch / 32),
//               e = nch - 32 (qc - 1) lanes own qc, the rest qc - 1), so a warp's loads are coalesced, each
//               lane walks one contiguous run of nonzeros, and the only padding is the last chunk's tail.
// A warp takes a row (one row a warp: rows are many). Its lanes count the bitmap's bits (a warp scan), each
// finds where its run starts by a binary search over the lanes' counts, then walks its bits: one clz, one mask
// and one shared-memory x load per nonzero. x is staged once per block in shared memory as fp32 (or fp16)
// [column][NT], with 32 zero columns past the segment (where a last chunk's padding walks).
// bitmap_walk_transposed.cu is a variant (x lane-block-transposed, the bitmap read four words at a time) that
// measured slower (docs/history.md). bitmap_walk_rows, below, runs persistent warps over several rows each,
// the next row's loads in flight while this one is walked (not yet measured).
#include "bitmap_walk_common.cuh"

// A lane's run over the row: from its first nonzero (the rem-th set bit of lane o's words in the row's bitmap
// mybm) through cl chunks of C values, buf holding the first PF (the rest loaded from vp as these are used),
// W x added into acc. Both entries below walk with it.
__device__ __forceinline__ void walk_run(float (&acc)[NT], chunk_t (&buf)[PF], const chunk_t* vp, int cl,
                                         const unsigned* mybm, int W, int P, int o, int rem, const xs_t* xs) {
  int wi = o * P;
  unsigned w = mybm[wi];
  int pc = __popc(w);
  while (rem >= pc) {
    rem -= pc;
    w = mybm[++wi];
    pc = __popc(w);
  }
  for (; rem > 0; --rem) w &= 0x7fffffffu >> __clz(w);
  for (int r = 0; r < cl; r += PF) {
#pragma unroll
    for (int i = 0; i < PF; ++i) {
      if (r + i < cl) {
        const chunk_t cv = buf[i];
        if (r + i + PF < cl) buf[i] = load_chunk(vp + (r + i + PF) * 32);
#pragma unroll
        for (int j = 0; j < C; ++j) {
          while (w == 0) {
            ++wi;
            w = wi < W ? mybm[wi] : FULL;
          }
          const int z = __clz(w);
          const int col = wi * 32 + z;
          w &= 0x7fffffffu >> z;
          const float a = value_of(pair_of(cv, j >> 1), j & 1);
#if NT == 1
          acc[0] = fmaf(a, xs_float(xs[col]), acc[0]);
#elif defined(XHALF) && (NT % 2 == 0)
#pragma unroll
          for (int t = 0; t < NT; t += 2) {
            const float2 xv = __half22float2(*reinterpret_cast<const __half2*>(xs + col * NT + t));
            acc[t] = fmaf(a, xv.x, acc[t]);
            acc[t + 1] = fmaf(a, xv.y, acc[t + 1]);
          }
#elif !defined(XHALF) && (NT % 4 == 0)
#pragma unroll
          for (int t = 0; t < NT; t += 4) {
            const float4 xv = *reinterpret_cast<const float4*>(xs + col * NT + t);
            acc[t] = fmaf(a, xv.x, acc[t]);
            acc[t + 1] = fmaf(a, xv.y, acc[t + 1]);
            acc[t + 2] = fmaf(a, xv.z, acc[t + 2]);
            acc[t + 3] = fmaf(a, xv.w, acc[t + 3]);
          }
#else
#pragma unroll
          for (int t = 0; t < NT; ++t) acc[t] = fmaf(a, xs_float(xs[col * NT + t]), acc[t]);
#endif
        }
      }
    }
  }
}

// One row (of one segment) a warp. Every load the row needs is issued before the block waits for x:
// the row's chunk offsets first, then its bitmap words and its first PF value chunks side by side, so a
// row costs two memory round trips, not one per chunk.
extern "C" __global__ void __launch_bounds__(MAXT) bitmap_walk(
    const unsigned* __restrict__ bm, const chunk_t* __restrict__ vals, const int* __restrict__ coff,
    const unsigned short* __restrict__ x, unsigned short* __restrict__ y, float* __restrict__ ws,
    int rows, int cols, int n, int seg, int nseg, int W) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int xs_cols = seg + 32;  // 32 zero columns past the segment: where a last chunk's padding walks
  xs_t* xs = reinterpret_cast<xs_t*>(smem);
  unsigned* bms = reinterpret_cast<unsigned*>(smem + ((xs_cols * NT * sizeof(xs_t) + 15) / 16) * 16);
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = blockIdx.x % nseg, c0 = s * seg;
  const int row = (blockIdx.x / nseg) * warps + warp;
  const bool live = row < rows;
  const int v = s * rows + (live ? row : 0);
  const int base = __ldg(coff + v), nch = live ? __ldg(coff + v + 1) - base : 0;
  const int qc = (nch + 31) >> 5, e = nch - 32 * (qc - 1);
  const int cl = nch == 0 ? 0 : (lane < e ? qc : qc - 1);
  const int t0 = (lane * (qc - 1) + min(lane, e)) * C;
  const int P = (W + 31) >> 5;
  const unsigned* rb = bm + (size_t)v * W;
  unsigned words[PMAX];
#pragma unroll
  for (int k = 0; k < PMAX; ++k) {
    const int wi = lane * P + k;
    words[k] = (live && k < P && wi < W) ? __ldg(rb + wi) : 0u;
  }
  const chunk_t* vp = vals + (size_t)base + lane;
  chunk_t buf[PF];
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (i < cl) buf[i] = load_chunk(vp + i * 32);
  for (int i = threadIdx.x; i < xs_cols * NT; i += blockDim.x) {
    const int col = i / NT, t = i % NT;
    float xv = 0.f;
    if (t < n && col < seg && c0 + col < cols) xv = in_float(x[(size_t)t * cols + c0 + col]);
    xs[i] = to_xs(xv);
  }
  unsigned* mybm = bms + warp * W;
  const int cnt = stage_words(mybm, words, lane, P, W);
  __syncthreads();
  if (!live) return;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  int ex;
  const int o = run_start(cnt, t0, lane, ex);  // the lane of words holding nonzero t0
  if (cl > 0) walk_run(acc, buf, vp, cl, mybm, W, P, o, t0 - ex, xs);
  store_row(acc, lane, n, nseg, y, ws, rows, row);
}


// What a warp loads for one row before walking it: the chunk offsets, its lanes' bitmap words and the first
// PF value chunks of each lane's run.
struct RowLoads {
  int base, nch;
  unsigned words[PMAX];
  chunk_t buf[PF];
};

__device__ __forceinline__ void load_row_head(RowLoads& st, const unsigned* __restrict__ bm,
                                              const int* __restrict__ coff, int v, bool live, int lane, int P,
                                              int W) {
  st.base = live ? __ldg(coff + v) : 0;
  st.nch = live ? __ldg(coff + v + 1) - st.base : 0;
  const unsigned* rb = bm + (size_t)v * W;
#pragma unroll
  for (int k = 0; k < PMAX; ++k) {
    const int wi = lane * P + k;
    st.words[k] = (live && k < P && wi < W) ? __ldg(rb + wi) : 0u;
  }
}

__device__ __forceinline__ void load_row_chunks(RowLoads& st, const chunk_t* __restrict__ vals, int lane) {
  const int qc = (st.nch + 31) >> 5, e = st.nch - 32 * (qc - 1);
  const int cl = st.nch == 0 ? 0 : (lane < e ? qc : qc - 1);
  const chunk_t* vp = vals + (size_t)st.base + lane;
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (i < cl) st.buf[i] = load_chunk(vp + i * 32);
}

// Persistent warps, several rows each (a grid-stride loop over rows): x is staged once per block for all its
// rows, and the next row's offsets and bitmap words are loaded while this row is counted and searched, its
// first chunks while this row is walked, so a row's round trips overlap the previous row's work instead of
// adding up (bitmap_walk pays them once per warp with nothing to hide them). Not yet measured.
extern "C" __global__ void __launch_bounds__(MAXT) bitmap_walk_rows(
    const unsigned* __restrict__ bm, const chunk_t* __restrict__ vals, const int* __restrict__ coff,
    const unsigned short* __restrict__ x, unsigned short* __restrict__ y, float* __restrict__ ws,
    int rows, int cols, int n, int seg, int nseg, int W) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int xs_cols = seg + 32;
  xs_t* xs = reinterpret_cast<xs_t*>(smem);
  unsigned* bms = reinterpret_cast<unsigned*>(smem + ((xs_cols * NT * sizeof(xs_t) + 15) / 16) * 16);
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = blockIdx.x % nseg, c0 = s * seg;
  const int stride = (gridDim.x / nseg) * warps;
  const int P = (W + 31) >> 5;
  int row = (blockIdx.x / nseg) * warps + warp;
  RowLoads cur;
  load_row_head(cur, bm, coff, s * rows + min(row, rows - 1), row < rows, lane, P, W);
  load_row_chunks(cur, vals, lane);
  for (int i = threadIdx.x; i < xs_cols * NT; i += blockDim.x) {
    const int col = i / NT, t = i % NT;
    float xv = 0.f;
    if (t < n && col < seg && c0 + col < cols) xv = in_float(x[(size_t)t * cols + c0 + col]);
    xs[i] = to_xs(xv);
  }
  __syncthreads();
  unsigned* mybm = bms + warp * W;
  for (; row < rows; row += stride) {
    const int after = row + stride;
    RowLoads nxt;
    load_row_head(nxt, bm, coff, s * rows + min(after, rows - 1), after < rows, lane, P, W);
    __syncwarp();  // the last row's walk has read mybm
    const int cnt = stage_words(mybm, cur.words, lane, P, W);
    __syncwarp();
    const int nch = cur.nch, qc = (nch + 31) >> 5, e = nch - 32 * (qc - 1);
    const int cl = nch == 0 ? 0 : (lane < e ? qc : qc - 1);
    const int t0 = (lane * (qc - 1) + min(lane, e)) * C;
    int ex;
    const int o = run_start(cnt, t0, lane, ex);
    load_row_chunks(nxt, vals, lane);  // its offsets have arrived by now
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t] = 0.f;
    if (cl > 0) walk_run(acc, cur.buf, vals + (size_t)cur.base + lane, cl, mybm, W, P, o, t0 - ex, xs);
    store_row(acc, lane, n, nseg, y, ws, rows, row);
    cur = nxt;
  }
}
