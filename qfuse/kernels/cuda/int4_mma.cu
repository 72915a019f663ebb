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

#ifndef CHECKPOINT
// Where a lane reads the repacked weight: its 16 bytes of chunk c at words[32 c] (a tile's chunks in a row), its
// group's pairs of rows g and g + 8 at pairs[q * pair_stride]. A-row g of the MMA is weight row 16 T + g, g + 8 is
// 16 T + g + 8.
struct WeightLane {
    const Words* words;
    const Pair* pairs;
    int pair_stride;

    __device__ __forceinline__ Words chunk(int c) const { return load_streaming(words + (long long)c * 32); }

    // (scale, -(MAGIC + 8 + z)) of rows g and g + 8 in group q
    __device__ __forceinline__ void group(int q, unsigned& s_g, unsigned& z_g, unsigned& s_h, unsigned& z_h) const {
        const Pair pair = pairs[(long long)q * pair_stride];
        s_g = low_pair(pair.x), z_g = high_pair(pair.x), s_h = low_pair(pair.y), z_h = high_pair(pair.y);
    }
};
#define A_OPERANDS a_operands
#define ROW_G 1   // weight rows of A-rows g and g + 8 in a tile: 16 T + ROW_G g and + ROW_H
#define ROW_H 8

// step s's B operand: k = 16 t + 4 s + {0, 1 | 2, 3} (the repacked order)
__device__ __forceinline__ void b_operands(const unsigned* xs, int s, unsigned& b0, unsigned& b1) {
    b0 = xs[2 * s], b1 = xs[2 * s + 1];
}
#else
// The checkpoint's own words, nothing repacked: CHECKPOINT 1 is [N, K / 8] with a row's words along K
// (compressed-tensors, GPTQ v2), 2 is [K / 8, N] with a word row's words along N (AutoGPTQ's qweight); word
// (n, i) holds k = 8 i + e at bits 4 e. Lane t of a chunk reads the two words of k = 16 t .. + 16 of two weight
// rows with two 8-byte loads: rows 16 T + g and + 8 (CHECKPOINT 1: one row's two words a load) or 16 T + 2 g and
// + 1 (2: one word row's two rows a load). Step s's MMA k slots 2t, 2t+1 | 2t+8, 2t+9 hold k = 16 t + s, + 4 |
// + 8 + s, + 12 + s: the pairs the dequantize makes of a word, (w >> 4 s) & 0x000F000F; x's B operands are
// put in that order by `prmt`. Scales [N, K / G] and zero points [N / 8, K / G] (packed along N, nibble n % 8)
// in the words' orientation; ZERO_CONVENTION 0: none (the uint4 offset 8), 1: stored, 2: plus one, 3: plus one
// mod 16.
#if CHECKPOINT == 1
#define ROW_G 1
#define ROW_H 8
#else
#define ROW_G 2
#define ROW_H 1
#endif
#ifdef HALF_BF16
#define MINUS_MAGIC 0xC300u  // -(MAGIC + z) is MINUS_MAGIC | z for z in [0, 16]
#else
#define MINUS_MAGIC 0xE400u
#endif
#ifndef ZERO_CONVENTION
#define ZERO_CONVENTION 0
#endif

__device__ __forceinline__ Pair load_streaming_pair(const Pair* p) {  // read once: not kept in L1
    Pair v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ unsigned both_halves(unsigned h) { return h | (h << 16); }

__device__ __forceinline__ unsigned minus_magic_zero(unsigned word, int shift) {  // -(MAGIC + z), both halves
#if ZERO_CONVENTION == 0
    return both_halves(MINUS_MAGIC | 8u);
#elif ZERO_CONVENTION == 1
    return both_halves(MINUS_MAGIC | ((word >> shift) & 0xFu));
#elif ZERO_CONVENTION == 2
    return both_halves(MINUS_MAGIC | (((word >> shift) & 0xFu) + 1u));
#else
    return both_halves(MINUS_MAGIC | (((word >> shift) + 1u) & 0xFu));
#endif
}

struct WeightLane {
    const Pair* first;        // chunk 0's first 8-byte load (CHECKPOINT 1: row g's words; 2: word 2t of both rows)
    const Pair* second;       // and its second (row g + 8's; word 2t + 1)
    long long chunk_stride;   // Pairs from chunk c to c + 1
    const unsigned short* scales;  // row g's scale of group 0
    int scale_group_stride, scale_row_step;  // to group q + 1; to row g + 8's
    const unsigned* zeros;    // row g's zero point word of group 0 (ZERO_CONVENTION > 0)
    int zero_group_stride, zero_row_step, zero_shift_g, zero_shift_h;

    // a[] order of the repacked words: x, y the words of k = 16 t .. + 8 of rows g, g + 8; z, w of k + 8 .. + 16
    __device__ __forceinline__ Words chunk(int c) const {
        const Pair p = load_streaming_pair(first + c * chunk_stride), q = load_streaming_pair(second + c * chunk_stride);
#if CHECKPOINT == 1
        return Words{p.x, q.x, p.y, q.y};
#else
        return Words{p.x, p.y, q.x, q.y};
#endif
    }

    __device__ __forceinline__ void group(int q, unsigned& s_g, unsigned& z_g, unsigned& s_h, unsigned& z_h) const {
        const unsigned short* s = scales + (long long)q * scale_group_stride;
        s_g = both_halves(s[0]), s_h = both_halves(s[scale_row_step]);
#if ZERO_CONVENTION > 0
        const unsigned* z = zeros + (long long)q * zero_group_stride;
        z_g = minus_magic_zero(z[0], zero_shift_g), z_h = minus_magic_zero(z[zero_row_step], zero_shift_h);
#else
        z_g = z_h = minus_magic_zero(0u, 0);
#endif
    }
};

// A chunk's A operands from its words (`WeightLane::chunk`): step s takes pair s of each word
__device__ __forceinline__ void checkpoint_a_operands(unsigned (&a)[16], const Words& w, unsigned s_g, unsigned z_g,
                                                      unsigned s_h, unsigned z_h) {
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        a[4 * s + 0] = pair_value(w.x >> (4 * s), z_g, s_g);
        a[4 * s + 1] = pair_value(w.y >> (4 * s), z_h, s_h);
        a[4 * s + 2] = pair_value(w.z >> (4 * s), z_g, s_g);
        a[4 * s + 3] = pair_value(w.w >> (4 * s), z_h, s_h);
    }
}
#define A_OPERANDS checkpoint_a_operands

// step s's B operand: (x[16 t + s], x[16 t + s + 4]) and (x[16 t + 8 + s], x[16 t + 12 + s]) from the pairs
// xs[i] = (x[16 t + 2 i], x[16 t + 2 i + 1])
__device__ __forceinline__ void b_operands(const unsigned* xs, int s, unsigned& b0, unsigned& b1) {
    const unsigned selector = (s & 1) ? 0x7632u : 0x5410u;  // both high halves : both low halves
    b0 = select_bytes(xs[s >> 1], xs[(s >> 1) + 2], selector);
    b1 = select_bytes(xs[4 + (s >> 1)], xs[6 + (s >> 1)], selector);
}
#endif

// U chunks from chunk c on (c a multiple of min(U, GROUP_CHUNKS), so a group's scales are read once), their words in
// registers: each chunk's 16 A registers made once, from its group's scales and zero points of rows g and g + 8, and
// used for every tile of x (x's chunk c + u is chunk xc + u of `x`: xc = c here, a stage's own index in a kernel that
// stages x)
template <int U>
__device__ __forceinline__ void multiply_chunks(float (&acc)[M_TILES][4], const Words (&w)[U], const WeightLane& lane,
                                                const XRows& x, int c, int xc) {
    unsigned s_g, z_g, s_h, z_h;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u % GROUP_CHUNKS == 0) lane.group((c >> GROUP_SHIFT) + u / GROUP_CHUNKS, s_g, z_g, s_h, z_h);
        unsigned a[16];  // the chunk's A operands
        A_OPERANDS(a, w[u], s_g, z_g, s_h, z_h);
#pragma unroll
        for (int i = 0; i < M_TILES; ++i) {  // one tile's x live at a time, whatever M_TILES is
            const Words xv[2] = {x.tile[i][8 * (xc + u)], x.tile[i][8 * (xc + u) + 1]};
            const unsigned* xs = reinterpret_cast<const unsigned*>(xv);  // 8 pairs, k = 16 t + 2 p
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                unsigned b0, b1;
                b_operands(xs, s, b0, b1);
                mma(acc[i], a[4 * s], a[4 * s + 1], a[4 * s + 2], a[4 * s + 3], b0, b1);
            }
        }
    }
}

// U chunks from chunk c on loaded (U * 512 bytes in flight a warp), then multiplied; x's chunk c is chunk xc of `x`
template <int U>
__device__ __forceinline__ void load_and_multiply(float (&acc)[M_TILES][4], const WeightLane& lane, const XRows& x,
                                                  int c, int xc) {
    Words w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) w[u] = lane.chunk(c + u);
    multiply_chunks<U>(acc, w, lane, x, c, xc);
}

typedef float Partials[32][4 * M_TILES];  // a warp's sums: 4 a lane for each tile of B

// Warps [first, first + COUNT) of the block, each with the sums of one part of K of the same 16-row tile, added up
// in a fixed order by the calling warp and written once: bias added, rounded to the output's dtype. `row` is the
// weight row of A-row g (ROW_H more: of A-row g + 8)
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
            // c0, c1: A-row g, columns 2t, 2t + 1; c2, c3: A-row g + 8
            const int n = row + ROW_H * (j >> 1), m = 8 * i + 2 * t + (j & 1);
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

// The block's 16-row tile on `lane`'s weight: its warps split K, add their sums up and store them
__device__ __forceinline__ void multiply_tile(const WeightLane& lane, const Words* __restrict__ x,
                                              const unsigned short* __restrict__ bias, void* __restrict__ out, int M,
                                              int N, int K, int has_bias) {
    __shared__ Partials partial[WARPS];
    const int tile = blockIdx.x, warp = threadIdx.x >> 5, lane_index = threadIdx.x & 31;
    const int g = lane_index >> 2, t = lane_index & 3;
    const int chunks = K >> 6;
    const int aligned = imin(UNROLL, GROUP_CHUNKS);  // a warp's first chunk a multiple of it
    const int per_warp = ((chunks + WARPS - 1) / WARPS + aligned - 1) / aligned * aligned;
    const int begin = warp * per_warp;
    const int end = imin(chunks, begin + per_warp);
    const int row_words = K >> 3;  // 16-byte words (8 halves) per row of x
    XRows x_rows;
#pragma unroll
    for (int i = 0; i < M_TILES; ++i) x_rows.tile[i] = x + (long long)imin(g + 8 * i, M - 1) * row_words + 2 * t;
    float acc[M_TILES][4];
    zero(acc);
    int c = begin;
    for (; c + UNROLL <= end; c += UNROLL) load_and_multiply<UNROLL>(acc, lane, x_rows, c, c);
    if (UNROLL > 4 && c + 4 <= end) load_and_multiply<4>(acc, lane, x_rows, c, c), c += 4;
    if (UNROLL > 2 && c + 2 <= end) load_and_multiply<2>(acc, lane, x_rows, c, c), c += 2;
    if (c < end) load_and_multiply<1>(acc, lane, x_rows, c, c);

    let_the_next_kernel_start();  // (its blocks still wait for this kernel's end before they read its output)
    keep(partial, warp, lane_index, acc);
    __syncthreads();
    if (warp == 0) add_up_and_store<WARPS>(partial, 0, lane_index, tile * 16 + ROW_G * g, bias, out, M, N, has_bias);
}

// Blocks a multiprocessor holds at least: up to 16 rows 32 warps (64 registers a thread: faster at M = 1 and 16 than
// more registers and fewer warps, docs/benchmarks.md, "The int4 decode kernel's stream"); 24 warps (80) for 4 tiles of
// B, 16 (128) for 8, about what the kernel took before the compiler was free to dequantize every chunk ahead
#ifndef MIN_BLOCKS
#define MIN_BLOCKS MIN_BLOCKS_FOR(M_TILES <= 2 ? 32 : M_TILES == 4 ? 24 : 16)
#endif

#ifndef CHECKPOINT
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
qfuse_int4_mma(const Words* __restrict__ words, const Words* __restrict__ x, const Pair* __restrict__ pairs,
               const unsigned short* __restrict__ bias, void* __restrict__ out, int M, int N, int K, int has_bias) {
    wait_for_the_previous_kernel();
    const int lane = threadIdx.x & 31;
    const WeightLane weight{words + (long long)blockIdx.x * (K >> 6) * 32 + lane,
                            pairs + blockIdx.x * 8 + (lane >> 2),  // group q's pairs of rows g, g + 8: [q * N / 2]
                            N >> 1};
    multiply_tile(weight, x, bias, out, M, N, K, has_bias);
}
#else
// `members` int64 [count, 4]: a member's words, scales and zero points (their addresses: 0 for none) and the end of
// its tiles (the first tile of the next member): siblings (q / k / v, gate / up) in one launch, each read where the
// checkpoint holds it
extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
qfuse_int4_mma_checkpoint(const long long* __restrict__ members, const Words* __restrict__ x,
                          const unsigned short* __restrict__ bias, void* __restrict__ out, int M, int N, int K,
                          int has_bias) {
    wait_for_the_previous_kernel();
    int member = 0, first_tile = 0;
    while ((long long)blockIdx.x >= members[4 * member + 3]) first_tile = (int)members[4 * member + 3], ++member;
    const int rows = ((int)members[4 * member + 3] - first_tile) * 16;  // the member's N
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int groups = GROUP_SHIFT >= 30 ? 1 : K >> (6 + GROUP_SHIFT);
    const int row = ((int)blockIdx.x - first_tile) * 16 + ROW_G * g;  // the member's weight row of A-row g
    const unsigned* words = reinterpret_cast<const unsigned*>(members[4 * member]);
    const unsigned short* scales = reinterpret_cast<const unsigned short*>(members[4 * member + 1]);
    const unsigned* zeros = reinterpret_cast<const unsigned*>(members[4 * member + 2]);
    WeightLane weight;
#if CHECKPOINT == 1  // [N, K / 8]; scales [N, K / G]; zero points [N / 8, K / G]
    weight.first = reinterpret_cast<const Pair*>(words + (long long)row * (K >> 3) + 2 * t);
    weight.second = weight.first + 8 * (K >> 4);  // row g + 8
    weight.chunk_stride = 4;
    weight.scales = scales + (long long)row * groups, weight.scale_group_stride = 1, weight.scale_row_step = 8 * groups;
    weight.zeros = zeros + (long long)(row >> 3) * groups, weight.zero_group_stride = 1, weight.zero_row_step = groups;
    weight.zero_shift_g = weight.zero_shift_h = 4 * (row & 7);
#else  // [K / 8, N]; scales [K / G, N]; zero points [K / G, N / 8]
    weight.first = reinterpret_cast<const Pair*>(words + (long long)(2 * t) * rows + row);
    weight.second = weight.first + (rows >> 1);  // word 2t + 1
    weight.chunk_stride = 4LL * rows;
    weight.scales = scales + row, weight.scale_group_stride = rows, weight.scale_row_step = 1;
    weight.zeros = zeros + (row >> 3), weight.zero_group_stride = rows >> 3, weight.zero_row_step = 0;
    weight.zero_shift_g = 4 * (row & 7), weight.zero_shift_h = 4 * (row & 7) + 4;
#endif
    multiply_tile(weight, x, bias, out, M, N, K, has_bias);
}
#endif
