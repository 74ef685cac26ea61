// Bitmap-tile SpMM for decode (Y = X W^T, X: N x K tokens, W: M x K) on tensor cores.
// W is stored as 16 x 16 fragments (four 8 x 8 tiles, each a 64-bit bitmap) and the nonzero values packed in
// fragment order. A lane of mma.m16n8k16's A fragment holds the same two bit positions (row g, columns 2t, 2t+1)
// of each of the four tiles, so it finds its values by popcount below those positions: no dense rebuild.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef NT
#define NT 1        // n tiles of 8 tokens
#endif
#ifndef UNROLL
#define UNROLL 4    // fragments a warp decodes before its mmas
#endif
#ifndef MAXT
#define MAXT 256
#endif
#ifndef GROUP
#define GROUP 16    // fragments per offset group
#endif
#ifdef BF16
typedef __nv_bfloat16 T;
#define MMA_TYPE "bf16"
#define TO_T(x) __float2bfloat16(x)
#else
typedef __half T;
#define MMA_TYPE "f16"
#define TO_T(x) __float2half(x)
#endif

__device__ __forceinline__ unsigned pack_pair(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

extern "C" __global__ void __launch_bounds__(MAXT)
bitmap_tiles_nk(const unsigned long long* __restrict__ bitmaps,  // [strips][chunks][4]
                const unsigned short* __restrict__ values,       // packed, fragment order
                const unsigned* __restrict__ offsets,            // [strips][groups]: first value of each group
                const T* __restrict__ x,                         // N x K
                T* __restrict__ y,                               // N x M
                const float* __restrict__ bias,                  // M or null
                int M, int K, int N, int chunks, int groups, int kw, int groups_per_warp) {
    extern __shared__ float red[];  // [strips per block][16][8 * NT]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int spb = blockDim.x / (32 * kw);
    const int sl = warp / kw, kslot = warp % kw;
    const int strip = blockIdx.x * spb + sl;
    const int strips = (M + 15) >> 4;
    for (int i = threadIdx.x; i < spb * 16 * 8 * NT; i += blockDim.x) red[i] = 0.f;
    __syncthreads();
    const int g = lane >> 2, t = lane & 3;
    const int p = g * 8 + 2 * t;
    const unsigned long long below = (1ull << p) - 1ull;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    if (strip < strips) {
        const int g0 = kslot * groups_per_warp;
        const int g1 = min(groups, g0 + groups_per_warp);
        if (g0 < g1) {
            const int c0 = g0 * GROUP, c1 = min(chunks, g1 * GROUP);
            unsigned off = offsets[strip * groups + g0];
            const ulonglong2* bm = reinterpret_cast<const ulonglong2*>(bitmaps) + (size_t)strip * chunks * 2;
            for (int c = c0; c < c1; c += UNROLL) {
                ulonglong2 b[UNROLL][2];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    if (c + u < c1) {
                        b[u][0] = __ldg(bm + 2 * (c + u));
                        b[u][1] = __ldg(bm + 2 * (c + u) + 1);
                    } else {
                        b[u][0] = make_ulonglong2(0, 0);
                        b[u][1] = make_ulonglong2(0, 0);
                    }
                }
                unsigned a[UNROLL][4];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    unsigned long long w[4] = {b[u][0].x, b[u][0].y, b[u][1].x, b[u][1].y};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const unsigned o = off + __popcll(w[j] & below);
                        const bool h0 = (w[j] >> p) & 1ull, h1 = (w[j] >> (p + 1)) & 1ull;
                        const unsigned short v0 = h0 ? __ldg(values + o) : (unsigned short)0;
                        const unsigned short v1 = h1 ? __ldg(values + o + h0) : (unsigned short)0;
                        a[u][j] = pack_pair(v0, v1);
                        off += __popcll(w[j]);
                    }
                }
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    const int k0 = (c + u) * 16;
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        const int n = j * 8 + g;
                        unsigned b0 = 0, b1 = 0;
                        if (n < N && c + u < c1) {
                            const unsigned* xr = reinterpret_cast<const unsigned*>(x + (size_t)n * K + k0);
                            b0 = __ldg(xr + t);
                            b1 = __ldg(xr + 4 + t);
                        }
                        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                                     : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                                     : "r"(a[u][0]), "r"(a[u][1]), "r"(a[u][2]), "r"(a[u][3]), "r"(b0), "r"(b1));
                    }
                }
            }
        }
        float* r = red + sl * 16 * 8 * NT;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int col = j * 8 + 2 * t;
            atomicAdd(r + g * 8 * NT + col, acc[j][0]);
            atomicAdd(r + g * 8 * NT + col + 1, acc[j][1]);
            atomicAdd(r + (g + 8) * 8 * NT + col, acc[j][2]);
            atomicAdd(r + (g + 8) * 8 * NT + col + 1, acc[j][3]);
        }
    }
    __syncthreads();
    // out: y[n][m], m fastest across threads (coalesced)
    for (int i = threadIdx.x; i < spb * 16 * 8 * NT; i += blockDim.x) {
        const int s = i / (16 * 8 * NT), rem = i % (16 * 8 * NT);
        const int n = rem / 16, row = rem % 16;
        const int m = (blockIdx.x * spb + s) * 16 + row;
        if (m < M && n < N) {
            float v = red[s * 16 * 8 * NT + row * 8 * NT + n];
            if (bias) v += bias[m];
            y[(size_t)n * M + m] = TO_T(v);
        }
    }
}
