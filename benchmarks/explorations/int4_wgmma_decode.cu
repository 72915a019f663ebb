// W4A16 batched decode on Hopper's wgmma (an exploration, issue #38): 8-64 rows of x read by the tensor cores from
// shared memory once a warpgroup, not by every warp through L1 as `qfuse_int4_mma` reads them.
//
//   out^T tile = w tile (64 rows a warpgroup, WG warpgroups a block) x x^T (TOKENS rows of x: wgmma's N)
//
// The weight in the decode kernel's layout (`int4_mma.repack`: a lane's 16 bytes are its A registers for four
// k16 steps), dequantized by its `pair_value` into the register-sourced A operand of wgmma.m64nNk16 (the
// harness puts int4_mma.cu's helpers and the `wgmma` wrapper for TOKENS in front of this file).
//
// A block takes one slice of K (`split_chunks` chunks of 64) for `row_blocks` consecutive blocks of 64 WG rows
// (blockIdx.x = row group * splits + split):
// - it stages the slice's x in shared memory once, k permuted into the A operands' order (a thread loads 64 bytes
//   of one row of x and stores four 16-byte rows of core matrices), one barrier, then streams the weight of its row
//   blocks one after the other through that x, with no barrier but the split reduction's;
// - each chunk: 16 A registers made (double-buffered, one wgmma group in flight; or -DSINGLE_A: one set, the
//   group waited for), four wgmma on the chunk's x;
// - the weight arrives (-DSTREAM) straight into registers two steps of UNROLL chunks deep (0: loads of the next
//   step in flight while one is multiplied), one step deep (1: loaded, then multiplied, the decode kernel's way:
//   fewer registers), or (2) through a ring of RING slots a warp in shared memory, filled by each lane's own
//   16-byte cp.async RING - 1 chunks ahead (and its 8-byte pair at each group's first chunk): bytes in flight that
//   cost no registers, and no barrier, since a lane reads back only what it copied;
// - with one split the block stores its tile (bias, one rounding); with several, each block writes its float sums to
//   `partial` [splits, M, N], and the last block of a row block (an atomic counter, reset by it) adds them in split
//   order, so the result does not depend on which block finishes last.
//
// -DTOKENS=8|16|...|64 (a multiple of 8, >= M), -DWG=1|2, -DUNROLL=2|4|8 (slices are whole steps of it),
// -DSTREAM=0|1|2, -DRING=4|8|16, -DSINGLE_A, -DGROUP_SHIFT (int4_mma.cu's), -DMIN_BLOCKS (launch bounds),
// -DHALF_BF16; ablations (timed only, wrong results): -DSKIP_STAGE, -DSKIP_WGMMA.

#if GROUP_SHIFT >= 30
#define GROUP_CHUNKS (1 << 30)  // one group along K
#else
#define GROUP_CHUNKS (1 << GROUP_SHIFT)
#endif

#define THREADS (128 * WG)
#define LBO_BYTES (TOKENS * 16)       // from one 8-k core matrix to the next along K
#define SBO_BYTES 128                 // from one 8-token core matrix to the next
#define CHUNK_BYTES (8 * LBO_BYTES)   // one chunk of x in shared memory
#define PAIRS (UNROLL >= GROUP_CHUNKS ? UNROLL / GROUP_CHUNKS : 1)  // groups a step of UNROLL chunks touches
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1
#endif
#ifndef STREAM
#define STREAM 0
#endif
#ifndef STAGE_PIECES
#define STAGE_PIECES 2  // pieces of x (64 bytes each) a thread has in flight while staging
#endif

// WGMMA_WRAPPER (the harness puts `wgmma(d, a, desc)` for TOKENS here)

__device__ __forceinline__ unsigned long long descriptor(unsigned address) {  // no swizzle, B K-major
    return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(LBO_BYTES >> 4) << 16) |
           ((unsigned long long)(SBO_BYTES >> 4) << 32);
}

__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < TOKENS / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

struct Step {  // UNROLL chunks of a lane's tile: its words and the (s, z) pairs of their groups
    Words w[UNROLL];
    Pair p[PAIRS];
};

__device__ __forceinline__ void load_step(Step& step, const Words* w_lane, const Pair* pairs_lane, int c,
                                          int pair_stride) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) step.w[u] = load_streaming(w_lane + (long long)(c + u) * 32);
#pragma unroll
    for (int p = 0; p < PAIRS; ++p) step.p[p] = pairs_lane[(long long)((c >> GROUP_SHIFT) + p) * pair_stride];
}

// one chunk on the tensor cores: its A operands `a` made from its words (rows g, g + 8 scaled by their pairs), then
// four wgmma on the chunk's x at `base`; returns once the previous chunk's wgmma are done (its `a` free)
__device__ __forceinline__ void multiply_chunk(float* acc, unsigned (&a)[16], const Words& w, unsigned s_g,
                                               unsigned z_g, unsigned s_h, unsigned z_h, unsigned base) {
    a_operands(a, w, s_g, z_g, s_h, z_h);
#ifdef SKIP_WGMMA  // ablation (wrong results): the A operands made and chained into one sum, no tensor core
    unsigned folded = 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) folded ^= a[i];
    acc[0] += bits_as_float(folded & 0x3FFFFFFF);
    return;
#endif
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    fence_operands(acc);
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma(acc, a + 4 * s, descriptor(base + 2 * s * LBO_BYTES));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    fence_operands(acc);
#ifdef SINGLE_A
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#else
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
#endif
}

// the step's chunks on the tensor cores; x's chunk c_local of the slice at x_base
__device__ __forceinline__ void multiply_step(float* acc, unsigned (&a)[2][16], const Step& step, unsigned x_base,
                                              int c_local) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const Pair pair = step.p[PAIRS > 1 ? u / GROUP_CHUNKS : 0];
#ifdef SINGLE_A
        unsigned (&au)[16] = a[0];
#else
        unsigned (&au)[16] = a[u & 1];
#endif
        multiply_chunk(acc, au, step.w[u], low_pair(pair.x), high_pair(pair.x), low_pair(pair.y),
                       high_pair(pair.y), x_base + (c_local + u) * CHUNK_BYTES);
    }
}

#if STREAM == 2
// The ring: a lane's chunk c of its slice in slot (c - c0) % RING, its words at w_ring + 512 slot, its group's pair
// (copied at a group's first chunk, and at the slice's) at p_ring + 256 slot
__device__ __forceinline__ bool starts_group(int c, int c0) { return c == c0 || (c & (GROUP_CHUNKS - 1)) == 0; }

__device__ __forceinline__ void copy_chunk(unsigned w_ring, unsigned p_ring, const Words* w_lane,
                                           const Pair* pairs_lane, int c, int c0, int c1, int pair_stride) {
    if (c < c1) {
        const unsigned slot = (c - c0) & (RING - 1);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(w_ring + slot * 512),
                     "l"(w_lane + (long long)c * 32) : "memory");
        if (starts_group(c, c0))
            asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(p_ring + slot * 256),
                         "l"(pairs_lane + (long long)(c >> GROUP_SHIFT) * pair_stride) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");  // (empty past the slice: the waits count groups)
}

// chunk c from its slot (landed: RING - 2 younger groups may be in flight), the slot refilled with chunk c + RING - 1
__device__ __forceinline__ void ring_chunk(float* acc, unsigned (&a)[16], unsigned (&sz)[4], unsigned w_ring,
                                           unsigned p_ring, const Words* w_lane, const Pair* pairs_lane, unsigned x_base,
                                           int c, int c0, int c1, int pair_stride) {
    asm volatile("cp.async.wait_group %0;" ::"n"(RING - 2) : "memory");
    const unsigned slot = (c - c0) & (RING - 1);
    Words w;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w)
                 : "r"(w_ring + slot * 512) : "memory");
    if (starts_group(c, c0)) {
        Pair p;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(p.x), "=r"(p.y) : "r"(p_ring + slot * 256) : "memory");
        sz[0] = low_pair(p.x), sz[1] = high_pair(p.x), sz[2] = low_pair(p.y), sz[3] = high_pair(p.y);
    }
    copy_chunk(w_ring, p_ring, w_lane, pairs_lane, c + RING - 1, c0, c1, pair_stride);  // into chunk c - 1's slot
    multiply_chunk(acc, a, w, sz[0], sz[1], sz[2], sz[3], x_base + (c - c0) * CHUNK_BYTES);
}
#endif

// x's chunks [c0, c1) into shared memory, each a [8 core matrices along k][TOKENS / 8][8 tokens][16 bytes] block,
// k permuted into the A operands' order: core matrix 2 s + h of a chunk holds k = 16 t + 4 s + 2 h + {0, 1},
// t = 0..3 (int4_mma.cu's order), so 16 bytes of x (k = 16 t + 8 j .. + 8) give 4 bytes to each of 4 core matrices
__device__ __forceinline__ void stage_x(const Words* __restrict__ x, unsigned x_base, int c0, int c1, int M, int K) {
    const int row_words = K >> 3;
    const int pieces = TOKENS * (c1 - c0) * 2;  // (token, chunk, half j of its core matrices)
    for (int p0 = threadIdx.x; p0 < pieces; p0 += STAGE_PIECES * THREADS) {
        Words v[STAGE_PIECES][4];
#pragma unroll
        for (int i = 0; i < STAGE_PIECES; ++i) {  // the pieces' loads in flight before any store
            const int p = p0 + i * THREADS;
            if (p < pieces) {
                const int token = p % TOKENS, rest = p / TOKENS, j = rest & 1, c = rest >> 1;
                const Words* src = x + (long long)imin(token, M - 1) * row_words + 8 * (c0 + c) + j;
#pragma unroll
                for (int tt = 0; tt < 4; ++tt) v[i][tt] = src[2 * tt];
            }
        }
#pragma unroll
        for (int i = 0; i < STAGE_PIECES; ++i) {
            const int p = p0 + i * THREADS;
            if (p < pieces) {
                const int token = p % TOKENS, rest = p / TOKENS, j = rest & 1, c = rest >> 1;
                const unsigned dst = x_base + c * CHUNK_BYTES + 4 * j * LBO_BYTES + (token >> 3) * SBO_BYTES +
                                     (token & 7) * 16;
                const unsigned* w0 = &v[i][0].x;
                const unsigned* w1 = &v[i][1].x;
                const unsigned* w2 = &v[i][2].x;
                const unsigned* w3 = &v[i][3].x;
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst + q * LBO_BYTES), "r"(w0[q]),
                                 "r"(w1[q]), "r"(w2[q]), "r"(w3[q]));
            }
        }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, seen by wgmma's async proxy
}

// one tile's sums over chunks [c0, c1) of K through x's slice at x_base (the weight's stream by STREAM)
__device__ __forceinline__ void stream_tile(float* acc, unsigned (&a)[2][16], const Words* w_lane,
                                            const Pair* pairs_lane, unsigned x_base, unsigned ring_base, int c0,
                                            int c1, int pair_stride) {
#if STREAM == 2
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned w_ring = ring_base + warp * RING * 512 + lane * 16;
    const unsigned p_ring = ring_base + 4 * WG * RING * 512 + warp * RING * 256 + lane * 8;
#pragma unroll
    for (int i = 0; i < RING - 1; ++i) copy_chunk(w_ring, p_ring, w_lane, pairs_lane, c0 + i, c0, c1, pair_stride);
    unsigned sz[4];  // the current group's (s, z) of rows g and g + 8
    for (int c = c0; c < c1; c += 2) {  // (the slice is a whole number of pairs of chunks)
        ring_chunk(acc, a[0], sz, w_ring, p_ring, w_lane, pairs_lane, x_base, c, c0, c1, pair_stride);
#ifdef SINGLE_A
        ring_chunk(acc, a[0], sz, w_ring, p_ring, w_lane, pairs_lane, x_base, c + 1, c0, c1, pair_stride);
#else
        ring_chunk(acc, a[1], sz, w_ring, p_ring, w_lane, pairs_lane, x_base, c + 1, c0, c1, pair_stride);
#endif
    }
#elif STREAM == 1
    for (int c = c0; c < c1; c += UNROLL) {  // (the slice is a multiple of UNROLL chunks)
        Step now;
        load_step(now, w_lane, pairs_lane, c, pair_stride);
        multiply_step(acc, a, now, x_base, c - c0);
    }
#else
    Step now, next;
    load_step(now, w_lane, pairs_lane, c0, pair_stride);
    for (int c = c0; c < c1; c += 2 * UNROLL) {
        const bool second = c + UNROLL < c1;
        if (second) load_step(next, w_lane, pairs_lane, c + UNROLL, pair_stride);
        multiply_step(acc, a, now, x_base, c - c0);
        if (second) {
            if (c + 2 * UNROLL < c1) load_step(now, w_lane, pairs_lane, c + 2 * UNROLL, pair_stride);
            multiply_step(acc, a, next, x_base, c + UNROLL - c0);
        }
    }
#endif
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_operands(acc);
}

// a row block's sums written: with one split stored (bias, one rounding); with several, this split's sums into
// `partial` and, in the last block to finish the row block, all splits' added in split order and stored
__device__ __forceinline__ void finish(const float* acc, int row_block, int tile, int split, int splits,
                                       const unsigned short* __restrict__ bias, void* __restrict__ out,
                                       float* __restrict__ partial, int* __restrict__ counters, int M, int N,
                                       int has_bias) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row = tile * 16 + g;  // acc[4 i + e]: weight row row + 8 (e >> 1), token 8 i + 2 t + (e & 1)
    if (splits > 1) {
#pragma unroll
        for (int i = 0; i < TOKENS / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int n = row + 8 * (e >> 1), m = 8 * i + 2 * t + (e & 1);
                if (m < M) __stcg(partial + ((long long)split * M + m) * N + n, acc[4 * i + e]);
            }
        __threadfence();
        __syncthreads();  // (no static shared memory: the launcher raises the limit for the dynamic part only)
        if (!__syncthreads_or(threadIdx.x == 0 && atomicAdd(counters + row_block, 1) == splits - 1)) return;
        __threadfence();
    }
#pragma unroll
    for (int i = 0; i < TOKENS / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = row + 8 * (e >> 1), m = 8 * i + 2 * t + (e & 1);
            if (m >= M) continue;
            float sum = acc[4 * i + e];
            if (splits > 1) {
                sum = 0.0f;
                for (int s = 0; s < splits; ++s) sum += __ldcg(partial + ((long long)s * M + m) * N + n);
            }
            if (has_bias) sum += load_as_float<HALF_CODE>(bias, n);
            store_from_float<HALF_CODE>(out, (long long)m * N + n, sum);
        }
    }
    if (splits > 1 && threadIdx.x == 0) counters[row_block] = 0;  // ready for the next launch
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
qfuse_int4_wgmma_decode(const Words* __restrict__ words, const Words* __restrict__ x, const Pair* __restrict__ pairs,
                        const unsigned short* __restrict__ bias, void* __restrict__ out, float* __restrict__ partial,
                        int* __restrict__ counters, int M, int N, int K, int split_chunks, int row_blocks,
                        int has_bias) {
    extern __shared__ __align__(128) unsigned char x_chunks[];
    const int chunks = K >> 6;
    const int splits = (chunks + split_chunks - 1) / split_chunks;
    const int row_group = blockIdx.x / splits, split = blockIdx.x % splits;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int c0 = split * split_chunks, c1 = imin(chunks, c0 + split_chunks);
    const int pair_stride = N >> 1;
    const unsigned x_base = (unsigned)__cvta_generic_to_shared(x_chunks);
    const int first = row_group * row_blocks, last = imin(N / (64 * WG), first + row_blocks);

#ifndef SKIP_STAGE  // ablation (wrong results): x's slice left as it is
    stage_x(x, x_base, c0, c1, M, K);
#endif
    __syncthreads();
    for (int row_block = first; row_block < last; ++row_block) {
        const int tile = row_block * (4 * WG) + warp;  // this warp's 16-row tile: rows 16 (warp % 4) .. of its wgmma
        float acc[TOKENS / 2];
#pragma unroll
        for (int i = 0; i < TOKENS / 2; ++i) acc[i] = 0.0f;
        unsigned a[2][16];
        stream_tile(acc, a, words + (long long)tile * chunks * 32 + lane, pairs + tile * 8 + g, x_base,
                    x_base + split_chunks * CHUNK_BYTES, c0, c1, pair_stride);
        finish(acc, row_block, tile, split, splits, bias, out, partial, counters, M, N, has_bias);
    }
}
