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
// and one shared-memory x load per nonzero. x is staged once per block in shared memory, fp32 (or fp16), NT
// tokens an entry, lane-block-transposed so that lanes walking their own stretches of a row read different
// banks. Segments are multiples of 128 columns (a warp reads its bitmap four words at a time).
// A variant of bitmap_walk.cu (x staged by column, the bitmap read a word at a time), which measured faster
// (docs/history.md); run by `VARIANT=transposed python3 benchmarks/proto/bitmap_walk_bench.py`. -DSTAGE16 (N = 1,
// not yet measured): x staged by 16-byte loads, lane l taking lane block l (its strided loads made x's staging
// uncoalesced).
#include "bitmap_walk_common.cuh"

// One row (of one segment) a warp. Every load the row needs is issued before the block waits for x:
// the row's chunk offsets first, then its bitmap words and its first PF value chunks side by side, so a
// row costs two memory round trips, not one per chunk.
extern "C" __global__ void __launch_bounds__(MAXT, 1) bitmap_walk(
    const unsigned* __restrict__ bm, const chunk_t* __restrict__ vals, const int* __restrict__ coff,
    const unsigned short* __restrict__ x, unsigned short* __restrict__ y, float* __restrict__ ws,
    int rows, int cols, int n, int seg, int nseg, int W) {
  extern __shared__ __align__(16) unsigned char smem[];
  xs_t* xs = reinterpret_cast<xs_t*>(smem);
  unsigned* bms = reinterpret_cast<unsigned*>(smem + ((32 * 32 * ((W + 31) >> 5) * NT * sizeof(xs_t) + 15) / 16) * 16);
  const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int s = blockIdx.x % nseg, c0 = s * seg;
  const int row = (blockIdx.x / nseg) * warps + warp;
  const bool live = row < rows;
  const int v = s * rows + (live ? row : 0);
  // Loads in the order they can be issued: the row's chunk offsets and bitmap words (addressed by the row
  // alone), x for the block, then the value chunks (addressed by the offsets), so the offsets' round trip
  // overlaps the staging and the chunks' the search.
  const int base = __ldg(coff + v), next = __ldg(coff + v + 1);
  const int P = (W + 31) >> 5;
  const unsigned* rb = bm + (size_t)v * W;
  unsigned words[PMAX];
#pragma unroll
  for (int k = 0; k < PMAX; ++k) {
    const int wi = lane * P + k;
    words[k] = (live && k < P && wi < W) ? __ldg(rb + wi) : 0u;
  }
  // x staged lane-block-transposed: column c at entry (c % B) * 32 + c / B (B = 32 P columns, the columns
  // of P words), so lanes walking their own stretches of a row read different banks; a warp's stores here
  // go to 32 banks, one a lane.
  const int B = 32 * P;
#if defined(STAGE16) && NT == 1
  // 16-byte loads: lane l reads 8 columns of lane block l (entries (off .. off + 7) * 32 + l: its stores hit
  // 32 banks), so a warp's loads touch 32 lines once per 8 columns, not once per column
  for (int i = threadIdx.x; i < B * 4; i += blockDim.x) {
    const int blk = i & 31, off = (i >> 5) * 8, col = blk * B + off;
    const size_t at = (size_t)c0 + col;
    float xv[8];
    if (n > 0 && col + 8 <= seg && at + 8 <= (size_t)cols && at % 8 == 0) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + at));
      const unsigned pairs[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) xv[k] = in_float((unsigned short)(pairs[k >> 1] >> (16 * (k & 1))));
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k)
        xv[k] = (n > 0 && col + k < seg && at + k < (size_t)cols) ? in_float(x[at + k]) : 0.f;
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) xs[(off + k) * 32 + blk] = to_xs(xv[k]);
  }
#else
#pragma unroll 4
  for (int i = threadIdx.x; i < B * 32; i += blockDim.x) {
    const int col = (i & 31) * B + (i >> 5);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      float xv = 0.f;
      if (t < n && col < seg && c0 + col < cols) xv = in_float(x[(size_t)t * cols + c0 + col]);
      xs[i * NT + t] = to_xs(xv);
    }
  }
#endif
  const int nch = live ? next - base : 0;
  const int qc = (nch + 31) >> 5, e = nch - 32 * (qc - 1);
  const int cl = nch == 0 ? 0 : (lane < e ? qc : qc - 1);
  const int t0 = (lane * (qc - 1) + min(lane, e)) * C;
  const chunk_t* vp = vals + (size_t)base + lane;
  chunk_t buf[PF];
#pragma unroll
  for (int i = 0; i < PF; ++i)
    if (i < cl) buf[i] = load_chunk(vp + i * 32);
  unsigned* mybm = bms + warp * W;
  const int cnt = stage_words(mybm, words, lane, P, W);
  __syncthreads();
  if (!live) return;
  float acc[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) acc[t] = 0.f;
  int ex;
  const int o = run_start(cnt, t0, lane, ex);  // the lane of words holding nonzero t0
  if (cl > 0) {
    int rem = t0 - ex, wi = o * P;
    unsigned w = mybm[wi];
    int pc = __popc(w);
    while (rem >= pc) {
      rem -= pc;
      w = mybm[++wi];
      pc = __popc(w);
    }
    for (; rem > 0; --rem) w &= 0x7fffffffu >> __clz(w);
    int blk = wi / P, off = wi - blk * P;  // the word's lane block and place in it: x's entry, kept by increments
    uint4 win = *reinterpret_cast<const uint4*>(mybm + (wi & ~3));  // the next words, four at a time
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
              if (++off == P) {
                off = 0;
                ++blk;
              }
              const int q = wi & 3;
              if (q == 0) win = wi < W ? *reinterpret_cast<const uint4*>(mybm + wi) : make_uint4(FULL, FULL, FULL, FULL);
              w = q == 0 ? win.x : q == 1 ? win.y : q == 2 ? win.z : win.w;
            }
            const int z = __clz(w);
            w &= 0x7fffffffu >> z;
            const int xi = (off * 32 + z) * 32 + blk;
            const bool real = wi < W;  // a last chunk's padding walks past the row: x is zero there
            const float a = value_of(pair_of(cv, j >> 1), j & 1);
#if NT == 1
            acc[0] = fmaf(a, real ? xs_float(xs[xi]) : 0.f, acc[0]);
#elif defined(XHALF) && (NT % 2 == 0)
#pragma unroll
            for (int t = 0; t < NT; t += 2) {
              const float2 xv = real ? __half22float2(*reinterpret_cast<const __half2*>(xs + xi * NT + t)) : make_float2(0.f, 0.f);
              acc[t] = fmaf(a, xv.x, acc[t]);
              acc[t + 1] = fmaf(a, xv.y, acc[t + 1]);
            }
#elif !defined(XHALF) && (NT % 4 == 0)
#pragma unroll
            for (int t = 0; t < NT; t += 4) {
              const float4 xv = real ? *reinterpret_cast<const float4*>(xs + xi * NT + t) : make_float4(0.f, 0.f, 0.f, 0.f);
              acc[t] = fmaf(a, xv.x, acc[t]);
              acc[t + 1] = fmaf(a, xv.y, acc[t + 1]);
              acc[t + 2] = fmaf(a, xv.z, acc[t + 2]);
              acc[t + 3] = fmaf(a, xv.w, acc[t + 3]);
            }
#else
#pragma unroll
            for (int t = 0; t < NT; ++t) acc[t] = fmaf(a, real ? xs_float(xs[xi * NT + t]) : 0.f, acc[t]);
#endif
          }
        }
      }
    }
  }
  store_row(acc, lane, n, nseg, y, ws, rows, row);
}

