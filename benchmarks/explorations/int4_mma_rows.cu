// qfuse_int4_mma with x staged in shared memory for a block of several 16-row tiles: tried for issue #38's batched
// decode (9-64 rows) and not kept (docs/benchmarks.md, "x staged in shared memory for a block of row tiles").
// The harness (int4_batched_decode.py) compiles qfuse/kernels/cuda/int4_mma.cu up to its kernel, then this file.
//
// A block of ROW_TILES 16-row tiles whose warps share x's loads from the L2. Warp w takes tile ROW_TILES * blockIdx.x + w / K_WARPS and, at each step, the UNROLL chunks K_WARPS * UNROLL * step +
// UNROLL * (w % K_WARPS) on: the block's step covers STEP_CHUNKS chunks of K, whose x (8 * M_TILES rows, the last row
// repeated past M) the block copies by cp.async into one of two stages in shared memory while it multiplies the step
// before. Each warp reads its x from the stage as `qfuse_int4_mma` reads it from L1 (rows padded by 16 bytes: a
// quarter warp's 16-byte reads fall in distinct banks), so x crosses the L2 once a block, not once a 16-row tile.
// Shared memory: the harness's `stage_bytes`, dynamic; the stages hold the warps' sums after the loop.
#ifndef MIN_BLOCKS
#define MIN_BLOCKS MIN_BLOCKS_FOR(M_TILES <= 2 ? 32 : M_TILES == 4 ? 24 : 16)
#endif
#define K_WARPS (WARPS / ROW_TILES)
#define STEP_CHUNKS (K_WARPS * UNROLL)
#define STAGE_ROW_WORDS (8 * STEP_CHUNKS + 1)     // 16-byte words a row of x takes in a stage
#define STAGE_WORDS (8 * M_TILES * STAGE_ROW_WORDS)
#define COPIES ((8 * M_TILES * 8 * STEP_CHUNKS + WARPS * 32 - 1) / (WARPS * 32))  // 16-byte copies a thread a step

__device__ __forceinline__ void copy_async(Words* to, const Words* from) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(to)), "l"(from)
                 : "memory");
}

// x's words of the block's step `step` into its stage, one commit group
__device__ __forceinline__ void copy_step(Words* stages, const Words* __restrict__ x, int step, int M, int row_words) {
    Words* stage = stages + (step & 1) * STAGE_WORDS;
    const int first = step * 8 * STEP_CHUNKS;  // x's first word of the step along a row
#pragma unroll
    for (int i = 0; i < COPIES; ++i) {
        const int piece = threadIdx.x + WARPS * 32 * i, r = piece / (8 * STEP_CHUNKS), w = piece % (8 * STEP_CHUNKS);
        if (r < 8 * M_TILES && first + w < row_words)
            copy_async(stage + r * STAGE_ROW_WORDS + w, x + (long long)imin(r, M - 1) * row_words + first + w);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
qfuse_int4_mma_rows(const Words* __restrict__ words, const Words* __restrict__ x, const Pair* __restrict__ pairs,
                    const unsigned short* __restrict__ bias, void* __restrict__ out, int M, int N, int K, int has_bias) {
    extern __shared__ Words stages[];  // [2][8 M_TILES][STAGE_ROW_WORDS], then the warps' Partials
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tile = blockIdx.x * ROW_TILES + warp / K_WARPS, k_warp = warp % K_WARPS;
    const int chunks = K >> 6, row_words = K >> 3;
    const int steps = (chunks + STEP_CHUNKS - 1) / STEP_CHUNKS;
    const Words* lane_x = stages + g * STAGE_ROW_WORDS + 8 * UNROLL * k_warp + 2 * t;  // from its first chunk a step
    const WeightLane weight{words + (long long)tile * chunks * 32 + lane, pairs + tile * 8 + g, N >> 1};
    float acc[M_TILES][4];
    zero(acc);
    copy_step(stages, x, 0, M, row_words);
    for (int step = 0; step < steps; ++step) {
        const int c = step * STEP_CHUNKS + UNROLL * k_warp;  // this warp's first chunk of the step
        const int here = imin(UNROLL, chunks - c);           // its chunks (the last step may hold fewer)
        Words w[UNROLL];
        if (here == UNROLL)
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) w[u] = weight.chunk(c + u);
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();  // the step's x in its stage; every warp done with the other stage
        if (step + 1 < steps) copy_step(stages, x, step + 1, M, row_words);
        XRows xs;  // the lane's rows in the step's stage
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) xs.tile[i] = lane_x + (step & 1) * STAGE_WORDS + 8 * i * STAGE_ROW_WORDS;
        if (here == UNROLL) {
            multiply_chunks<UNROLL>(acc, w, weight, xs, c, 0);
        } else if (here > 0) {  // a step's end in steps of 4, 2, 1 (c a multiple of UNROLL)
            int d = 0;
            if (UNROLL > 4 && d + 4 <= here) load_and_multiply<4>(acc, weight, xs, c + d, d), d += 4;
            if (UNROLL > 2 && d + 2 <= here) load_and_multiply<2>(acc, weight, xs, c + d, d), d += 2;
            if (d < here) load_and_multiply<1>(acc, weight, xs, c + d, d);
        }
    }
    __syncthreads();  // the stages are free: they hold the sums now
    Partials* partial = reinterpret_cast<Partials*>(stages);
    keep(partial, warp, lane, acc);
    __syncthreads();
    if (k_warp == 0) add_up_and_store<K_WARPS>(partial, warp, lane, tile * 16 + g, bias, out, M, N, has_bias);
}
