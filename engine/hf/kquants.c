/* ggml's reference quantizers: the k-quants (Q4_K, Q5_K, Q6_K) and the legacy 32-value blocks
 * (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), for the engine's conversions (engine/gguf/quantize.py).
 *
 * A copy of quantize_row_{q4_K,q5_K,q6_K,q8_0,q4_0,q4_1,q5_0,q5_1}_ref and their helpers
 * (make_qkx2_quants, make_qx_quants, nearest_int, get_scale_min_k4) from ggml/src/ggml-quants.c
 * of the llama.cpp vendored in llama-cpp-python 0.3.36 (MIT licence, (c) the ggml authors): what
 * llama-quantize runs for these types without an importance matrix. Built without FMA
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

static float make_qx_quants(int n, int nmax, const float *x, int8_t *L, int rmse_type,
                            const float *qw) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) { amax = ax; max = x[i]; }
    }
    if (amax < GROUP_MAX_EPS) { for (int i = 0; i < n; ++i) L[i] = 0; return 0.f; }
    float iscale = -nmax / max;
    if (rmse_type == 0) {
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            L[i] = nmax + MAX(-nmax, MIN(nmax-1, l));
        }
        return 1/iscale;
    }
    int return_early = 0;
    if (rmse_type < 0) { rmse_type = -rmse_type; return_early = 1; }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAX(-nmax, MIN(nmax-1, l));
        L[i] = l + nmax;
        float w = qw ? qw[i] : rmse_type == 1 ? x[i] * x[i] : rmse_type == 2 ? 1 :
                  rmse_type == 3 ? fabsf(x[i]) : sqrtf(fabsf(x[i]));
        sumlx += w*x[i]*l;
        suml2 += w*l*l;
    }
    float scale = suml2 ? sumlx/suml2 : 0.0f;
    if (return_early) return suml2 > 0 ? 0.5f*(scale + 1/iscale) : 1/iscale;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f*is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = MAX(-nmax, MIN(nmax-1, l));
            float w = qw ? qw[i] : rmse_type == 1 ? x[i] * x[i] : rmse_type == 2 ? 1 :
                      rmse_type == 3 ? fabsf(x[i]) : sqrtf(fabsf(x[i]));
            sumlx += w*x[i]*l;
            suml2 += w*l*l;
        }
        if (suml2 > 0 && sumlx*sumlx > best*suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = nmax + MAX(-nmax, MIN(nmax-1, l));
            }
            scale = sumlx/suml2; best = scale*sumlx;
        }
    }
    return scale;
}

static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              int use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) { for (int i = 0; i < n; ++i) L[i] = 0; *the_min = -min; return 0.f; }
    float iscale = nmax/(max - min);
    float scale = 1/iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale*(x[i] - min));
        L[i] = MAX(0, MIN(nmax, l));
        float diff = scale * L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    if (nstep < 1) { *the_min = -min; return scale; }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta*is + nmax)/(max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale*(x[i] - min));
            l = MAX(0, MIN(nmax, l));
            Laux[i] = l;
            float w = weights[i];
            sum_l += w*l;
            sum_l2 += w*l*l;
            sum_xl += w*l*x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l)/D;
            float this_min   = (sum_l2 * sum_x - sum_l * sum_xl)/D;
            if (this_min > 0) { this_min = 0; this_scale = sum_xl / sum_l2; }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i) L[i] = Laux[i];
                best_error = cur_error; scale = this_scale; min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
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
    uint8_t Laux[32];
    float weights[32], mins[QK_K/32], scales[QK_K/32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K/32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l) sum_x2 += x[32*j + l] * x[32*j + l];
        float av_x = sqrtf(sum_x2/32);
        for (int l = 0; l < 32; ++l) weights[l] = av_x + fabsf(x[32*j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32*j, weights, L + 32*j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, 0);
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
        for (int ib = 0; ib < QK_K/16; ++ib) {
            const float scale = make_qx_quants(16, 32, x + 16*ib, L + 16*ib, 1, NULL);
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

/* roundf (halves away from zero) without the libm call, so the loop vectorizes: x - trunc(x) is
 * exact in float, and so is trunc(x) ± 1 below 2^24 (above, x has no fraction) */
static inline float round_half_away(float x) {
    const float t = truncf(x);
    return fabsf(x - t) >= 0.5f ? t + copysignf(1.0f, x) : t;
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
