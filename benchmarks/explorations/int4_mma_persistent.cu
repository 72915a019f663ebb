// qfuse_int4_mma with x staged once in shared memory by persistent blocks (an exploration for issue #38: decode at
// 16-64 rows, where every warp's loads of x through L1, not the weight's stream, bound the launch rule's kernel).
// The harness (int4_persistent_decode.py) compiles qfuse/kernels/cuda/int4_mma.cu up to its kernel, then this file.
//
// The grid is a few blocks a multiprocessor, each resident for the whole launch. Block b takes slice b % SLICES of
// K (SLICE_CHUNKS chunks of 64) and copies x's rows of that slice into shared memory once (rows padded by 16 bytes:
// the 8 lanes of a quarter warp read distinct banks), then its GROUPS groups of GROUP_WARPS warps stream 16-row
// tiles through it: group i of the slice's blocks takes tiles i, i + groups, ... Within a group the warps split the
// slice's chunks as the launch rule's warps split K (UNROLL chunks in registers ahead, the same dequantize and MMAs),
// then add their sums in shared memory behind a named barrier. With one slice the group stores the tile; with more,
// each slice's group sum goes to a float32 workspace and the last slice to arrive (an atomic counter a tile, reset by
// it) adds the slices in slice order, so the result does not depend on which block ends last.
//
// x crosses the L2 once a block (not once a 16-row tile) and is read by ld.shared, 4 wavefronts a 16-byte read.
// Shared memory (dynamic): x [M][8 SLICE_CHUNKS + 1] 16-byte words, then the warps' Partials.
#define GROUPS (WARPS / GROUP_WARPS)
#ifndef SLICES
#define SLICES 1
#endif
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 1
#endif

__device__ __forceinline__ void copy_async(Words* to, const Words* from) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(to)), "l"(from)
                 : "memory");
}

__device__ __forceinline__ void group_barrier(int group) {  // the group's warps only (barrier 0 is __syncthreads')
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(GROUP_WARPS * 32) : "memory");
}

// The group's sums of one tile (warps [first, first + GROUP_WARPS) of `partial`), added in warp order, as lane's
// 4 M_TILES floats
__device__ __forceinline__ void group_sum(float (&sum)[4 * M_TILES], const Partials* partial, int first, int lane) {
#pragma unroll
    for (int j = 0; j < 4 * M_TILES; ++j) {
        float s = 0.0f;
#pragma unroll
        for (int other = 0; other < GROUP_WARPS; ++other) s += partial[first + other][lane][j];
        sum[j] = s;
    }
}

__device__ __forceinline__ void store_tile(const float (&sum)[4 * M_TILES], int lane, int row,
                                           const unsigned short* __restrict__ bias, void* __restrict__ out, int M,
                                           int N, int has_bias) {
    const int t = lane & 3;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int n = row + 8 * (j >> 1), m = 8 * i + 2 * t + (j & 1);
            if (m >= M) continue;
            float v = sum[4 * i + j];
            if (has_bias) v += load_as_float<HALF_CODE>(bias, n);
            store_from_float<OUT_CODE>(out, (long long)m * N + n, v);
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, BLOCKS_PER_SM)
qfuse_int4_mma_persistent(const Words* __restrict__ words, const Words* __restrict__ x, const Pair* __restrict__ pairs,
                          const unsigned short* __restrict__ bias, void* __restrict__ out, float* __restrict__ workspace,
                          int* __restrict__ counters, int M, int N, int K, int has_bias) {
    extern __shared__ Words staged[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int group = warp / GROUP_WARPS, group_warp = warp % GROUP_WARPS;
    const int slice = blockIdx.x % SLICES, slice_blocks = gridDim.x / SLICES;
    const int chunks = K >> 6, row_words = K >> 3;
    const int first_chunk = slice * SLICE_CHUNKS;
    const int slice_chunks = imin(SLICE_CHUNKS, chunks - first_chunk);
    const int rows = imin(M, 8 * M_TILES);
    constexpr int stride = 8 * SLICE_CHUNKS + 1;  // 16-byte words a staged row of x

    for (int piece = threadIdx.x; piece < rows * 8 * slice_chunks; piece += WARPS * 32) {
        const int r = piece / (8 * slice_chunks), w = piece % (8 * slice_chunks);
        copy_async(staged + r * stride + w, x + (long long)r * row_words + 8 * first_chunk + w);
    }
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
    __syncthreads();

    Partials* partial = reinterpret_cast<Partials*>(staged + rows * stride);
    XRows x_rows;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) x_rows.tile[i] = staged + imin(g + 8 * i, M - 1) * stride + 2 * t;
    const int aligned = imin(UNROLL, GROUP_CHUNKS);
    const int per_warp = ((slice_chunks + GROUP_WARPS - 1) / GROUP_WARPS + aligned - 1) / aligned * aligned;
    const int begin = group_warp * per_warp, end = imin(slice_chunks, begin + per_warp);
    const int tiles = N >> 4;
    for (int tile = (blockIdx.x / SLICES) * GROUPS + group; tile < tiles; tile += slice_blocks * GROUPS) {
        const WeightLane weight{words + (long long)tile * chunks * 32 + lane, pairs + tile * 8 + g, N >> 1};
        float acc[M_TILES][4];
        zero(acc);
        int c = begin;  // within the slice; the weight's chunk is first_chunk + c
        for (; c + UNROLL <= end; c += UNROLL) load_and_multiply<UNROLL>(acc, weight, x_rows, first_chunk + c, c);
        if (UNROLL > 4 && c + 4 <= end) load_and_multiply<4>(acc, weight, x_rows, first_chunk + c, c), c += 4;
        if (UNROLL > 2 && c + 2 <= end) load_and_multiply<2>(acc, weight, x_rows, first_chunk + c, c), c += 2;
        if (c < end) load_and_multiply<1>(acc, weight, x_rows, first_chunk + c, c);
        keep(partial, warp, lane, acc);
        group_barrier(group);
        if (group_warp == 0) {
            float sum[4 * M_TILES];
            group_sum(sum, partial, warp, lane);
            if (SLICES == 1) {
                store_tile(sum, lane, tile * 16 + g, bias, out, M, N, has_bias);
            } else {
                float* mine = workspace + ((long long)slice * tiles + tile) * 32 * 4 * M_TILES + lane * 4 * M_TILES;
#pragma unroll
                for (int j = 0; j < 4 * M_TILES; ++j) __stcg(mine + j, sum[j]);
                __threadfence();
                int arrived = 0;
                if (lane == 0) arrived = atomicAdd(counters + tile, 1);
                arrived = __shfl_sync(0xffffffffu, arrived, 0);
                if (arrived == SLICES - 1) {  // the last slice of this tile: add them all, in slice order
                    __threadfence();
#pragma unroll
                    for (int j = 0; j < 4 * M_TILES; ++j) sum[j] = 0.0f;
                    for (int s = 0; s < SLICES; ++s) {
                        const float* theirs = workspace + ((long long)s * tiles + tile) * 32 * 4 * M_TILES + lane * 4 * M_TILES;
#pragma unroll
                        for (int j = 0; j < 4 * M_TILES; ++j) sum[j] += __ldcg(theirs + j);
                    }
                    store_tile(sum, lane, tile * 16 + g, bias, out, M, N, has_bias);
                    if (lane == 0) counters[tile] = 0;
                }
            }
        }
        group_barrier(group);  // the partial sums read before the group's warps keep the next tile's
    }
}
