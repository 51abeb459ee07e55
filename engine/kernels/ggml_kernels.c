/* llama.cpp's CPU matmul summation orders (ggml-cpu, x86 builds with AVX2 + FMA + F16C, with or
 * without AVX-512), in plain C.
 *
 * The same arithmetic as the torch reference in engine/kernels/ggml_matmul.py and
 * engine/kernels/numerics.py (see there for the ggml sources each order comes from); this file
 * only makes it fast. Compiled with -ffp-contract=off: the only fused operations are the explicit
 * fmaf() calls, every other float operation rounds on its own, as in ggml's intrinsics.
 * Integer parts are exact in int32 (any order gives the same integer). Rows of the output are
 * independent, so they are split across OpenMP threads without changing any result; one-token
 * steps stay on one thread (a parallel region costs more than the work, worse on a busy machine).
 *
 * Which order ggml uses depends on the instruction set llama.cpp was compiled for (-march=native
 * by default): the caller passes it (engine/kernels/cpu.py decides). Every order is written with
 * AVX2 intrinsics or scalar code, so an AVX2-only machine can compute the AVX-512 orders too (a
 * 16-lane accumulator is two 8-lane halves; the lanes never interact until the reduction).
 * x86 with AVX2 + FMA only; elsewhere the build fails and the torch reference runs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <cpuid.h>

#define PARALLEL_ROWS 8

/* ggml's hsum_float_8: ((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7)). */
static inline float hsum8(const float *a) {
    const float r0 = a[4] + a[0], r1 = a[5] + a[1], r2 = a[6] + a[2], r3 = a[7] + a[3];
    return (r0 + r2) + (r1 + r3);
}

static inline float hsum8v(__m256 v);

/* GCC's _mm512_reduce_add_ps: the upper 256 bits onto the lower, then hsum_float_8. */
static inline float hsum16v(__m256 lo, __m256 hi) {
    return hsum8v(_mm256_add_ps(hi, lo));
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
 * fma with d_x (its AVX2 and AVX512-VNNI microtiles alike, as GCC compiles them).
 * tiled = 0: vec_dot_q6_K_q8_K's eight lanes and hsum_float_8. */
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
                    const float scaled = d[n * nsb + b] * (float) dot;
                    acc = fmaf(scaled, xd[r * nsb + b], acc);
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

/* llamafile's tinyBLAS for one output: lanes k mod L (L = 8 on AVX2, 16 on AVX-512), an fma
 * chain each, then hsum(__m256) or _mm512_reduce_add_ps. K % L == 0. */
static float dot_tinyblas(const float *a, const float *b, int64_t K, int lanes) {
    if (lanes == 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
        return hsum8v(acc);
    }
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), hi);
    }
    return hsum16v(lo, hi);
}

/* ggml_vec_dot_f16: four L-lane accumulators over 4L-element steps, reduced (acc0+acc2) +
 * (acc1+acc3) and then across lanes (GGML_F32Cx8_REDUCE's hadds on AVX2,
 * _mm512_reduce_add_ps on AVX-512); the K % 4L leftover products are added in double. */
static float dot_vec(const float *a, const float *b, int64_t K, int lanes) {
    const int64_t step = 4 * lanes, np = K - K % step;
    double sum;
    if (lanes == 8) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t k = 0; k < np; k += step)
            for (int s = 0; s < 4; s++)
                acc[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8 * s), _mm256_loadu_ps(b + k + 8 * s), acc[s]);
        float x[8];
        _mm256_storeu_ps(x, _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
        const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];
        sum = (t0 + t1) + (t2 + t3);
    } else {
        __m256 lo[4], hi[4];
        for (int s = 0; s < 4; s++) lo[s] = hi[s] = _mm256_setzero_ps();
        for (int64_t k = 0; k < np; k += step)
            for (int s = 0; s < 4; s++) {
                lo[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16 * s), _mm256_loadu_ps(b + k + 16 * s), lo[s]);
                hi[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16 * s + 8), _mm256_loadu_ps(b + k + 16 * s + 8), hi[s]);
            }
        sum = hsum16v(_mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3])),
                      _mm256_add_ps(_mm256_add_ps(hi[0], hi[2]), _mm256_add_ps(hi[1], hi[3])));
    }
    for (int64_t k = np; k < K; k++) sum += (double) (a[k] * b[k]);
    return (float) sum;
}

/* a [G][P][K] . b [G][Q][K] -> out [G][P][Q] (f32 holding f16 values), by tinyBLAS (tinyblas = 1)
 * or ggml_vec_dot_f16 (tinyblas = 0) with L = lanes. */
void f16_dot(int64_t G, int64_t P, int64_t Q, int64_t K, const float *a, const float *b,
             int tinyblas, int lanes, float *out) {
    #pragma omp parallel for collapse(2) schedule(static) if (P >= PARALLEL_ROWS)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t p = 0; p < P; p++) {
            const float *ar = a + (g * P + p) * K;
            for (int64_t j = 0; j < Q; j++) {
                const float *br = b + (g * Q + j) * K;
                out[(g * P + p) * Q + j] = tinyblas ? dot_tinyblas(ar, br, K, lanes) : dot_vec(ar, br, K, lanes);
            }
        }
    }
}

/* The x86 features ggml's build and kernel choice depend on, read with cpuid the way GCC's
 * -march=native and ggml's cpu-feats.cpp read them (the OS must also save the AVX / AVX-512 / AMX
 * register state: XCR0). Bits: see engine/kernels/cpu.py FEATURE_BITS. */
int64_t cpu_features(void) {
    unsigned a, b, c, d;
    int64_t f = 0;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1;
    uint64_t xcr0 = 0;
    if (osxsave) {
        uint32_t lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t) hi << 32) | lo;
    }
    const int avx_os = (xcr0 & 0x6) == 0x6, avx512_os = avx_os && (xcr0 & 0xE0) == 0xE0;
    const int amx_os = (xcr0 & 0x60000) == 0x60000;
    if (avx_os && ((c >> 28) & 1)) f |= 1 << 0;                   /* avx */
    if (avx_os && ((c >> 12) & 1)) f |= 1 << 2;                   /* fma */
    if (avx_os && ((c >> 29) & 1)) f |= 1 << 3;                   /* f16c */
    unsigned max_leaf = __get_cpuid_max(0, 0);
    if (max_leaf >= 7) {
        __get_cpuid_count(7, 0, &a, &b, &c, &d);
        if (avx_os && ((b >> 5) & 1)) f |= 1 << 1;                /* avx2 */
        if (avx512_os) {
            if ((b >> 16) & 1) f |= 1 << 4;                       /* avx512f */
            if ((b >> 17) & 1) f |= 1 << 5;                       /* avx512dq */
            if ((b >> 30) & 1) f |= 1 << 6;                       /* avx512bw */
            if ((b >> 31) & 1) f |= 1 << 7;                       /* avx512vl */
            if ((c >> 1) & 1) f |= 1 << 8;                        /* avx512vbmi */
            if ((c >> 11) & 1) f |= 1 << 9;                       /* avx512vnni */
            if ((d >> 23) & 1) f |= 1 << 11;                      /* avx512fp16 */
        }
        if (amx_os && ((d >> 25) & 1)) f |= 1 << 13;              /* amx_int8 */
        const unsigned sub = a;
        if (sub >= 1) {
            __get_cpuid_count(7, 1, &a, &b, &c, &d);
            if (avx_os && ((a >> 4) & 1)) f |= 1 << 12;           /* avxvnni */
            if (avx512_os && ((a >> 5) & 1)) f |= 1 << 10;        /* avx512bf16 */
        }
    }
    return f;
}
