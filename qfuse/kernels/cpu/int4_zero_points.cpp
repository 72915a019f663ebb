// qfuse's int4 GEMM with zero points on the CPU, exact: out[m, n] = sum_k x[m, k] * w[k, n] in float32, where
//
//   w[k, n] = (u[k, n] - z[k / G, n]) * s[k / G, n]   rounded once to the activation's dtype, as eager's
//
// u the stored nibble (0..15), z its zero point as a float (any integer), s the group scale as a float. The
// difference is an integer of at most 5 bits and s has 8 (bf16) or 11 (fp16) significant bits, so their float32
// product is exact and ROUND gives eager's one rounding of (q - z) * s in bf16 / fp16 (nearest even, NaN kept); with
// float32 activations a float32 scale has 24 bits and the product is eager's float32 one, rounded once as eager's is.
//
// The weight [K / 2, N] uint8 holds k = 2 i in its low nibble and 2 i + 1 in its high one (`int4_zero_points.py`,
// `pack`): a row of bytes is contiguous along N, so the compiler vectorizes the loops over a block of NB columns.
// Each thread takes blocks of columns; a block dequantizes each pair of rows once and uses it for 16 rows of x.
// Compiled by Inductor's C++ code cache at first use (the compiler Inductor's own CPU code needs), with its ISA
// flags and GCC's loop vectorizer on (`int4_zero_points.py`).

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NB = 64;  // columns a block
constexpr int64_t MB = 16;  // rows of x a pass over the weight

inline float round_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    float g;
    std::memcpy(&g, &r, 4);
    return f != f ? f : g;
}

inline float round_to_fp16(float f) { return static_cast<float>(static_cast<_Float16>(f)); }

// v[0..n) rounded in place: bf16 by integer operations the compiler vectorizes, fp16 by F16C's conversions
// eight at a time where the CPU has them (the compiler does not vectorize the casts through _Float16)
inline void round_block_to_bf16(float* v, int64_t n) {
    for (int64_t j = 0; j < n; ++j) v[j] = round_to_bf16(v[j]);
}

inline void round_block_to_fp16(float* v, int64_t n) {
    int64_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(v + j, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(v + j), _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; j < n; ++j) v[j] = round_to_fp16(v[j]);
}

inline void keep_block(float*, int64_t) {}  // float32 activations: the exact product is eager's float32 weight

template <void (*ROUND)(float*, int64_t)>
void int4_zero_points_mm(const uint8_t* w, const float* s, const float* z, const float* x, float* out, int64_t M,
                         int64_t N, int64_t K, int64_t G) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += NB) {
        const int64_t nb = N - n0 < NB ? N - n0 : NB;
        float acc[MB][NB];
        float low[NB], high[NB];
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            for (int64_t m = 0; m < mb; ++m)
                for (int64_t j = 0; j < NB; ++j) acc[m][j] = 0.0f;
            for (int64_t k = 0; k < K; k += 2) {
                const float* sg = s + (k / G) * N + n0;
                const float* zg = z + (k / G) * N + n0;
                const uint8_t* row = w + (k / 2) * N + n0;
                for (int64_t j = 0; j < nb; ++j) {
                    low[j] = (static_cast<float>(row[j] & 15) - zg[j]) * sg[j];
                    high[j] = (static_cast<float>(row[j] >> 4) - zg[j]) * sg[j];
                }
                ROUND(low, nb);
                ROUND(high, nb);
                for (int64_t m = 0; m < mb; ++m) {
                    const float x0 = x[(m0 + m) * K + k], x1 = x[(m0 + m) * K + k + 1];
                    for (int64_t j = 0; j < nb; ++j) acc[m][j] += x0 * low[j] + x1 * high[j];
                }
            }
            for (int64_t m = 0; m < mb; ++m)
                for (int64_t j = 0; j < nb; ++j) out[(m0 + m) * N + n0 + j] = acc[m][j];
        }
    }
}

}  // namespace

extern "C" void qfuse_int4_zero_points_mm_bf16(const uint8_t* w, const float* s, const float* z, const float* x,
                                               float* out, int64_t M, int64_t N, int64_t K, int64_t G) {
    int4_zero_points_mm<round_block_to_bf16>(w, s, z, x, out, M, N, K, G);
}

extern "C" void qfuse_int4_zero_points_mm_fp16(const uint8_t* w, const float* s, const float* z, const float* x,
                                               float* out, int64_t M, int64_t N, int64_t K, int64_t G) {
    int4_zero_points_mm<round_block_to_fp16>(w, s, z, x, out, M, N, K, G);
}

extern "C" void qfuse_int4_zero_points_mm_fp32(const uint8_t* w, const float* s, const float* z, const float* x,
                                               float* out, int64_t M, int64_t N, int64_t K, int64_t G) {
    int4_zero_points_mm<keep_block>(w, s, z, x, out, M, N, K, G);
}
