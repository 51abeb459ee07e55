/* llama.cpp's CPU matmul summation orders (ggml-cpu, x86 AVX2 + FMA build), in plain C.
 *
 * The same arithmetic as the torch reference in engine/llm/ggml_matmul.py and
 * engine/llm/numerics.py (see there for the ggml sources each order comes from); this file only
 * makes it fast. Compiled with -ffp-contract=off: the only fused operations are the explicit
 * fmaf() calls, every other float operation rounds on its own, as in ggml's intrinsics.
 * Integer parts are exact in int32 (any order gives the same integer). Rows of the output are
 * independent, so they are split across OpenMP threads without changing any result; one-token
 * steps stay on one thread (a parallel region costs more than the work, worse on a busy machine).
 * x86 with AVX2 + FMA only, like the llama.cpp build it reproduces; elsewhere the build fails and
 * the torch reference runs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PARALLEL_ROWS 8

/* ggml's hsum_float_8: ((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7)). */
static inline float hsum8(const float *a) {
    const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    return (r0 + r2) + (r1 + r3);
}

static inline float hsum8v(__m256 v) {
    float a[8];
    _mm256_storeu_ps(a, v);
    return hsum8(a);
}

/* Eight int32 lanes, lane l = sum of the products of bytes 4l..4l+3 (signed x signed, exact). */
static inline __m256i lanes_i8(const int8_t *x, const int8_t *w) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *) x);
    const __m256i wv = _mm256_loadu_si256((const __m256i *) w);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    return _mm256_madd_epi16(_mm256_set1_epi16(1), pairs);
}

/* The same for unsigned weights (0..63) x signed activations. */
static inline __m256i lanes_u8(const int8_t *x, const uint8_t *w) {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *) w),
                                               _mm256_loadu_si256((const __m256i *) x));
    return _mm256_madd_epi16(_mm256_set1_epi16(1), pairs);
}

static inline int32_t hsum_i32(__m256i v) {
    int32_t a[8];
    _mm256_storeu_si256((__m256i *) a, v);
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* Q8_0 / Q5_0 weights x Q8_0 activations (vec_dot_q8_0_q8_0, vec_dot_q5_0_q8_0, tinyBLAS_Q0_AVX).
 * x [R][nb*32] int8, xd [R][nb]; w [N][nb*32] int8, wd [N][nb]; out [R][N]. */
void q0_matmul(int64_t R, int64_t N, int64_t nb, const int8_t *x, const float *xd,
               const int8_t *w, const float *wd, float *out) {
    const int64_t K = nb * 32;
    #pragma omp parallel for schedule(static) if (R >= PARALLEL_ROWS)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wr = w + n * K;
        for (int64_t r = 0; r < R; r++) {
            const int8_t *xr = x + r * K;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                const float s = wd[n * nb + b] * xd[r * nb + b];
                const __m256 lanes = _mm256_cvtepi32_ps(lanes_i8(xr + b * 32, wr + b * 32));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(s), lanes, acc);
            }
            out[r * N + n] = hsum8v(acc);
        }
    }
}

/* Q4_K weights, repacked q4_K_8x8 kernels, x Q8_K activations.
 * x [R][nsb*256] int8, xd [R][nsb]; q [N][nsb*256] 0..15, scales/mins [N][nsb*8] 0..63,
 * d/dmin [N][nsb]. per_superblock: 1 = gemv (one fma per 256), 0 = gemm (one per 64). */
void q4_k_matmul(int64_t R, int64_t N, int64_t nsb, const int8_t *x, const float *xd,
                 const uint8_t *q, const uint8_t *scales, const uint8_t *mins,
                 const float *d, const float *dmin, int per_superblock, float *out) {
    const int64_t K = nsb * 256;
    #pragma omp parallel for schedule(static) if (R >= PARALLEL_ROWS)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r = 0; r < R; r++) {
            float acc = 0.0f, acc_min = 0.0f;
            for (int64_t b = 0; b < nsb; b++) {
                const float s = d[n * nsb + b] * xd[r * nsb + b];
                const float s_min = dmin[n * nsb + b] * xd[r * nsb + b];
                const int8_t *xa = x + r * K + b * 256;
                const uint8_t *qa = q + n * K + b * 256;
                const uint8_t *sc = scales + (n * nsb + b) * 8, *mn = mins + (n * nsb + b) * 8;
                int32_t total = 0, total_min = 0;
                for (int c = 0; c < 4; c++) {
                    int32_t dot = 0, dot_min = 0;
                    for (int sub = 2 * c; sub < 2 * c + 2; sub++) {
                        const int32_t part = hsum_i32(lanes_u8(xa + sub * 32, qa + sub * 32));
                        int32_t sum = 0;
                        for (int i = 0; i < 32; i++) sum += xa[sub * 32 + i];
                        dot += sc[sub] * part;
                        dot_min += mn[sub] * sum;
                    }
                    if (per_superblock) {
                        total += dot;
                        total_min += dot_min;
                    } else {
                        acc = fmaf((float) dot, s, acc);
                        acc_min = fmaf((float) dot_min, s_min, acc_min);
                    }
                }
                if (per_superblock) {
                    acc = fmaf((float) total, s, acc);
                    acc_min = fmaf((float) total_min, s_min, acc_min);
                }
            }
            out[r * N + n] = acc - acc_min;
        }
    }
}

/* Q6_K weights x Q8_K activations. x [R][nsb*256] int8, xd [R][nsb]; q [N][nsb*256] 0..63
 * (stored value + 32), scales [N][nsb*16] int8, d [N][nsb].
 * tiled = 1: ggml's tiled K-quant matmul (8 or more rows): the exact dot per 256, times d_w, then
 * fma with d_x. tiled = 0: vec_dot_q6_K_q8_K's eight lanes and hsum_float_8. */
void q6_k_matmul(int64_t R, int64_t N, int64_t nsb, const int8_t *x, const float *xd,
                 const uint8_t *q, const int8_t *scales, const float *d, int tiled, float *out) {
    const int64_t K = nsb * 256;
    #pragma omp parallel for schedule(static) if (R >= PARALLEL_ROWS)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t r = 0; r < R; r++) {
            float acc = 0.0f, lanes_acc[8] = {0};
            for (int64_t b = 0; b < nsb; b++) {
                const int8_t *xa = x + r * K + b * 256;
                const uint8_t *qa = q + n * K + b * 256;
                const int8_t *sc = scales + (n * nsb + b) * 16;
                /* lane l of 32-group c: 4 products times the group's 16-scale (lanes 0-3, 4-7) */
                __m256i lanes = _mm256_setzero_si256();
                int32_t offset[8];
                for (int c = 0; c < 8; c++) {
                    const __m256i scale = _mm256_setr_epi32(sc[2 * c], sc[2 * c], sc[2 * c], sc[2 * c], sc[2 * c + 1],
                                                            sc[2 * c + 1], sc[2 * c + 1], sc[2 * c + 1]);
                    lanes = _mm256_add_epi32(lanes, _mm256_mullo_epi32(scale, lanes_u8(xa + 32 * c, qa + 32 * c)));
                    int32_t lo = 0, hi = 0;
                    for (int i = 0; i < 16; i++) { lo += xa[32 * c + i]; hi += xa[32 * c + 16 + i]; }
                    offset[c] = sc[2 * c] * lo + sc[2 * c + 1] * hi;
                }
                int32_t lane[8];
                _mm256_storeu_si256((__m256i *) lane, lanes);
                if (tiled) {
                    int32_t dot = 0;
                    for (int l = 0; l < 8; l++) dot += lane[l] - 32 * offset[l];
                    acc = fmaf(d[n * nsb + b] * (float) dot, xd[r * nsb + b], acc);
                } else {
                    for (int l = 0; l < 8; l++)
                        lanes_acc[l] = fmaf(xd[r * nsb + b] * d[n * nsb + b], (float) (lane[l] - 32 * offset[l]),
                                            lanes_acc[l]);
                }
            }
            out[r * N + n] = tiled ? acc : hsum8(lanes_acc);
        }
    }
}

/* a [G][P][K] . b [G][Q][K] -> out [G][P][Q] (f32 holding f16 values).
 * tinyblas = 1: llamafile's tinyBLAS (lanes k mod 8, an fma chain each, hsum_float_8);
 * tinyblas = 0: ggml_vec_dot_f16 (four 8-lane accumulators over 32-element steps). K % 32 == 0. */
void f16_dot(int64_t G, int64_t P, int64_t Q, int64_t K, const float *a, const float *b,
             int tinyblas, float *out) {
    #pragma omp parallel for collapse(2) schedule(static) if (P >= PARALLEL_ROWS)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t p = 0; p < P; p++) {
            const float *ar = a + (g * P + p) * K;
            for (int64_t j = 0; j < Q; j++) {
                const float *br = b + (g * Q + j) * K;
                if (tinyblas) {
                    __m256 acc = _mm256_setzero_ps();
                    for (int64_t k = 0; k < K; k += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(ar + k), _mm256_loadu_ps(br + k), acc);
                    out[(g * P + p) * Q + j] = hsum8v(acc);
                } else {
                    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
                    for (int64_t k = 0; k < K; k += 32)
                        for (int s = 0; s < 4; s++)
                            acc[s] = _mm256_fmadd_ps(_mm256_loadu_ps(ar + k + 8 * s), _mm256_loadu_ps(br + k + 8 * s), acc[s]);
                    float x[8];
                    _mm256_storeu_ps(x, _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
                    const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
                    out[(g * P + p) * Q + j] = (t0 + t1) + (t2 + t3);
                }
            }
        }
    }
}
