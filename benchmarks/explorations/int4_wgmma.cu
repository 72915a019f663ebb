// W4A16 prefill on Hopper, tried for issue #39 (not kept): the int4 weight dequantized in registers as the A
// operand of wgmma (register-sourced), x's tile the B operand in shared memory (no swizzle).
//
//   out^T tile = w tile (64 rows a warpgroup, WG warpgroups a block) x x^T tile (TOKENS rows of x)
//
// The weight in the decode kernel's layout (int4_mma.cu: a lane's 16 bytes are its A registers for four k16 steps),
// dequantized by its `pair_value` (the harness puts int4_mma.cu's helpers in front of this file). That layout
// orders k within a chunk of 64 for the A registers, so x's tile must hold its k in the same order:
// - default: each thread loads a token's 128 bytes of a chunk into registers and stores them permuted with
//   st.shared, one iteration ahead (3 stages);
// - -DCP_ASYNC: x arrives permuted beforehand (x.view(M, K / 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5)) and is
//   copied by 16-byte cp.async into STAGES stages, the 8-k core matrices padded 16 bytes apart (no bank conflicts).
// Ablation switches: -DNO_CONVERT (A = the raw words), -DNO_STAGE (register staging: x staged once).
// Results: docs/benchmarks.md, "W4A16 prefill on wgmma with the weight in registers".

#ifndef TOKENS
#define TOKENS 256
#endif
#ifndef WG
#define WG 2
#endif
#define THREADS (128 * WG)
#define SBO_BYTES 128  // from one 8-token core matrix to the next
#ifdef CP_ASYNC
#ifndef STAGES
#define STAGES 4
#endif
#define PIECES (8 * TOKENS / THREADS)  // 16-byte pieces of x a thread copies a chunk
#define LBO_BYTES (TOKENS * 16 + 16)   // from one 8-k core matrix to the next along K (+16: no bank conflicts)
#else
#define STAGES 3
#define PIECES (2 * TOKENS / THREADS)  // (token, half of the chunk) pieces a thread stages: 64 bytes each
#define LBO_BYTES (TOKENS * 16)        // from one 8-k core matrix to the next along K
#endif
#define STAGE_BYTES (8 * LBO_BYTES)

// WGMMA_WRAPPERS (the harness puts wgmma_n128 / wgmma_n256 here)

__device__ __forceinline__ void wgmma(float* d, const unsigned* a, unsigned long long desc, int accumulate) {
#if TOKENS == 256
    wgmma_n256(d, a, desc, accumulate);
#else
    wgmma_n128(d, a, desc, accumulate);
#endif
}

__device__ __forceinline__ unsigned long long descriptor(unsigned address) {
    // no swizzle; LBO: from one 8-k core matrix to the next along K, SBO: from one 8-token group to the next
    return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(LBO_BYTES >> 4) << 16) |
           ((unsigned long long)(SBO_BYTES >> 4) << 32);
}

__device__ __forceinline__ void fence_operands(float* d) {
#pragma unroll
    for (int i = 0; i < TOKENS / 2; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

struct Chunk {  // what a lane reads of one chunk of its 16-row tile: the words and the (s, z) pairs of rows g, g + 8
    Words w;
    unsigned pair_g, pair_h;
};

__device__ __forceinline__ void convert(unsigned (&a)[16], const Chunk& ch) {
#ifdef NO_CONVERT
    const unsigned raw[4] = {ch.w.x, ch.w.y, ch.w.z, ch.w.w};
#pragma unroll
    for (int i = 0; i < 16; ++i) a[i] = raw[i & 3] & 0x3F3F3F3Fu;
    return;
#endif
    a_operands(a, ch.w, low_pair(ch.pair_g), high_pair(ch.pair_g), low_pair(ch.pair_h), high_pair(ch.pair_h));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
qfuse_int4_wgmma(const Words* __restrict__ words, const Words* __restrict__ x, const unsigned* __restrict__ sz,
                 const unsigned short* __restrict__ bias, void* __restrict__ out, int M, int N, int K,
                 int group_chunks, int has_bias) {
    extern __shared__ __align__(128) unsigned char stages[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int chunks = K >> 6;
    const int tile = blockIdx.x * (4 * WG) + warp;  // this warp's 16-row tile of the weight
    const int row = tile * 16 + g;
    const int token0 = blockIdx.y * TOKENS;
    const int row_words = K >> 3;  // 16-byte words a row of x
    const Words* w_lane = words + (long long)tile * chunks * 32 + lane;
    const unsigned* sz_row = sz + row;
    const unsigned stage0 = (unsigned)__cvta_generic_to_shared(stages);

#ifdef CP_ASYNC
    // the pieces this thread copies: piece p = tid + THREADS i is (token p / 8, core matrix kc = p % 8) of x,
    // whose k are already in the A operands' order (x permuted within each chunk of 64)
    const Words* x_piece[PIECES];
    unsigned st_piece[PIECES];
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        const int p = tid + THREADS * i, token = p >> 3, kc = p & 7;
        x_piece[i] = x + (long long)min(token0 + token, M - 1) * row_words + kc;
        st_piece[i] = kc * LBO_BYTES + (token >> 3) * SBO_BYTES + (token & 7) * 16;
    }
    auto load_chunk = [&](int c) {
        Chunk ch;
        ch.w = load_streaming(w_lane + (long long)c * 32);
        const unsigned* p = sz_row + (long long)(c / group_chunks) * N;
        ch.pair_g = p[0];
        ch.pair_h = p[8];
        return ch;
    };
    auto copy_x = [&](int c) {  // chunk c's x into its stage, one commit group (empty past the last chunk)
        if (c < chunks) {
            const unsigned base = stage0 + (c % STAGES) * STAGE_BYTES;
#pragma unroll
            for (int i = 0; i < PIECES; ++i)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + st_piece[i]), "l"(x_piece[i] + 8 * c)
                             : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };

#else
    // the pieces this thread stages: piece p = tid + THREADS i is (token p % TOKENS, half j = p / TOKENS)
    const Words* x_piece[PIECES];
    unsigned st_piece[PIECES];  // its byte offset in a stage, kc = 4 j
#pragma unroll
    for (int i = 0; i < PIECES; ++i) {
        const int p = tid + THREADS * i, token = p % TOKENS, j = p / TOKENS;
        x_piece[i] = x + (long long)min(token0 + token, M - 1) * row_words + j;  // + 4 c ... word 2 t' + j of chunk
        st_piece[i] = 4 * j * LBO_BYTES + (token >> 3) * SBO_BYTES + (token & 7) * 16;
    }
    auto load_chunk = [&](int c) {
        Chunk ch;
        ch.w = load_streaming(w_lane + (long long)c * 32);
        const unsigned* p = sz_row + (long long)(c / group_chunks) * N;
        ch.pair_g = p[0];
        ch.pair_h = p[8];
        return ch;
    };
    Words xs[PIECES][4];
    auto load_x = [&](int c) {
#pragma unroll
        for (int i = 0; i < PIECES; ++i)
#pragma unroll
            for (int tt = 0; tt < 4; ++tt) xs[i][tt] = x_piece[i][8 * c + 2 * tt];
    };
    auto store_x = [&](int c) {
        const unsigned base = stage0 + (c % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < PIECES; ++i) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {  // core matrix kc = 4 j + q: word q of each t
                const unsigned* w0 = &xs[i][0].x;
                const unsigned* w1 = &xs[i][1].x;
                const unsigned* w2 = &xs[i][2].x;
                const unsigned* w3 = &xs[i][3].x;
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(base + st_piece[i] + q * LBO_BYTES),
                             "r"(w0[q]), "r"(w1[q]), "r"(w2[q]), "r"(w3[q]) : "memory");
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    };

#endif
    float acc[TOKENS / 2];  // (the first chunk's MMAs ignore what they hold)
    unsigned a[2][16];
    Chunk next[2];

    // chunk c's four k16 steps on the tensor cores, its A operands `a_now`; returns once chunk c - 1's are done
    auto multiply = [&](int c, const unsigned* a_now) {
        const unsigned base = stage0 + (c % STAGES) * STAGE_BYTES;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        fence_operands(acc);
#pragma unroll
        for (int s = 0; s < 4; ++s) wgmma(acc, a_now + 4 * s, descriptor(base + 2 * s * LBO_BYTES), c > 0 || s > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        fence_operands(acc);
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    };

#ifdef CP_ASYNC
    // prologue: chunks 0 .. STAGES - 2 on their way, chunk 0 landed, a[0] its A operands
    next[0] = load_chunk(0);
    if (chunks > 1) next[1] = load_chunk(1);
#pragma unroll
    for (int c = 0; c < STAGES - 1; ++c) copy_x(c);
    convert(a[0], next[0]);
    if (chunks > 2) next[0] = load_chunk(2);
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();

    auto iteration = [&](int c, unsigned (&a_now)[16], unsigned (&a_next)[16], Chunk& ch_next) {
        multiply(c, a_now);  // then chunk c - 1's MMAs are done: its stage free
        if (c + 1 < chunks) {
            convert(a_next, ch_next);
            if (c + 3 < chunks) ch_next = load_chunk(c + 3);
        }
        asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 3) : "memory");  // chunk c + 1 landed
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncthreads();
        copy_x(c + STAGES - 1);  // into chunk c - 1's stage
    };
#else
    // prologue: stage 0 holds chunk 0, a[0] its A operands; chunk 1's words and x in registers, chunk 2's words
    next[0] = load_chunk(0);
    if (chunks > 1) next[1] = load_chunk(1);
    load_x(0);
    store_x(0);
    if (chunks > 1) load_x(1);
    convert(a[0], next[0]);
    if (chunks > 2) next[0] = load_chunk(2);
    __syncthreads();

    auto iteration = [&](int c, unsigned (&a_now)[16], unsigned (&a_next)[16], Chunk& ch_next) {
        multiply(c, a_now);
        if (c + 1 < chunks) {
            convert(a_next, ch_next);
            if (c + 3 < chunks) ch_next = load_chunk(c + 3);
#ifndef NO_STAGE
            store_x(c + 1);
            if (c + 2 < chunks) load_x(c + 2);
#endif
        }
        __syncthreads();
    };
#endif
    for (int c = 0; c < chunks; c += 2) {
        iteration(c, a[0], a[1], next[1]);
        if (c + 1 < chunks) iteration(c + 1, a[1], a[0], next[0]);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    fence_operands(acc);

    // d[4 i + e]: weight row 16 warp + g + 8 (e >> 1), token 8 i + 2 t + (e & 1)
#pragma unroll
    for (int i = 0; i < TOKENS / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int n = row + 8 * (e >> 1), m = token0 + 8 * i + 2 * t + (e & 1);
            if (m >= M) continue;
            float sum = acc[4 * i + e];
            if (has_bias) sum += load_as_float<HALF_CODE>(bias, n);
            store_from_float<HALF_CODE>(out, (long long)m * N + n, sum);
        }
    }
}
