/* llama.cpp's CPU arithmetic (ggml-cpu, x86 builds with AVX2 + FMA + F16C, with or without
 * AVX-512), in plain C: the matmul summation orders, and a whole decoder forward built on them.
 *
 * The same arithmetic as the torch reference in engine/kernels/ggml_matmul.py,
 * engine/kernels/numerics.py and engine/models/blocks.py (see there for the ggml sources each
 * order comes from); this file only makes it fast. Compiled with -ffp-contract=off: the only fused
 * operations are the explicit fmaf() / _mm256_fmadd_ps calls, every other float operation rounds
 * on its own, as in ggml's intrinsics. Integer parts are exact in int32 (any order gives the same
 * integer).
 *
 * Threads split the rows of each output the way ggml's threads do: every output value is computed
 * by one thread in the same order whatever the thread count, so the bits never depend on it.
 * fb_forward runs every layer of a Llama / Qwen / Gemma 3 decoder for a batch of positions in one
 * call (one parallel region, a barrier between ops that spins, then sleeps: barrier_wait), with the f16
 * KV cache in the caller's buffers.
 *
 * Which order ggml uses depends on the instruction set llama.cpp was compiled for (-march=native
 * by default) and on whether it was opened with its extra buffer types (repacked Q4_0/Q4_K) or
 * without (--no-repack, as engine/export/llamacpp.py opens an AMX build): the caller passes both
 * in fb_plan (engine/kernels/cpu.py decides). Every order is written with
 * AVX2 intrinsics or scalar code, so an AVX2-only machine can compute the AVX-512 orders too (a
 * 16-lane accumulator is two 8-lane halves; the lanes never interact until the reduction).
 * x86 with AVX2 + FMA + F16C only; elsewhere the build fails and the torch reference runs.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <cpuid.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <omp.h>
#include <x86intrin.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PARALLEL_ROWS 8  /* f16_dot: fewer rows stay on one thread */

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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

/* Integer dot products are exact in any order, so how the lanes are formed is free: VNNI's
 * dpbusd where the compiler targets it, else maddubs + madd (whose int16 pair sums cannot saturate
 * here: |w| <= 128 and |x| <= 127 give at most 32512). */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(u, s));
#endif
}

/* Q8_0 activations (the Q8_0 / Q5_0 / Q4_0 weights' vec_dot type) as the q0 kernels read them
 * (quantize_rows writes them so; the values are ggml's, only where they lie differs):
 * - rows in tiles of Q0_TILE, each block's Q0_TILE rows side by side: block b of row r at
 *   Q0_AT(nb, r, b), so a tile's rows are at fixed offsets from one pointer;
 * - with VNNI, the bytes stored + 128 (unsigned), so that dpbusd multiplies them by the signed
 *   weights directly (|x| <= 127: x + 128 fits a byte); without, as ggml stores them (maddubs's
 *   int16 pair sums could saturate on the shifted values);
 * - the scales likewise, block b of row r at Q0_SCALE(nb, r, b): a tile's eight side by side, its
 *   blocks one after another. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q0_ACT_UNSIGNED 1
#else
#define Q0_ACT_UNSIGNED 0
#endif
#define Q0_TILE 8
#define Q0_AT(nb, r, b) ((((r) / Q0_TILE) * (nb) + (b)) * (32 * Q0_TILE) + ((r) % Q0_TILE) * 32)
#define Q0_SCALE(nb, r, b) ((((r) / Q0_TILE) * (nb) + (b)) * Q0_TILE + (r) % Q0_TILE)

/* Unsigned weights (0..63) x signed activations, each int16 pair times its scale: lane l = the
 * products of bytes 4l..4l+3, bytes 0-15 times s_lo and 16-31 times s_hi (exact in int32). */
static inline __m256i lanes_u8_scaled(const int8_t *x, __m256i w, __m256i scale16) {
    return _mm256_madd_epi16(scale16, _mm256_maddubs_epi16(w, _mm256_loadu_si256((const __m256i *) x)));
}

/* ggml's bytes_from_bits_32: byte j = 0xFF where bit j of the 32 is set. */
static inline __m256i bytes_from_bits_32(const uint8_t *x) {
    uint32_t x32;
    memcpy(&x32, x, sizeof(uint32_t));
    const __m256i shuf_mask = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int) x32), shuf_mask);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

/* The horizontal sums of four vectors, [sum v0, sum v1, sum v2, sum v3]. */
static inline __m128i hsum4_i32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* ---- activations as ggml's matmul quantizes them ---------------------------------------- */

static inline float round_f16(float x) { return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)); }

/* quantize_row_q8_0 (its AVX2 path, vector for vector): d = f16(amax/127), q = round-half-even(
 * x·(127/amax)). Block b's 32 bytes at q + b·q_stride, its d at d[b·d_stride]; `unsigned_q`
 * stores q + 128 (Q0_ACT_UNSIGNED). */
static void quantize_q8_0_row(const float *x, int64_t K, int8_t *q, int64_t q_stride, float *d, int64_t d_stride,
                              int unsigned_q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / 32; b++) {
        const float *xb = x + 32 * b;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        d[b * d_stride] = round_f16(amax / 127.f);
        const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.f / amax : 0.0f);
        __m256i i32[4];
        for (int j = 0; j < 4; j++)
            i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_ROUND_NEAREST | _MM_FROUND_NO_EXC));
        /* packs interleaves the 128-bit halves: the permute puts the 32 bytes back in order */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        if (unsigned_q) bytes = _mm256_xor_si256(bytes, _mm256_set1_epi8((char) 0x80));
        _mm256_storeu_si256((__m256i *) (q + b * q_stride), bytes);
    }
}

/* quantize_row_q8_1 (AVX2 path): the Q8_0 ints and f16(amax/127), and s = f16(d·Σq) with the
 * f32 d = amax/127. */
static void quantize_q8_1_row(const float *x, int64_t K, int8_t *q, float *d, float *s) {
    quantize_q8_0_row(x, K, q, 32, d, 1, 0);
    for (int64_t b = 0; b < K / 32; b++) {
        float amax = 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < 32; i++) {
            amax = fmaxf(amax, fabsf(x[32 * b + i]));
            sum += q[32 * b + i];
        }
        s[b] = round_f16(amax / 127.f * (float) sum);
    }
}

/* quantize_row_q8_K_ref: the first element of largest magnitude sets iscale = -127/max,
 * q = min(127, nearest(iscale·x)), d = 1/iscale; plus the sums of each 16 (ggml's bsums). */
static void quantize_q8_k_row(const float *x, int64_t K, int8_t *q, float *d, int16_t *sums) {
    for (int64_t b = 0; b < K / 256; b++) {
        const float *xb = x + 256 * b;
        int8_t *qb = q + 256 * b;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < 256; j++) {
            const float ax = fabsf(xb[j]);
            if (ax > amax) { amax = ax; max = xb[j]; }
        }
        if (amax == 0.0f) {
            d[b] = 0.0f;
            memset(qb, 0, 256);
            for (int g = 0; g < 16; g++) sums[16 * b + g] = 0;
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            const int v = (int) nearbyintf(iscale * xb[j]);
            qb[j] = (int8_t) (v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int32_t s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * g + i];
            sums[16 * b + g] = (int16_t) s;  /* |s| <= 16 * 128 */
        }
        d[b] = 1.0f / iscale;
    }
}

/* ---- weights and the per-row matmul kernels --------------------------------------------- */

enum { FB_F16 = 1, FB_Q4_0 = 2, FB_Q4_1 = 3, FB_Q5_0 = 6, FB_Q5_1 = 7, FB_Q8_0 = 8, FB_Q4_K = 12, FB_Q5_K = 13,
       FB_Q6_K = 14, FB_TQ1_0 = 34, FB_TQ2_0 = 35 };

/* Q8_0-activation weights (vec_dot_q*_0_q8_0 and tinyBLAS_Q0_AVX), and the K-quants with a min. */
static inline int is_q0(int type) { return type == FB_Q8_0 || type == FB_Q5_0 || type == FB_Q4_0; }
static inline int q0_block_bytes(int type) { return type == FB_Q8_0 ? 34 : type == FB_Q5_0 ? 22 : 18; }
/* Q4_1 / Q5_1: weights with a min, Q8_1 activations (vec_dot_q4_1_q8_1, vec_dot_q5_1_q8_1). */
static inline int is_q1(int type) { return type == FB_Q4_1 || type == FB_Q5_1; }

/* A weight [rows][cols] in the layout of engine/gguf/dequant.py unpack_blocks (F16: the raw
 * halves). Mirrored by engine/kernels/native.py Weight. */
typedef struct {
    int32_t type, pad_;
    int64_t rows, cols;
    const void *q;          /* Q4_0, Q8_0, Q5_0, Q4_K, Q5_K: the GGUF blocks themselves (the
                             * kernels unpack the bits in registers); Q6_K uint8 [rows][cols];
                             * F16 uint16 */
    const void *scales;     /* Q4_K, Q5_K uint8 [rows][cols/256][8]; Q6_K int8 [rows][cols/256][16] */
    const uint8_t *mins;    /* Q4_K, Q5_K [rows][cols/256][8] */
    const float *d, *dmin;  /* [rows][blocks] (Q4_1, Q5_1: dmin holds the block's min m) */
    const float *bias;      /* [rows] or NULL (Qwen2's q/k/v) */
    const void *q2;         /* TQ1_0, TQ2_0: a second plane's GGUF blocks (PTQTP, engine/ptqtp), the
                             * weight being the sum of the two; NULL for one plane */
    const void *raw;        /* Q6_K: the GGUF blocks, which the one-row (decode) kernel reads instead of
                             * q, scales and d (210 bytes a superblock against 276); NULL: it reads
                             * those */
} fb_weight;

/* The orders llama.cpp's build runs (engine/kernels/cpu.py KernelPlan). Mirrored by native.py. */
typedef struct {
    int32_t f16_lanes, softmax_lanes;
    int32_t repack;  /* llama.cpp's extra buffer types on (its default): Q4_K matrices with
                      * rows % 8 == 0 are repacked to q4_K_8x8; 0 (--no-repack, AMX builds as
                      * engine/export/llamacpp.py opens them): every weight in its GGUF layout */
} fb_plan;

/* A batch of activation rows as the weight's vec_dot type holds them. */
typedef struct {
    int8_t *q;      /* [R][K] (Q8_0: Q0_AT, + 128 where Q0_ACT_UNSIGNED) */
    float *d;       /* Q8_0: Q0_SCALE; [R][K/32] (Q8_1) or [R][K/256] (Q8_K) */
    int16_t *sums;  /* [R][K/16] (Q8_K): each 16's sum */
    float *h;       /* [R][K] f16-rounded (F16 weights) */
    float *s;       /* [R][K/32] (Q8_1): f16(d·Σq), d before its f16 rounding */
    /* Q8_K (or, AVX512-VNNI builds, Q8_0) again, bands of KT_BAND rows side by side for the
     * band kernels (NULL for fewer than KT_BAND rows): the same values, laid out so that one
     * load holds four consecutive k of the band's rows (16 rows and 64 bytes for dpbusd on
     * AVX512-VNNI builds, 8 rows and 32 bytes for maddubs on AVX2 ones) */
    int8_t *qt;     /* [R/KT_BAND][K/4][KT_BAND][4] */
    int32_t *bt;    /* [R/KT_BAND][K/16][KT_BAND]: each 16's sum */
    float *dt;      /* [R/KT_BAND][K/256 or K/32][KT_BAND] */
} fb_act;

/* ---- unpacking GGUF blocks into the kernels' layout (dequant.py unpack_blocks) ----------- */

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* nblocks blocks of `type` (ggml-common.h layouts) -> what the kernels do not read from the blocks
 * themselves: d (f32) for Q8_0 / Q5_0; scales, mins (6-bit), d, dmin for Q4_K; for Q6_K also q
 * (one byte per weight, 0..63 = stored + 32) and its 16 int8 scales. Blocks are independent:
 * split across threads. */
void fb_unpack(int type, int64_t nblocks, const uint8_t *raw, void *q, void *scales, uint8_t *mins,
               float *d, float *dmin, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && nblocks > 4096)
    for (int64_t i = 0; i < nblocks; i++) {
        if (is_q0(type)) {
            d[i] = f16_at(raw + i * q0_block_bytes(type));
        } else if (is_q1(type)) {
            const uint8_t *b = raw + i * (type == FB_Q4_1 ? 20 : 24);
            d[i] = f16_at(b);
            dmin[i] = f16_at(b + 2);
        } else if (type == FB_Q4_K || type == FB_Q5_K) {
            const uint8_t *b = raw + i * (type == FB_Q4_K ? 144 : 176), *sc = b + 4;
            uint8_t *os = (uint8_t *) scales + i * 8, *om = mins + i * 8;
            d[i] = f16_at(b);
            dmin[i] = f16_at(b + 2);
            for (int j = 0; j < 8; j++) {
                if (j < 4) {
                    os[j] = sc[j] & 63;
                    om[j] = sc[j + 4] & 63;
                } else {
                    os[j] = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
                    om[j] = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
                }
            }
        } else {  /* Q6_K */
            const uint8_t *b = raw + i * 210, *ql = b, *qh = b + 128;
            uint8_t *o = (uint8_t *) q + i * 256;
            memcpy((int8_t *) scales + i * 16, b + 192, 16);
            d[i] = f16_at(b + 208);
            for (int half = 0; half < 2; half++, ql += 64, qh += 32, o += 128)
                for (int l = 0; l < 32; l++) {
                    o[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
                    o[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                    o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
        }
    }
}

/* ---- band kernels for many activation rows ----------------------------------------------
 * llama.cpp's tiled K-quant matmul and its repacked Q4_K gemm compute, per weight row and
 * activation row, an exact integer dot per superblock (or per 64), then a fixed chain of f32
 * operations. The integers do not depend on how they are formed, so these kernels form them as
 * the tiled microkernel does (ggml-cpu/tiled/tiled-kernel.cpp): KT_BAND activation rows in the
 * lanes of one zmm, four k of one weight row broadcast, one dpbusd per 4 k for 16 outputs, each
 * subblock's sum times its scale (mullo) once; then each output's f32 chain, vector for vector,
 * exactly as q6_k_tiled_tile / q4_k_gemm_tile / k_plain_rows run it for four rows. Only whole
 * bands go here; the rows after the last band take the four-row tiles and one-row loops as
 * before. AVX512-VNNI builds also have bands for Q8_0 / Q5_0 / Q4_0 (q0_band). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define KT_BANDS 1
#define KT_BAND 16
#define Q6_BAND_TN 8  /* weight rows per pass of the band kernels (their accumulators in registers) */
#define Q4_BAND_TN 4
#else
/* AVX2 builds: the K-quant band kernels with 8 activation rows per ymm (no VNNI: maddubs, whose
 * int16 sums are added over as many groups as cannot saturate, then one madd by the scale). The
 * Q8_0 / Q5_0 / Q4_0 matmuls keep q0_tile there: ggml's order converts and fmas each lane of
 * four products on its own, which costs one cvt and one fma per 32 products in either layout,
 * and the integer part is maddubs + madd in both, so a band saves nothing to count on */
#define KT_BANDS 0
#define KT_BAND 8
#define Q6_BAND_TN 4  /* 16 ymm registers */
#define Q4_BAND_TN 4
#endif
/* Weight rows per pass over the bands: their unpacked bytes (32 rows of K = 2048: 64 KB) stay in
 * L2 while each band of activations passes, and the outputs of a band are written together (a
 * band's 16 rows times KT_SUB columns) instead of one column of 16 rows at a time. */
#define KT_SUB 32

/* Row r's Q8_K values (already in a->q, a->d, a->sums) copied into its band (fb_act.qt). */
static void band_row(const fb_act *a, int64_t r, int64_t K) {
    const int64_t band = r / KT_BAND, i = r % KT_BAND, nsb = K / 256;
    const int8_t *q = a->q + r * K;
    int8_t *qt = a->qt + band * KT_BAND * K + i * 4;
    for (int64_t g = 0; g < K / 4; g++) memcpy(qt + g * 4 * KT_BAND, q + 4 * g, 4);
    int32_t *bt = a->bt + band * KT_BAND * (K / 16) + i;
    for (int64_t s = 0; s < K / 16; s++) bt[s * KT_BAND] = a->sums[r * (K / 16) + s];
    float *dt = a->dt + band * KT_BAND * nsb + i;
    for (int64_t b = 0; b < nsb; b++) dt[b * KT_BAND] = a->d[r * nsb + b];
}

static inline __m256i q0_block(const fb_weight *w, int64_t blk);

/* Row r's Q8_0 values (already in the q0 tiles: Q0_AT, Q0_SCALE) copied into its band. */
static void band_row_q0(const fb_act *a, int64_t r, int64_t K) {
    const int64_t band = r / KT_BAND, i = r % KT_BAND, nb = K / 32;
    int8_t *qt = a->qt + band * KT_BAND * K + i * 4;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *q = a->q + Q0_AT(nb, r, b);
        for (int g = 0; g < 8; g++) memcpy(qt + (b * 8 + g) * 4 * KT_BAND, q + 4 * g, 4);
    }
    float *dt = a->dt + band * KT_BAND * nb + i;
    for (int64_t b = 0; b < nb; b++) dt[b * KT_BAND] = a->d[Q0_SCALE(nb, r, b)];
}

#if KT_BANDS
/* The lanes of v (one output per activation row of the band) into column n of out. */
static inline void band_store(__m512 v, float *out, int64_t band, int64_t N, int64_t n) {
    float tmp[KT_BAND];
    _mm512_storeu_ps(tmp, v);
    for (int i = 0; i < KT_BAND; i++) out[(band * KT_BAND + i) * N + n] = tmp[i];
}

/* Q6_K, ggml's tiled order (q6_k_tiled_tile): weight rows n..n+TN-1 against band `band`: per
 * 256, s1 = Σ_subblock scale·(Σ w·x - 32·bsum) exact, then acc = fma(d_w·f32(s1), d_x, acc). */
static inline __attribute__((always_inline)) void q6_k_band(const fb_weight *w, const fb_act *a, int64_t n,
                                                            const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *wq = (const uint8_t *) w->q + n * K;
    const int8_t *sc = (const int8_t *) w->scales + n * nsb * 16;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    __m512 acc[8];
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m512i s1[8];
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++) s1[t] = _mm512_setzero_si512();
        for (int s = 0; s < 16; s++) {
            const int64_t k0 = b * 256 + s * 16;
            __m512i raw[8];
            #pragma GCC unroll 8
            for (int t = 0; t < TN; t++) raw[t] = _mm512_setzero_si512();
            #pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                const __m512i codes = _mm512_loadu_si512((const void *) (xq + (k0 / 4 + g) * 4 * KT_BAND));
                #pragma GCC unroll 8
                for (int t = 0; t < TN; t++) {
                    int32_t u;
                    memcpy(&u, wq + t * K + k0 + 4 * g, 4);
                    raw[t] = _mm512_dpbusd_epi32(raw[t], _mm512_set1_epi32(u), codes);
                }
            }
            const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512((const void *) (xs + (k0 / 16) * KT_BAND)), 5);
            #pragma GCC unroll 8
            for (int t = 0; t < TN; t++)
                s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(_mm512_sub_epi32(raw[t], off),
                                                                   _mm512_set1_epi32(sc[(t * nsb + b) * 16 + s])));
        }
        const __m512 d = _mm512_loadu_ps(xd + b * KT_BAND);
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(w->d[(n + t) * nsb + b]), _mm512_cvtepi32_ps(s1[t])), d, acc[t]);
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) band_store(acc[t], out, band, N, n + t);
}


/* Repacked Q4_K, ggml_gemm_q4_K_8x8_q8_K's order (q4_k_gemm_tile): weight rows n..n+TN-1, their
 * nibbles unpacked to one byte per k in wu [TN][K], against band `band`: per 64-chunk the exact
 * dot and min, acc = fma(f32(dot), d_w·d_x, acc), acc_min = fma(f32(min), dmin_w·d_x, acc_min);
 * output acc - acc_min. */
static inline __attribute__((always_inline)) void q4_k_band(const fb_weight *w, const fb_act *a, const uint8_t *wu,
                                                            int64_t n, const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *scales = (const uint8_t *) w->scales;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    __m512 acc[4], acc_min[4];
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) acc[t] = acc_min[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m512 xdv = _mm512_loadu_ps(xd + b * KT_BAND);
        __m512 sd[4], smin[4];  /* f32(d_w·d_x) and f32(dmin_w·d_x) of the superblock */
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++) {
            sd[t] = _mm512_mul_ps(_mm512_set1_ps(w->d[(n + t) * nsb + b]), xdv);
            smin[t] = _mm512_mul_ps(_mm512_set1_ps(w->dmin[(n + t) * nsb + b]), xdv);
        }
        for (int c = 0; c < 4; c++) {
            const int64_t k0 = b * 256 + 64 * c;
            __m512i lo[4], hi[4];
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++) lo[t] = hi[t] = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m512i codes_lo = _mm512_loadu_si512((const void *) (xq + (k0 / 4 + g) * 4 * KT_BAND));
                const __m512i codes_hi = _mm512_loadu_si512((const void *) (xq + (k0 / 4 + 8 + g) * 4 * KT_BAND));
                #pragma GCC unroll 4
                for (int t = 0; t < TN; t++) {
                    int32_t u_lo, u_hi;
                    memcpy(&u_lo, wu + t * K + k0 + 4 * g, 4);  /* wu: row n's bytes */
                    memcpy(&u_hi, wu + t * K + k0 + 32 + 4 * g, 4);
                    lo[t] = _mm512_dpbusd_epi32(lo[t], _mm512_set1_epi32(u_lo), codes_lo);
                    hi[t] = _mm512_dpbusd_epi32(hi[t], _mm512_set1_epi32(u_hi), codes_hi);
                }
            }
            /* the activation's 32-sums of the chunk's two subblocks */
            const int32_t *xs_c = xs + (k0 / 16) * KT_BAND;
            const __m512i p0 = _mm512_add_epi32(_mm512_loadu_si512((const void *) xs_c),
                                                _mm512_loadu_si512((const void *) (xs_c + KT_BAND)));
            const __m512i p1 = _mm512_add_epi32(_mm512_loadu_si512((const void *) (xs_c + 2 * KT_BAND)),
                                                _mm512_loadu_si512((const void *) (xs_c + 3 * KT_BAND)));
            /* each lane's two sums as an int16 pair (|.| <= 2·16·128 fits), so that one dpwssd
             * forms m_2c·p0 + m_2c+1·p1 per weight row */
            const __m512i pp = _mm512_or_si512(_mm512_and_si512(p0, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(p1, 16));
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++) {
                const int64_t blk = (n + t) * nsb + b;
                const uint8_t *sc = scales + blk * 8, *mn = w->mins + blk * 8;
                const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(lo[t], _mm512_set1_epi32(sc[2 * c])),
                                                     _mm512_mullo_epi32(hi[t], _mm512_set1_epi32(sc[2 * c + 1])));
                const __m512i min = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pp,
                                                        _mm512_set1_epi32(mn[2 * c] | (int32_t) mn[2 * c + 1] << 16));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd[t], acc[t]);
                acc_min[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(min), smin[t], acc_min[t]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) band_store(_mm512_sub_ps(acc[t], acc_min[t]), out, band, N, n + t);
}

/* Q8_0 / Q5_0 / Q4_0, the order of q0_tile (vec_dot_q*_0_q8_0, tinyBLAS_Q0): weight rows
 * n..n+TN-1, as signed bytes in wu [TN][K] with corr [TN][K/4] = -128·(each 4's sum), against
 * band `band` (activations + 128, Q0_ACT_UNSIGNED): lane l of block b, the four products
 * 4l..4l+3, is one dpbusd on top of corr, exact; per block and lane
 * acc_l = fma(f32(d_w·d_x), f32(lane), acc_l); the eight lanes summed as hsum_float_8. */
static inline __attribute__((always_inline)) void q0_band(const fb_weight *w, const fb_act *a, const int8_t *wu,
                                                          const int32_t *corr, int64_t n, const int TN, int64_t band,
                                                          float *out) {
    const int64_t K = w->cols, nb = K / 32, N = w->rows;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const float *xd = a->dt + band * KT_BAND * nb;
    __m512 acc[2][8];
    #pragma GCC unroll 2
    for (int t = 0; t < TN; t++)
        #pragma GCC unroll 8
        for (int l = 0; l < 8; l++) acc[t][l] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m512 dx = _mm512_loadu_ps(xd + b * KT_BAND);
        __m512 d[2];
        #pragma GCC unroll 2
        for (int t = 0; t < TN; t++) d[t] = _mm512_mul_ps(_mm512_set1_ps(w->d[(n + t) * nb + b]), dx);
        #pragma GCC unroll 8
        for (int l = 0; l < 8; l++) {
            const __m512i codes = _mm512_loadu_si512((const void *) (xq + (b * 8 + l) * 4 * KT_BAND));
            #pragma GCC unroll 2
            for (int t = 0; t < TN; t++) {
                int32_t u;
                memcpy(&u, wu + t * K + b * 32 + 4 * l, 4);
                const __m512i lane = _mm512_dpbusd_epi32(_mm512_set1_epi32(corr[t * (K / 4) + b * 8 + l]), codes,
                                                         _mm512_set1_epi32(u));
                acc[t][l] = _mm512_fmadd_ps(d[t], _mm512_cvtepi32_ps(lane), acc[t][l]);
            }
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < TN; t++) {
        const __m512 *x = acc[t];  /* hsum_float_8: ((x0+x4) + (x2+x6)) + ((x1+x5) + (x3+x7)) */
        const __m512 r0 = _mm512_add_ps(x[4], x[0]), r1 = _mm512_add_ps(x[5], x[1]);
        const __m512 r2 = _mm512_add_ps(x[6], x[2]), r3 = _mm512_add_ps(x[7], x[3]);
        band_store(_mm512_add_ps(_mm512_add_ps(r0, r2), _mm512_add_ps(r1, r3)), out, band, N, n + t);
    }
}

/* Weight row n of a Q8_0 / Q5_0 / Q4_0 matrix as signed bytes (q0_block) and each 4's -128·sum. */
static void q0_unpack_row(const fb_weight *w, int64_t n, int8_t *dst, int32_t *corr) {
    const int64_t nb = w->cols / 32;
    for (int64_t b = 0; b < nb; b++) {
        const __m256i v = q0_block(w, n * nb + b);
        _mm256_storeu_si256((__m256i *) (dst + 32 * b), v);
        const __m256i sums = _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(_mm256_set1_epi8(1), v));
        _mm256_storeu_si256((__m256i *) (corr + 8 * b), _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), sums), 7));
    }
}

/* Returns 0, or -1 (nothing done: the caller's other kernels take the rows) without memory for
 * the unpacked rows (on the heap: a thread's stack may be small, and K large). */
static int q0_bands(const fb_weight *w, int64_t bands, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols;
    int8_t *wu = malloc((size_t) (KT_SUB * K));
    int32_t *corr = malloc(sizeof(int32_t) * (size_t) (KT_SUB * (K / 4)));
    if (!wu || !corr) { free(wu); free(corr); return -1; }
    for (int64_t s0 = n0; s0 < n1; s0 += KT_SUB) {
        const int64_t s1 = s0 + KT_SUB < n1 ? s0 + KT_SUB : n1;
        for (int64_t n = s0; n < s1; n++) q0_unpack_row(w, n, wu + (n - s0) * K, corr + (n - s0) * (K / 4));
        for (int64_t band = 0; band < bands; band++) {
            int64_t n = s0;
            for (; n + 2 <= s1; n += 2) q0_band(w, a, wu + (n - s0) * K, corr + (n - s0) * (K / 4), n, 2, band, out);
            for (; n < s1; n++) q0_band(w, a, wu + (n - s0) * K, corr + (n - s0) * (K / 4), n, 1, band, out);
        }
    }
    free(wu);
    free(corr);
    return 0;
}




/* Q4_K / Q5_K in their GGUF layout (no extra buffer types: AMX builds as opened here, or
 * --no-repack), ggml's tiled order (k_plain_rows, tiled = 1): weight rows n..n+TN-1, their
 * unsigned 4- or 5-bit values one byte per k in wu [TN][K], against band `band`: per 256 the exact
 * s1 = Σ_subblock scale·(Σ w·x) and s2 = Σ_subblock min·(its 32-sum of x), then
 * res = fnmadd(dmin_w, f32(s2), d_w·f32(s1)) and acc = fma(res, d_x, acc), as the microtile. */
static inline __attribute__((always_inline)) void k_plain_band(const fb_weight *w, const fb_act *a, const uint8_t *wu,
                                                               int64_t n, const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *scales = (const uint8_t *) w->scales;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    __m512 acc[8];
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m512i s1[8], s2[8];
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++) s1[t] = s2[t] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) {  /* subblock j: k b·256 + 32j .. + 31 */
            const int64_t k0 = b * 256 + 32 * j;
            __m512i raw[8];
            #pragma GCC unroll 8
            for (int t = 0; t < TN; t++) raw[t] = _mm512_setzero_si512();
            #pragma GCC unroll 8
            for (int g = 0; g < 8; g++) {
                const __m512i codes = _mm512_loadu_si512((const void *) (xq + (k0 / 4 + g) * 4 * KT_BAND));
                #pragma GCC unroll 8
                for (int t = 0; t < TN; t++) {
                    int32_t u;
                    memcpy(&u, wu + t * K + k0 + 4 * g, 4);
                    raw[t] = _mm512_dpbusd_epi32(raw[t], _mm512_set1_epi32(u), codes);
                }
            }
            /* the subblock's 32-sum of each activation row (two 16-sums) */
            const __m512i bsum = _mm512_add_epi32(_mm512_loadu_si512((const void *) (xs + (k0 / 16) * KT_BAND)),
                                                  _mm512_loadu_si512((const void *) (xs + (k0 / 16 + 1) * KT_BAND)));
            #pragma GCC unroll 8
            for (int t = 0; t < TN; t++) {
                const int64_t blk = (n + t) * nsb + b;
                s1[t] = _mm512_add_epi32(s1[t], _mm512_mullo_epi32(raw[t], _mm512_set1_epi32(scales[blk * 8 + j])));
                s2[t] = _mm512_add_epi32(s2[t], _mm512_mullo_epi32(bsum, _mm512_set1_epi32(w->mins[blk * 8 + j])));
            }
        }
        const __m512 d = _mm512_loadu_ps(xd + b * KT_BAND);
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++) {
            const int64_t blk = (n + t) * nsb + b;
            const __m512 res = _mm512_fnmadd_ps(_mm512_set1_ps(w->dmin[blk]), _mm512_cvtepi32_ps(s2[t]),
                                                _mm512_mul_ps(_mm512_set1_ps(w->d[blk]), _mm512_cvtepi32_ps(s1[t])));
            acc[t] = _mm512_fmadd_ps(res, d, acc[t]);
        }
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) band_store(acc[t], out, band, N, n + t);
}


#else
/* The lanes of v (one output per activation row of the band) into column n of out. */
static inline void band_store(__m256 v, float *out, int64_t band, int64_t N, int64_t n) {
    float tmp[KT_BAND];
    _mm256_storeu_ps(tmp, v);
    for (int i = 0; i < KT_BAND; i++) out[(band * KT_BAND + i) * N + n] = tmp[i];
}

/* Two int16 values as the int32 a madd pairs them from: a in the low half, b in the high. */
static inline int32_t i16_pair(int a, int b) { return (int32_t) ((uint32_t) (uint16_t) a | (uint32_t) (uint16_t) b << 16); }

/* Per activation row of the band, Σ over G groups of four k from k0 of the unsigned weight bytes
 * wr times the row's Q8_K values, as maddubs leaves it: int16 pair 2r the products 0 and 1 of each
 * group, 2r+1 the products 2 and 3. Exact where G·2·w_max·128 < 32768: G = 8 for Q4_K (w <= 15),
 * 4 for Q5_K (31), 2 for Q6_K (63); the callers keep to those. */
static inline __attribute__((always_inline)) __m256i band8_pairs(const uint8_t *wr, const int8_t *xq, int64_t k0,
                                                                 const int G) {
    __m256i p = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int g = 0; g < G; g++) {
        int32_t u;
        memcpy(&u, wr + k0 + 4 * g, 4);
        p = _mm256_add_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi32(u),
                                                      _mm256_loadu_si256((const __m256i *) (xq + (k0 / 4 + g) * 4 * KT_BAND))));
    }
    return p;
}

/* Each row's sums x and y (|.| < 2^15: at most 32 values of |q| <= 128) as an int16 pair. */
static inline __m256i band8_sum_pair(__m256i x, __m256i y) {
    return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(y, 16));
}

static inline __m256i band8_sums(const int32_t *xs, int64_t s) {  /* 16-sum s of the band's rows */
    return _mm256_loadu_si256((const __m256i *) (xs + s * KT_BAND));
}

/* Q6_K, q6_k_tiled_tile's order for the 8 rows of a band (as the AVX512-VNNI q6_k_band): per 256
 * s1 = Σ_16 scale·(Σ w·x) - 32·Σ_16 scale·bsum, exact; acc = fma(d_w·f32(s1), d_x, acc). */
static inline __attribute__((always_inline)) void q6_k_band(const fb_weight *w, const fb_act *a, int64_t n,
                                                            const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *wq = (const uint8_t *) w->q + n * K;
    const int8_t *sc = (const int8_t *) w->scales + n * nsb * 16;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    __m256 acc[Q6_BAND_TN];
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i s1[Q6_BAND_TN];
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++) {  /* the offset part first: -32·Σ scale·bsum, two 16s per madd */
            const int8_t *st = sc + (t * nsb + b) * 16;
            __m256i off = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++)
                off = _mm256_add_epi32(off, _mm256_madd_epi16(band8_sum_pair(band8_sums(xs, b * 16 + 2 * j),
                                                                             band8_sums(xs, b * 16 + 2 * j + 1)),
                                                              _mm256_set1_epi32(i16_pair(st[2 * j], st[2 * j + 1]))));
            s1[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
        }
        for (int s = 0; s < 16; s++) {
            const int64_t k0 = b * 256 + 16 * s;
            #pragma GCC unroll 8
            for (int t = 0; t < TN; t++) {
                const __m256i scale = _mm256_set1_epi16(sc[(t * nsb + b) * 16 + s]);
                const __m256i lo = _mm256_madd_epi16(band8_pairs(wq + t * K, xq, k0, 2), scale);
                const __m256i hi = _mm256_madd_epi16(band8_pairs(wq + t * K, xq, k0 + 8, 2), scale);
                s1[t] = _mm256_add_epi32(s1[t], _mm256_add_epi32(lo, hi));
            }
        }
        const __m256 d = _mm256_loadu_ps(xd + b * KT_BAND);
        #pragma GCC unroll 8
        for (int t = 0; t < TN; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(w->d[(n + t) * nsb + b]), _mm256_cvtepi32_ps(s1[t])), d, acc[t]);
    }
    #pragma GCC unroll 8
    for (int t = 0; t < TN; t++) band_store(acc[t], out, band, N, n + t);
}

/* Repacked Q4_K, q4_k_gemm_tile's order for the 8 rows of a band (as the AVX512-VNNI q4_k_band):
 * per 64-chunk the exact dot (each 32-subblock's Σ w·x times its scale) and min (m·32-sums),
 * acc = fma(f32(dot), d_w·d_x, acc), acc_min = fma(f32(min), dmin_w·d_x, acc_min); acc - acc_min. */
static inline __attribute__((always_inline)) void q4_k_band(const fb_weight *w, const fb_act *a, const uint8_t *wu,
                                                            int64_t n, const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *scales = (const uint8_t *) w->scales;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    __m256 acc[Q4_BAND_TN], acc_min[Q4_BAND_TN];
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) acc[t] = acc_min[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const __m256 xdv = _mm256_loadu_ps(xd + b * KT_BAND);
        for (int c = 0; c < 4; c++) {
            const int64_t k0 = b * 256 + 64 * c, s = k0 / 16;
            const __m256i pp = band8_sum_pair(_mm256_add_epi32(band8_sums(xs, s), band8_sums(xs, s + 1)),
                                              _mm256_add_epi32(band8_sums(xs, s + 2), band8_sums(xs, s + 3)));
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++) {
                const int64_t blk = (n + t) * nsb + b;
                const uint8_t *sc = scales + blk * 8, *mn = w->mins + blk * 8;
                const __m256i dot = _mm256_add_epi32(
                    _mm256_madd_epi16(band8_pairs(wu + t * K, xq, k0, 8), _mm256_set1_epi16(sc[2 * c])),
                    _mm256_madd_epi16(band8_pairs(wu + t * K, xq, k0 + 32, 8), _mm256_set1_epi16(sc[2 * c + 1])));
                const __m256i min = _mm256_madd_epi16(pp, _mm256_set1_epi32(i16_pair(mn[2 * c], mn[2 * c + 1])));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(w->d[blk]), xdv), acc[t]);
                acc_min[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), _mm256_mul_ps(_mm256_set1_ps(w->dmin[blk]), xdv),
                                             acc_min[t]);
            }
        }
    }
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) band_store(_mm256_sub_ps(acc[t], acc_min[t]), out, band, N, n + t);
}

/* Q4_K / Q5_K in their GGUF layout, ggml's tiled order for the 8 rows of a band (as the
 * AVX512-VNNI k_plain_band): per 256 s1 = Σ scale·(Σ w·x) and s2 = Σ min·32-sum exact,
 * res = fnmadd(dmin_w, f32(s2), d_w·f32(s1)), acc = fma(res, d_x, acc). */
static inline __attribute__((always_inline)) void k_plain_band(const fb_weight *w, const fb_act *a, const uint8_t *wu,
                                                               int64_t n, const int TN, int64_t band, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *scales = (const uint8_t *) w->scales;
    const int8_t *xq = a->qt + band * KT_BAND * K;
    const int32_t *xs = a->bt + band * KT_BAND * (K / 16);
    const float *xd = a->dt + band * KT_BAND * nsb;
    const int q5 = w->type == FB_Q5_K;  /* 5-bit weights: int16 sums over 4 groups, not 8 */
    __m256 acc[Q4_BAND_TN];
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        __m256i s1[Q4_BAND_TN];
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++) s1[t] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {  /* subblock j: k b·256 + 32j .. + 31 */
            const int64_t k0 = b * 256 + 32 * j;
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++) {
                const __m256i scale = _mm256_set1_epi16(scales[((n + t) * nsb + b) * 8 + j]);
                const uint8_t *wr = wu + t * K;
                const __m256i p = q5 ? _mm256_add_epi32(_mm256_madd_epi16(band8_pairs(wr, xq, k0, 4), scale),
                                                        _mm256_madd_epi16(band8_pairs(wr, xq, k0 + 16, 4), scale))
                                     : _mm256_madd_epi16(band8_pairs(wr, xq, k0, 8), scale);
                s1[t] = _mm256_add_epi32(s1[t], p);
            }
        }
        const __m256 d = _mm256_loadu_ps(xd + b * KT_BAND);
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++) {
            const int64_t blk = (n + t) * nsb + b;
            const uint8_t *mn = w->mins + blk * 8;
            __m256i s2 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {  /* subblocks 2c, 2c+1: one madd of their 32-sums by the mins */
                const int64_t s = b * 16 + 4 * c;
                const __m256i pp = band8_sum_pair(_mm256_add_epi32(band8_sums(xs, s), band8_sums(xs, s + 1)),
                                                  _mm256_add_epi32(band8_sums(xs, s + 2), band8_sums(xs, s + 3)));
                s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(pp, _mm256_set1_epi32(i16_pair(mn[2 * c], mn[2 * c + 1]))));
            }
            const __m256 res = _mm256_fnmadd_ps(_mm256_set1_ps(w->dmin[blk]), _mm256_cvtepi32_ps(s2),
                                                _mm256_mul_ps(_mm256_set1_ps(w->d[blk]), _mm256_cvtepi32_ps(s1[t])));
            acc[t] = _mm256_fmadd_ps(res, d, acc[t]);
        }
    }
    #pragma GCC unroll 4
    for (int t = 0; t < TN; t++) band_store(acc[t], out, band, N, n + t);
}
#endif

static inline __m256i q5_k_bytes(const uint8_t *qs, const uint8_t *qh, int c, int half);

/* Weight row n's Q4_K nibbles, one byte per k (chunk c: bytes 32c.. low nibbles are k 64c..,
 * their high nibbles k 64c + 32..). */
static void q4_k_unpack_row(const fb_weight *w, int64_t n, uint8_t *dst) {
    const int64_t nsb = w->cols / 256;
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *qa = (const uint8_t *) w->q + (n * nsb + b) * 144 + 16;
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (qa + 32 * c));
            _mm256_storeu_si256((__m256i *) (dst + b * 256 + 64 * c), _mm256_and_si256(v, low));
            _mm256_storeu_si256((__m256i *) (dst + b * 256 + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        }
    }
}

/* Weight row n of a Q5_K matrix, one byte per k (0..31: nibble + 16·fifth bit, q5_k_bytes). */
static void q5_k_unpack_row(const fb_weight *w, int64_t n, uint8_t *dst) {
    const int64_t nsb = w->cols / 256;
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = (const uint8_t *) w->q + (n * nsb + b) * 176;
        for (int c = 0; c < 4; c++)
            for (int half = 0; half < 2; half++)
                _mm256_storeu_si256((__m256i *) (dst + b * 256 + 64 * c + 32 * half), q5_k_bytes(blk + 48, blk + 16, c, half));
    }
}

static void q6_k_bands(const fb_weight *w, int64_t bands, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    for (int64_t s0 = n0; s0 < n1; s0 += KT_SUB) {
        const int64_t s1 = s0 + KT_SUB < n1 ? s0 + KT_SUB : n1;
        for (int64_t band = 0; band < bands; band++) {
            int64_t n = s0;
            for (; n + Q6_BAND_TN <= s1; n += Q6_BAND_TN) q6_k_band(w, a, n, Q6_BAND_TN, band, out);
            for (; n < s1; n++) q6_k_band(w, a, n, 1, band, out);
        }
    }
}

static int q4_k_bands(const fb_weight *w, int64_t bands, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols;
    uint8_t *wu = malloc((size_t) (KT_SUB * K));  /* as q0_bands */
    if (!wu) return -1;
    for (int64_t s0 = n0; s0 < n1; s0 += KT_SUB) {
        const int64_t s1 = s0 + KT_SUB < n1 ? s0 + KT_SUB : n1;
        for (int64_t n = s0; n < s1; n++) q4_k_unpack_row(w, n, wu + (n - s0) * K);
        for (int64_t band = 0; band < bands; band++) {
            int64_t n = s0;
            for (; n + Q4_BAND_TN <= s1; n += Q4_BAND_TN) q4_k_band(w, a, wu + (n - s0) * K, n, Q4_BAND_TN, band, out);
            for (; n < s1; n++) q4_k_band(w, a, wu + (n - s0) * K, n, 1, band, out);
        }
    }
    free(wu);
    return 0;
}

/* Returns 0, or -1 without memory for the unpacked rows (as q0_bands). */
static int k_plain_bands(const fb_weight *w, int64_t bands, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols;
    uint8_t *wu = malloc((size_t) (KT_SUB * K));
    if (!wu) return -1;
    for (int64_t s0 = n0; s0 < n1; s0 += KT_SUB) {
        const int64_t s1 = s0 + KT_SUB < n1 ? s0 + KT_SUB : n1;
        for (int64_t n = s0; n < s1; n++) {
            if (w->type == FB_Q4_K) q4_k_unpack_row(w, n, wu + (n - s0) * K);
            else q5_k_unpack_row(w, n, wu + (n - s0) * K);
        }
        for (int64_t band = 0; band < bands; band++) {
            int64_t n = s0;
            for (; n + Q4_BAND_TN <= s1; n += Q4_BAND_TN) k_plain_band(w, a, wu + (n - s0) * K, n, Q4_BAND_TN, band, out);
            for (; n < s1; n++) k_plain_band(w, a, wu + (n - s0) * K, n, 1, band, out);
        }
    }
    free(wu);
    return 0;
}

static void quantize_rows(int type, const float *x, int64_t R, int64_t K, const fb_act *a,
                          int ith, int nth) {
    for (int64_t r = ith; r < R; r += nth) {
        const float *xr = x + r * K;
        if (is_q0(type))  /* the q0 kernels' layout (Q0_AT, Q0_SCALE) */
        {
            quantize_q8_0_row(xr, K, a->q + Q0_AT(K / 32, r, 0), 32 * Q0_TILE, a->d + Q0_SCALE(K / 32, r, 0), Q0_TILE,
                              Q0_ACT_UNSIGNED);
            if (KT_BANDS && a->qt && r < R - R % KT_BAND) band_row_q0(a, r, K);
        }
        else if (is_q1(type)) quantize_q8_1_row(xr, K, a->q + r * K, a->d + r * (K / 32), a->s + r * (K / 32));
        else if (type == FB_F16) for (int64_t k = 0; k < K; k++) a->h[r * K + k] = round_f16(xr[k]);
        else {
            quantize_q8_k_row(xr, K, a->q + r * K, a->d + r * (K / 256), a->sums + r * (K / 16));
            if (a->qt && r < R - R % KT_BAND) band_row(a, r, K);
        }
    }
}

/* Q8_0 / Q5_0 weights x Q8_0 activations (vec_dot_q8_0_q8_0, vec_dot_q5_0_q8_0, tinyBLAS_Q0_AVX):
 * per block of 32, eight exact int32 lanes of four products, one fma per block, hsum_float_8.
 * Eight (or four) activation rows at a time share each weight block (the sums stay per output). */
/* The 32 signed weights of block blk, unpacked from the GGUF block in registers (Q5_0 as
 * ggml's vec_dot_q5_0_q8_0 does: nibbles, then 0xF0 where the fifth bit is clear). */
static inline __m256i q0_block(const fb_weight *w, int64_t blk) {
    const uint8_t *q = (const uint8_t *) w->q;
    if (w->type == FB_Q8_0) return _mm256_loadu_si256((const __m256i *) (q + blk * 34 + 2));
    if (w->type == FB_Q4_0) {  /* bytes_from_nibbles_32 - 8, as vec_dot_q4_0_q8_0 and tinyBLAS */
        const __m128i nibbles = _mm_loadu_si128((const __m128i *) (q + blk * 18 + 2));
        const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
        return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    }
    const uint8_t *b = q + blk * 22;
    const __m128i nibbles = _mm_loadu_si128((const __m128i *) (b + 6));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(lo, _mm256_andnot_si256(bytes_from_bits_32(b + 2), _mm256_set1_epi8((char) 0xF0)));
}

/* Outputs (r..r+TR-1, n), r..r+TR-1 inside one Q0_TILE: the weight block unpacked once for the TR
 * activation rows. Each output's sum is ggml's whatever TR is: per block, eight exact int32 lanes,
 * acc = fma(f32(d_w·d_x), lane, acc), hsum_float_8 at the end. With Q0_ACT_UNSIGNED one dpbusd
 * per row and block forms Σ(x + 128)·w on top of -128·Σw: the exact Σx·w that the sign trick of
 * ggml's mul_sum_i8_pairs gives (integers cannot differ). The products d_w·d_x are formed
 * Q0_CHUNK blocks ahead, a vector multiply for eight rows, and each fma broadcasts its own from
 * memory. */
#define Q0_CHUNK 32
static inline __attribute__((always_inline)) void q0_tile(const fb_weight *w, const fb_act *a, int64_t R, int64_t n,
                                                          int64_t r, const int TR, float *out) {
    const int64_t K = w->cols, nb = K / 32, N = w->rows;
    const float *wd = w->d + n * nb;
    __m256 acc[Q0_TILE];
    #pragma GCC unroll 8
    for (int i = 0; i < TR; i++) acc[i] = _mm256_setzero_ps();
    float scale[Q0_CHUNK][Q0_TILE];  /* f32(d_w·d_x): the product ggml forms before its fma */
    for (int64_t b0 = 0; b0 < nb; b0 += Q0_CHUNK) {
        const int64_t b1 = b0 + Q0_CHUNK < nb ? b0 + Q0_CHUNK : nb;
        if (TR == Q0_TILE) {
            for (int64_t b = b0; b < b1; b++)
                _mm256_storeu_ps(scale[b - b0], _mm256_mul_ps(_mm256_set1_ps(wd[b]), _mm256_loadu_ps(a->d + Q0_SCALE(nb, r, b))));
            /* read back from memory (GCC would otherwise take each from the register with shuffles) */
            __asm__("" : "+m"(scale));
        }
        for (int64_t b = b0; b < b1; b++) {
            const __m256i wv = q0_block(w, n * nb + b);
            const int8_t *xq = a->q + Q0_AT(nb, r, b);
#if Q0_ACT_UNSIGNED
            const __m256i base = _mm256_sub_epi32(_mm256_setzero_si256(),
                                                  _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char) 0x80), wv));
#else
            const __m256i u = _mm256_sign_epi8(wv, wv);
#endif
            #pragma GCC unroll 8
            for (int i = 0; i < TR; i++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *) (xq + 32 * i));
#if Q0_ACT_UNSIGNED
                const __m256i lanes = _mm256_dpbusd_epi32(base, xv, wv);
#else
                const __m256i lanes = dot_u8_i8(u, _mm256_sign_epi8(xv, wv));
#endif
                const float d = TR == Q0_TILE ? scale[b - b0][i] : wd[b] * a->d[Q0_SCALE(nb, r + i, b)];
                acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[i]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < TR; i++) out[(r + i) * N + n] = hsum8v(acc[i]);
}

/* The 32 weights of the block at `blk` (a GGUF block of `type`) as q0_block gives them, or with
 * VNNI made unsigned (see q0_single). `type` is a constant where it is inlined. */
static inline __attribute__((always_inline)) __m256i q0_weights(const uint8_t *blk, const int type) {
#if Q0_ACT_UNSIGNED
    if (type == FB_Q8_0) return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *) (blk + 2)), _mm256_set1_epi8((char) 0x80));
    if (type == FB_Q4_0) {
        const __m128i nibbles = _mm_loadu_si128((const __m128i *) (blk + 2));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
    }
    const __m128i nibbles = _mm_loadu_si128((const __m128i *) (blk + 6));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
#if defined(__AVX512BW__)
    /* the 32 fifth bits as a mask register: +16 where set, one masked add */
    uint32_t qh;
    memcpy(&qh, blk + 2, sizeof(qh));
    return _mm256_mask_add_epi8(lo, (__mmask32) qh, lo, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(lo, _mm256_and_si256(bytes_from_bits_32(blk + 2), _mm256_set1_epi8(0x10)));
#endif
#else
    if (type == FB_Q8_0) return _mm256_loadu_si256((const __m256i *) (blk + 2));
    if (type == FB_Q4_0) {
        const __m128i nibbles = _mm_loadu_si128((const __m128i *) (blk + 2));
        const __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
        return _mm256_sub_epi8(v, _mm256_set1_epi8(8));
    }
    const __m128i nibbles = _mm_loadu_si128((const __m128i *) (blk + 6));
    const __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
    return _mm256_or_si256(lo, _mm256_andnot_si256(bytes_from_bits_32(blk + 2), _mm256_set1_epi8((char) 0xF0)));
#endif
}

#define Q0_PREFETCH_ROWS 16
#define Q0_STREAM_AHEAD 4096
/* One activation row r against weight rows n .. n+TN-1 (a decode step's matmuls and its LM
 * head: what decode spends its time in). Each output is q0_tile's sum for one row, one fma per
 * block into its own eight lanes, but TN outputs advance together: their fma chains are
 * independent, so the 4-cycle fma latency of one output's chain is hidden behind the others
 * (one row at a time, a K = 2048 row is 64 dependent fmas), and the activation block is loaded
 * once for the TN weight rows.
 * With VNNI the integer lanes come from one dpbusd per weight row and block: the weights made
 * unsigned (Q8_0: w + 128; Q5_0 / Q4_0: the stored 5- and 4-bit values, w + 16 and w + 8, before
 * ggml subtracts the offset) times the signed activations, on top of -offset · (the lane's sum of
 * activations), formed once per block for all TN rows: Σ(w + c)·x - c·Σx = Σw·x exactly, the
 * integer ggml's lanes hold.
 * The weight scale comes from the block's own f16 (exactly the f32 that w->d holds: f16 -> f32 is
 * exact), not from w->d: the block's line is read anyway, and the d array's 4 bytes per block were
 * a twelfth more to read for a Q8_0 block, a sixth for Q5_0 (decode reads from memory, the LM head
 * alone 178 MB per token for Gemma 3, and w->d added 21 MB to it). */
static inline __attribute__((always_inline)) void q0_single(const fb_weight *w, const fb_act *a, int64_t r,
                                                            int64_t n, const int TN, const int type, float *out) {
    const int64_t K = w->cols, nb = K / 32, N = w->rows;
    const int64_t bytes = type == FB_Q8_0 ? 34 : type == FB_Q5_0 ? 22 : 18, row_bytes = nb * bytes;
    const uint8_t *wq = (const uint8_t *) w->q + n * row_bytes;
    const int8_t *xq = a->q + Q0_AT(nb, r, 0);
    const float *xd = a->d + Q0_SCALE(nb, r, 0);
    /* the rows Q0_PREFETCH_ROWS ahead, fetched while these are summed: TN rows read side by side
     * are TN interleaved streams, which the hardware prefetchers follow less well than one */
    const uint8_t *ahead = wq + Q0_PREFETCH_ROWS * row_bytes, *end = (const uint8_t *) w->q + N * row_bytes;
    __m256 acc[4];
    #pragma GCC unroll 4
    for (int j = 0; j < TN; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, wq += bytes, ahead += bytes) {
        /* a row's blocks are 32 · Q0_TILE bytes apart in the tiled activations (Q0_AT) */
        const __m256i xv = _mm256_loadu_si256((const __m256i *) (xq + b * 32 * Q0_TILE));
        const float dx = xd[b * Q0_TILE];
#if Q0_ACT_UNSIGNED
        const __m256i xs = _mm256_xor_si256(xv, _mm256_set1_epi8((char) 0x80));  /* x, signed */
        const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), xs);
        const int shift = type == FB_Q8_0 ? 7 : type == FB_Q5_0 ? 4 : 3;  /* the offset 2^shift */
        const __m256i base = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, shift));
#endif
        #pragma GCC unroll 4
        for (int j = 0; j < TN; j++) {
            if (TN > 1 && ahead + j * row_bytes < end) _mm_prefetch((const char *) (ahead + j * row_bytes), _MM_HINT_T0);
            /* one row at a time (the LM head): the line Q0_STREAM_AHEAD bytes on, one per two blocks
             * (17 -> 19 GB/s on one Zen 4 core for Gemma 3's Q8_0 head, 1 KB ahead too little, 16 KB
             * no better) */
            if (TN == 1 && (b & 1) == 0 && wq + Q0_STREAM_AHEAD < end)
                _mm_prefetch((const char *) (wq + Q0_STREAM_AHEAD), _MM_HINT_T0);
#if Q0_ACT_UNSIGNED
            const __m256i lanes = _mm256_dpbusd_epi32(base, q0_weights(wq + j * row_bytes, type), xs);
#else
            const __m256i wv = q0_weights(wq + j * row_bytes, type);
            const __m256i lanes = dot_u8_i8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
#endif
            const float d = f16_at(wq + j * row_bytes) * dx;
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[j]);
        }
    }
    #pragma GCC unroll 4
    for (int j = 0; j < TN; j++) out[r * N + n + j] = hsum8v(acc[j]);
}

/* q0_single over weight rows [g, g1), four at a time, for one weight type; a matrix of
 * Q0_STREAM_ROWS rows or more (an LM head: 262144 rows for Gemma 3) one row at a time: read as
 * one stream it ran at 17 GB/s on one Zen 4 core, and at half that read as two or four streams
 * side by side, with or without software prefetch; the layers' matrices (at most a few thousand
 * rows) gain from the four (7.1 -> 6.4 ms for gemma-3-270m's decode step, one thread). */
#define Q0_STREAM_ROWS 16384
static inline __attribute__((always_inline)) void q0_single_rows(const fb_weight *w, const fb_act *a, int64_t r,
                                                                 int64_t g, int64_t g1, const int type, float *out) {
    int64_t n = g;
    if (w->rows < Q0_STREAM_ROWS)
        for (; n + 4 <= g1; n += 4) q0_single(w, a, r, n, 4, type, out);
    for (; n < g1; n++) q0_single(w, a, r, n, 1, type, out);
}

/* Weight rows [n0, n1) in groups of Q0_ROW_GROUP, each group against every activation tile: the
 * group's weights and one tile of activations stay in L1 while the group's rows pass over it
 * (which outputs are computed when, never how). The tails of R: a tile of 4 rows, then single
 * rows, four weight rows at a time (q0_single). */
#define Q0_ROW_GROUP 16
static void q0_rows(const fb_weight *w, int64_t R, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    int64_t banded = 0;  /* activation rows in whole bands (q0_bands), the rest below */
#if KT_BANDS
    if (a->qt) {
        banded = R - R % KT_BAND;
        if (banded && q0_bands(w, banded / KT_BAND, a, n0, n1, out)) banded = 0;
    }
#endif
    for (int64_t g = n0; g < n1; g += Q0_ROW_GROUP) {
        const int64_t g1 = g + Q0_ROW_GROUP < n1 ? g + Q0_ROW_GROUP : n1;
        int64_t r = banded;
        for (; r + Q0_TILE <= R; r += Q0_TILE)
            for (int64_t n = g; n < g1; n++) q0_tile(w, a, R, n, r, Q0_TILE, out);
        for (; r + 4 <= R; r += 4)
            for (int64_t n = g; n < g1; n++) q0_tile(w, a, R, n, r, 4, out);
        for (; r < R; r++) {
            if (w->type == FB_Q8_0) q0_single_rows(w, a, r, g, g1, FB_Q8_0, out);
            else if (w->type == FB_Q5_0) q0_single_rows(w, a, r, g, g1, FB_Q5_0, out);
            else q0_single_rows(w, a, r, g, g1, FB_Q4_0, out);
        }
    }
}

/* Q4_1 / Q5_1 weights x Q8_1 activations (vec_dot_q4_1_q8_1 / vec_dot_q5_1_q8_1, every batch
 * size: llamafile has no kernel for them, nor repack or tiled): per block of 32, eight exact lanes
 * of four products of the unsigned weights, acc = fma(d_w·d_x, lane, acc); the min part
 * summs = fma(m_w, s_x, summs) (GCC contracts `summs += m * s`: gnu11); hsum_float_8(acc) + summs. */
static void q1_rows(const fb_weight *w, int64_t R, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols, nb = K / 32, N = w->rows;
    const int bytes = w->type == FB_Q4_1 ? 20 : 24;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t r = 0; r < R; r++) {
            __m256 acc = _mm256_setzero_ps();
            float summs = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t blk = n * nb + b;
                const uint8_t *blkp = (const uint8_t *) w->q + blk * bytes;
                const __m128i nibbles = _mm_loadu_si128((const __m128i *) (blkp + bytes - 16));
                __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
                if (w->type == FB_Q5_1)
                    u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits_32(blkp + 4), _mm256_set1_epi8(0x10)));
                const __m256i xv = _mm256_loadu_si256((const __m256i *) (a->q + r * K + 32 * b));
                const float xd = a->d[r * nb + b];
                summs = fmaf(w->dmin[blk], a->s[r * nb + b], summs);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(w->d[blk] * xd), _mm256_cvtepi32_ps(dot_u8_i8(u, xv)), acc);
            }
            out[r * N + n] = hsum8v(acc) + summs;
        }
}

/* Q4_K weights (repacked q4_K_8x8) x Q8_K activations, rows [r0, r1): one accumulator per output;
 * per_superblock = 1 (gemv): one fma per 256, 0 (gemm): one per 64; output = acc - acc_min.
 * The integer dot of a 64 (two 32-blocks, each times its 6-bit scale) is exact in any order. */
static inline __m256i q4_k_dot64(const int8_t *xa, const uint8_t *qa, const uint8_t *sc, int c) {
    /* qa: the block's 128 bytes of nibbles; 32-block 2c is the low nibbles of bytes 32c.., 2c+1
     * their high nibbles */
    const __m256i v = _mm256_loadu_si256((const __m256i *) (qa + 32 * c)), low = _mm256_set1_epi8(0x0F);
    return _mm256_add_epi32(
        lanes_u8_scaled(xa + 64 * c, _mm256_and_si256(v, low), _mm256_set1_epi16(sc[2 * c])),
        lanes_u8_scaled(xa + 64 * c + 32, _mm256_and_si256(_mm256_srli_epi16(v, 4), low), _mm256_set1_epi16(sc[2 * c + 1])));
}

static inline int32_t q4_k_min64(const int16_t *xs, const uint8_t *mn, int c) {
    return mn[2 * c] * (xs[4 * c] + xs[4 * c + 1]) + mn[2 * c + 1] * (xs[4 * c + 2] + xs[4 * c + 3]);
}

/* A Q4_K / Q5_K block's eight 6-bit scales (bytes 0..7 of out) and mins (8..15) from its 12 packed
 * bytes at b + 4, ggml's utmp / kmask unpacking in vec_dot_q4_K_q8_K: the values fb_unpack writes
 * (get_scale_min_k4). The one-row kernels read them here rather than from w->scales / w->mins: the
 * block's line is read anyway, and the unpacked copies (with d and dmin as f32) were 24 more bytes
 * to read per 144-byte block, a sixth more (decode reads its weights from memory). */
static inline void k_scales_mins(const uint8_t *b, uint8_t out[16]) {
    uint32_t u[4];
    memcpy(u, b + 4, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    const uint32_t mins_lo = u[1] & m1;
    u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    u[2] = mins_lo;
    u[0] &= m1;
    /* u[0], u[1]: scales 0..3, 4..7; u[2], u[3]: mins 0..3, 4..7 */
    memcpy(out, u, 16);
}

/* Weight rows per group in the K-quant batch kernels: a group's weights (8 rows of up to 2048
 * columns: 9 KB of Q4_K) and one tile of activation rows stay in L1 while the group's rows pass
 * over the tile (which outputs are computed when, never how). */
#define K_ROW_GROUP 8

/* The four 64-chunks' min terms of one superblock for activation rows r..r+3 (the integers of
 * q4_k_min64): out[c] = [row r, r+1, r+2, r+3] of chunk c. One madd per row forms lane k =
 * m_k·(bsum 2k + bsum 2k+1) (exact: |.| <= 63·2·2032); hadd pairs the lanes of each chunk. */
static inline void q4_k_mins4(const int16_t *xs, int64_t S, const uint8_t *mn, __m128 out[4]) {
    const __m128i m8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) mn));
    const __m256i m16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    __m256i m[4];
    for (int i = 0; i < 4; i++) m[i] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) (xs + i * S)), m16);
    /* [r c0, r c1, r+1 c0, r+1 c1 | r c2, r c3, r+1 c2, r+1 c3], and the same for r+2, r+3 */
    const __m256 h01 = _mm256_castsi256_ps(_mm256_hadd_epi32(m[0], m[1]));
    const __m256 h23 = _mm256_castsi256_ps(_mm256_hadd_epi32(m[2], m[3]));
    const __m128 lo01 = _mm256_castps256_ps128(h01), lo23 = _mm256_castps256_ps128(h23);
    const __m128 hi01 = _mm256_extractf128_ps(h01, 1), hi23 = _mm256_extractf128_ps(h23, 1);
    out[0] = _mm_shuffle_ps(lo01, lo23, _MM_SHUFFLE(2, 0, 2, 0));
    out[1] = _mm_shuffle_ps(lo01, lo23, _MM_SHUFFLE(3, 1, 3, 1));
    out[2] = _mm_shuffle_ps(hi01, hi23, _MM_SHUFFLE(2, 0, 2, 0));
    out[3] = _mm_shuffle_ps(hi01, hi23, _MM_SHUFFLE(3, 1, 3, 1));
}

/* Lanes of a 64-chunk's scaled dot, as q4_k_dot64 (exact, any order): the two 32-subblocks'
 * unsigned nibbles lo, hi against the activations, each pair sum times its subblock scale. */
static inline __m256i q4_k_lanes64(const int8_t *x, __m256i lo, __m256i hi, __m256i sc_lo, __m256i sc_hi) {
    const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *) x));
    const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *) (x + 32)));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(p_lo, sc_lo), p_hi, sc_hi);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(p_lo, sc_lo), _mm256_madd_epi16(p_hi, sc_hi));
#endif
}

/* ggml_gemm_q4_K_8x8_q8_K for activation rows r..r+3 and output n: per 64-chunk
 * acc = fma(f32(dot), d_w·d_x, acc) and acc_min = fma(f32(min), dmin_w·d_x, acc_min), the four
 * rows side by side in a vector; output acc - acc_min. */
static inline void q4_k_gemm_tile(const fb_weight *w, const fb_act *a, int64_t n, int64_t r, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows, S = K / 16;
    const uint8_t *wq = (const uint8_t *) w->q, *scales = (const uint8_t *) w->scales;
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m128 acc = _mm_setzero_ps(), acc_min = _mm_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const int64_t blk = n * nsb + b;
        const uint8_t *qa = wq + blk * 144 + 16, *sc = scales + blk * 8;
        const float *xd = a->d + b;
        const __m128 xdv = _mm_setr_ps(xd[r * nsb], xd[(r + 1) * nsb], xd[(r + 2) * nsb], xd[(r + 3) * nsb]);
        const __m128 s = _mm_mul_ps(_mm_set1_ps(w->d[blk]), xdv);
        const __m128 s_min = _mm_mul_ps(_mm_set1_ps(w->dmin[blk]), xdv);
        const int8_t *x0 = a->q + r * K + b * 256;
        __m128 mins[4];
        q4_k_mins4(a->sums + r * S + b * 16, S, w->mins + blk * 8, mins);
        for (int c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (qa + 32 * c));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i sc_lo = _mm256_set1_epi16(sc[2 * c]), sc_hi = _mm256_set1_epi16(sc[2 * c + 1]);
            const __m128i dot = hsum4_i32(q4_k_lanes64(x0 + 64 * c, lo, hi, sc_lo, sc_hi),
                                          q4_k_lanes64(x0 + K + 64 * c, lo, hi, sc_lo, sc_hi),
                                          q4_k_lanes64(x0 + 2 * K + 64 * c, lo, hi, sc_lo, sc_hi),
                                          q4_k_lanes64(x0 + 3 * K + 64 * c, lo, hi, sc_lo, sc_hi));
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(dot), s, acc);
            acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_castps_si128(mins[c])), s_min, acc_min);
        }
    }
    float res[4];
    _mm_storeu_ps(res, _mm_sub_ps(acc, acc_min));
    for (int i = 0; i < 4; i++) out[(r + i) * N + n] = res[i];
}

static void q4_k_rows(const fb_weight *w, int64_t r0, int64_t r1, const fb_act *a, int per_superblock,
                      int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows;
    const uint8_t *wq = (const uint8_t *) w->q, *scales = (const uint8_t *) w->scales;
    if (!per_superblock) {  /* gemm: tiles of four rows; weight rows in groups that stay in L1 */
        int64_t r = r0;
        for (int64_t g = n0; g < n1; g += K_ROW_GROUP) {
            const int64_t g1 = g + K_ROW_GROUP < n1 ? g + K_ROW_GROUP : n1;
            for (r = r0; r + 4 <= r1; r += 4)
                for (int64_t n = g; n < g1; n++) q4_k_gemm_tile(w, a, n, r, out);
        }
        r0 = r;  /* rows left over (fewer than four) one at a time below, one fma per 64 */
    }
    for (int64_t n = n0; n < n1; n++) {
        int64_t r = r0;
        for (; r < r1; r++) {
            float acc = 0.0f, acc_min = 0.0f;
            for (int64_t b = 0; b < nsb; b++) {
                const float xd = a->d[r * nsb + b];
                const uint8_t *blk = wq + (n * nsb + b) * 144, *qa = blk + 16;
                uint8_t packed[16];  /* per_superblock (one row: gemv): everything from the block */
                const uint8_t *sc, *mn;
                float wd, wdmin;
                if (per_superblock) {
                    k_scales_mins(blk, packed);
                    sc = packed, mn = packed + 8, wd = f16_at(blk), wdmin = f16_at(blk + 2);
                } else {
                    sc = scales + (n * nsb + b) * 8, mn = w->mins + (n * nsb + b) * 8;
                    wd = w->d[n * nsb + b], wdmin = w->dmin[n * nsb + b];
                }
                const float s = wd * xd, s_min = wdmin * xd;
                const int8_t *xa = a->q + r * K + b * 256;
                const int16_t *xs = a->sums + r * (K / 16) + b * 16;
                __m256i total = _mm256_setzero_si256();
                int32_t total_min = 0;
                for (int c = 0; c < 4; c++) {
                    const __m256i dot = q4_k_dot64(xa, qa, sc, c);
                    const int32_t dot_min = q4_k_min64(xs, mn, c);
                    if (per_superblock) {
                        total = _mm256_add_epi32(total, dot);
                        total_min += dot_min;
                    } else {
                        acc = fmaf((float) hsum_i32(dot), s, acc);
                        acc_min = fmaf((float) dot_min, s_min, acc_min);
                    }
                }
                if (per_superblock) {
                    acc = fmaf((float) hsum_i32(total), s, acc);
                    acc_min = fmaf((float) total_min, s_min, acc_min);
                }
            }
            out[r * N + n] = acc - acc_min;
        }
    }
}

/* The 32 5-bit weights of subblock `half` (0: low nibbles, 1: high) of 64-chunk c of a Q5_K block:
 * the nibbles, plus 16 where bit 2c + half of the byte's qh is set (as vec_dot_q5_K_q8_K and the
 * tiled unpack build them). */
static inline __m256i q5_k_bytes(const uint8_t *qs, const uint8_t *qh, int c, int half) {
    const __m256i v = _mm256_loadu_si256((const __m256i *) (qs + 32 * c)), low = _mm256_set1_epi8(0x0F);
    const __m256i nib = half ? _mm256_and_si256(_mm256_srli_epi16(v, 4), low) : _mm256_and_si256(v, low);
    const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *) qh), 2 * c + half),
                                         _mm256_set1_epi8(1));
    return _mm256_or_si256(nib, _mm256_slli_epi16(bit, 4));
}

/* Q4_K / Q5_K weights in their GGUF layout (not repacked) x Q8_K activations, the per-lane
 * integer dot of 64-chunk c: lane l = scale_2c · (products 4l..4l+3 of its low 32) + scale_2c+1 ·
 * (the same of its high 32), exact. */
static inline __m256i k_dot64(const fb_weight *w, const int8_t *xa, int64_t blk, const uint8_t *sc, int c) {
    const uint8_t *b = (const uint8_t *) w->q + blk * (w->type == FB_Q4_K ? 144 : 176);
    if (w->type == FB_Q4_K) return q4_k_dot64(xa, b + 16, sc, c);
    return _mm256_add_epi32(
        lanes_u8_scaled(xa + 64 * c, q5_k_bytes(b + 48, b + 16, c, 0), _mm256_set1_epi16(sc[2 * c])),
        lanes_u8_scaled(xa + 64 * c + 32, q5_k_bytes(b + 48, b + 16, c, 1), _mm256_set1_epi16(sc[2 * c + 1])));
}

/* Q4_K / Q5_K without repacking (llama.cpp --no-repack, or a Q4_K matrix whose rows are not a
 * multiple of 8):
 * tiled = 1, 8 or more rows (ggml-cpu/tiled, its AVX2 and AVX512-VNNI microtiles alike): per 256,
 * the exact integer dot s1 (the scaled subblock dots) and s2 (the mins times the activation's
 * 32-sums), res = fnmadd(dmin_w, f32(s2), d_w · f32(s1)), acc = fma(res, d_x, acc).
 * tiled = 0, fewer rows (vec_dot_q4_K_q8_K / vec_dot_q5_K_q8_K, AVX2: no AVX-512 variant): eight
 * lanes acc = fma(d_x·d_w, f32(lane), acc); the min part per 256 with dmin = -(d_x·dmin_w): Q4_K
 * in four lanes (lane l: subblocks 2l and 2l+1), fma each, reduced (m0+m2) + (m1+m3); Q5_K as one
 * scalar, fma(dmin, f32(sum), summs) (GCC contracts the C statement: gnu11 defaults to
 * -ffp-contract=fast); output hsum_float_8(acc) + the min part. */
static void k_plain_rows(const fb_weight *w, int64_t r0, int64_t R, const fb_act *a, int tiled, int64_t n0,
                         int64_t n1, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows, S = K / 16;
    const uint8_t *scales = (const uint8_t *) w->scales;
    for (int64_t n = n0; n < n1; n++) {
        int64_t r = r0;  /* rows r0..R-1 (those before, the band kernel's) */
        if (tiled)  /* four rows at a time: each weight chunk unpacked once for them */
            for (; r + 4 <= R; r += 4) {
                float acc4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                for (int64_t b = 0; b < nsb; b++) {
                    const int64_t blk = n * nsb + b;
                    const uint8_t *sc = scales + blk * 8, *mn = w->mins + blk * 8;
                    const uint8_t *bp = (const uint8_t *) w->q + blk * (w->type == FB_Q4_K ? 144 : 176);
                    __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                                       _mm256_setzero_si256()};
                    for (int c = 0; c < 4; c++) {
                        __m256i lo, hi;
                        if (w->type == FB_Q4_K) {
                            const __m256i v = _mm256_loadu_si256((const __m256i *) (bp + 16 + 32 * c)), m4 = _mm256_set1_epi8(0x0F);
                            lo = _mm256_and_si256(v, m4);
                            hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        } else {
                            lo = q5_k_bytes(bp + 48, bp + 16, c, 0);
                            hi = q5_k_bytes(bp + 48, bp + 16, c, 1);
                        }
                        const __m256i s_lo = _mm256_set1_epi16(sc[2 * c]), s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
                        for (int i = 0; i < 4; i++) {
                            const int8_t *xa = a->q + (r + i) * K + b * 256 + 64 * c;
                            sumi[i] = _mm256_add_epi32(sumi[i], _mm256_add_epi32(lanes_u8_scaled(xa, lo, s_lo),
                                                                                 lanes_u8_scaled(xa + 32, hi, s_hi)));
                        }
                    }
                    int32_t s1[4];
                    _mm_storeu_si128((__m128i *) s1, hsum4_i32(sumi[0], sumi[1], sumi[2], sumi[3]));
                    for (int i = 0; i < 4; i++) {
                        const int16_t *xs = a->sums + (r + i) * S + b * 16;
                        int32_t s2 = 0;
                        for (int c = 0; c < 4; c++) s2 += q4_k_min64(xs, mn, c);
                        const float res = fmaf(-w->dmin[blk], (float) s2, w->d[blk] * (float) s1[i]);
                        acc4[i] = fmaf(res, a->d[(r + i) * nsb + b], acc4[i]);
                    }
                }
                for (int i = 0; i < 4; i++) out[(r + i) * N + n] = acc4[i];
            }
        for (; r < R; r++) {
            float acc = 0.0f, summs = 0.0f, acc_m[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            __m256 lanes_acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const int64_t blk = n * nsb + b;
                const int8_t *xa = a->q + r * K + b * 256;
                const int16_t *xs = a->sums + r * S + b * 16;
                const uint8_t *sc = scales + blk * 8, *mn = w->mins + blk * 8;
                uint8_t packed[16];
                if (!tiled) {  /* vec_dot (fewer than 8 rows: decode): scales, mins from the block (k_scales_mins) */
                    k_scales_mins((const uint8_t *) w->q + blk * (w->type == FB_Q4_K ? 144 : 176), packed);
                    sc = packed, mn = packed + 8;
                }
                __m256i sumi = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) sumi = _mm256_add_epi32(sumi, k_dot64(w, xa, blk, sc, c));
                const float xd = a->d[r * nsb + b];
                if (tiled) {
                    int32_t s2 = 0;
                    for (int c = 0; c < 4; c++) s2 += q4_k_min64(xs, mn, c);
                    const float res = fmaf(-w->dmin[blk], (float) s2, w->d[blk] * (float) hsum_i32(sumi));
                    acc = fmaf(res, xd, acc);
                    continue;
                }
                const uint8_t *bp = (const uint8_t *) w->q + blk * (w->type == FB_Q4_K ? 144 : 176);
                const float d = xd * f16_at(bp), dmin = -xd * f16_at(bp + 2);
                lanes_acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), lanes_acc);
                if (w->type == FB_Q4_K) {
                    for (int l = 0; l < 4; l++) acc_m[l] = fmaf(dmin, (float) q4_k_min64(xs, mn, l), acc_m[l]);
                } else {
                    int32_t m = 0;
                    for (int l = 0; l < 4; l++) m += q4_k_min64(xs, mn, l);
                    summs = fmaf(dmin, (float) m, summs);
                }
            }
            if (tiled) out[r * N + n] = acc;
            else if (w->type == FB_Q4_K) out[r * N + n] = hsum8v(lanes_acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]));
            else out[r * N + n] = hsum8v(lanes_acc) + summs;
        }
    }
}

/* Q6_K weights x Q8_K activations. tiled = 1: ggml's tiled K-quant matmul (8 or more rows): the
 * exact dot per 256, times d_w, then fma with d_x (its AVX2 and AVX512-VNNI microtiles alike, as
 * GCC compiles them). tiled = 0: vec_dot_q6_K_q8_K's eight lanes (four products of each 32-group
 * times the 16-scale, minus 32·scale·sums for the 32-group of the lane's index), one fma per 256,
 * hsum_float_8. */
static inline __m256i q6_k_lanes(const int8_t *xa, const int16_t *xs, const uint8_t *qa, const int8_t *sc) {
    __m256i lanes = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i scale = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * c]), _mm_set1_epi16(sc[2 * c + 1]));
        lanes = _mm256_add_epi32(lanes, lanes_u8_scaled(xa + 32 * c, _mm256_loadu_si256((const __m256i *) (qa + 32 * c)), scale));
    }
    /* lane l: minus 32·(scale_2l·sum_2l + scale_2l+1·sum_2l+1), one madd of the 16 scales and sums */
    const __m256i offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc)),
                                             _mm256_loadu_si256((const __m256i *) xs));
    return _mm256_sub_epi32(lanes, _mm256_slli_epi32(offset, 5));
}

/* q6_k_lanes from the GGUF block b itself (ql at 0, qh at 128, scales at 192): 32-chunk c of the
 * unpacked layout (fb_unpack: chunk 4h + k of 128-half h) formed in registers as ggml's
 * vec_dot_q6_K_q8_K forms it, low or high nibbles of ql bytes 32(k & 1).. with bits 2k, 2k+1 of
 * qh above them: the same bytes, so the same exact lanes. */
static inline __m256i q6_k_lanes_raw(const int8_t *xa, const int16_t *xs, const uint8_t *b) {
    const int8_t *sc = (const int8_t *) (b + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    __m256i lanes = _mm256_setzero_si256();
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *) (b + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *) (b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *) (b + 128 + 32 * h));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4))};
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int c = 4 * h + k;
            const __m256i scale = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * c]), _mm_set1_epi16(sc[2 * c + 1]));
            lanes = _mm256_add_epi32(lanes, lanes_u8_scaled(xa + 32 * c, q[k], scale));
        }
    }
    const __m256i offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc)),
                                             _mm256_loadu_si256((const __m256i *) xs));
    return _mm256_sub_epi32(lanes, _mm256_slli_epi32(offset, 5));
}

/* The tiled microtile for activation rows r..r+3 and output n: per 256 the exact dot (the
 * superblock's eight 32-chunks unpacked and scaled once for the four rows), times d_w, then
 * acc = fma(that, d_x, acc), the four rows side by side in a vector. */
static inline void q6_k_tiled_tile(const fb_weight *w, const fb_act *a, int64_t n, int64_t r, float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows, S = K / 16;
    const uint8_t *wq = (const uint8_t *) w->q;
    const int8_t *scales = (const int8_t *) w->scales;
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *qa = wq + n * K + b * 256;
        const int8_t *sc = scales + (n * nsb + b) * 16;
        const int8_t *x0 = a->q + r * K + b * 256;
        const int16_t *xs0 = a->sums + r * S + b * 16;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc));
        __m256i tot[4];
        for (int i = 0; i < 4; i++)  /* the offset part first: 32·Σ scale·bsum, subtracted below */
            tot[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                      _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *) (xs0 + i * S))), 5));
        for (int c = 0; c < 8; c++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *) (qa + 32 * c));
            const __m256i scale = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * c]), _mm_set1_epi16(sc[2 * c + 1]));
            for (int i = 0; i < 4; i++) {
                const __m256i p = _mm256_maddubs_epi16(wv, _mm256_loadu_si256((const __m256i *) (x0 + i * K + 32 * c)));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                tot[i] = _mm256_dpwssd_epi32(tot[i], p, scale);
#else
                tot[i] = _mm256_add_epi32(tot[i], _mm256_madd_epi16(p, scale));
#endif
            }
        }
        const __m128i dot = hsum4_i32(tot[0], tot[1], tot[2], tot[3]);
        const float *xd = a->d + b;
        const __m128 xdv = _mm_setr_ps(xd[r * nsb], xd[(r + 1) * nsb], xd[(r + 2) * nsb], xd[(r + 3) * nsb]);
        const __m128 scaled = _mm_mul_ps(_mm_set1_ps(w->d[n * nsb + b]), _mm_cvtepi32_ps(dot));
        acc = _mm_fmadd_ps(scaled, xdv, acc);
    }
    float res[4];
    _mm_storeu_ps(res, acc);
    for (int i = 0; i < 4; i++) out[(r + i) * N + n] = res[i];
}

static void q6_k_rows(const fb_weight *w, int64_t r0, int64_t R, const fb_act *a, int tiled, int64_t n0, int64_t n1,
                      float *out) {
    const int64_t K = w->cols, nsb = K / 256, N = w->rows, S = K / 16;
    const uint8_t *wq = (const uint8_t *) w->q;
    const int8_t *scales = (const int8_t *) w->scales;
    int64_t r_left = r0;  /* rows r0..R-1 (those before, the band kernel's) */
    if (tiled)  /* tiles of four rows; weight rows in groups that stay in L1 */
        for (int64_t g = n0; g < n1; g += K_ROW_GROUP) {
            const int64_t g1 = g + K_ROW_GROUP < n1 ? g + K_ROW_GROUP : n1;
            for (r_left = r0; r_left + 4 <= R; r_left += 4)
                for (int64_t n = g; n < g1; n++) q6_k_tiled_tile(w, a, n, r_left, out);
        }
    for (int64_t n = n0; n < n1; n++) {
        int64_t r = r_left;
        for (; r < R; r++) {
            float acc = 0.0f;
            __m256 lanes_acc = _mm256_setzero_ps();
            for (int64_t b = 0; b < nsb; b++) {
                const float xd = a->d[r * nsb + b];
                if (!tiled && w->raw) {  /* vec_dot (decode) from the GGUF block: q6_k_lanes_raw */
                    const uint8_t *blk = (const uint8_t *) w->raw + (n * nsb + b) * 210;
                    const __m256i lanes = q6_k_lanes_raw(a->q + r * K + b * 256, a->sums + r * S + b * 16, blk);
                    lanes_acc = _mm256_fmadd_ps(_mm256_set1_ps(xd * f16_at(blk + 208)), _mm256_cvtepi32_ps(lanes), lanes_acc);
                    continue;
                }
                const __m256i lanes = q6_k_lanes(a->q + r * K + b * 256, a->sums + r * S + b * 16, wq + n * K + b * 256,
                                                 scales + (n * nsb + b) * 16);
                const float wd = w->d[n * nsb + b];
                if (tiled) {
                    const float scaled = wd * (float) hsum_i32(lanes);
                    acc = fmaf(scaled, xd, acc);
                } else {
                    lanes_acc = _mm256_fmadd_ps(_mm256_set1_ps(xd * wd), _mm256_cvtepi32_ps(lanes), lanes_acc);
                }
            }
            out[r * N + n] = tiled ? acc : hsum8v(lanes_acc);
        }
    }
}

/* ---- TQ1_0 / TQ2_0 (ternary) weights x Q8_K activations ---------------------------------- */

/* Trit k of a TQ1_0 byte q·3^k (mod 256) is (that·3) >> 8; ggml's vec_dot_tq1_0_q8_K forms it
 * with a saturating subtract, two averages and a shift, which gives the same value for all 256
 * bytes (checked exhaustively); the stored value is trit + 1, 0..2. */
static inline __m256i tq1_digit(__m256i q) {
    q = _mm256_subs_epu8(q, _mm256_set1_epi8(1));
    q = _mm256_avg_epu8(q, _mm256_avg_epu8(q, _mm256_setzero_si256()));
    return _mm256_and_si256(_mm256_srli_epi16(q, 6), _mm256_set1_epi8(3));
}

static inline __m256i times3_u8(__m256i v) { return _mm256_add_epi8(v, _mm256_add_epi8(v, v)); }

static inline __m256i times9_u8(__m256i v) {  /* v·8 per byte (the bits shifted in from the byte below cleared) + v */
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(v, 3), _mm256_set1_epi8((char) 0xF8)), v);
}

/* The 256 stored values of a TQ1_0 / TQ2_0 block as eight vectors, vector c holding positions
 * 32c..32c+31 (the activations' order; both ggml kernels multiply 32-aligned activation chunks):
 * TQ2_0 its 2-bit fields (element 32l + n of each 128-half at bits 2l of byte 32·half + n), TQ1_0
 * the base-3 digits (byte n of the first 32: elements n, 32 + n, ..., 128 + n; of the next 16:
 * 160 + n, 176 + n, ...; of the last 4: 240 + n, 244 + n, 248 + n, 252 + n). */
static inline void tq_unpack(int type, const uint8_t *b, __m256i v[8]) {
    const __m256i three = _mm256_set1_epi8(3);
    if (type == FB_TQ2_0) {
        for (int h = 0; h < 2; h++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *) (b + 32 * h));
            v[4 * h + 0] = _mm256_and_si256(x, three);
            v[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(x, 2), three);
            v[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(x, 4), three);
            v[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(x, 6), three);
        }
        return;
    }
    const __m256i x0 = _mm256_loadu_si256((const __m256i *) b), x1 = times3_u8(x0), x2 = times9_u8(x0);
    v[0] = tq1_digit(x0);
    v[1] = tq1_digit(x1);
    v[2] = tq1_digit(x2);
    v[3] = tq1_digit(times9_u8(x1));
    v[4] = tq1_digit(times9_u8(x2));
    const __m128i y = _mm_loadu_si128((const __m128i *) (b + 32));
    const __m256i y1 = _mm256_set_m128i(y, y), y3 = times3_u8(y1), y9 = times9_u8(y1);
    uint8_t h[16];  /* the 4 bytes of 4 trits: position 240 + 4k + m is trit k of byte m */
    for (int k = 0, p3 = 1; k < 4; k++, p3 *= 3)
        for (int m = 0; m < 4; m++) h[4 * k + m] = (uint8_t) (b[48 + m] * p3);
    v[5] = tq1_digit(_mm256_blend_epi32(y1, y3, 0xF0));
    v[6] = tq1_digit(_mm256_blend_epi32(y9, times3_u8(y9), 0xF0));
    v[7] = tq1_digit(_mm256_set_m128i(_mm_loadu_si128((const __m128i *) h),
                                      _mm256_castsi256_si128(times9_u8(y9))));
}

/* ggml_vec_dot_tq1_0_q8_K / tq2_0_q8_K (x86: the AVX2 code, which AVX-512 builds run too; ggml
 * has no tinyBLAS, tiled or repacked kernel for them, so every batch size takes this vec_dot):
 * per block eight exact int32 lanes, lane l = Σ over the eight 32-chunks of the products of
 * positions 4l..4l+3 (stored value 0..2 times the activation) minus the activations' sum over
 * positions 32l..32l+31 (bsums 2l and 2l+1: the +1 offset of the stored trits); then
 * acc = fma(f32(lane), d_x·d_w, acc) (its mul + add, fused by GCC: gnu11 contracts); output
 * hsum_float_8(acc). */
static inline __m256i tq_lanes(const __m256i v[8], const int8_t *xa, const int16_t *xs) {
    __m256i lanes = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++)
        lanes = _mm256_add_epi32(lanes, dot_u8_i8(v[c], _mm256_loadu_si256((const __m256i *) (xa + 32 * c))));
    const __m256i sums = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) xs), _mm256_set1_epi16(1));
    return _mm256_sub_epi32(lanes, sums);
}

/* One plane's dots for activation rows r..r+TR-1 and output n: each weight block unpacked once
 * for the TR rows. */
static inline __attribute__((always_inline)) void tq_tile(int type, const uint8_t *plane, const fb_act *a,
                                                          int64_t K, int64_t n, int64_t r, const int TR, float *res) {
    const int bytes = type == FB_TQ1_0 ? 54 : 66;
    const int64_t nsb = K / 256;
    __m256 acc[4];
    #pragma GCC unroll 4
    for (int i = 0; i < TR; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const uint8_t *blk = plane + (n * nsb + b) * bytes;
        __m256i v[8];
        tq_unpack(type, blk, v);
        const float wd = f16_at(blk + bytes - 2);
        #pragma GCC unroll 4
        for (int i = 0; i < TR; i++) {
            const int64_t row = r + i;
            const __m256i lanes = tq_lanes(v, a->q + row * K + b * 256, a->sums + row * (K / 16) + b * 16);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(a->d[row * nsb + b] * wd), acc[i]);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < TR; i++) res[i] = hsum8v(acc[i]);
}

/* TQ1_0 / TQ2_0 weights, rows [n0, n1): each output the plane's vec_dot; with a second plane
 * (PTQTP) the sum of the two planes' dots, plane 1 + plane 2 (the sum the torch path's
 * PlaneSumLinear forms from two matmuls; two f32 terms sum alike in either order), before any
 * bias. */
static void tq_rows(const fb_weight *w, int64_t R, const fb_act *a, int64_t n0, int64_t n1, float *out) {
    const int64_t K = w->cols, N = w->rows;
    for (int64_t n = n0; n < n1; n++) {
        float one[4], two[4];
        int64_t r = 0;
        for (; r < R; ) {
            const int TR = R - r >= 4 ? 4 : 1;
            if (TR == 4) tq_tile(w->type, (const uint8_t *) w->q, a, K, n, r, 4, one);
            else tq_tile(w->type, (const uint8_t *) w->q, a, K, n, r, 1, one);
            if (w->q2) {
                if (TR == 4) tq_tile(w->type, (const uint8_t *) w->q2, a, K, n, r, 4, two);
                else tq_tile(w->type, (const uint8_t *) w->q2, a, K, n, r, 1, two);
            }
            for (int i = 0; i < TR; i++) out[(r + i) * N + n] = w->q2 ? one[i] + two[i] : one[i];
            r += TR;
        }
    }
}

/* ---- f16 dot products ------------------------------------------------------------------- */

#define LOAD_F32(p) _mm256_loadu_ps(p)
#define LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p)))
#define SCALAR_F32(x) (x)
#define SCALAR_F16(x) _cvtsh_ss(x)

/* llamafile's tinyBLAS for one output: lanes k mod L (L = 8 on AVX2, 16 on AVX-512), an fma
 * chain each, then hsum(__m256) or _mm512_reduce_add_ps. K % L == 0.
 * ggml_vec_dot_f16: four L-lane accumulators over 4L-element steps, reduced (acc0+acc2) +
 * (acc1+acc3) and then across lanes (GGML_F32Cx8_REDUCE's hadds on AVX2,
 * _mm512_reduce_add_ps on AVX-512); the K % 4L leftover products are added in double.
 * b is f32 (holding f16 values) or f16: the conversion is exact, so both give the same bits. */
#define DEFINE_F16_DOTS(SUFFIX, BTYPE, LOADB, SCALARB)                                                  \
static float dot_tinyblas##SUFFIX(const float *a, const BTYPE *b, int64_t K, int lanes) {               \
    if (lanes == 8) {                                                                                   \
        __m256 acc = _mm256_setzero_ps();                                                               \
        for (int64_t k = 0; k < K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), LOADB(b + k), acc); \
        return hsum8v(acc);                                                                             \
    }                                                                                                   \
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();                                          \
    for (int64_t k = 0; k < K; k += 16) {                                                               \
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), LOADB(b + k), lo);                                 \
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), LOADB(b + k + 8), hi);                         \
    }                                                                                                   \
    return hsum16v(lo, hi);                                                                             \
}                                                                                                       \
static float dot_vec##SUFFIX(const float *a, const BTYPE *b, int64_t K, int lanes) {                    \
    const int64_t step = 4 * lanes, np = K - K % step;                                                  \
    double sum;                                                                                         \
    if (lanes == 8) {                                                                                   \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()}; \
        for (int64_t k = 0; k < np; k += step)                                                          \
            for (int s = 0; s < 4; s++)                                                                 \
                acc[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8 * s), LOADB(b + k + 8 * s), acc[s]); \
        float x[8];                                                                                     \
        _mm256_storeu_ps(x, _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]))); \
        const float t0 = x[0] + x[4], t1 = x[1] + x[5], t2 = x[2] + x[6], t3 = x[3] + x[7];              \
        sum = (t0 + t1) + (t2 + t3);                                                                    \
    } else {                                                                                            \
        __m256 lo[4], hi[4];                                                                            \
        for (int s = 0; s < 4; s++) lo[s] = hi[s] = _mm256_setzero_ps();                                \
        for (int64_t k = 0; k < np; k += step)                                                          \
            for (int s = 0; s < 4; s++) {                                                               \
                lo[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16 * s), LOADB(b + k + 16 * s), lo[s]); \
                hi[s] = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16 * s + 8), LOADB(b + k + 16 * s + 8), hi[s]); \
            }                                                                                           \
        sum = hsum16v(_mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3])),          \
                      _mm256_add_ps(_mm256_add_ps(hi[0], hi[2]), _mm256_add_ps(hi[1], hi[3])));         \
    }                                                                                                   \
    for (int64_t k = np; k < K; k++) sum += (double) (a[k] * SCALARB(b[k]));                            \
    return (float) sum;                                                                                 \
}

DEFINE_F16_DOTS(, float, LOAD_F32, SCALAR_F32)
DEFINE_F16_DOTS(_h, uint16_t, LOAD_F16, SCALAR_F16)

/* tinyBLAS for TR activation rows against one f16 weight row: each weight step converted once,
 * each output its own L-lane fma chain (as dot_tinyblas_h), as tinyBLAS's register tiles do. */
static inline __attribute__((always_inline)) void f16_tile(const uint16_t *wr, const float *x, int64_t K, int lanes,
                                                           const int TR, float *res) {
    __m256 lo[4], hi[4];
    #pragma GCC unroll 4
    for (int i = 0; i < TR; i++) lo[i] = hi[i] = _mm256_setzero_ps();
    if (lanes == 8) {
        for (int64_t k = 0; k < K; k += 8) {
            const __m256 wv = LOAD_F16(wr + k);
            #pragma GCC unroll 4
            for (int i = 0; i < TR; i++) lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), wv, lo[i]);
        }
        #pragma GCC unroll 4
        for (int i = 0; i < TR; i++) res[i] = hsum8v(lo[i]);
        return;
    }
    for (int64_t k = 0; k < K; k += 16) {
        const __m256 w0 = LOAD_F16(wr + k), w1 = LOAD_F16(wr + k + 8);
        #pragma GCC unroll 4
        for (int i = 0; i < TR; i++) {
            lo[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k), w0, lo[i]);
            hi[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8), w1, hi[i]);
        }
    }
    #pragma GCC unroll 4
    for (int i = 0; i < TR; i++) res[i] = hsum16v(lo[i], hi[i]);
}

/* f16 weights x f16-rounded activations: tinyBLAS where llamafile_sgemm takes the product (2+
 * rows, rows % 4 == 0, cols % L == 0), else ggml_vec_dot_f16. */
static void f16_rows(const fb_weight *w, int64_t R, const fb_act *a, int lanes, int64_t n0, int64_t n1,
                     float *out) {
    const int64_t K = w->cols, N = w->rows;
    const uint16_t *wq = (const uint16_t *) w->q;
    const int tiny = R >= 2 && N % 4 == 0 && K % lanes == 0;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = wq + n * K;
        if (!tiny) {
            for (int64_t r = 0; r < R; r++) out[r * N + n] = dot_vec_h(a->h + r * K, wr, K, lanes);
            continue;
        }
        float res[4];
        int64_t r = 0;
        for (; r + 4 <= R; r += 4) {
            f16_tile(wr, a->h + r * K, K, lanes, 4, res);
            for (int i = 0; i < 4; i++) out[(r + i) * N + n] = res[i];
        }
        for (; r < R; r++) {
            f16_tile(wr, a->h + r * K, K, lanes, 1, res);
            out[r * N + n] = res[0];
        }
    }
}

/* Output rows [n0, n1) of x·Wᵀ for R activation rows already quantized into `a`, with the
 * kernel llama.cpp picks for a batch of R rows (one ubatch); the bias added last. */
static void matmul_part(const fb_weight *w, int64_t R, const fb_act *a, const fb_plan *p, int64_t n0,
                        int64_t n1, float *out) {
    switch (w->type) {
    case FB_Q8_0: case FB_Q5_0: case FB_Q4_0: q0_rows(w, R, a, n0, n1, out); break;
    case FB_Q4_1: case FB_Q5_1: q1_rows(w, R, a, n0, n1, out); break;
    case FB_Q5_K: case FB_Q4_K: {
        if (w->type == FB_Q5_K || !p->repack || w->rows % 8) {
            /* in its GGUF layout: tiled (whole bands first), or vec_dot for < 8 rows */
            int64_t banded = 0;
            if (a->qt && R >= 8) {
                banded = R - R % KT_BAND;
                if (banded && k_plain_bands(w, banded / KT_BAND, a, n0, n1, out)) banded = 0;
            }
            if (banded < R) k_plain_rows(w, banded, R, a, R >= 8, n0, n1, out);
            break;
        }
        const int64_t gemm = R > 3 ? R - R % 4 : 0;  /* repacked Q4_K: gemm rows, then gemv */
        int64_t banded = 0;  /* gemm rows in whole bands (q4_k_bands), the rest by four */
        if (a->qt) {
            banded = gemm - gemm % KT_BAND;
            if (banded && q4_k_bands(w, banded / KT_BAND, a, n0, n1, out)) banded = 0;
        }
        if (banded < gemm) q4_k_rows(w, banded, gemm, a, 0, n0, n1, out);
        if (gemm < R) q4_k_rows(w, gemm, R, a, 1, n0, n1, out);
        break;
    }
    case FB_Q6_K: {
        int64_t banded = 0;  /* tiled rows in whole bands (q6_k_bands), the rest by four */
        if (a->qt && R >= 8) {
            banded = R - R % KT_BAND;
            if (banded) q6_k_bands(w, banded / KT_BAND, a, n0, n1, out);
        }
        if (banded < R) q6_k_rows(w, banded, R, a, R >= 8, n0, n1, out);
        break;
    }
    case FB_TQ1_0: case FB_TQ2_0: tq_rows(w, R, a, n0, n1, out); break;
    default: f16_rows(w, R, a, p->f16_lanes, n0, n1, out); break;
    }
    if (w->bias)
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = n0; n < n1; n++) out[r * w->rows + n] += w->bias[n];
}

/* The contiguous share [*n0, *n1) of `total` rows for thread ith of nth. */
static inline void thread_share(int64_t total, int ith, int nth, int64_t *n0, int64_t *n1) {
    const int64_t per = (total + nth - 1) / nth;
    *n0 = per * ith < total ? per * ith : total;
    *n1 = per * (ith + 1) < total ? per * (ith + 1) : total;
}

/* The row chunks of one matmul shared out as contiguous runs: thread t owns the t-th of nth equal
 * runs (thread_share) and takes its chunks front to back, one stream of weight rows; a thread done
 * with its own run takes what is left of the others' from their back ends, so a thread the OS
 * holds back (a busy machine, more threads than free cores) leaves its chunks to the others
 * instead of making them wait for its fixed share. Chunks handed out one after another from a
 * single counter interleave the threads instead: each thread's prefetches run into the chunk
 * after its own, which the other thread is reading, and both walk the same pages. A run's claims
 * are counted in one atomic word, front claims in the low 32 bits and back claims in the high
 * 32: a claim is good while front + back stay below the run's length, so no chunk goes twice.
 * Which thread sums a row never changes how. */
typedef struct {
    _Alignas(64) atomic_llong claims;  /* a cache line each: the threads' counters do not share one */
} fb_run;

/* The next chunk in [0, chunks) for thread ith of nth over `runs` (nth zeroed runs), or -1 when
 * every chunk is taken. */
static int64_t next_chunk(fb_run *runs, int64_t chunks, int ith, int nth) {
    for (int k = 0; k < nth; k++) {
        const int t = ith + k < nth ? ith + k : ith + k - nth;  /* its own run first */
        int64_t c0, c1;
        thread_share(chunks, t, nth, &c0, &c1);
        const long long len = c1 - c0;
        long long v = atomic_load_explicit(&runs[t].claims, memory_order_relaxed);
        if ((v & 0xffffffffLL) + (v >> 32) >= len) continue;
        v = atomic_fetch_add_explicit(&runs[t].claims, k == 0 ? 1LL : 1LL << 32, memory_order_relaxed);
        const long long front = v & 0xffffffffLL, back = v >> 32;
        if (front + back < len) return k == 0 ? c0 + front : c1 - 1 - back;
    }
    return -1;
}

static int act_alloc(fb_act *a, int64_t R, int64_t K) {
    a->q = malloc((size_t) (round_up(R, Q0_TILE) * K) + 64);  /* Q8_0: whole tiles (Q0_AT) */
    a->d = malloc(sizeof(float) * (size_t) (round_up(R, Q0_TILE) * (K / 32) + 1));
    a->sums = malloc(sizeof(int16_t) * (size_t) (R * (K / 16) + 16));
    a->h = malloc(sizeof(float) * (size_t) (R * K) + 64);
    a->s = malloc(sizeof(float) * (size_t) (R * (K / 32) + 1));
    a->qt = NULL, a->bt = NULL, a->dt = NULL;
    if (R >= KT_BAND) {  /* the band kernels' copy of whole bands */
        const int64_t Rb = R - R % KT_BAND;
        a->qt = malloc((size_t) (Rb * K) + 64);
        a->bt = malloc(sizeof(int32_t) * (size_t) (Rb * (K / 16) + 16));
        a->dt = malloc(sizeof(float) * (size_t) (Rb * (K / 32) + 16));  /* Q8_0's scales, or Q8_K's */
        if (!(a->qt && a->bt && a->dt)) return -1;
    }
    return a->q && a->d && a->sums && a->h && a->s ? 0 : -1;
}

static void act_free(fb_act *a) {
    free(a->q); free(a->d); free(a->sums); free(a->h); free(a->s); free(a->qt); free(a->bt); free(a->dt);
}

static void matmul_part_rowwise(const fb_weight *w, int64_t R, const fb_act *a, const fb_plan *p, int64_t n0,
                                int64_t n1, float *out);

/* x [R][cols] · Wᵀ -> out [R][rows] on `nthreads` threads (rows in chunks; the bits do not
 * depend on the count): the activations quantized once, then llama.cpp's matmul for R rows, or with
 * `rowwise` each row by the one-row kernel. Returns 0, or -1 when out of memory. */
static int matmul_threads(const fb_weight *w, int64_t R, const float *x, const fb_plan *p,
                          int nthreads, float *out, int rowwise) {
    fb_act a;
    fb_run *runs = aligned_alloc(64, sizeof(fb_run) * (size_t) (nthreads > 1 ? nthreads : 1));
    if (act_alloc(&a, R, w->cols) || !runs) { act_free(&a); free(runs); return -1; }
    memset(runs, 0, sizeof(fb_run) * (size_t) (nthreads > 1 ? nthreads : 1));
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
        quantize_rows(w->type, x, R, w->cols, &a, ith, nth);
        #pragma omp barrier
        /* rows in chunks taken by runs (next_chunk), about 32 per thread, whole multiples of 64
         * rows: the last chunk's thread finishes at most 1/32 of its share after the others (an
         * LM head of 262144 rows: chunks of 4096 rows, each thread's run one long stream) */
        const int64_t per = w->rows / (32 * nth) > 64 ? w->rows / (32 * nth) : 64;
        const int64_t chunk = round_up(per, 64), chunks = (w->rows + chunk - 1) / chunk;
        for (int64_t c; (c = next_chunk(runs, chunks, ith, nth)) >= 0;) {
            const int64_t n0 = c * chunk, n1 = n0 + chunk < w->rows ? n0 + chunk : w->rows;
            if (rowwise) matmul_part_rowwise(w, R, &a, p, n0, n1, out);
            else matmul_part(w, R, &a, p, n0, n1, out);
        }
    }
    act_free(&a);
    free(runs);
    return 0;
}

/* x [R][cols] · Wᵀ -> out [R][rows] for one ubatch (matmul_threads). */
int fb_matmul(const fb_weight *w, int64_t R, const float *x, const fb_plan *p, int nthreads, float *out) {
    return matmul_threads(w, R, x, p, nthreads, out, 0);
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

/* ---- the decoder forward ---------------------------------------------------------------- */

/* A spinning barrier, as ggml's threadpool waits: a thread that arrives early polls instead of
 * sleeping in the kernel, for up to BARRIER_SPIN_TICKS (a decode step's phases are a few to a few
 * hundred microseconds: on an idle machine the waits end while spinning, without a system call).
 * Past that the thread it waits for has most likely been taken off its core by other load: the
 * waiter sleeps on a futex and leaves its core to it (yielding instead kept it on the core,
 * spinning, while the thread it waited for queued for one), and the last thread to arrive wakes
 * the sleepers. Each thread halves its spin after a wait longer than BARRIER_SPIN_TICKS and
 * doubles it after a shorter one (between BARRIER_SPIN_MIN and BARRIER_SPIN_TICKS): on a busy machine
 * the spins that end asleep anyway stop taking the CPU time the other threads need (a decode
 * step's layers on 2 threads with other load on both cores: wall 15 ms, of it 15 ms of CPU, at
 * a fixed spin). `sleepers` is raised before the waiter's last look at `phase` and read after the
 * last thread moves `phase` on (both sequentially consistent), so one of the two sees the other:
 * no wake is lost. */
#define BARRIER_SPIN_TICKS 100000  /* TSC ticks: about 40 us at 2.6 GHz */
#define BARRIER_SPIN_MIN 2500      /* about 1 us */
static __thread uint64_t barrier_spin = BARRIER_SPIN_TICKS;
typedef struct {
    atomic_int arrived, phase, sleepers;
    int n;
    /* the chunk claims of each matmul of a phase (region_matmuls: [4][n] runs, next_chunk),
     * zeroed at every barrier; NULL where no phase shares chunks out */
    fb_run *runs;
} fb_barrier;

#ifdef __linux__
static void futex_wait(atomic_int *addr, int value) {  /* returns at once where *addr != value */
    syscall(SYS_futex, (int *) addr, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}
static void futex_wake_all(atomic_int *addr) {
    syscall(SYS_futex, (int *) addr, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}
#else  /* no futex: the waiter yields its core and looks again */
static void futex_wait(atomic_int *addr, int value) { (void) addr; (void) value; sched_yield(); }
static void futex_wake_all(atomic_int *addr) { (void) addr; }
#endif

/* Per-phase time of fb_forward (FORGEBENCH_PHASE_TIMES=1, read at each call; bench_generate.py
 * --split --phases prints it): each thread's TSC ticks since the last mark go to the phase it was
 * in, the waits at barriers to their own bucket, so work and waiting read apart. Off, one load and
 * branch per mark. */
enum { PH_NORM_ROPE, PH_QKV, PH_QK_CACHE, PH_ATTEND, PH_O, PH_RESID_ATTN, PH_GATE_UP, PH_GLU, PH_DOWN,
       PH_RESID_MLP, PH_WAIT, PH_COUNT };
#define PH_THREADS 4
static int phase_timing = -1;
static uint64_t phase_ticks[PH_THREADS][PH_COUNT];
static __thread uint64_t phase_last;
static __thread int phase_cur, phase_tid;

static inline void phase_mark(int next) {
    if (phase_timing <= 0) return;
    const uint64_t now = __rdtsc();
    if (phase_tid < PH_THREADS && phase_last) phase_ticks[phase_tid][phase_cur] += now - phase_last;
    phase_last = now;
    phase_cur = next;
}

/* The ticks so far, [PH_THREADS][PH_COUNT], zeroed after the copy where `reset`. */
void fb_phase_ticks(uint64_t *out, int reset) {
    memcpy(out, phase_ticks, sizeof(phase_ticks));
    if (reset) memset(phase_ticks, 0, sizeof(phase_ticks));
}

uint64_t fb_rdtsc(void) { return __rdtsc(); }

static void barrier_wait_(fb_barrier *b);
static void barrier_wait(fb_barrier *b) {
    if (phase_timing <= 0 || b->n <= 1) {
        barrier_wait_(b);
        return;
    }
    const int was = phase_cur;
    phase_mark(PH_WAIT);
    barrier_wait_(b);
    phase_mark(was);
}

static void barrier_wait_(fb_barrier *b) {
    if (b->n <= 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        /* every thread is here, done with the last phase's chunks: the next phase starts at 0 */
        if (b->runs)
            for (int i = 0; i < 4 * b->n; i++) atomic_store_explicit(&b->runs[i].claims, 0, memory_order_relaxed);
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&b->phase, 1);
        if (atomic_load(&b->sleepers) > 0) futex_wake_all(&b->phase);
        return;
    }
    const uint64_t start = __rdtsc();
    while (atomic_load_explicit(&b->phase, memory_order_acquire) == phase) {
        if (__rdtsc() - start < barrier_spin) {
            _mm_pause();
            continue;
        }
        atomic_fetch_add(&b->sleepers, 1);
        if (atomic_load(&b->phase) == phase) futex_wait(&b->phase, phase);
        atomic_fetch_sub(&b->sleepers, 1);
    }
    /* judged by the whole wait, not by whether it slept: a short spin sleeps through waits that
     * a full one would have spun through, and must grow back after them */
    if (__rdtsc() - start > BARRIER_SPIN_TICKS)
        barrier_spin = barrier_spin / 2 > BARRIER_SPIN_MIN ? barrier_spin / 2 : BARRIER_SPIN_MIN;
    else
        barrier_spin = barrier_spin * 2 < BARRIER_SPIN_TICKS ? barrier_spin * 2 : BARRIER_SPIN_TICKS;
}

/* One decoder layer's weights and settings. Mirrored by engine/kernels/native.py Layer. */
typedef struct {
    fb_weight q, k, v, o, gate, up, down;
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *mlp_norm, *post_mlp_norm;  /* NULL = none */
    int64_t window;                   /* sliding window: key j visible from p when p - j < window; 0 = all */
    float rope_step;                  /* f32(base^(-2/head_dim)): theta_{i+1} = theta_i · step */
    float rope_freq_scale;            /* linear scaling (1 = none) */
    const float *rope_freq_factors;   /* [head_dim/2] divisors, or NULL */
} fb_layer;

/* The decoder. Mirrored by engine/kernels/native.py Model. */
typedef struct {
    int64_t n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim;
    float norm_eps, q_scale, kq_scale;  /* q·q_scale before attention (Gemma), scores·kq_scale */
    int32_t rope_neox, gelu;            /* neox: rotate (i, i+hd/2), else (2i, 2i+1); gelu: GeGLU by
                                         * ggml's f16 table, else SwiGLU */
    const float *gelu_table;            /* [65536] by f16 bit pattern (ggml_table_gelu_f16) */
    const float *output_norm;
    const fb_layer *layers;
} fb_model;

/* ggml_compute_forward_rms_norm_f32 and the weight multiply: the squares summed in double in
 * order, 1/sqrtf(mean + eps), then (x·scale)·w. */
static void rmsnorm_row(const float *x, int64_t n, const float *w, float eps, float *y) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double) (x[i] * x[i]);
    const float mean = (float) (sum / (double) n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

/* ggml_v_expf (x <= 0 for the softmax; any x with |n| <= 126): AVX2 form (lanes 8) ends k·j + k,
 * the AVX-512 form (16) folds the 1 into the last fma and scales by 2^n. 0 where |n| > 126. */
static inline float expf_ggml(float x, int lanes) {
    const float log2e = 0x1.715476p+0f, ln2_hi = 0x1.62e4p-1f, ln2_lo = 0x1.7f7d1cp-20f;
    const float c5 = 0x1.0e4020p-7f, c4 = 0x1.573e2ep-5f, c3 = 0x1.555e66p-3f, c2 = 0x1.fffdb6p-2f,
                c1 = 0x1.ffffecp-1f, shifter = 0x1.8p23f;
    const float z = fmaf(x, log2e, shifter);
    const float n = z - shifter;
    if (fabsf(n) > 126.0f) return 0.0f;
    const float b = fmaf(-n, ln2_lo, fmaf(-n, ln2_hi, x));
    const float u = b * b;
    if (lanes == 16) {
        const float j = fmaf(fmaf(fmaf(c5, b, c4), u, fmaf(c3, b, c2)), u, fmaf(c1, b, 1.0f));
        return ldexpf(j, (int) n);
    }
    uint32_t zb;
    memcpy(&zb, &z, 4);
    const uint32_t kb = (zb << 23) + 0x3F800000u;
    float k;
    memcpy(&k, &kb, 4);
    const float j = fmaf(fmaf(fmaf(c5, b, c4), u, fmaf(c3, b, c2)), u, c1 * b);
    return fmaf(j, k, k);
}

/* expf_ggml on eight values at once, the same operations lane for lane (vector fma = fmaf; for
 * the AVX-512 form, ldexpf(j, n) = j · 2^n: both are the exact product rounded once). */
static inline __m256 expf_ggml8(__m256 x, int lanes) {
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), _mm256_set1_ps(0x1.8p23f));
    const __m256 n = _mm256_sub_ps(z, _mm256_set1_ps(0x1.8p23f));
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), n), _mm256_set1_ps(126.0f), _CMP_GT_OQ);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 p = _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                                     _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f)));
    __m256 r;
    if (lanes == 16) {
        const __m256 j = _mm256_fmadd_ps(p, u, _mm256_fmadd_ps(_mm256_set1_ps(0x1.ffffecp-1f), b, _mm256_set1_ps(1.0f)));
        /* 2^n for |n| <= 126 (the other lanes are zeroed below) */
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        r = _mm256_mul_ps(j, _mm256_castsi256_ps(e));
    } else {
        const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(z), 23),
                                                              _mm256_set1_epi32(0x3F800000)));
        const __m256 j = _mm256_fmadd_ps(p, u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
        r = _mm256_fmadd_ps(j, k, k);
    }
    return _mm256_andnot_ps(big, r);
}

/* ggml's table GELU (GGML_GELU_FP16) and ggml_v_silu, as engine/kernels/numerics.py has them. */
static inline float gelu_table(const float *table, float x) {
    if (x <= -10.0f) return 0.0f;
    if (x >= 10.0f) return x;
    return table[_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT)];
}

/* g[i] <- gelu_table(g[i]) · u[i] for i in [0, n): eight at a time, the table read by a gather at
 * the f16 bit patterns (vcvtps2ph rounds as _cvtss_sh does), x <= -10 -> +0 and x >= 10 -> x by
 * compares that are false for NaN as the scalar tests are: the scalar's bits, about ten times
 * fewer cycles than one f16 conversion and load per element (2048 elements a Gemma 3 layer). */
static void geglu_row(const float *table, float *g, const float *u, int64_t n) {
    int64_t i = 0;
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256i idx = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
        __m256 r = _mm256_i32gather_ps(table, idx, 4);
        r = _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, hi, _CMP_GE_OQ));
        r = _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LE_OQ), r);
        _mm256_storeu_ps(g + i, _mm256_mul_ps(r, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) g[i] = gelu_table(table, g[i]) * u[i];
}

static inline float silu_ggml(float x, int lanes) {
    const float neg = 0.0f - x;
    const float e = fabsf(neg) > 87.0f ? (float) exp((double) neg) : expf_ggml(neg, lanes);
    return x / (1.0f + e);
}

/* cosf/sinf through pointers, so the compiler cannot merge them into sincosf: the reference (and
 * ggml's rope cache) calls the two functions. */
static float (*volatile libm_cosf)(float) = cosf;
static float (*volatile libm_sinf)(float) = sinf;

static void rope_part(const fb_layer *L, int64_t pos, int64_t i0, int64_t i1, float *cs, float *sn);

/* ggml_rope_cache_init's angles for one position (engine/models/blocks.py rope_tables). */
static void rope_row(const fb_layer *L, int64_t pos, int64_t half, float *cs, float *sn) {
    rope_part(L, pos, 0, half, cs, sn);
}

/* rope_row's angles i0..i1-1 only (the others' threads take the rest of a one-position step; the
 * chain of theta products is the same from 0, only the cosf / sinf calls are shared out). */
static void rope_part(const fb_layer *L, int64_t pos, int64_t i0, int64_t i1, float *cs, float *sn) {
    float theta = (float) pos;
    for (int64_t i = 0; i < i0; i++) theta = theta * L->rope_step;
    for (int64_t i = i0; i < i1; i++) {
        float angle = theta;
        theta = theta * L->rope_step;
        if (L->rope_freq_factors) angle = angle / L->rope_freq_factors[i];
        if (L->rope_freq_scale != 1.0f) angle = L->rope_freq_scale * angle;
        cs[i] = libm_cosf(angle);
        sn[i] = libm_sinf(angle);
    }
}

/* ggml's compiled rotate_pairs: fma(x0, cos, -(x1·sin)), fma(x0, sin, x1·cos). */
static void rope_apply(float *x, int64_t hd, int neox, const float *cs, const float *sn) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        float *p0 = neox ? x + i : x + 2 * i, *p1 = neox ? x + i + half : x + 2 * i + 1;
        const float x1 = *p0, x2 = *p1;
        *p0 = fmaf(x1, cs[i], -(x2 * sn[i]));
        *p1 = fmaf(x1, sn[i], x2 * cs[i]);
    }
}

/* Query rows of llama.cpp's non-flash attention over the f16 cache (numerics.py
 * attention_llamacpp): kq = f16(q)·f16(k), softmax(kq·scale) as ggml_soft_max sums it,
 * f16(p)·f16(v). Keys outside [lo, hi) are masked: they would add exact zeros (lo and hi are
 * multiples of 4·L, so every lane and step keeps its place in the sums).
 * G (1, 2 or ATT_GROUP = 4) heads of one position that share a KV head at once: q16 and out hold their G
 * rows of hd, s G rows of s_stride scores, acc G sets of accumulators. Each key and value row is
 * converted from f16 once for the G heads (tinyBLAS's register tile, f16_tile, for the scores);
 * every head's sums are those it gets alone. */
#define ATT_GROUP 4
/* V·p of the batch kernel (tinyBLAS: output dim d is the dot over the keys j, lane j mod L, an
 * fma chain each in key order, then _mm512_reduce_add_ps / hsum_float_8 of the lanes) for G
 * heads, keys lo..last (lo a multiple of L): eight dims at a time with the L chains in
 * registers, rather than L rows of accumulators in memory loaded and stored at every key. */
static inline __attribute__((always_inline)) void attend_v_tiny_hd(const float *s, int64_t s_stride, int G,
                                                                    const uint16_t *vc, const int64_t hd, int64_t lo,
                                                                    int64_t last, const int L, float *out) {
    for (int64_t d = 0; d < hd; d += 8)
        for (int g = 0; g < G; g++) {
            const float *sg = s + g * s_stride;
            __m256 a[16];
            #pragma GCC unroll 16
            for (int l = 0; l < L; l++) a[l] = _mm256_setzero_ps();
            int64_t j = lo;
            for (; j + L <= last + 1; j += L) {
                const uint16_t *vj = vc + j * hd + d;
                #pragma GCC unroll 16
                for (int l = 0; l < L; l++) a[l] = _mm256_fmadd_ps(_mm256_set1_ps(sg[j + l]), LOAD_F16(vj + l * hd), a[l]);
            }
            {  /* the last keys, fewer than L: chain l takes key j + l */
                const uint16_t *vj = vc + j * hd + d;
                #pragma GCC unroll 16
                for (int l = 0; l < L; l++)
                    if (j + l <= last) a[l] = _mm256_fmadd_ps(_mm256_set1_ps(sg[j + l]), LOAD_F16(vj + l * hd), a[l]);
            }
            __m256 x[8];
            #pragma GCC unroll 8
            for (int l = 0; l < 8; l++) x[l] = L == 16 ? _mm256_add_ps(a[l + 8], a[l]) : a[l];
            const __m256 r0 = _mm256_add_ps(x[4], x[0]), r1 = _mm256_add_ps(x[5], x[1]);
            const __m256 r2 = _mm256_add_ps(x[6], x[2]), r3 = _mm256_add_ps(x[7], x[3]);
            _mm256_storeu_ps(out + g * hd + d, _mm256_add_ps(_mm256_add_ps(r0, r2), _mm256_add_ps(r1, r3)));
        }
}

/* (the head dimension and lane count made constants for the common cases: the key offsets
 * l·hd become immediates instead of sixteen live pointers) */
static void attend_v_tiny(const float *s, int64_t s_stride, int G, const uint16_t *vc, int64_t hd, int64_t lo,
                          int64_t last, int L, float *out) {
    if (L == 16 && hd == 256) attend_v_tiny_hd(s, s_stride, G, vc, 256, lo, last, 16, out);
    else if (L == 16 && hd == 128) attend_v_tiny_hd(s, s_stride, G, vc, 128, lo, last, 16, out);
    else if (L == 16) attend_v_tiny_hd(s, s_stride, G, vc, hd, lo, last, 16, out);
    else if (hd == 256) attend_v_tiny_hd(s, s_stride, G, vc, 256, lo, last, 8, out);
    else if (hd == 128) attend_v_tiny_hd(s, s_stride, G, vc, 128, lo, last, 8, out);
    else attend_v_tiny_hd(s, s_stride, G, vc, hd, lo, last, 8, out);
}

/* V·p of ggml_vec_dot_f16 (one query row, decode: the non-flash kqv mul_mat over the transposed V),
 * key j into chain j mod 4L (lo a multiple of 4L), each chain an fma sequence in key order, then
 * per output dim (c0 + c2) + (c1 + c3) of the four L-lane steps and the lane reduction
 * (GGML_F32Cx8_REDUCE for L = 8, _mm512_reduce_add_ps for 16). Eight dims at a time, the 4L chains
 * of those dims in a 4L·32-byte array that stays in L1, instead of 4L rows of hd accumulators
 * (64 KB for L = 16, hd = 256: beyond L1, and zeroed for every head). */
static inline __attribute__((always_inline)) void attend_v_vec_hd(const float *s, int64_t s_stride, int G,
                                                                   const uint16_t *vc, const int64_t hd, int64_t lo,
                                                                   int64_t last, const int L, float *out) {
    const int C = 4 * L;
    for (int g = 0; g < G; g++) {
        const float *sg = s + g * s_stride;
        for (int64_t d = 0; d < hd; d += 8) {
            __m256 a[64];
            #pragma GCC unroll 64
            for (int c = 0; c < C; c++) a[c] = _mm256_setzero_ps();
            int64_t j0 = lo;
            for (; j0 + C <= last + 1; j0 += C) {
                const uint16_t *vj = vc + j0 * hd + d;
                #pragma GCC unroll 64
                for (int c = 0; c < C; c++) a[c] = _mm256_fmadd_ps(_mm256_set1_ps(sg[j0 + c]), LOAD_F16(vj + c * hd), a[c]);
            }
            for (int c = 0; j0 + c <= last; c++)  /* the last keys, fewer than 4L */
                a[c] = _mm256_fmadd_ps(_mm256_set1_ps(sg[j0 + c]), LOAD_F16(vc + (j0 + c) * hd + d), a[c]);
            __m256 x[16];
            #pragma GCC unroll 16
            for (int l = 0; l < L; l++)
                x[l] = _mm256_add_ps(_mm256_add_ps(a[l], a[2 * L + l]), _mm256_add_ps(a[L + l], a[3 * L + l]));
            __m256 sum;
            if (L == 8) {  /* GGML_F32Cx8_REDUCE: ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7)) */
                const __m256 t0 = _mm256_add_ps(x[0], x[4]), t1 = _mm256_add_ps(x[1], x[5]);
                const __m256 t2 = _mm256_add_ps(x[2], x[6]), t3 = _mm256_add_ps(x[3], x[7]);
                sum = _mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3));
            } else {  /* the 16 lanes folded onto 8, then hsum_float_8 */
                #pragma GCC unroll 8
                for (int l = 0; l < 8; l++) x[l] = _mm256_add_ps(x[l + 8], x[l]);
                const __m256 r0 = _mm256_add_ps(x[4], x[0]), r1 = _mm256_add_ps(x[5], x[1]);
                const __m256 r2 = _mm256_add_ps(x[6], x[2]), r3 = _mm256_add_ps(x[7], x[3]);
                sum = _mm256_add_ps(_mm256_add_ps(r0, r2), _mm256_add_ps(r1, r3));
            }
            _mm256_storeu_ps(out + g * hd + d, sum);
        }
    }
}

static void attend_v_vec(const float *s, int64_t s_stride, int G, const uint16_t *vc, int64_t hd, int64_t lo,
                         int64_t last, int L, float *out) {
    if (L == 16 && hd == 256) attend_v_vec_hd(s, s_stride, G, vc, 256, lo, last, 16, out);
    else if (L == 16) attend_v_vec_hd(s, s_stride, G, vc, hd, lo, last, 16, out);
    else if (hd == 256) attend_v_vec_hd(s, s_stride, G, vc, 256, lo, last, 8, out);
    else attend_v_vec_hd(s, s_stride, G, vc, hd, lo, last, 8, out);
}

static void attend_heads(const float *q16, int G, const uint16_t *kc, const uint16_t *vc, int64_t hd, int64_t pos,
                         int64_t window, int64_t cache_len, float kq_scale, int batch, const fb_plan *p,
                         float *s, int64_t s_stride, float *acc, float *out) {
    const int L = p->f16_lanes, SL = p->softmax_lanes;
    const int64_t first = window && pos - window + 1 > 0 ? pos - window + 1 : 0;  /* visible keys */
    const int64_t lo = first - first % (4 * L), hi = round_up(pos + 1, 4 * L);
    const int kq_tiny = batch >= 2 && hd % L == 0, v_tiny = batch >= 2 && hd % 4 == 0;
    float top[ATT_GROUP];
    for (int g = 0; g < G; g++) top[g] = -INFINITY;
    for (int64_t j = first; j <= pos; j++) {
        const uint16_t *kj = kc + j * hd;
        float dots[ATT_GROUP];
        if (kq_tiny && G == 4) f16_tile(kj, q16, hd, L, 4, dots);
        else if (kq_tiny && G == 2) f16_tile(kj, q16, hd, L, 2, dots);
        else
            for (int g = 0; g < G; g++)
                dots[g] = kq_tiny ? dot_tinyblas_h(q16 + g * hd, kj, hd, L) : dot_vec_h(q16 + g * hd, kj, hd, L);
        for (int g = 0; g < G; g++) {
            s[g * s_stride + j] = dots[g] * kq_scale;
            top[g] = fmaxf(top[g], s[g * s_stride + j]);
        }
    }
    for (int g = 0; g < G; g++) {
        float *sg = s + g * s_stride;
        /* lo, first - first % 8, pos + 1 rounded up and hi are multiples of 8 (4·L is) */
        const int64_t e0 = first - first % 8, e1 = round_up(pos + 1, 8);
        for (int64_t j = lo; j < e0; j++) sg[j] = 0.0f;
        const __m256 topv = _mm256_set1_ps(top[g]);
        for (int64_t j = e0; j < e1; j += 8) {
            const __m256 e = expf_ggml8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), topv), SL);
            _mm256_storeu_ps(sg + j, e);
            if (j < first || j + 8 > pos + 1)  /* the keys outside [first, pos] of an edge group */
                for (int64_t i = j; i < j + 8; i++)
                    if (i < first || i > pos) sg[i] = 0.0f;
        }
        for (int64_t j = e1; j < hi; j++) sg[j] = 0.0f;
        double total = 0.0;
        for (int64_t i = lo; i < hi; i += SL)
            total += (double) (SL == 16 ? hsum8v(_mm256_add_ps(_mm256_loadu_ps(sg + i + 8), _mm256_loadu_ps(sg + i)))
                                        : hsum8(sg + i));
        const float inv = (float) (1.0 / total);
        const __m256 invv = _mm256_set1_ps(inv);
        for (int64_t j = lo; j < hi; j += 8)  /* round_f16(sg[j] · inv), eight at a time */
            _mm256_storeu_ps(sg + j, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(sg + j), invv),
                                                                     _MM_FROUND_TO_NEAREST_INT)));
    }
    if (v_tiny) {
        attend_v_tiny(s, s_stride, G, vc, hd, lo, pos < cache_len ? pos : cache_len - 1, L, out);
        return;
    }
    if (hd % 8 == 0) {
        attend_v_vec(s, s_stride, G, vc, hd, lo, pos < cache_len ? pos : cache_len - 1, L, out);
        return;
    }
    /* V·p, vectorized across the head's dims: per output dim the lanes (and steps) of the kernel
     * llama.cpp runs, each an fma chain over the keys in order */
    const int chains = v_tiny ? L : 4 * L;
    const int64_t per_head = (int64_t) chains * hd;
    memset(acc, 0, sizeof(float) * (size_t) (G * per_head));
    const int64_t last = pos < cache_len ? pos : cache_len - 1;
    for (int64_t j = lo; j <= last; j++) {
        const int c = v_tiny ? (int) (j % L) : (int) (((j / L) % 4) * L + j % L);
        const uint16_t *vj = vc + j * hd;
        __m256 pj[ATT_GROUP];
        for (int g = 0; g < G; g++) pj[g] = _mm256_set1_ps(s[g * s_stride + j]);
        for (int64_t d = 0; d < hd; d += 8) {
            const __m256 v = LOAD_F16(vj + d);
            for (int g = 0; g < G; g++) {
                float *a = acc + g * per_head + (int64_t) c * hd + d;
                _mm256_storeu_ps(a, _mm256_fmadd_ps(pj[g], v, _mm256_loadu_ps(a)));
            }
        }
    }
    for (int g = 0; g < G; g++) {
        const float *ag = acc + g * per_head;
        for (int64_t d = 0; d < hd; d += 8) {
            __m256 x[16];
            for (int l = 0; l < L; l++) {
                if (v_tiny) x[l] = _mm256_loadu_ps(ag + l * hd + d);
                else {
                    const __m256 a0 = _mm256_loadu_ps(ag + (0 * L + l) * hd + d), a1 = _mm256_loadu_ps(ag + (1 * L + l) * hd + d);
                    const __m256 a2 = _mm256_loadu_ps(ag + (2 * L + l) * hd + d), a3 = _mm256_loadu_ps(ag + (3 * L + l) * hd + d);
                    x[l] = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
                }
            }
            __m256 sum;
            if (!v_tiny && L == 8) {  /* GGML_F32Cx8_REDUCE: ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7)) */
                const __m256 t0 = _mm256_add_ps(x[0], x[4]), t1 = _mm256_add_ps(x[1], x[5]);
                const __m256 t2 = _mm256_add_ps(x[2], x[6]), t3 = _mm256_add_ps(x[3], x[7]);
                sum = _mm256_add_ps(_mm256_add_ps(t0, t1), _mm256_add_ps(t2, t3));
            } else {  /* hsum_float_8 (after folding 16 lanes onto 8: _mm512_reduce_add_ps) */
                if (L == 16)
                    for (int l = 0; l < 8; l++) x[l] = _mm256_add_ps(x[l + 8], x[l]);
                const __m256 r0 = _mm256_add_ps(x[4], x[0]), r1 = _mm256_add_ps(x[5], x[1]);
                const __m256 r2 = _mm256_add_ps(x[6], x[2]), r3 = _mm256_add_ps(x[7], x[3]);
                sum = _mm256_add_ps(_mm256_add_ps(r0, r2), _mm256_add_ps(r1, r3));
            }
            _mm256_storeu_ps(out + g * hd + d, sum);
        }
    }
}

/* One query row (attend_heads for one head). */
static void attend_row(const float *q16, const uint16_t *kc, const uint16_t *vc, int64_t hd, int64_t pos,
                       int64_t window, int64_t cache_len, float kq_scale, int batch, const fb_plan *p,
                       float *s, float *acc, float *out) {
    attend_heads(q16, 1, kc, vc, hd, pos, window, cache_len, kq_scale, batch, p, s, 0, acc, out);
}

/* The activation format a weight type's matmul quantizes to (ggml's vec_dot_type). */
static inline int act_format(int type) {
    return is_q0(type) ? 0 : type == FB_F16 ? 1 : is_q1(type) ? 3 : 2;
}

/* Matmuls of one input inside the forward's parallel region (q, k, v or gate, up): the input
 * quantized once where the weights share an activation format, then each output's rows taken by
 * the threads REGION_CHUNK at a time in runs (next_chunk), as ggml's threads take chunks of a
 * mul_mat from a shared counter. `own`: `a` is this thread's own (one row, a decode step): each
 * thread quantizes the row itself, the same bytes, and starts on its rows at once, where a
 * shared copy needs a barrier after it and another before a second format overwrites it (a
 * decode step's layer had 13 barriers, 9 with its own copies). Otherwise the rows are split
 * between the threads. A barrier after each phase. */
#define REGION_CHUNK 32
static void region_matmuls(const fb_weight *const *w, float *const *out, int count, int64_t R, const float *x,
                           const fb_act *a, int own, const fb_plan *p, int ith, int nth, fb_barrier *bar) {
    int shared = 1;
    for (int i = 1; i < count; i++) shared &= act_format(w[i]->type) == act_format(w[0]->type);
    for (int i = 0; i < count; i++) {
        if (i == 0 || !shared) {
            if (own) quantize_rows(w[i]->type, x, R, w[i]->cols, a, 0, 1);
            else {
                if (i > 0) barrier_wait(bar);  /* the previous weight is done with the activations */
                quantize_rows(w[i]->type, x, R, w[i]->cols, a, ith, nth);
                barrier_wait(bar);
            }
        }
        const int64_t N = w[i]->rows, chunks = (N + REGION_CHUNK - 1) / REGION_CHUNK;
        if (nth == 1) {
            matmul_part(w[i], R, a, p, 0, N, out[i]);
            continue;
        }
        for (int64_t c; (c = next_chunk(bar->runs + i * nth, chunks, ith, nth)) >= 0;) {
            const int64_t n0 = c * REGION_CHUNK;
            matmul_part(w[i], R, a, p, n0, n0 + REGION_CHUNK < N ? n0 + REGION_CHUNK : N, out[i]);
        }
    }
    barrier_wait(bar);
}

static void region_matmul(const fb_weight *w, int64_t R, const float *x, const fb_act *a, int own,
                          const fb_plan *p, float *out, int ith, int nth, fb_barrier *bar) {
    region_matmuls(&w, &out, 1, R, x, a, own, p, ith, nth, bar);
}

/* Every layer for T positions start_pos... (one ubatch, T <= 512): h [T][dim] holds the input
 * embeddings (scaled as the family scales them) and is overwritten. Keys and values are written
 * into k_cache[l] / v_cache[l] ([n_kv_heads][cache_len][head_dim] f16) at their positions. The
 * last layer's MLP and the final norm run only on the n_out rows out_rows (all T when NULL), as
 * llama.cpp runs them only for the rows whose logits are asked for; out [n_out][dim] gets the
 * final-normed hidden states. Returns 0, or -1 when out of memory. */
/* A block's output added to the residual stream, rows ith, ith+nth, ... of R: the output `ab`
 * normed first where the layer has a post-norm, then h += ab, then h normed by `next_norm` into
 * `next` where one follows (the MLP's input norm, or the output norm after the last layer).
 * Shared by fb_forward and fb_decode_batch, so a batched step adds exactly as a single one. */
static void add_to_residual(const fb_model *m, const float *post_norm, const float *next_norm,
                            float *h, float *ab, float *next, int64_t R, int ith, int nth) {
    const int64_t D = m->dim;
    for (int64_t t = ith; t < R; t += nth) {
        float *hr = h + t * D, *ar = ab + t * D;
        if (post_norm) rmsnorm_row(ar, D, post_norm, m->norm_eps, ar);
        for (int64_t i = 0; i < D; i++) hr[i] = hr[i] + ar[i];
        if (next_norm) rmsnorm_row(hr, D, next_norm, m->norm_eps, next + t * D);
    }
}

/* add_to_residual for one row on a thread's own copy hp of it (fb_forward's `own`): the block's
 * output ab (shared, read only) normed into tp where the layer has a post-norm, hp += it, then hp
 * normed by next_norm into `next`; every thread alike, the bits add_to_residual gives. */
static void add_to_own_residual(const fb_model *m, const float *post_norm, const float *next_norm, float *hp,
                                const float *ab, float *tp, float *next) {
    const int64_t D = m->dim;
    if (post_norm) {
        rmsnorm_row(ab, D, post_norm, m->norm_eps, tp);
        ab = tp;
    }
    for (int64_t i = 0; i < D; i++) hp[i] = hp[i] + ab[i];
    if (next_norm) rmsnorm_row(hp, D, next_norm, m->norm_eps, next);
}

/* The gated unit, rows ith, ith+nth, ... of R: gate <- act(gate) · up (GeGLU by ggml's f16
 * table, else SwiGLU). */
static void gated_unit(const fb_model *m, const fb_plan *p, float *gb, const float *ub, int64_t R,
                       int ith, int nth) {
    const int64_t F = m->ffn_dim;
    if (R == 1) {  /* one row (a decode step): its elements shared out, each computed alike */
        int64_t i0, i1;
        thread_share(F, ith, nth, &i0, &i1);
        if (m->gelu) {
            geglu_row(m->gelu_table, gb + i0, ub + i0, i1 - i0);
            return;
        }
        for (int64_t i = i0; i < i1; i++)
            gb[i] = (m->gelu ? gelu_table(m->gelu_table, gb[i]) : silu_ggml(gb[i], p->softmax_lanes)) * ub[i];
        return;
    }
    for (int64_t t = ith; t < R; t += nth) {
        if (m->gelu) {
            geglu_row(m->gelu_table, gb + t * F, ub + t * F, F);
            continue;
        }
        for (int64_t i = 0; i < F; i++) {
            const float g = gb[t * F + i];
            gb[t * F + i] = (m->gelu ? gelu_table(m->gelu_table, g) : silu_ggml(g, p->softmax_lanes)) * ub[t * F + i];
        }
    }
}

int fb_forward(const fb_model *m, const fb_plan *p, int64_t T, int64_t start_pos, float *h,
               uint16_t *const *k_cache, uint16_t *const *v_cache, int64_t cache_len, int64_t n_out,
               const int64_t *out_rows, float *out, int nthreads) {
    const int64_t D = m->dim, H = m->n_heads, Hkv = m->n_kv_heads, hd = m->head_dim, F = m->ffn_dim;
    const int64_t QD = H * hd, KD = Hkv * hd, half = hd / 2, groups = H / Hkv;
    const int64_t Kmax = F > QD ? (F > D ? F : D) : (QD > D ? QD : D);
    const int64_t S = start_pos + T, Sp = round_up(S, 64);
    const int L = p->f16_lanes;
    /* heads per attention item: 4 (ATT_GROUP) or 2 of a KV head's group for a batch */
    const int G = T < 2 ? 1 : groups % 4 == 0 ? 4 : groups % 2 == 0 ? 2 : 1;
    float *xn = malloc(sizeof(float) * (size_t) (T * D)), *qb = malloc(sizeof(float) * (size_t) (T * QD));
    float *kb = malloc(sizeof(float) * (size_t) (T * KD)), *vb = malloc(sizeof(float) * (size_t) (T * KD));
    float *att = malloc(sizeof(float) * (size_t) (T * QD)), *ab = malloc(sizeof(float) * (size_t) (T * D));
    float *gb = malloc(sizeof(float) * (size_t) (T * F)), *ub = malloc(sizeof(float) * (size_t) (T * F));
    float *cs = malloc(sizeof(float) * (size_t) (T * half)), *sn = malloc(sizeof(float) * (size_t) (T * half));
    fb_act a;
    int failed = act_alloc(&a, T, Kmax);
    failed |= !(xn && qb && kb && vb && att && ab && gb && ub && cs && sn);
    /* one position on several threads: each thread's own quantized input (region_matmuls) */
    const int owned = T == 1 && nthreads > 1 && n_out == 1 && (!out_rows || out_rows[0] == 0) ? nthreads : 0;
    fb_act *mine = owned ? calloc((size_t) owned, sizeof(fb_act)) : NULL;
    if (owned && !mine) failed = 1;
    for (int t = 0; mine && t < owned; t++) failed |= act_alloc(&mine[t], 1, Kmax);
    /* and its own copy of the row's state: residual, normed input, normed block output, angles */
    const int64_t row_floats = 3 * D + 2 * half;
    float *rows = owned ? malloc(sizeof(float) * (size_t) (owned * row_floats)) : NULL;
    if (owned && !rows) failed = 1;
    fb_barrier bar = {.n = 1};
    bar.runs = aligned_alloc(64, sizeof(fb_run) * 4 * (size_t) (nthreads > 1 ? nthreads : 1));
    if (!bar.runs) failed = 1;
    else memset(bar.runs, 0, sizeof(fb_run) * 4 * (size_t) (nthreads > 1 ? nthreads : 1));
    if (!failed && start_pos + T > cache_len) failed = 1;
    {  /* read at every call (a microsecond against a step's milliseconds): a bench turns it on between runs */
        const char *env = getenv("FORGEBENCH_PHASE_TIMES");
        phase_timing = env && env[0] == '1';
    }
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
            phase_tid = ith;
            phase_last = 0;
            phase_mark(PH_NORM_ROPE);
            #pragma omp single
            bar.n = nth;
            /* the implicit barrier after `single` publishes bar.n */
            float *s = malloc(sizeof(float) * (size_t) (G * (Sp + 64)));
            float *acc = malloc(sizeof(float) * (size_t) (G * 4 * L * hd));
            int64_t R = T;
            const fb_layer *prev = NULL;
            /* one position on several threads: every thread keeps the row's residual, its norms and
             * its angles itself, each computed alike (the same bits as one thread computing them
             * for all), and needs no barrier after a norm, a residual add or the angles: a layer
             * waits 7 times instead of 13 (region_matmuls' `own` saves the others) */
            const int own = mine && nth > 1;
            const fb_act *ta = own ? &mine[ith] : &a;
            float *const hp = own ? rows + ith * row_floats : h, *const xp = own ? hp + D : xn;
            float *const tp = own ? hp + 2 * D : NULL;
            float *const csp = own ? hp + 3 * D : cs, *const snp = own ? csp + half : sn;
            if (own) {
                memcpy(hp, h, sizeof(float) * (size_t) D);
                if (m->layers[0].attn_norm) rmsnorm_row(hp, D, m->layers[0].attn_norm, m->norm_eps, xp);
            }
            for (int64_t il = 0; il < m->n_layers; il++) {
                const fb_layer *Lr = &m->layers[il];
                const int last = il == m->n_layers - 1;
                phase_mark(PH_NORM_ROPE);
                if (!own)
                    for (int64_t t = ith; t < T; t += nth) rmsnorm_row(h + t * D, D, Lr->attn_norm, m->norm_eps, xn + t * D);
                if (!prev || prev->rope_step != Lr->rope_step || prev->rope_freq_scale != Lr->rope_freq_scale ||
                    prev->rope_freq_factors != Lr->rope_freq_factors)
                {
                    if (own) rope_part(Lr, start_pos, 0, half, csp, snp);
                    else if (T == 1) {  /* one position (a decode step): its angles shared out */
                        int64_t i0, i1;
                        thread_share(half, ith, nth, &i0, &i1);
                        rope_part(Lr, start_pos, i0, i1, cs, sn);
                    } else
                        for (int64_t t = ith; t < T; t += nth) rope_row(Lr, start_pos + t, half, cs + t * half, sn + t * half);
                }
                prev = Lr;
                if (!own) barrier_wait(&bar);
                phase_mark(PH_QKV);
                {
                    const fb_weight *qkv[3] = {&Lr->q, &Lr->k, &Lr->v};
                    float *const outs[3] = {qb, kb, vb};
                    region_matmuls(qkv, outs, 3, T, xp, ta, own, p, ith, nth, &bar);
                }
                /* per head: q/k norm, RoPE; q scaled and rounded to f16, k and v into the cache */
                phase_mark(PH_QK_CACHE);
                for (int64_t item = ith; item < T * (H + Hkv); item += nth) {
                    const int64_t t = item / (H + Hkv), head = item % (H + Hkv), pos = start_pos + t;
                    if (head < H) {
                        float *x = qb + t * QD + head * hd;
                        if (Lr->q_norm) rmsnorm_row(x, hd, Lr->q_norm, m->norm_eps, x);
                        rope_apply(x, hd, m->rope_neox, csp + t * half, snp + t * half);
                        for (int64_t d = 0; d < hd; d++) x[d] = round_f16(x[d] * m->q_scale);
                    } else {
                        const int64_t kvh = head - H;
                        float *x = kb + t * KD + kvh * hd;
                        if (Lr->k_norm) rmsnorm_row(x, hd, Lr->k_norm, m->norm_eps, x);
                        rope_apply(x, hd, m->rope_neox, csp + t * half, snp + t * half);
                        uint16_t *kc = k_cache[il] + (kvh * cache_len + pos) * hd;
                        uint16_t *vc = v_cache[il] + (kvh * cache_len + pos) * hd;
                        for (int64_t d = 0; d < hd; d++) {
                            kc[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
                            vc[d] = _cvtss_sh(vb[t * KD + kvh * hd + d], _MM_FROUND_TO_NEAREST_INT);
                        }
                    }
                }
                barrier_wait(&bar);
                /* per position, the heads of one KV head ATT_GROUP at a time where a batch gives
                 * every thread work (one token: one head per item, so the threads share them) */
                phase_mark(PH_ATTEND);
                for (int64_t item = ith; item < T * (H / G); item += nth) {
                    const int64_t t = item / (H / G), head = item % (H / G) * G, kvh = head / groups;
                    attend_heads(qb + t * QD + head * hd, G, k_cache[il] + kvh * cache_len * hd,
                                 v_cache[il] + kvh * cache_len * hd, hd, start_pos + t, Lr->window, cache_len,
                                 m->kq_scale, (int) T, p, s, Sp + 64, acc, att + t * QD + head * hd);
                }
                barrier_wait(&bar);
                phase_mark(PH_O);
                region_matmul(&Lr->o, T, att, ta, own, p, ab, ith, nth, &bar);
                if (last && out_rows) {  /* only the asked-for rows go on (llama.cpp's inp_out_ids) */
                    if (ith == 0)
                        for (int64_t i = 0; i < n_out; i++) {
                            memmove(h + i * D, h + out_rows[i] * D, sizeof(float) * (size_t) D);
                            memmove(ab + i * D, ab + out_rows[i] * D, sizeof(float) * (size_t) D);
                        }
                    R = n_out;
                    barrier_wait(&bar);
                }
                phase_mark(PH_RESID_ATTN);
                if (own) add_to_own_residual(m, Lr->post_attn_norm, Lr->mlp_norm, hp, ab, tp, xp);
                else {
                    add_to_residual(m, Lr->post_attn_norm, Lr->mlp_norm, h, ab, xn, R, ith, nth);
                    barrier_wait(&bar);
                }
                phase_mark(PH_GATE_UP);
                {
                    const fb_weight *gate_up[2] = {&Lr->gate, &Lr->up};
                    float *const outs[2] = {gb, ub};
                    region_matmuls(gate_up, outs, 2, R, xp, ta, own, p, ith, nth, &bar);
                }
                phase_mark(PH_GLU);
                gated_unit(m, p, gb, ub, R, ith, nth);
                barrier_wait(&bar);
                phase_mark(PH_DOWN);
                region_matmul(&Lr->down, R, gb, ta, own, p, ab, ith, nth, &bar);
                phase_mark(PH_RESID_MLP);
                if (own) {  /* the next layer's input norm, or the output norm after the last */
                    const float *next_norm = last ? m->output_norm : m->layers[il + 1].attn_norm;
                    add_to_own_residual(m, Lr->post_mlp_norm, next_norm, hp, ab, tp, xp);
                    if (last && ith == 0) {
                        memcpy(out, xp, sizeof(float) * (size_t) D);
                        memcpy(h, hp, sizeof(float) * (size_t) D);
                    }
                } else {
                    add_to_residual(m, Lr->post_mlp_norm, last ? m->output_norm : NULL, h, ab, out, R,
                                    ith, nth);
                    barrier_wait(&bar);
                }
            }
            phase_mark(PH_NORM_ROPE);
            phase_last = 0;
            free(s);
            free(acc);
        }
    }
    free(xn); free(qb); free(kb); free(vb); free(att); free(ab); free(gb); free(ub); free(cs); free(sn);
    act_free(&a);
    for (int t = 0; mine && t < owned; t++) act_free(&mine[t]);
    free(mine);
    free(rows);
    free(bar.runs);
    return failed ? -1 : 0;
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

/* ---- batched decode: one new token of each of B sequences in one pass -------------------- */

/* Output rows [n0, n1) of x·Wᵀ for R activation rows, each row summed by the kernel llama.cpp
 * runs for a batch of ONE row (vec_dot, or the repacked Q4_K gemv), never the batch kernels
 * (tiled, gemm, tinyBLAS) that R rows of one sequence would get: a row's bits do not depend on
 * which other sequences share the step. Every kernel loops over the weight rows outside and the
 * activation rows inside, so weight row n is read from memory once for all R rows: the saving of
 * the batch. (Q8_0 / Q5_0 / Q4_0: q0_tile sums each row alike at every tile width.) */
static void matmul_part_rowwise(const fb_weight *w, int64_t R, const fb_act *a, const fb_plan *p, int64_t n0,
                                int64_t n1, float *out) {
    const int64_t K = w->cols, N = w->rows;
    switch (w->type) {
    case FB_Q8_0: case FB_Q5_0: case FB_Q4_0: q0_rows(w, R, a, n0, n1, out); break;
    case FB_Q4_1: case FB_Q5_1: q1_rows(w, R, a, n0, n1, out); break;
    case FB_Q5_K: k_plain_rows(w, 0, R, a, 0, n0, n1, out); break;
    case FB_Q4_K:
        if (!p->repack || w->rows % 8) k_plain_rows(w, 0, R, a, 0, n0, n1, out);
        else q4_k_rows(w, 0, R, a, 1, n0, n1, out);
        break;
    case FB_Q6_K: q6_k_rows(w, 0, R, a, 0, n0, n1, out); break;
    case FB_TQ1_0: case FB_TQ2_0: tq_rows(w, R, a, n0, n1, out); break;
    default:
        for (int64_t n = n0; n < n1; n++)
            for (int64_t r = 0; r < R; r++)
                out[r * N + n] = dot_vec_h(a->h + r * K, (const uint16_t *) w->q + n * K, K, p->f16_lanes);
        break;
    }
    if (w->bias)
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = n0; n < n1; n++) out[r * N + n] += w->bias[n];
}

/* x [R][cols] · Wᵀ -> out [R][rows], every row as a one-row matmul gives it (the LM head of a
 * batched decode step). Returns 0, or -1 when out of memory. */
int fb_matmul_rowwise(const fb_weight *w, int64_t R, const float *x, const fb_plan *p, int nthreads, float *out) {
    return matmul_threads(w, R, x, p, nthreads, out, 1);
}

/* The weights of one input (q, k, v / gate, up / o / down) for the B rows of a decode step
 * inside the parallel region: quantized once where they share an activation format, rows of
 * each output split across the threads, a barrier after each phase. */
static void batch_matmuls(const fb_weight *const *w, float *const *out, int count, int64_t R, const float *x,
                          const fb_act *a, const fb_plan *p, int ith, int nth, fb_barrier *bar) {
    for (int i = 0; i < count; i++) {
        if (i == 0 || act_format(w[i]->type) != act_format(w[i - 1]->type)) {
            if (i > 0) barrier_wait(bar);
            quantize_rows(w[i]->type, x, R, w[i]->cols, a, ith, nth);
            barrier_wait(bar);
        }
        int64_t n0, n1;
        thread_share(w[i]->rows, ith, nth, &n0, &n1);
        matmul_part_rowwise(w[i], R, a, p, n0, n1, out[i]);
    }
    barrier_wait(bar);
}

/* One decode step for B sequences: row b of h [B][dim] is the embedding of sequence b's next
 * token, at position positions[b] of its own KV cache (k_caches[b·n_layers + l],
 * [n_kv_heads][cache_lens[b]][head_dim] f16, written there). Each row's result is bit for bit
 * what fb_forward gives that sequence for its one token (T = 1): the same per-row norms, RoPE and
 * attention (one query: ggml_vec_dot_f16 orders), and one-row matmul kernels
 * (matmul_part_rowwise); only the weights are streamed once for all rows. out [B][dim] gets the
 * final-normed hidden states. Returns 0, or -1 when out of memory or a position is past its
 * cache. */
int fb_decode_batch(const fb_model *m, const fb_plan *p, int64_t B, const int64_t *positions, float *h,
                    uint16_t *const *k_caches, uint16_t *const *v_caches, const int64_t *cache_lens, float *out,
                    int nthreads) {
    const int64_t D = m->dim, H = m->n_heads, Hkv = m->n_kv_heads, hd = m->head_dim, F = m->ffn_dim;
    const int64_t QD = H * hd, KD = Hkv * hd, half = hd / 2, groups = H / Hkv, NL = m->n_layers;
    const int64_t Kmax = F > QD ? (F > D ? F : D) : (QD > D ? QD : D);
    const int L = p->f16_lanes;
    int64_t longest = 0;
    int failed = 0;
    for (int64_t b = 0; b < B; b++) {
        if (positions[b] < 0 || positions[b] >= cache_lens[b]) failed = 1;
        if (positions[b] + 1 > longest) longest = positions[b] + 1;
    }
    const int64_t Sp = round_up(longest, 64);
    float *xn = malloc(sizeof(float) * (size_t) (B * D)), *qb = malloc(sizeof(float) * (size_t) (B * QD));
    float *kb = malloc(sizeof(float) * (size_t) (B * KD)), *vb = malloc(sizeof(float) * (size_t) (B * KD));
    float *att = malloc(sizeof(float) * (size_t) (B * QD)), *ab = malloc(sizeof(float) * (size_t) (B * D));
    float *gb = malloc(sizeof(float) * (size_t) (B * F)), *ub = malloc(sizeof(float) * (size_t) (B * F));
    float *cs = malloc(sizeof(float) * (size_t) (B * half)), *sn = malloc(sizeof(float) * (size_t) (B * half));
    fb_act a;
    failed |= act_alloc(&a, B, Kmax);
    failed |= !(xn && qb && kb && vb && att && ab && gb && ub && cs && sn);
    fb_barrier bar = {.n = 1};
    if (!failed) {
        #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            const int ith = omp_get_thread_num(), nth = omp_get_num_threads();
            #pragma omp single
            bar.n = nth;
            float *s = malloc(sizeof(float) * (size_t) (Sp + 64));
            float *acc = malloc(sizeof(float) * (size_t) (4 * L * hd));
            for (int64_t il = 0; il < NL; il++) {
                const fb_layer *Lr = &m->layers[il];
                for (int64_t t = ith; t < B; t += nth) {
                    rmsnorm_row(h + t * D, D, Lr->attn_norm, m->norm_eps, xn + t * D);
                    rope_row(Lr, positions[t], half, cs + t * half, sn + t * half);
                }
                barrier_wait(&bar);
                {
                    const fb_weight *qkv[3] = {&Lr->q, &Lr->k, &Lr->v};
                    float *const outs[3] = {qb, kb, vb};
                    batch_matmuls(qkv, outs, 3, B, xn, &a, p, ith, nth, &bar);
                }
                for (int64_t item = ith; item < B * (H + Hkv); item += nth) {
                    const int64_t t = item / (H + Hkv), head = item % (H + Hkv);
                    if (head < H) {
                        float *x = qb + t * QD + head * hd;
                        if (Lr->q_norm) rmsnorm_row(x, hd, Lr->q_norm, m->norm_eps, x);
                        rope_apply(x, hd, m->rope_neox, cs + t * half, sn + t * half);
                        for (int64_t d = 0; d < hd; d++) x[d] = round_f16(x[d] * m->q_scale);
                    } else {
                        const int64_t kvh = head - H, at = (kvh * cache_lens[t] + positions[t]) * hd;
                        float *x = kb + t * KD + kvh * hd;
                        if (Lr->k_norm) rmsnorm_row(x, hd, Lr->k_norm, m->norm_eps, x);
                        rope_apply(x, hd, m->rope_neox, cs + t * half, sn + t * half);
                        uint16_t *kc = k_caches[t * NL + il] + at, *vc = v_caches[t * NL + il] + at;
                        for (int64_t d = 0; d < hd; d++) {
                            kc[d] = _cvtss_sh(x[d], _MM_FROUND_TO_NEAREST_INT);
                            vc[d] = _cvtss_sh(vb[t * KD + kvh * hd + d], _MM_FROUND_TO_NEAREST_INT);
                        }
                    }
                }
                barrier_wait(&bar);
                for (int64_t item = ith; item < B * H; item += nth) {
                    const int64_t t = item / H, head = item % H, kvh = head / groups, len = cache_lens[t];
                    attend_row(qb + t * QD + head * hd, k_caches[t * NL + il] + kvh * len * hd,
                               v_caches[t * NL + il] + kvh * len * hd, hd, positions[t], Lr->window, len,
                               m->kq_scale, 1, p, s, acc, att + t * QD + head * hd);
                }
                barrier_wait(&bar);
                {
                    const fb_weight *o[1] = {&Lr->o};
                    float *const outs[1] = {ab};
                    batch_matmuls(o, outs, 1, B, att, &a, p, ith, nth, &bar);
                }
                add_to_residual(m, Lr->post_attn_norm, Lr->mlp_norm, h, ab, xn, B, ith, nth);
                barrier_wait(&bar);
                {
                    const fb_weight *gate_up[2] = {&Lr->gate, &Lr->up};
                    float *const outs[2] = {gb, ub};
                    batch_matmuls(gate_up, outs, 2, B, xn, &a, p, ith, nth, &bar);
                }
                gated_unit(m, p, gb, ub, B, ith, nth);
                barrier_wait(&bar);
                {
                    const fb_weight *down[1] = {&Lr->down};
                    float *const outs[1] = {ab};
                    batch_matmuls(down, outs, 1, B, gb, &a, p, ith, nth, &bar);
                }
                add_to_residual(m, Lr->post_mlp_norm, il == NL - 1 ? m->output_norm : NULL, h, ab,
                                out, B, ith, nth);
                barrier_wait(&bar);
            }
            free(s);
            free(acc);
        }
    }
    free(xn); free(qb); free(kb); free(vb); free(att); free(ab); free(gb); free(ub); free(cs); free(sn);
    act_free(&a);
    return failed ? -1 : 0;
}
