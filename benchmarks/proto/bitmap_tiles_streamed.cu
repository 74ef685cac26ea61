// Bitmap-tile decode SpMM, streamed (LANE_MAJOR: the fragment's bitmap as 8 words, word g byte t = lane 4g+t's 8
// A-fragment slots, values packed lane after lane, a lane's slot offsets from a 256-entry table): each warp copies its (strip, K-range)'s bitmaps and packed values group by
// group into a shared-memory ring with cp.async (16-byte vectors, STAGES groups in flight, no dependence on the
// bitmaps to know what to copy: a group's value range comes from the offsets array), then decodes each 16 x 16
// fragment's four 8 x 8 tile bitmaps by popcount straight into mma.m16n8k16 A fragments.
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
#ifndef GROUP
#define GROUP 16
#endif
#define BM_BYTES (GROUP * 32)
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
bitmap_tiles_stream(const unsigned long long* __restrict__ bitmaps,  // [strips][chunks][4]
                    const unsigned short* __restrict__ values,       // packed; 8 pad entries before and after
                    const unsigned* __restrict__ offsets,            // [strips * groups + 1]: first value of each group
                    const T* __restrict__ x, T* __restrict__ y, const float* __restrict__ bias,
                    int M, int K, int N, int chunks, int groups, int kw, int groups_per_warp, int slot_bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5, spb = warps / kw;
    const int sl = warp / kw, kslot = warp % kw;
    const int strip = blockIdx.x * spb + sl;
    const int strips = (M + 15) >> 4;
    float* red = reinterpret_cast<float*>(smem);
#ifdef LANE_MAJOR
    // slot_offsets[b]: nibble i = byte offset of slot i in a lane's run for slot pattern b; slot_masks[b]: 4 words
    // keeping the halves whose slot is set
    unsigned* slot_offsets = reinterpret_cast<unsigned*>(smem + spb * 16 * 8 * NT * 4);
    uint4* slot_masks = reinterpret_cast<uint4*>(smem + spb * 16 * 8 * NT * 4 + 1024);
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        unsigned e = 0, c = 0, mk[4] = {0, 0, 0, 0};
        for (int i = 0; i < 8; ++i) {
            e |= (2u * c) << (4 * i);
            if ((b >> i) & 1) { mk[i >> 1] |= (i & 1) ? 0xffff0000u : 0x0000ffffu; ++c; }
        }
        slot_offsets[b] = e;
        slot_masks[b] = make_uint4(mk[0], mk[1], mk[2], mk[3]);
    }
#define TABLE_BYTES (1024 + 4096)
#else
#define TABLE_BYTES 0
#endif
    unsigned char* ring = smem + spb * 16 * 8 * NT * 4 + TABLE_BYTES + warp * STAGES * slot_bytes;
    const unsigned ring_s = (unsigned)__cvta_generic_to_shared(ring);
    for (int i = threadIdx.x; i < spb * 16 * 8 * NT; i += blockDim.x) red[i] = 0.f;
    __syncthreads();
    const int g = lane >> 2, t = lane & 3, p = g * 8 + 2 * t;
    const bool high = p >= 32;
    const unsigned below_lo = high ? 0xffffffffu : ((1u << p) - 1u);
    const unsigned below_hi = high ? ((1u << (p - 32)) - 1u) : 0u;
    const unsigned sh = p & 31;
    const unsigned lane_below = (1u << (8 * t)) - 1u;  // slots of the lanes before this one in its word
    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const int g0 = kslot * groups_per_warp;
    const int g1 = strip < strips ? min(groups, g0 + groups_per_warp) : g0;
    const int nst = max(0, g1 - g0);
    // the warp's stage offsets, loaded once: lane i holds stage i's first value (nst <= 31 asserted by the host)
    const unsigned my_off = (strip < strips && lane <= nst) ? offsets[strip * groups + g0 + lane] : 0u;
#ifdef XSTAGE
    const int xrow = GROUP * 32 + 16;  // bytes a staged x row takes (padded against bank conflicts)
#define XS_BYTES (8 * NT * (GROUP * 32 + 16))
#else
#define XS_BYTES 0
#endif
    auto issue = [&](int i) {  // stage i: group g0 + i into slot i % STAGES
        if (i < nst) {
            const int grp = g0 + i;
            const int c0 = grp * GROUP, nf = min(chunks - c0, GROUP);
            const unsigned slot = ring_s + (i % STAGES) * slot_bytes;
#ifndef SKIP_COPY
            if (lane < 2 * nf) cp16(slot + lane * 16, bitmaps + ((size_t)strip * chunks + c0) * 4 + lane * 2);
            const size_t v0 = __shfl_sync(0xffffffffu, my_off, i), v1 = __shfl_sync(0xffffffffu, my_off, i + 1);
#ifdef XSTAGE
            for (int v = lane; v < N * GROUP * 2; v += 32) {
                const int n = v / (GROUP * 2), q = v % (GROUP * 2);
                cp16(slot + BM_BYTES + n * xrow + q * 16, x + (size_t)n * K + c0 * 16 + q * 8);
            }
#endif
            const size_t a0 = v0 & ~(size_t)7, nvec = (v1 - a0 + 7) >> 3;
            for (int v = lane; v < (int)nvec; v += 32) cp16(slot + BM_BYTES + XS_BYTES + v * 16, values + a0 + v * 8);
#endif
        }
        commit();
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) issue(i);
    for (int i = 0; i < nst; ++i) {
        issue(i + STAGES - 1);
        wait_group<STAGES - 1>();
        __syncwarp();
        const int grp = g0 + i, c0 = grp * GROUP, nf = min(chunks - c0, GROUP);
        const unsigned char* slot = ring + (i % STAGES) * slot_bytes;
        const unsigned long long* bm = reinterpret_cast<const unsigned long long*>(slot);
        const unsigned v0 = __shfl_sync(0xffffffffu, my_off, i);
        const unsigned short* vals = reinterpret_cast<const unsigned short*>(slot + BM_BYTES + XS_BYTES) + (v0 & 7);
        unsigned off = 0;
#pragma unroll 2
        for (int f = 0; f < nf; ++f) {
#ifdef LANE_MAJOR
            const unsigned* words = reinterpret_cast<const unsigned*>(bm) + 8 * f;
            const unsigned mine = words[lane & 7], count = __popc(mine);
            unsigned incl = count;
#pragma unroll
            for (int d = 1; d < 8; d <<= 1) {
                const unsigned up = __shfl_up_sync(0xffffffffu, incl, d, 8);
                if ((lane & 7) >= d) incl += up;
            }
            const unsigned before = __shfl_sync(0xffffffffu, incl - count, g, 8);
            const unsigned total = __shfl_sync(0xffffffffu, incl, 7, 8);
            const unsigned word = __shfl_sync(0xffffffffu, mine, g, 8);
            const unsigned pattern = (word >> (8 * t)) & 0xffu;
            const unsigned run = off + before + __popc(word & lane_below);
            const unsigned char* base = reinterpret_cast<const unsigned char*>(vals + run);
            const unsigned e = slot_offsets[pattern];
            const uint4 mk = slot_masks[pattern];
            const unsigned keep[4] = {mk.x, mk.y, mk.z, mk.w};
            unsigned a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned short r0 = *reinterpret_cast<const unsigned short*>(base + ((e >> (8 * j)) & 15u));
                const unsigned short r1 = *reinterpret_cast<const unsigned short*>(base + ((e >> (8 * j + 4)) & 15u));
                a[j] = ((unsigned)r0 | ((unsigned)r1 << 16)) & keep[j];
            }
            off += total;
#else
            const ulonglong2 b01 = reinterpret_cast<const ulonglong2*>(bm)[2 * f];
            const ulonglong2 b23 = reinterpret_cast<const ulonglong2*>(bm)[2 * f + 1];
            const unsigned long long w[4] = {b01.x, b01.y, b23.x, b23.y};
            unsigned a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned lo = (unsigned)w[j], hi = (unsigned)(w[j] >> 32);
                const unsigned o = off + __popc(lo & below_lo) + __popc(hi & below_hi);
                const unsigned bits = ((high ? hi : lo) >> sh) & 3u;
#ifdef SKIP_VALS
                const unsigned short e0 = (unsigned short)(o & 0x3ff), e1 = (unsigned short)bits;
#else
#ifdef BRANCHY
                const unsigned short e0 = (bits & 1u) ? vals[o] : (unsigned short)0;
                const unsigned short e1 = (bits & 2u) ? vals[o + (bits & 1u)] : (unsigned short)0;
#else
                // unconditional loads (the index stays inside the copied stage), then a select: no branches
                const unsigned short r0 = vals[o], r1 = vals[o + (bits & 1u)];
                const unsigned short e0 = (bits & 1u) ? r0 : (unsigned short)0;
                const unsigned short e1 = (bits & 2u) ? r1 : (unsigned short)0;
#endif
#endif
                a[j] = (unsigned)e0 | ((unsigned)e1 << 16);
                off += __popc(lo) + __popc(hi);
            }
#endif
            const int k0 = (c0 + f) * 16;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = j * 8 + g;
                unsigned b0 = 0, b1 = 0;
#ifdef SKIP_X
                b0 = k0; b1 = n;
                if (false) {
#else
                if (n < N) {
#endif
#ifdef XSTAGE
                    const unsigned* xr = reinterpret_cast<const unsigned*>(slot + BM_BYTES + n * xrow + f * 32);
                    b0 = xr[t];
                    b1 = xr[4 + t];
#else
                    const unsigned* xr = reinterpret_cast<const unsigned*>(x + (size_t)n * K + k0);
                    b0 = __ldg(xr + t);
                    b1 = __ldg(xr + 4 + t);
#endif
                }
#ifdef SKIP_MMA
                acc[j][0] += __uint_as_float(a[0] ^ a[1] ^ a[2] ^ a[3] ^ b0 ^ b1);
#else
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                             : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
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
