// qfuse's W4A16 decode GEMM: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), M <= 64, on tensor cores.
//
//   w[n, k] = (u[n, k] - 8 - z[n, k / G]) * s[n, k / G]       u the stored nibble (0..15), rounded once
//                                                             to the activation's dtype, as eager's
//
// The weight is repacked once (qfuse/kernels/cuda/int4_mma.py, `repack`) so that each lane of a warp reads
// the A operand of four mma.m16n8k16 with one 16-byte load: `words` is [N / 16, K / 64, 32 lanes, 4]
// int32, word s of lane l = 4 g + t in chunk c holding rows 16 T + g and 16 T + g + 8 at
// k = 64 c + 16 t + 4 s + {0, 1, 2, 3}. The MMA's k slots 2t, 2t+1, 2t+8, 2t+9 of step s are those
// four k, for A and B alike, so a lane's B operand for the four steps is x[m, 64 c + 16 t .. + 16]:
// two 16-byte loads. A word's nibbles, in the order the dequantize takes them:
//
//   bits  0- 3 | 16-19   row g,     k + 0 | k + 1      -> a0
//   bits  4- 7 | 20-23   row g + 8, k + 0 | k + 1      -> a1
//   bits  8-11 | 24-27   row g,     k + 2 | k + 3      -> a2
//   bits 12-15 | 28-31   row g + 8, k + 2 | k + 3      -> a3
//
// Dequantize, two values a register: (w >> 4 j) & 0x000F000F | MAGIC is the pair MAGIC + u (MAGIC the
// half float whose ulp is 1: 128 in bf16, 1024 in fp16), then fma(., 1, -(MAGIC + 8 + z)) = u - 8 - z
// exactly, then fma(., s, -0) rounds (u - 8 - z) * s once. `pairs` holds (s, -(MAGIC + 8 + z)) per row and
// group, [K / G, N], rows 16 T + g and 16 T + g + 8 side by side (column 16 T + 2 g + h: one 8-byte load a lane);
// chunk c is in group c >> GROUP_SHIFT (groups of a power of two chunks, or 30: one group along K). 3 shifts,
// 4 lop3 and 8 fma for 8 values; a chunk's 16 A registers are made once, then each 8-column tile of B takes its
// x and its 4 MMAs.
//
// A block is one tile of 16 rows; its WARPS warps split K and add their sums through shared memory, so
// the output is written once, bias and cast included, with no second launch. Column m of B is x's row
// min(m, M - 1): columns past M compute values nobody stores. Every warp loads x's rows for its chunks from L1,
// M_TILES times 1 KiB a chunk of 512 weight bytes: at M > 16 that traffic, not the weight's, bounds a launch
// (docs/benchmarks.md, "Batched decode on the CUDA kernels").
//
// Compiled by NVRTC at first use with -DHALF_BF16 (or fp16), -DM_TILES=1|2|4|8 (the 8-column tiles of B: M <= 8,
// 16, 32, 64), -DWARPS=w, -DOUT_F32 for a float32 output, -DUNROLL=u for the chunks a warp loads ahead (its share
// ends in steps of 4, 2 and 1), -DGROUP_SHIFT=s.

#ifdef HALF_BF16
#define HALF "bf16"
#define HALF_CODE 2  // common.cuh's dtype codes
#define MAGIC 0x43004300u
#define ONE 0x3F803F80u
#define FMA_PAIR "fma.rn.bf16x2"
#else
#define HALF "f16"
#define HALF_CODE 3
#define MAGIC 0x64006400u
#define ONE 0x3C003C00u
#define FMA_PAIR "fma.rn.f16x2"
#endif
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32." HALF "." HALF ".f32"
#ifdef OUT_F32
#define OUT_CODE 1
#else
#define OUT_CODE HALF_CODE
#endif

#ifndef UNROLL
#define UNROLL 4  // chunks loaded before any is used: 2 KiB in flight a warp
#endif

__device__ __forceinline__ unsigned pair_value(unsigned w, unsigned minus_zero, unsigned scale) {
    unsigned r;
    asm("{\n"
        "  .reg .b32 u;\n"
        "  lop3.b32 u, %1, 0x000F000F, %4, 0xEA;\n"
        "  " FMA_PAIR " u, u, %5, %2;\n"
        "  " FMA_PAIR " %0, u, %3, %6;\n"
        "}\n"
        : "=r"(r) : "r"(w), "r"(minus_zero), "r"(scale), "r"(MAGIC), "r"(ONE), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
    asm volatile(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A chunk's A operands: a[4 s + i] is register i of step s's mma.m16n8k16 (or wgmma's) A, from a lane's 16 bytes of
// words (word s), rows g and g + 8 made with their (scale, -(MAGIC + 8 + z)) pairs
__device__ __forceinline__ void a_operands(unsigned (&a)[16], const Words& w, unsigned s_g, unsigned z_g, unsigned s_h,
                                           unsigned z_h) {
    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        a[4 * s + 0] = pair_value(ws[s], z_g, s_g);
        a[4 * s + 1] = pair_value(ws[s] >> 4, z_h, s_h);
        a[4 * s + 2] = pair_value(ws[s] >> 8, z_g, s_g);
        a[4 * s + 3] = pair_value(ws[s] >> 12, z_h, s_h);
    }
}

// The kernel (above: the dequantize and the MMA, which the wgmma explorations take alone)

#if GROUP_SHIFT >= 30
#define GROUP_CHUNKS (1 << 30)  // one group along K (per channel scales)
#else
#define GROUP_CHUNKS (1 << GROUP_SHIFT)
#endif

struct XRows { const Words* tile[M_TILES]; };  // a lane's x rows, one a tile of B: g + 8 i, or M - 1 past M

// U chunks from chunk c on (c a multiple of min(U, GROUP_CHUNKS), so a group's pairs are read once), their words in
// registers: each chunk's 16 A registers made once, from its group's pairs of rows g and g + 8, and used for every
// tile of x (x's chunk c + u is chunk xc + u of `x`: xc = c here, a stage's own index in a kernel that stages x)
template <int U>
__device__ __forceinline__ void multiply_chunks(float (&acc)[M_TILES][4], const Words (&w)[U], const Pair* pairs_lane,
                                                const XRows& x, int c, int xc, int pair_stride) {
    const Pair* group_pairs = pairs_lane + (long long)(c >> GROUP_SHIFT) * pair_stride;
    unsigned s_g, z_g, s_h, z_h;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u % GROUP_CHUNKS == 0) {  // (rows g, g + 8)
            const Pair pair = group_pairs[(long long)(u / GROUP_CHUNKS) * pair_stride];
            s_g = low_pair(pair.x), z_g = high_pair(pair.x), s_h = low_pair(pair.y), z_h = high_pair(pair.y);
        }
        unsigned a[16];  // the chunk's A operands
        a_operands(a, w[u], s_g, z_g, s_h, z_h);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {  // one tile's x live at a time, whatever M_TILES is
            const Words xv[2] = {x.tile[i][8 * (xc + u)], x.tile[i][8 * (xc + u) + 1]};
            const unsigned* xs = reinterpret_cast<const unsigned*>(xv);  // 8 pairs, k = 16 t + 2 p
#pragma unroll
            for (int s = 0; s < 4; ++s)
                mma(acc[i], a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], xs[2 * s], xs[2 * s + 1]);
        }
    }
}

template <int U>
__device__ __forceinline__ void load_chunks(Words (&w)[U], const Words* w_lane, int c) {
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = load_streaming(w_lane + (long long)(c + u) * 32);
}

// U chunks from chunk c on loaded (U * 512 bytes in flight a warp), then multiplied; x's chunk c is chunk xc of `x`
template <int U>
__device__ __forceinline__ void load_and_multiply(float (&acc)[M_TILES][4], const Words* w_lane, const Pair* pairs_lane,
                                                  const XRows& x, int c, int xc, int pair_stride) {
    Words w[U];
    load_chunks<U>(w, w_lane, c);
    multiply_chunks<U>(acc, w, pairs_lane, x, c, xc, pair_stride);
}

typedef float Partials[32][4 * M_TILES];  // a warp's sums: 4 a lane for each tile of B

// Warps [first, first + COUNT) of the block, each with the sums of one part of K of the same 16-row tile, added up
// in a fixed order by the calling warp and written once: bias added, rounded to the output's dtype
template <int COUNT>
__device__ __forceinline__ void add_up_and_store(const Partials* partial, int first, int lane, int row,
                                                 const unsigned short* __restrict__ bias, void* __restrict__ out,
                                                 int M, int N, int has_bias) {
    const int t = lane & 3;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float sum = 0.0f;
#pragma unroll
            for (int other = 0; other < COUNT; ++other) sum += partial[first + other][lane][4 * i + j];
            // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
            const int n = row + 8 * (j >> 1), m = 8 * i + 2 * t + (j & 1);
            if (m >= M) continue;
            if (has_bias) sum += load_as_float<HALF_CODE>(bias, n);
            store_from_float<OUT_CODE>(out, (long long)m * N + n, sum);
        }
    }
}

__device__ __forceinline__ void zero(float (&acc)[M_TILES][4]) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
}

__device__ __forceinline__ void keep(Partials* partial, int warp, int lane, const float (&acc)[M_TILES][4]) {
#pragma unroll
    for (int i = 0; i < M_TILES; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) partial[warp][lane][4 * i + j] = acc[i][j];
}

// Blocks a multiprocessor holds at least: up to 16 rows 32 warps (64 registers a thread: faster at M = 1 and 16 than
// more registers and fewer warps, docs/benchmarks.md, "The int4 decode kernel's stream"); 24 warps (80) for 4 tiles of
// B, 16 (128) for 8, about what the kernel took before the compiler was free to dequantize every chunk ahead
#ifndef MIN_BLOCKS
#define MIN_BLOCKS MIN_BLOCKS_FOR(M_TILES <= 2 ? 32 : M_TILES == 4 ? 24 : 16)
#endif
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
qfuse_int4_mma(const Words* __restrict__ words, const Words* __restrict__ x, const Pair* __restrict__ pairs,
               const unsigned short* __restrict__ bias, void* __restrict__ out, int M, int N, int K, int has_bias) {
    __shared__ Partials partial[WARPS];
    const int tile = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = K >> 6;
    const int aligned = imin(UNROLL, GROUP_CHUNKS);  // a warp's first chunk a multiple of it
    const int per_warp = ((chunks + WARPS - 1) / WARPS + aligned - 1) / aligned * aligned;
    const int begin = warp * per_warp;
    const int end = imin(chunks, begin + per_warp);
    const int row_words = K >> 3;  // 16-byte words (8 halves) per row of x
    XRows x_rows;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) x_rows.tile[i] = x + (long long)imin(g + 8 * i, M - 1) * row_words + 2 * t;
    const Pair* pairs_lane = pairs + tile * 8 + g;  // group q's pairs of rows g, g + 8: pairs_lane[q * N / 2]
    float acc[M_TILES][4];
    zero(acc);
    int c = begin;
    const Words* w_lane = words + (long long)tile * chunks * 32 + lane;
    for (; c + UNROLL <= end; c += UNROLL) load_and_multiply<UNROLL>(acc, w_lane, pairs_lane, x_rows, c, c, N >> 1);
    if (UNROLL > 4 && c + 4 <= end) load_and_multiply<4>(acc, w_lane, pairs_lane, x_rows, c, c, N >> 1), c += 4;
    if (UNROLL > 2 && c + 2 <= end) load_and_multiply<2>(acc, w_lane, pairs_lane, x_rows, c, c, N >> 1), c += 2;
    if (c < end) load_and_multiply<1>(acc, w_lane, pairs_lane, x_rows, c, c, N >> 1);

    keep(partial, warp, lane, acc);
    __syncthreads();
    if (warp == 0) add_up_and_store<WARPS>(partial, 0, lane, tile * 16 + g, bias, out, M, N, has_bias);
}
