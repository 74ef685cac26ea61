// Bitmap decode SpMM on tensor cores, lane-major by stage (Y = X W^T; X: N x K tokens, W: M x K).
// W is cut into 16 x 16 fragments; a stage is 16 fragments along K (256 columns) of one 16-row strip.
// Lane l = 4g + t of mma.m16n8k16 holds 8 A slots of a fragment (register j = i / 2, half h = i % 2):
//   row g + 8 (j & 1), column 4t + h + 2 (j >> 1) of the fragment (the k order inside a fragment is permuted
//   so that a lane's B fragment is 4 consecutive x values: one 8-byte load).
// Per stage the format holds each lane's 16 slot bytes (byte f: the lane's slots of fragment f) and the
// nonzero values lane after lane, fragment by fragment, slot by slot; one 32-bit offset per stage.
// A lane's run therefore starts at (its stage start) + (popcounts of its earlier bytes): one scan per stage,
// one popc per fragment, and each slot's offset inside the run from a 256-entry table.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef NT
#define NT 1
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef MAXT
#define MAXT 256
#endif
#define FRAGS 16                 // fragments a stage
#define BM_BYTES (32 * FRAGS)    // slot bytes of a stage
#define X_ROW (FRAGS * 32 + 16)  // bytes of one staged x row (padded against bank conflicts)
#ifdef BF16
typedef __nv_bfloat16 T;
#define MMA_TYPE "bf16"
#define TO_T(x) __float2bfloat16(x)
#else
typedef __half T;
#define MMA_TYPE "f16"
#define TO_T(x) __float2half(x)
#endif

__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;"); }
template <int N_> __device__ __forceinline__ void wait_group() { asm volatile("cp.async.wait_group %0;" :: "n"(N_)); }

extern "C" __global__ void __launch_bounds__(MAXT)
bitmap_lanes(const uint4* __restrict__ slots,            // [strips][stages][32 lanes]: 16 slot bytes each
             const unsigned short* __restrict__ values,  // packed; 8 pad entries before and after
             const unsigned* __restrict__ offsets,       // [strips * stages + 1]: first value of each stage
             const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ bias,
             int M, int K, int N, int nstages, int kw, int stages_per_warp, int slot_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5, spb = warps / kw;
    const int sl = warp / kw, kslot = warp % kw;
    const int strip = blockIdx.x * spb + sl;
    const int strips = (M + 15) >> 4;
    const int xrows = N < 8 * NT ? N : 8 * NT;
    float* red = reinterpret_cast<float*>(smem);
    unsigned* slot_offsets = reinterpret_cast<unsigned*>(smem + spb * 16 * 8 * NT * 4);
    uint4* slot_masks = reinterpret_cast<uint4*>(smem + spb * 16 * 8 * NT * 4 + 1024);
    unsigned char* ring = smem + spb * 16 * 8 * NT * 4 + 1024 + 4096 + warp * STAGES * slot_bytes;
    const unsigned ring_s = (unsigned)__cvta_generic_to_shared(ring);
    for (int i = threadIdx.x; i < spb * 16 * 8 * NT; i += blockDim.x) red[i] = 0.f;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        unsigned e = 0, c = 0, mk[4] = {0, 0, 0, 0};
        for (int i = 0; i < 8; ++i) {
            e |= (2u * c) << (4 * i);
            if ((b >> i) & 1) { mk[i >> 1] |= (i & 1) ? 0xffff0000u : 0x0000ffffu; ++c; }
        }
        slot_offsets[b] = e;
        slot_masks[b] = make_uint4(mk[0], mk[1], mk[2], mk[3]);
    }
    __syncthreads();
    const int g = lane >> 2, t = lane & 3;
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const int s0 = kslot * stages_per_warp;
    const int s1 = strip < strips ? min(nstages, s0 + stages_per_warp) : s0;
    const int nst = max(0, s1 - s0);
    const unsigned my_off = (strip < strips && lane <= nst) ? offsets[strip * nstages + s0 + lane] : 0u;
    auto issue = [&](int i) {
        if (i < nst) {
            const int st = s0 + i;
            const unsigned slot = ring_s + (i % STAGES) * slot_bytes;
            cp16(slot + lane * 16, slots + ((size_t)strip * nstages + st) * 32 + lane);
            for (int v = lane; v < xrows * (FRAGS * 2); v += 32) {  // x: 256 columns of each token, 16 bytes a copy
                const int n = v / (FRAGS * 2), q = v % (FRAGS * 2);
                cp16(slot + BM_BYTES + n * X_ROW + q * 16, x + (size_t)n * K + st * (FRAGS * 16) + q * 8);
            }
            const unsigned v0 = __shfl_sync(0xffffffffu, my_off, i), v1 = __shfl_sync(0xffffffffu, my_off, i + 1);
            const unsigned a0 = v0 & ~7u, nvec = (v1 - a0 + 7) >> 3;
            for (unsigned v = lane; v < nvec; v += 32)
                cp16(slot + BM_BYTES + xrows * X_ROW + v * 16, values + a0 + v * 8);
        }
        commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(i);
    for (int i = 0; i < nst; ++i) {
        issue(i + STAGES - 1);
        wait_group<STAGES - 1>();
        __syncwarp();
        const unsigned char* slot = ring + (i % STAGES) * slot_bytes;
        const uint4 mine = reinterpret_cast<const uint4*>(slot)[lane];
#ifndef ELL
        const unsigned total = __popc(mine.x) + __popc(mine.y) + __popc(mine.z) + __popc(mine.w);
#endif
#ifndef ELL
        unsigned incl = total;
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const unsigned up = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += up;
        }
#endif
        const unsigned v0 = __shfl_sync(0xffffffffu, my_off, i);
#ifdef ELL
        // lane l's r-th value of the stage sits at r * 32 + l: lanes read neighbouring halves, no bank conflicts
        const unsigned char* run = slot + BM_BYTES + xrows * X_ROW + 2 * ((v0 & 7) + lane);
#else
        const unsigned char* run = slot + BM_BYTES + xrows * X_ROW + 2 * ((v0 & 7) + incl - total);
#endif
        const unsigned words[4] = {mine.x, mine.y, mine.z, mine.w};
#pragma unroll
        for (int f = 0; f < FRAGS; ++f) {
            const unsigned pattern = (words[f >> 2] >> (8 * (f & 3))) & 0xffu;
            const unsigned e = slot_offsets[pattern];
            const uint4 mk = slot_masks[pattern];
            const unsigned keep[4] = {mk.x, mk.y, mk.z, mk.w};
            unsigned a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
#ifdef ELL
                const unsigned short r0 = *reinterpret_cast<const unsigned short*>(run + 32 * ((e >> (8 * j)) & 15u));
                const unsigned short r1 = *reinterpret_cast<const unsigned short*>(run + 32 * ((e >> (8 * j + 4)) & 15u));
#else
                const unsigned short r0 = *reinterpret_cast<const unsigned short*>(run + ((e >> (8 * j)) & 15u));
                const unsigned short r1 = *reinterpret_cast<const unsigned short*>(run + ((e >> (8 * j + 4)) & 15u));
#endif
                a[j] = ((unsigned)r0 | ((unsigned)r1 << 16)) & keep[j];
            }
#ifdef ELL
            run += 64 * __popc(pattern);
#else
            run += 2 * __popc(pattern);
#endif
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = j * 8 + g;
                uint2 b = make_uint2(0u, 0u);
                if (n < N) b = *reinterpret_cast<const uint2*>(slot + BM_BYTES + n * X_ROW + f * 32 + t * 8);
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                             : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
            }
        }
        __syncwarp();
    }
    wait_group<0>();
    if (strip < strips && nst > 0) {
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
