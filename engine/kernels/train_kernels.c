/* Fused elementwise passes of a training step: what torch runs as a chain of small ops, each
 * with its own pass over memory, a fresh output and a dispatch, done here in one pass.
 *
 * The contract is torch's arithmetic, not llama.cpp's (that is ggml_kernels.c): every value is
 * computed in f32 from f32 or bf16 operands, and a bf16 result is rounded once, to nearest even,
 * as torch rounds. What differs from torch's chain is the last bits: exp is a degree-5
 * polynomial (Cephes' expf, within 2 ulp of the true value), sums run over the vector's lanes in
 * a fixed order, and a bf16 result is rounded once where torch rounds after every op. Each value
 * depends only on its own row, so the bits do not change with the batch, the packing or the
 * thread count.
 *
 * Reading order: the loads and stores (f32 or bf16, a partial vector at a row's end), exp, then
 * one function per pass: the LM head's online-softmax step (fb_softmax_chunk), RMSNorm forward
 * and backward (fb_rmsnorm_fwd, fb_rmsnorm_bwd), the gated MLP's activation forward and
 * backward (fb_glu_fwd, fb_glu_bwd), RoPE with the heads' transpose forward and backward
 * (fb_rope_fwd, fb_rope_bwd).
 *
 * Single-threaded on purpose: these passes take tens to hundreds of microseconds, and a second
 * OpenMP runtime spinning beside torch's would cost more than it saves. The LM head calls
 * fb_softmax_chunk from one thread per share of the vocabulary.
 *
 * Written with GCC's vector extensions, no intrinsics: one register of 16 lanes where the CPU has
 * AVX-512, of 8 elsewhere (AVX2, or what the compiler makes of them on other CPUs), from the same
 * source. A lane's arithmetic is the same either way; a row's sums add their lanes in a fixed
 * tree, so the width can change their last bit, never the run-to-run bits. Compiled with
 * -ffp-contract=fast: a*b + c is one fused multiply-add where the CPU has FMA, which is what makes
 * exp's polynomial cheap.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FB_F32 = 0, FB_BF16 = 1 };
enum { FB_SILU = 0, FB_GELU_TANH = 1 };

#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8      /* wider vectors than the registers make GCC spill */
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));

static inline vf splat(float x) { return (vf){0} + x; }

/* a where mask (all ones), else b: the bits chosen lane by lane */
static inline vf select_v(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* the larger of a and b lane by lane; NaN in a stays (a row's NaN reaches its max) */
static inline vf max_v(vf a, vf b) { return select_v((a > b) | (a != a), a, b); }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load1(const void *p, int dtype, int64_t i) {
    return dtype == FB_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* LANES values from p[i…], or the `count` < LANES left at a row's end with `pad` after them. */
static inline vf load_v(const void *p, int dtype, int64_t i, int64_t count, float pad) {
    vf v;
    if (count >= LANES) {
        if (dtype == FB_BF16) {
            vh h;
            memcpy(&h, (const uint16_t *)p + i, sizeof h);
            return (vf)(__builtin_convertvector(h, vu) << 16);
        }
        memcpy(&v, (const float *)p + i, sizeof v);
        return v;
    }
    for (int k = 0; k < LANES; k++) v[k] = k < count ? load1(p, dtype, i + k) : pad;
    return v;
}

/* f32 to bf16, to nearest even, NaN to 0x7FC0: c10::BFloat16's rounding. */
static inline vh to_bf16_v(vf v) {
    vu bits = (vu)v;
    vu rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
    vu nan = (vu)(v != v);
    return __builtin_convertvector((nan & 0x7FC0) | (~nan & rounded), vh);
}

static inline void store1(void *p, int dtype, int64_t i, float v) {
    if (dtype == FB_BF16) ((uint16_t *)p)[i] = to_bf16_v(splat(v))[0];
    else ((float *)p)[i] = v;
}

static inline void store_v(void *p, int dtype, int64_t i, int64_t count, vf v) {
    if (dtype == FB_BF16) {
        vh h = to_bf16_v(v);
        if (count >= LANES) memcpy((uint16_t *)p + i, &h, sizeof h);
        else memcpy((uint16_t *)p + i, &h, (size_t)count * sizeof(uint16_t));
    } else if (count >= LANES) {
        memcpy((float *)p + i, &v, sizeof v);
    } else {
        memcpy((float *)p + i, &v, (size_t)count * sizeof(float));
    }
}

/* Lane sums and maxima in one fixed order: halves folded onto each other, 16 → 8 → 4 → 2 → 1. */
static inline float hsum(vf v) {
    float a[LANES];
    memcpy(a, &v, sizeof a);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int k = 0; k < width; k++) a[k] += a[k + width];
    return a[0];
}

static inline float hmax(vf v) {
    float a[LANES], m;
    memcpy(a, &v, sizeof a);
    m = a[0];
    for (int k = 1; k < LANES; k++) m = (a[k] > m || a[k] != a[k]) ? a[k] : m;
    return m;
}

/* Cephes' expf: 2^n · p(r) with x = n·ln2 + r, |r| <= ln2/2. Below ln(FLT_MIN) it gives 0 (torch
 * gives a subnormal there), from 88 up it saturates at e^88 (1.65e38); NaN stays NaN. */
static inline vf exp_v(vf x) {
    const float lo = -87.33654475f, hi = 88.0f;
    const vi below = x < lo;
    x = select_v(x < lo, splat(lo), x);
    x = select_v(x > hi, splat(hi), x);
    /* round to nearest: adding and taking away 1.5·2^23 leaves the integer part */
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf y = splat(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * (r * r) + (r + 1.0f);
    /* n in [-126, 127]: 2^n built in the exponent field */
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)(~below & (vi)(y * (vf)scale));
}

#define SUM_BLOCK 32

/* One chunk of the LM head's online logsumexp, rows [N] of z [N, C] (the chunk's logits):
 * m_new = max(m, max_j z), rescale = exp(m - m_new), z <- exp(z - m_new) in place (the chunk's
 * unnormalised probabilities, which the gradient's product reads), s <- s·rescale + Σ_j z. */
void fb_softmax_chunk(int64_t N, int64_t C, void *z, int dtype, float *m, float *s, float *rescale) {
    for (int64_t row = 0; row < N; row++) {
        const int64_t base = row * C;
        vf vmax = splat(-INFINITY);
        for (int64_t j = 0; j < C; j += LANES)
            vmax = max_v(load_v(z, dtype, base + j, C - j, -INFINITY), vmax);
        const float chunk_max = hmax(vmax);
        const float m_new = (chunk_max > m[row] || chunk_max != chunk_max) ? chunk_max : m[row];
        /* a row's sum in blocks of SUM_BLOCK vectors, the blocks then added: a vocabulary chunk
         * is 16384 values, and one running sum per lane would round 2048 times */
        vf vsum = {0}, block = {0};
        int64_t in_block = 0;
        for (int64_t j = 0; j < C; j += LANES) {
            const int64_t count = C - j;
            vf p = exp_v(load_v(z, dtype, base + j, count, -INFINITY) - m_new);
            store_v(z, dtype, base + j, count, p);
            block += p;                             /* the pad's exp(-inf) adds 0 */
            if (++in_block == SUM_BLOCK) { vsum += block; block = (vf){0}; in_block = 0; }
        }
        vsum += block;
        const float r = exp_v(splat(m[row] - m_new))[0];
        rescale[row] = r;
        s[row] = s[row] * r + hsum(vsum);
        m[row] = m_new;
    }
}

/* y = (x · rstd) · w per row of x [R, n], rstd = 1/sqrt(mean(x²) + eps) kept for the backward. */
void fb_rmsnorm_fwd(int64_t R, int64_t n, const void *x, int x_dtype, const float *w, float eps,
                    void *y, int y_dtype, float *rstd) {
    for (int64_t row = 0; row < R; row++) {
        const int64_t base = row * n;
        vf squares = {0};
        for (int64_t j = 0; j < n; j += LANES) {
            vf v = load_v(x, x_dtype, base + j, n - j, 0.0f);
            squares += v * v;
        }
        const float r = 1.0f / sqrtf(hsum(squares) / (float)n + eps);
        for (int64_t j = 0; j < n; j += LANES) {
            vf normed = load_v(x, x_dtype, base + j, n - j, 0.0f) * r;
            store_v(y, y_dtype, base + j, n - j, normed * load_v(w, FB_F32, j, n - j, 0.0f));
        }
        rstd[row] = r;
    }
}

/* dx = rstd · (g − x̂ · mean(g · x̂)) with g = dy · w and x̂ = x · rstd; dw += Σ_rows dy · x̂ where
 * dw is not NULL (summed row after row, so its bits do not depend on how rows are split). */
void fb_rmsnorm_bwd(int64_t R, int64_t n, const void *x, int x_dtype, const float *rstd,
                    const float *w, const void *dy, int dy_dtype, void *dx, int dx_dtype, float *dw) {
    for (int64_t row = 0; row < R; row++) {
        const int64_t base = row * n;
        const float r = rstd[row];
        vf dot = {0};
        for (int64_t j = 0; j < n; j += LANES) {
            const int64_t count = n - j;
            vf normed = load_v(x, x_dtype, base + j, count, 0.0f) * r;
            vf g = load_v(dy, dy_dtype, base + j, count, 0.0f) * load_v(w, FB_F32, j, count, 0.0f);
            dot += g * normed;
        }
        const float mean = hsum(dot) / (float)n;
        for (int64_t j = 0; j < n; j += LANES) {
            const int64_t count = n - j;
            vf normed = load_v(x, x_dtype, base + j, count, 0.0f) * r;
            vf d = load_v(dy, dy_dtype, base + j, count, 0.0f);
            vf g = d * load_v(w, FB_F32, j, count, 0.0f);
            store_v(dx, dx_dtype, base + j, count, (g - normed * mean) * r);
            if (dw) store_v(dw, FB_F32, j, count, load_v(dw, FB_F32, j, count, 0.0f) + d * normed);
        }
    }
}

/* act(v) and its slope act'(v). gelu-tanh: v·σ(2u) with u = √(2/π)(v + 0.044715 v³), which is
 * 0.5·v·(1 + tanh u); silu: v·σ(v). */
static inline vf sigmoid_v(vf t) { return 1.0f / (1.0f + exp_v(-t)); }

static inline vf activation_v(int act, vf v, vf *slope) {
    if (act == FB_GELU_TANH) {
        const float k = 0.7978845608028654f, c = 0.044715f;
        const vf v2 = v * v;
        const vf sig = sigmoid_v((2.0f * k) * (v + (c * v2) * v));
        if (slope)   /* σ(2u) + v·σ(1−σ)·2u', u' = √(2/π)(1 + 3·0.044715 v²) */
            *slope = sig + v * ((sig * (1.0f - sig)) * ((2.0f * k) * (1.0f + (3.0f * c) * v2)));
        return v * sig;
    }
    const vf sig = sigmoid_v(v);
    if (slope) *slope = sig * (1.0f + v * (1.0f - sig));
    return v * sig;
}

/* out = act(gate) · up over n values, all of one dtype. */
void fb_glu_fwd(int64_t n, int act, const void *gate, const void *up, int dtype, void *out) {
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t count = n - i;
        vf a = activation_v(act, load_v(gate, dtype, i, count, 0.0f), NULL);
        store_v(out, dtype, i, count, a * load_v(up, dtype, i, count, 0.0f));
    }
}

/* d_gate = d_out · up · act'(gate), d_up = d_out · act(gate). */
void fb_glu_bwd(int64_t n, int act, const void *gate, const void *up, const void *d_out, int dtype,
                void *d_gate, void *d_up) {
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t count = n - i;
        vf slope, d = load_v(d_out, dtype, i, count, 0.0f);
        vf a = activation_v(act, load_v(gate, dtype, i, count, 0.0f), &slope);
        store_v(d_gate, dtype, i, count, (d * load_v(up, dtype, i, count, 0.0f)) * slope);
        store_v(d_up, dtype, i, count, d * a);
    }
}

/* RoPE of x [B, T, H, hd] (a linear layer's output, heads split) by cos/sin [T, hd/2], times
 * `scale`, written as out [B, H, T, hd] f32 (the layout attention reads): for each pair (a, b) =
 * (x_i, x_{i+hd/2}) with neox, (x_2i, x_2i+1) otherwise, a·c − b·s and a·s + b·c. */
void fb_rope_fwd(int64_t B, int64_t T, int64_t H, int64_t hd, const void *x, int x_dtype,
                 const float *cos_t, const float *sin_t, float scale, int neox, float *out) {
    const int64_t half = hd / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t src = ((b * T + t) * H + h) * hd;
                float *dst = out + ((b * H + h) * T + t) * hd;
                const float *c = cos_t + t * half, *s = sin_t + t * half;
                if (neox) {
                    for (int64_t i = 0; i < half; i += LANES) {
                        const int64_t count = half - i;
                        vf x1 = load_v(x, x_dtype, src + i, count, 0.0f);
                        vf x2 = load_v(x, x_dtype, src + half + i, count, 0.0f);
                        vf vc = load_v(c, FB_F32, i, count, 0.0f), vs = load_v(s, FB_F32, i, count, 0.0f);
                        store_v(dst, FB_F32, i, count, (x1 * vc - x2 * vs) * scale);
                        store_v(dst, FB_F32, half + i, count, (x1 * vs + x2 * vc) * scale);
                    }
                } else {
                    for (int64_t i = 0; i < half; i++) {
                        const float x1 = load1(x, x_dtype, src + 2 * i), x2 = load1(x, x_dtype, src + 2 * i + 1);
                        dst[2 * i] = (x1 * c[i] - x2 * s[i]) * scale;
                        dst[2 * i + 1] = (x1 * s[i] + x2 * c[i]) * scale;
                    }
                }
            }
}

/* The backward of fb_rope_fwd: the rotation by −angle, times `scale`, of g [B, H, T, hd] f32,
 * written as dx [B, T, H, hd] in x's dtype. */
void fb_rope_bwd(int64_t B, int64_t T, int64_t H, int64_t hd, const float *g, const float *cos_t,
                 const float *sin_t, float scale, int neox, void *dx, int dx_dtype) {
    const int64_t half = hd / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const float *src = g + ((b * H + h) * T + t) * hd;
                const int64_t dst = ((b * T + t) * H + h) * hd;
                const float *c = cos_t + t * half, *s = sin_t + t * half;
                if (neox) {
                    for (int64_t i = 0; i < half; i += LANES) {
                        const int64_t count = half - i;
                        vf g1 = load_v(src, FB_F32, i, count, 0.0f);
                        vf g2 = load_v(src, FB_F32, half + i, count, 0.0f);
                        vf vc = load_v(c, FB_F32, i, count, 0.0f), vs = load_v(s, FB_F32, i, count, 0.0f);
                        store_v(dx, dx_dtype, dst + i, count, (g1 * vc + g2 * vs) * scale);
                        store_v(dx, dx_dtype, dst + half + i, count, (g2 * vc - g1 * vs) * scale);
                    }
                } else {
                    for (int64_t i = 0; i < half; i++) {
                        const float g1 = src[2 * i], g2 = src[2 * i + 1];
                        store1(dx, dx_dtype, dst + 2 * i, (g1 * c[i] + g2 * s[i]) * scale);
                        store1(dx, dx_dtype, dst + 2 * i + 1, (g2 * c[i] - g1 * s[i]) * scale);
                    }
                }
            }
}
