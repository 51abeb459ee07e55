/* ggml's reference quantizers: the k-quants (Q4_K, Q5_K, Q6_K) and the legacy 32-value blocks
 * (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), for the engine's conversions (engine/gguf/quantize.py).
 *
 * A copy of quantize_row_{q4_K,q5_K,q6_K,q8_0,q4_0,q4_1,q5_0,q5_1}_ref and their helpers
 * (make_qkx2_quants, make_qx_quants, nearest_int, get_scale_min_k4) from ggml/src/ggml-quants.c
 * of the llama.cpp vendored in llama-cpp-python 0.3.36 (MIT licence, (c) the ggml authors): what
 * llama-quantize runs for these types without an importance matrix. The two scale searches run
 * a block's groups side by side, one per vector lane, each lane the scalar code's operations. Built without FMA
 * contraction and fast-math, so the bytes equal the numpy port in engine/gguf/quantize.py and
 * llama.cpp's (tests/test_quantize*.py, tests/test_hf_convert.py): the compiler may use wider
 * registers (-march=native) but never reorders a float sum or fuses a multiply-add.
 * fb_kquantize_rows quantizes `nrows` rows of `ncols` floats into their blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK_K 256
#define QK 32            /* the legacy types' block */
#define K_SCALE_SIZE 12
#define GROUP_MAX_EPS 1e-15f
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

typedef uint16_t ggml_half;
typedef struct { ggml_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qs[QK_K/2]; } block_q4_K;
typedef struct { ggml_half d, dmin; uint8_t scales[K_SCALE_SIZE]; uint8_t qh[QK_K/8];
                 uint8_t qs[QK_K/2]; } block_q5_K;
typedef struct { uint8_t ql[QK_K/2]; uint8_t qh[QK_K/4]; int8_t scales[QK_K/16]; ggml_half d; }
    block_q6_K;
typedef struct { ggml_half d; int8_t qs[QK]; } block_q8_0;
typedef struct { ggml_half d; uint8_t qs[QK/2]; } block_q4_0;
typedef struct { ggml_half d, m; uint8_t qs[QK/2]; } block_q4_1;
typedef struct { ggml_half d; uint8_t qh[4]; uint8_t qs[QK/2]; } block_q5_0;
typedef struct { ggml_half d, m; uint8_t qh[4]; uint8_t qs[QK/2]; } block_q5_1;

static ggml_half fp32_to_fp16(float f) {      /* round to nearest even, as F16C and ggml do */
    _Float16 h = (_Float16)f;
    ggml_half out; memcpy(&out, &h, 2); return out;
}
static float fp16_to_fp32(ggml_half h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }

static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i; memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

/* The scale searches run on several groups at once, one group per vector lane: lane j does
 * exactly the float operations, in the same order, that ggml's scalar loop does for group j
 * (its branches become selects), so the bytes are the reference's, at vector speed. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define SEL(mask, a, b) (((mask) & (a)) | (~(mask) & (b)))          /* integer lanes */
#define SELF(vi, mask, a, b) ((__typeof__(a))SEL((mask), (vi)(a), (vi)(b)))   /* float lanes */

/* ggml's nearest_int, lane by lane */
#define NEAREST_INT(vi, f) ((((vi)((f) + 12582912.f)) & 0x007fffff) - 0x00400000)

/* make_qkx2_quants(32, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, use_mad = 0)
 * for the 8 groups of 32 of a Q4_K/Q5_K block: xt[i], wt[i] hold element i of every group.
 * Writes Lt[i] (the levels), the_min and the scales. */
static void make_qkx2_quants_x8(int nmax, const v8f *xt, const v8f *wt, v8i *Lt, v8f *the_min,
                                v8f *scales, float rmin, float rdelta, int nstep) {
    const v8f zero = {0}, fnmax = zero + (float)nmax;
    const v8i inmax = (v8i){0} + nmax;
    v8f min = xt[0], max = xt[0], sum_w = wt[0], sum_x = sum_w * xt[0];
    for (int i = 1; i < 32; ++i) {
        min = SELF(v8i, xt[i] < min, xt[i], min);
        max = SELF(v8i, xt[i] > max, xt[i], max);
        sum_w += wt[i];
        sum_x += wt[i] * xt[i];
    }
    min = SELF(v8i, min > 0, zero, min);
    const v8i flat = max == min;
    const v8f flat_min = min;
    v8f iscale = fnmax / (max - min);
    v8f scale = 1.0f / iscale;
    v8f best_error = zero;
    for (int i = 0; i < 32; ++i) {
        v8i l = NEAREST_INT(v8i, iscale * (xt[i] - min));
        l = SEL(l < 0, (v8i){0}, l);
        l = SEL(l > inmax, inmax, l);
        Lt[i] = l;
        v8f diff = scale * __builtin_convertvector(l, v8f) + min - xt[i];
        diff = diff * diff;
        best_error += wt[i] * diff;
    }
    v8i Laux[32];
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta*is + (float)nmax) / (max - min);
        v8f sum_l = zero, sum_l2 = zero, sum_xl = zero;
        for (int i = 0; i < 32; ++i) {
            v8i l = NEAREST_INT(v8i, iscale * (xt[i] - min));
            l = SEL(l < 0, (v8i){0}, l);
            l = SEL(l > inmax, inmax, l);
            Laux[i] = l;
            const v8f lf = __builtin_convertvector(l, v8f), w = wt[i];
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * xt[i];
        }
        const v8f D = sum_w * sum_l2 - sum_l * sum_l;
        v8f this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        v8f this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        const v8i positive = this_min > 0;
        this_min = SELF(v8i, positive, zero, this_min);
        this_scale = SELF(v8i, positive, sum_xl / sum_l2, this_scale);
        v8f cur_error = zero;
        for (int i = 0; i < 32; ++i) {
            v8f diff = this_scale * __builtin_convertvector(Laux[i], v8f) + this_min - xt[i];
            diff = diff * diff;
            cur_error += wt[i] * diff;
        }
        const v8i better = (D > 0) & (cur_error < best_error);
        for (int i = 0; i < 32; ++i) Lt[i] = SEL(better, Laux[i], Lt[i]);
        best_error = SELF(v8i, better, cur_error, best_error);
        scale = SELF(v8i, better, this_scale, scale);
        min = SELF(v8i, better, this_min, min);
    }
    for (int i = 0; i < 32; ++i) Lt[i] = SEL(flat, (v8i){0}, Lt[i]);
    *the_min = -SELF(v8i, flat, flat_min, min);
    *scales = SELF(v8i, flat, zero, scale);
}

/* make_qx_quants(16, nmax, x, L, rmse_type = 1, qw = NULL) for the 16 groups of 16 of a Q6_K
 * block: xt[i] holds element i of every group. Writes Lt[i] (levels + nmax) and the scales
 * (through pointers: a vector return would change the ABI with the CPU's vector width). */
static void make_qx_quants_x16(int nmax, const v16f *xt, v16i *Lt, v16f *scales) {
    const v16f zero = {0};
    const v16i lo = (v16i){0} - nmax, hi = (v16i){0} + (nmax - 1);
    v16f max = zero, amax = zero;
    for (int i = 0; i < 16; ++i) {
        const v16f ax = (v16f)((v16i)xt[i] & 0x7fffffff);            /* fabsf */
        const v16i larger = ax > amax;
        amax = SELF(v16i, larger, ax, amax);
        max = SELF(v16i, larger, xt[i], max);
    }
    const v16i tiny = amax < GROUP_MAX_EPS;
    v16f iscale = (float)-nmax / max;
    v16f sumlx = zero, suml2 = zero;
    for (int i = 0; i < 16; ++i) {
        v16i l = NEAREST_INT(v16i, iscale * xt[i]);
        l = SEL(l < lo, lo, l);
        l = SEL(l > hi, hi, l);
        Lt[i] = l + nmax;
        const v16f lf = __builtin_convertvector(l, v16f), w = xt[i] * xt[i];
        sumlx += w * xt[i] * lf;
        suml2 += w * lf * lf;
    }
    v16f scale = SELF(v16i, suml2 != 0, sumlx / suml2, zero);
    v16f best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f*is) / max;
        v16i Laux[16];
        sumlx = suml2 = zero;
        for (int i = 0; i < 16; ++i) {
            v16i l = NEAREST_INT(v16i, iscale * xt[i]);
            l = SEL(l < lo, lo, l);
            l = SEL(l > hi, hi, l);
            Laux[i] = l + nmax;
            const v16f lf = __builtin_convertvector(l, v16f), w = xt[i] * xt[i];
            sumlx += w * xt[i] * lf;
            suml2 += w * lf * lf;
        }
        const v16i better = (suml2 > 0) & (sumlx * sumlx > best * suml2);
        for (int i = 0; i < 16; ++i) Lt[i] = SEL(better, Laux[i], Lt[i]);
        scale = SELF(v16i, better, sumlx / suml2, scale);
        best = SELF(v16i, better, scale * sumlx, best);
    }
    for (int i = 0; i < 16; ++i) Lt[i] = SEL(tiny, (v16i){0}, Lt[i]);
    *scales = SELF(v16i, tiny, zero, scale);
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else {
        *d = (q[j+4] & 0xF) | ((q[j-4] >> 6) << 4);
        *m = (q[j+4] >>  4) | ((q[j-0] >> 6) << 4);
    }
}

/* the shared scale/min search of Q4_K (nmax 15) and Q5_K (nmax 31) */
static void kx_scales(const float *x, int nmax, float rmin, int nstep, uint8_t *L,
                      uint8_t *scales_out, ggml_half *d_out, ggml_half *dmin_out) {
    float mins[QK_K/32], scales[QK_K/32];
    float max_scale = 0, max_min = 0;
    /* the 8 groups of 32 side by side: xt[l][j] = x[32*j + l] */
    v8f xt[32], wt[32], sum_x2 = {0};
    v8i Lt[32];
    for (int l = 0; l < 32; ++l) {
        for (int j = 0; j < QK_K/32; ++j) xt[l][j] = x[32*j + l];
        sum_x2 += xt[l] * xt[l];
    }
    v8f av_x;
    for (int j = 0; j < QK_K/32; ++j) av_x[j] = sqrtf(sum_x2[j]/32);
    for (int l = 0; l < 32; ++l) wt[l] = av_x + (v8f)((v8i)xt[l] & 0x7fffffff);   /* fabsf */
    v8f the_min, scale;
    make_qkx2_quants_x8(nmax, xt, wt, Lt, &the_min, &scale, rmin, 0.1f, nstep);
    for (int j = 0; j < QK_K/32; ++j) {
        scales[j] = scale[j];
        mins[j] = the_min[j];
        for (int l = 0; l < 32; ++l) L[32*j + l] = (uint8_t)Lt[l][j];
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f/max_scale : 0.f;
    float inv_min   = max_min   > 0 ? 63.f/max_min   : 0.f;
    for (int j = 0; j < QK_K/32; ++j) {
        uint8_t ls = nearest_int(inv_scale*scales[j]);
        uint8_t lm = nearest_int(inv_min*mins[j]);
        ls = MIN(63, ls);
        lm = MIN(63, lm);
        if (j < 4) { scales_out[j] = ls; scales_out[j+4] = lm; }
        else {
            scales_out[j+4] = (ls & 0xF) | ((lm & 0xF) << 4);
            scales_out[j-4] |= ((ls >> 4) << 6);
            scales_out[j-0] |= ((lm >> 4) << 6);
        }
    }
    *d_out = fp32_to_fp16(max_scale/63.f);
    *dmin_out = fp32_to_fp16(max_min/63.f);
    uint8_t sc, m;
    for (int j = 0; j < QK_K/32; ++j) {
        get_scale_min_k4(j, scales_out, &sc, &m);
        const float d = fp16_to_fp32(*d_out) * sc;
        if (!d) continue;
        const float dm = fp16_to_fp32(*dmin_out) * m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32*j + ii] + dm)/d);
            L[32*j + ii] = MAX(0, MIN(nmax, l));
        }
    }
}

static void quantize_row_q4_K(const float *x, block_q4_K *y, int64_t k) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        kx_scales(x, 15, -1.f, 20, L, y[i].scales, &y[i].d, &y[i].dmin);
        uint8_t *q = y[i].qs;
        for (int j = 0; j < QK_K; j += 64) {
            for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
            q += 32;
        }
    }
}

static void quantize_row_q5_K(const float *x, block_q5_K *y, int64_t k) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        kx_scales(x, 31, -0.5f, 15, L, y[i].scales, &y[i].d, &y[i].dmin);
        uint8_t *qh = y[i].qh, *ql = y[i].qs;
        memset(qh, 0, QK_K/8);
        uint8_t m1 = 1, m2 = 2;
        for (int n = 0; n < QK_K; n += 64) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[n + j];
                if (l1 > 15) { l1 -= 16; qh[j] |= m1; }
                int l2 = L[n + j + 32];
                if (l2 > 15) { l2 -= 16; qh[j] |= m2; }
                ql[j] = l1 | (l2 << 4);
            }
            m1 <<= 2; m2 <<= 2;
            ql += 32;
        }
    }
}

static void quantize_row_q6_K(const float *x, block_q6_K *y, int64_t k) {
    int8_t L[QK_K];
    float scales[QK_K/16];
    for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
        float max_scale = 0, max_abs_scale = 0;
        v16f xt[16];                            /* the 16 groups of 16 side by side */
        v16i Lt[16];
        for (int l = 0; l < 16; ++l)
            for (int ib = 0; ib < QK_K/16; ++ib) xt[l][ib] = x[16*ib + l];
        v16f group_scales;
        make_qx_quants_x16(32, xt, Lt, &group_scales);
        for (int ib = 0; ib < QK_K/16; ++ib) {
            for (int l = 0; l < 16; ++l) L[16*ib + l] = (int8_t)Lt[l][ib];
            const float scale = group_scales[ib];
            scales[ib] = scale;
            const float abs_scale = fabsf(scale);
            if (abs_scale > max_abs_scale) { max_abs_scale = abs_scale; max_scale = scale; }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(&y[i], 0, sizeof(block_q6_K));
            y[i].d = fp32_to_fp16(0.f);
            continue;
        }
        float iscale = -128.f/max_scale;
        y[i].d = fp32_to_fp16(1/iscale);
        for (int ib = 0; ib < QK_K/16; ++ib) y[i].scales[ib] = MIN(127, nearest_int(iscale*scales[ib]));
        for (int j = 0; j < QK_K/16; ++j) {
            float d = fp16_to_fp32(y[i].d) * y[i].scales[j];
            if (!d) continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16*j + ii]/d);
                l = MAX(-32, MIN(31, l));
                L[16*j + ii] = l + 32;
            }
        }
        uint8_t *ql = y[i].ql, *qh = y[i].qh;
        for (int j = 0; j < QK_K; j += 128) {
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l +  0] & 0xF;
                const uint8_t q2 = L[j + l + 32] & 0xF;
                const uint8_t q3 = L[j + l + 64] & 0xF;
                const uint8_t q4 = L[j + l + 96] & 0xF;
                ql[l+ 0] = q1 | (q3 << 4);
                ql[l+32] = q2 | (q4 << 4);
                qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) |
                        ((L[j + l + 64] >> 4) << 4) | ((L[j + l + 96] >> 4) << 6);
            }
            ql += 64;
            qh += 32;
        }
    }
}

/* ---------------------------------------------------------------- legacy 32-value blocks */

/* (int)roundf(x) (halves away from zero) for |x| <= 128, without the libm call so the loop
 * vectorizes: |x| + 0.5 is exact in double, and the cast truncates it to the floor */
static inline int round_half_away(float x) {
    const int q = (int)(fabs((double)x) + 0.5);
    return x < 0 ? -q : q;
}

static void quantize_row_q8_0(const float *x, block_q8_0 *y, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++, x += QK) {
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = MAX(amax, fabsf(x[j]));
        const float d = amax / ((1 << 7) - 1);
        const float id = d ? 1.0f/d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK; ++j) y[i].qs[j] = (int8_t)round_half_away(x[j]*id);
    }
}

/* the value of largest magnitude (the first on ties; 0 for an all-zero block) */
static float abs_max_value(const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK; j++) {
        if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
    }
    return max;
}

static void min_max(const float *x, float *lo, float *hi) {
    float min = 3.402823466e+38f, max = -3.402823466e+38f;
    for (int j = 0; j < QK; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    *lo = min; *hi = max;
}

static void quantize_row_q4_0(const float *x, block_q4_0 *y, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++, x += QK) {
        const float d = abs_max_value(x) / -8;
        const float id = d ? 1.0f/d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        for (int j = 0; j < QK/2; ++j) {
            const uint8_t xi0 = MIN(15, (int8_t)(x[j]*id + 8.5f));
            const uint8_t xi1 = MIN(15, (int8_t)(x[QK/2 + j]*id + 8.5f));
            y[i].qs[j] = xi0 | (xi1 << 4);
        }
    }
}

static void quantize_row_q4_1(const float *x, block_q4_1 *y, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++, x += QK) {
        float min, max;
        min_max(x, &min, &max);
        const float d = (max - min) / ((1 << 4) - 1);
        const float id = d ? 1.0f/d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(min);
        for (int j = 0; j < QK/2; ++j) {
            const uint8_t xi0 = MIN(15, (int8_t)((x[j] - min)*id + 0.5f));
            const uint8_t xi1 = MIN(15, (int8_t)((x[QK/2 + j] - min)*id + 0.5f));
            y[i].qs[j] = xi0 | (xi1 << 4);
        }
    }
}

static void quantize_row_q5_0(const float *x, block_q5_0 *y, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++, x += QK) {
        const float d = abs_max_value(x) / -16;
        const float id = d ? 1.0f/d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        uint32_t qh = 0;
        for (int j = 0; j < QK/2; ++j) {
            const uint8_t xi0 = MIN(31, (int8_t)(x[j]*id + 16.5f));
            const uint8_t xi1 = MIN(31, (int8_t)(x[QK/2 + j]*id + 16.5f));
            y[i].qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);     /* bit 4 of each quant */
            qh |= ((xi1 & 0x10u) >> 4) << (j + QK/2);
        }
        memcpy(y[i].qh, &qh, sizeof qh);
    }
}

static void quantize_row_q5_1(const float *x, block_q5_1 *y, int64_t k) {
    for (int64_t i = 0; i < k / QK; i++, x += QK) {
        float min, max;
        min_max(x, &min, &max);
        const float d = (max - min) / ((1 << 5) - 1);
        const float id = d ? 1.0f/d : 0.0f;
        y[i].d = fp32_to_fp16(d);
        y[i].m = fp32_to_fp16(min);
        uint32_t qh = 0;
        for (int j = 0; j < QK/2; ++j) {
            const uint8_t xi0 = (uint8_t)((x[j] - min)*id + 0.5f);
            const uint8_t xi1 = (uint8_t)((x[QK/2 + j] - min)*id + 0.5f);
            y[i].qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
            qh |= ((xi1 & 0x10u) >> 4) << (j + QK/2);
        }
        memcpy(y[i].qh, &qh, sizeof qh);
    }
}

/* bytes of one row of `ncols` values of a type, 0 for a type without a quantizer here */
static int64_t row_bytes(int type, int64_t ncols) {
    switch (type) {
    case 2: return ncols / QK * (int64_t)sizeof(block_q4_0);
    case 3: return ncols / QK * (int64_t)sizeof(block_q4_1);
    case 6: return ncols / QK * (int64_t)sizeof(block_q5_0);
    case 7: return ncols / QK * (int64_t)sizeof(block_q5_1);
    case 8: return ncols / QK * (int64_t)sizeof(block_q8_0);
    case 12: return ncols / QK_K * (int64_t)sizeof(block_q4_K);
    case 13: return ncols / QK_K * (int64_t)sizeof(block_q5_K);
    case 14: return ncols / QK_K * (int64_t)sizeof(block_q6_K);
    default: return 0;
    }
}

int fb_kquantize_rows(int type, const float *x, int64_t nrows, int64_t ncols, uint8_t *out);

/* fb_kquantize_rows of f16 values (an f16 file's tensor as it lies in the file), each row
 * widened to f32 (exact) in a buffer of its own: no f32 copy of the whole tensor. Returns 0, or
 * -1 for a type without a quantizer here (or no memory for one row). */
int fb_kquantize_rows_f16(int type, const uint16_t *x, int64_t nrows, int64_t ncols,
                          uint8_t *out) {
    const int64_t size = row_bytes(type, ncols);
    float *row = size ? malloc((size_t)ncols * sizeof(float)) : NULL;
    if (!row) return -1;
    for (int64_t r = 0; r < nrows; ++r) {
        const uint16_t *src = x + r * ncols;
        for (int64_t j = 0; j < ncols; ++j) row[j] = fp16_to_fp32(src[j]);
        fb_kquantize_rows(type, row, 1, ncols, out + r * size);
    }
    free(row);
    return 0;
}

/* ggml type ids: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
 * Q6_K = 14. Returns 0, or -1 for another type. */
int fb_kquantize_rows(int type, const float *x, int64_t nrows, int64_t ncols, uint8_t *out) {
    for (int64_t r = 0; r < nrows; ++r) {
        const float *row = x + r * ncols;
        switch (type) {
        case 2: quantize_row_q4_0(row, (block_q4_0 *)out + r * (ncols / QK), ncols); break;
        case 3: quantize_row_q4_1(row, (block_q4_1 *)out + r * (ncols / QK), ncols); break;
        case 6: quantize_row_q5_0(row, (block_q5_0 *)out + r * (ncols / QK), ncols); break;
        case 7: quantize_row_q5_1(row, (block_q5_1 *)out + r * (ncols / QK), ncols); break;
        case 8: quantize_row_q8_0(row, (block_q8_0 *)out + r * (ncols / QK), ncols); break;
        case 12: quantize_row_q4_K(row, (block_q4_K *)out + r * (ncols / QK_K), ncols); break;
        case 13: quantize_row_q5_K(row, (block_q5_K *)out + r * (ncols / QK_K), ncols); break;
        case 14: quantize_row_q6_K(row, (block_q6_K *)out + r * (ncols / QK_K), ncols); break;
        default: return -1;
        }
    }
    return 0;
}
