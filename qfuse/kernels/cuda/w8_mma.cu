// qfuse's 8-bit weight decode GEMM on tensor cores, M <= 64: a stream of the weight, one launch a linear.
//
//   W8A8   x int8 / fp8 e4m3 (quantized by the model's own quantizer, in its producer's kernel), w the same:
//          mma.m16n8k32 (int8: exact int32 sums), out[m, n] = sum_k x[m, k] w[n, k] * sa[m] * sb[n] + bias[n]
//   W8A16  x bf16 / fp16, w int8 / fp8 e4m3 converted exactly (NaN kept) to x's dtype in registers: mma.m16n8k16,
//          out[m, n] = sum_k x[m, k] w[n, k] * sb[n] + bias[n]
//
// The sums are float32 (int32 for int8 x int8); the epilogue is float32, its value rounded once to the output.
// `+ (sa - sa)`: a row whose scale is inf or nan is nan, as in eager.
//
// Layout (w8_mma.py, `repack`): words [N / 16, K / 32, 32 lanes, 4] int32, a byte a value, k ascending from the
// low byte; lane l = 4 g + t of chunk c holds
//
//   word 0: row g,     k = 32 c + 8 t + 0..3        word 2: row g,     k = 32 c + 8 t + 4..7
//   word 1: row g + 8, k = 32 c + 8 t + 0..3        word 3: row g + 8, k = 32 c + 8 t + 4..7
//
// which is the A operand of one m16n8k32 (its k slots 4t..4t+3 taken as k 8t..8t+3 and slots 16+4t..16+4t+3
// as 8t+4..8t+7: a0..a3 = words 0..3), and of two m16n8k16 (step s: slots 2t, 2t+1 | 2t+8, 2t+9 as k 8t+4s+0,1
// | 8t+4s+2,3: a0 | a2 from word 2s's low | high bytes, a1 | a3 from word 2s+1's). Both MMAs take their B
// slots in the same order, so a lane's B operand of the chunk is x[m, 32 c + 8 t .. + 8]: one load (8 bytes
// of an 8-bit x, 16 of a half x).
//
// A block is ROW_TILES tiles of 16 rows sharing their loads of x; its WARPS warps split K and add their sums
// through shared memory, so the output is written once, scales, bias and cast included. Column m of B is x's
// row min(m, M - 1): columns past M compute values nobody stores.
//
// -D options: W8A8 (else W8A16), WEIGHT_FP8 (else int8), HALF_BF16 (W8A16's x: else fp16), M_TILES 1 | 2
// | 4 | 8 (M <= 8 | 16 | 32 | 64), ROW_TILES 1 | 2, WARPS, UNROLL (chunks a warp loads ahead; its share ends in
// steps of 4, 2 and 1), MIN_BLOCKS (`__launch_bounds__`' blocks a multiprocessor), and the dtype codes of
// common.cuh: SCALE_A (W8A8; 0: no activation scale), SCALE_B (0: none), BIAS (0: none), OUT.

#ifdef W8A8
typedef Pair XVec;
#ifdef WEIGHT_FP8
typedef float Acc;
#define MMA "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
#define ACC_CONSTRAINT "+f"
#else
typedef int Acc;
#define MMA "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"
#define ACC_CONSTRAINT "+r"
#endif
#else  // W8A16
typedef Words XVec;
typedef float Acc;
#define ACC_CONSTRAINT "+f"
#ifdef HALF_BF16
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#else
#define MMA "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
#endif
#endif

__device__ __forceinline__ void mma4(Acc* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(MMA " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : ACC_CONSTRAINT(c[0]), ACC_CONSTRAINT(c[1]), ACC_CONSTRAINT(c[2]), ACC_CONSTRAINT(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#ifndef W8A8
// Two stored values (bytes 2h, 2h + 1 of word v) as a pair of x's half dtype, exactly.
__device__ __forceinline__ unsigned half_pair(unsigned v, int h) {
#ifdef WEIGHT_FP8
    // cvt.rn.f16x2.e4m3x2 (sm_89): exact, NaN kept; to bf16 through float32, exact too
    const unsigned short two = h ? (unsigned short)(v >> 16) : (unsigned short)(v & 0xFFFF);
    unsigned r;
#ifdef HALF_BF16
    asm("{\n"
        "  .reg .b32 pair;\n"
        "  .reg .b16 lo, hi;\n"
        "  .reg .f32 flo, fhi;\n"
        "  cvt.rn.f16x2.e4m3x2 pair, %1;\n"
        "  mov.b32 {lo, hi}, pair;\n"
        "  cvt.f32.f16 flo, lo;\n"
        "  cvt.f32.f16 fhi, hi;\n"
        "  cvt.rn.bf16x2.f32 %0, fhi, flo;\n"
        "}\n"
        : "=r"(r) : "h"(two));
#else
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(two));
#endif
    return r;
#else  // int8: u = w + 128 in [0, 255]
    const unsigned u = v ^ 0x80808080u;
#ifdef HALF_BF16
    // u in the mantissa of 2^23 (float32), minus 2^23 + 128, then the two floats rounded (exactly) to bf16
    const float lo = bits_as_float(select_bytes(u, 0x4B000000u, h ? 0x7442 : 0x7440)) - 8388736.0f;
    const float hi = bits_as_float(select_bytes(u, 0x4B000000u, h ? 0x7443 : 0x7441)) - 8388736.0f;
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    // u in the mantissa of 1024 (fp16, whose ulp is 1 up to 2048), minus 1024 + 128
    const unsigned magic = select_bytes(u, 0x64646464u, h ? 0x7362 : 0x5140);
    unsigned r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(magic), "r"(0x3C003C00u), "r"(0xE480E480u));
    return r;
#endif
#endif
}
#endif

// acc[i] += this chunk's 16 rows x (the columns of M tile i)
__device__ __forceinline__ void chunk_mma(Acc (*acc)[4], const Words& w, const XVec* xv) {
#ifdef W8A8
    const unsigned a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) mma4(acc[i], a, xv[i].x, xv[i].y);
#else
    const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const unsigned a[4] = {half_pair(ws[2 * s], 0), half_pair(ws[2 * s + 1], 0), half_pair(ws[2 * s], 1),
                               half_pair(ws[2 * s + 1], 1)};
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
            const unsigned* xs = reinterpret_cast<const unsigned*>(&xv[i]);  // 4 pairs: k = 8 t + 2 p, + 1
            mma4(acc[i], a, xs[2 * s], xs[2 * s + 1]);
        }
    }
#endif
}

// U chunks from chunk c on, of every row tile: loaded first (U * ROW_TILES * 512 bytes in flight a warp), then
// multiplied with x's vectors of each chunk
template <int U>
__device__ __forceinline__ void load_and_multiply(Acc (&acc)[ROW_TILES][M_TILES][4], const Words* w_lane,
                                                  const XVec* const (&x_rows)[M_TILES], int c, int chunks) {
    Words w[U][ROW_TILES];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r) w[u][r] = load_streaming(w_lane + ((long long)r * chunks + c + u) * 32);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        XVec xv[M_TILES];
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) xv[i] = x_rows[i][4 * (c + u)];
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r) chunk_mma(acc[r], w[u][r], xv);
    }
}

// Blocks a multiprocessor holds at least: 32 warps (64 registers a thread) up to 16 rows, 24 (80) for 4 tiles of B,
// 12 (170) for 8: about the registers the loop took while it checked every chunk, before the compiler was free to
// load x ahead
#ifndef MIN_BLOCKS
#define MIN_BLOCKS MIN_BLOCKS_FOR(M_TILES <= 2 ? 32 : M_TILES == 4 ? 24 : 12)
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
qfuse_w8_mma(const Words* __restrict__ words, const XVec* __restrict__ x, const void* __restrict__ scale_a,
             const void* __restrict__ scale_b, const void* __restrict__ bias, void* __restrict__ out, int M, int N,
             int K, int scale_a_stride, int scale_b_stride) {
    __shared__ Acc partial[WARPS][32][ROW_TILES * M_TILES * 4];
    wait_for_the_previous_kernel();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = K >> 5;
    const int per_warp = (chunks + WARPS - 1) / WARPS;
    const int begin = warp * per_warp;
    const int end = imin(chunks, begin + per_warp);
    const int x_row_vectors = K >> 3;  // x's vectors of 8 values per row
    const XVec* x_rows[M_TILES];
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) x_rows[i] = x + (long long)imin(g + 8 * i, M - 1) * x_row_vectors + t;
    const Words* w_lane = words + (long long)blockIdx.x * ROW_TILES * chunks * 32 + lane;
    Acc acc[ROW_TILES][M_TILES][4];
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) acc[r][i][0] = acc[r][i][1] = acc[r][i][2] = acc[r][i][3] = 0;
    int c = begin;
    for (; c + UNROLL <= end; c += UNROLL) load_and_multiply<UNROLL>(acc, w_lane, x_rows, c, chunks);
    if (UNROLL > 4 && c + 4 <= end) load_and_multiply<4>(acc, w_lane, x_rows, c, chunks), c += 4;
    if (UNROLL > 2 && c + 2 <= end) load_and_multiply<2>(acc, w_lane, x_rows, c, chunks), c += 2;
    if (c < end) load_and_multiply<1>(acc, w_lane, x_rows, c, chunks);
    let_the_next_kernel_start();  // (its blocks still wait for this kernel's end before they read its output)
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
        for (int i = 0; i < M_TILES; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) partial[warp][lane][(r * M_TILES + i) * 4 + j] = acc[r][i][j];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                Acc sum = 0;
#pragma unroll
                for (int other = 0; other < WARPS; ++other) sum += partial[other][lane][(r * M_TILES + i) * 4 + j];
                // c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
                const int n = (blockIdx.x * ROW_TILES + r) * 16 + g + 8 * (j >> 1), m = 8 * i + 2 * t + (j & 1);
                if (m >= M) continue;
                float value = (float)sum;
#if defined(W8A8) && SCALE_A
                const float sa = load_as_float<SCALE_A>(scale_a, (long long)m * scale_a_stride);
                value = value * sa + (sa - sa);
#endif
#if SCALE_B
                value *= load_as_float<SCALE_B>(scale_b, (long long)n * scale_b_stride);
#endif
#if BIAS
                value += load_as_float<BIAS>(bias, n);
#endif
                store_from_float<OUT>(out, (long long)m * N + n, value);
            }
        }
    }
}
