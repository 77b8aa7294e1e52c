/* Portable kernels: plain C that compiles anywhere (gcc auto-vectorises the fp32 loops with the
 * baseline instruction set). The bf16/fp16 conversions are exact bit manipulations. */
#define LZO_INTERNAL
#include "lzo.h"

#include <math.h>
#include <string.h>

static inline uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* Round to nearest even; NaN stays NaN (quieted, sign and top payload bits kept). Branch-free, so
 * the loops that use it vectorise. */
static inline uint16_t f32_to_bf16(float x)
{
    uint32_t u = f32_bits(x);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1fu) /* inf, nan */
        return bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) /* normal: rebias 15 -> 127 */
        return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    float sub = (float)mant * 0x1p-24f; /* zero or subnormal: exact in fp32 */
    return sign ? -sub : sub;
}

/* Round to nearest even, overflow to inf, subnormals exact; NaN stays NaN (quieted). */
static inline uint16_t f32_to_f16(float x)
{
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) /* >= 65520: rounds to inf (and inf itself) */
        return sign | 0x7c00u;
    if (a >= 0x38800000u) { /* normal half: rebias 127 -> 15, round away 13 bits */
        a += 0xc8000fffu + ((a >> 13) & 1u); /* 0xc8000000 == -(112 << 23) mod 2^32 */
        return sign | (uint16_t)(a >> 13);
    }
    /* subnormal half: units of 2^-24, i.e. the 24-bit significand shifted right by 126 - exp */
    uint32_t exp = a >> 23, shift = 126u - exp;
    if (shift > 24u)
        return sign;
    uint32_t mant = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    q += rem > half || (rem == half && (q & 1u));
    return sign | (uint16_t)q;
}

static inline float load_elem(const void *src, int64_t i, int dtype)
{
    switch (dtype) {
    case LZO_BFLOAT16:
        return bf16_to_f32(((const uint16_t *)src)[i]);
    case LZO_FLOAT16:
        return f16_to_f32(((const uint16_t *)src)[i]);
    default:
        return ((const float *)src)[i];
    }
}

static inline void store_elem(void *out, int64_t i, float x, int dtype)
{
    if (dtype == LZO_BFLOAT16)
        ((uint16_t *)out)[i] = f32_to_bf16(x);
    else if (dtype == LZO_FLOAT16)
        ((uint16_t *)out)[i] = f32_to_f16(x);
}

/* Fused multiply-add where the hardware has one (then every backend gives the same bits), else a
 * multiply and an add: a libm fmaf call per element would make this path several times slower. */
#ifdef FP_FAST_FMAF
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif

/* Inlined with constant dtypes by the dispatch below, so each loop is specialised. */
static inline __attribute__((always_inline)) void
adam_loop(const lzo_adam_consts *c, float *restrict p, const void *restrict g, float *restrict m,
          float *restrict v, void *restrict out, int64_t n, int gdt, int odt)
{
    for (int64_t i = 0; i < n; ++i) {
        float gi = load_elem(g, i, gdt) * c->grad_scale, p0 = p[i], pi = p0;
        if (c->l2 != 0.0f)
            gi = FMA(pi, c->l2, gi);
        pi = pi * c->decay;
        float mi = m[i];
        mi = FMA(c->lerp_w, gi - mi, c->lerp_from_end ? gi : mi);
        float vi = FMA(c->one_minus_beta2 * gi, gi, v[i] * c->beta2);
        float denom = sqrtf(vi) / c->bc2_sqrt + c->eps;
        pi = pi + c->neg_step_size * mi / denom;
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        store_elem(out, i, c->extrapolate != 0.0f ? FMA(c->extrapolate, pi - p0, pi) : pi, odt);
    }
}

#define ADAM_CASE(G, O)                                                                           \
    if (gdt == (G) && odt == (O)) {                                                               \
        adam_loop(c, p, g, m, v, out, n, G, O);                                                   \
        return;                                                                                   \
    }

static void adam(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v, void *out,
                 int64_t n, int gdt, int odt)
{
    ADAM_CASE(LZO_FLOAT32, LZO_NONE)
    ADAM_CASE(LZO_BFLOAT16, LZO_NONE)
    ADAM_CASE(LZO_FLOAT16, LZO_NONE)
    ADAM_CASE(LZO_FLOAT32, LZO_BFLOAT16)
    ADAM_CASE(LZO_BFLOAT16, LZO_BFLOAT16)
    ADAM_CASE(LZO_FLOAT16, LZO_BFLOAT16)
    ADAM_CASE(LZO_FLOAT32, LZO_FLOAT16)
    ADAM_CASE(LZO_BFLOAT16, LZO_FLOAT16)
    ADAM_CASE(LZO_FLOAT16, LZO_FLOAT16)
}

static inline __attribute__((always_inline)) double
accumulate_loop(float *restrict dst, const void *restrict src, int64_t n, int sdt, float scale,
                int mode)
{
    double sumsq = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        float x = load_elem(src, i, sdt) * scale;
        if (mode == LZO_ACC_ADD)
            x = dst[i] + x;
        if (mode != LZO_ACC_READ)
            dst[i] = x;
        sumsq += (double)x * (double)x;
    }
    return sumsq;
}

static double accumulate(float *dst, const void *src, int64_t n, int sdt, float scale, int mode,
                         int stream)
{
    (void)stream; /* portable C has no non-temporal stores */
    switch (sdt) {
    case LZO_BFLOAT16:
        return accumulate_loop(dst, src, n, LZO_BFLOAT16, scale, mode);
    case LZO_FLOAT16:
        return accumulate_loop(dst, src, n, LZO_FLOAT16, scale, mode);
    default:
        return accumulate_loop(dst, src, n, LZO_FLOAT32, scale, mode);
    }
}

#define UNDO_TARGET
#include "undo_body.h"

/* ---- bf16 state (kernels_simd.h, adam_bf16state, documents the rules) ---- */

/* a * b + c rounded once, as the SIMD backends' fused multiply-add, where the CPU has no FMA (the bf16
 * state kernel must give their bits). The product is exact in double; the sum is rounded to odd
 * (round to nearest, then, if inexact and even, step to the neighbour on the side of the exact sum,
 * found with TwoSum), and rounding to odd in 53 bits then to nearest in 24 is correct rounding. */
static inline float fma_exact(float a, float b, float c)
{
    double prod = (double)a * (double)b, s = prod + (double)c, bb = s - prod;
    double err = (prod - (s - bb)) + ((double)c - bb); /* NaN when s is not finite: left alone */
    uint64_t u;
    memcpy(&u, &s, sizeof u);
    if ((err > 0.0 || err < 0.0) && !(u & 1u))
        u += (err > 0.0) == (s > 0.0) ? 1u : (uint64_t)-1;
    memcpy(&s, &u, sizeof s);
    return (float)s;
}

#ifdef FP_FAST_FMAF
#define FMA_EXACT(a, b, c) fmaf(a, b, c)
#else
#define FMA_EXACT(a, b, c) fma_exact(a, b, c)
#endif

static inline uint32_t hash32(uint32_t x) /* lowbias32, as kernels_simd.h */
{
    x = (x ^ (x >> 16)) * 0x7feb352du;
    x = (x ^ (x >> 15)) * 0x846ca68bu;
    return x ^ (x >> 16);
}

static inline uint16_t bf16_stochastic(float x, uint32_t r)
{
    uint32_t u = f32_bits(x);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (uint16_t)((u + r) >> 16);
}

static inline __attribute__((always_inline)) void
adam_bf16_loop(const lzo_adam_consts *c, const lzo_sr_keys *k, uint32_t index, uint16_t *restrict p,
               const void *restrict g, uint16_t *restrict m, uint16_t *restrict v, int64_t n, int gdt)
{
    for (int64_t i = 0; i < n; ++i) {
        float gi = load_elem(g, i, gdt) * c->grad_scale, pi = bf16_to_f32(p[i]);
        if (c->l2 != 0.0f)
            gi = FMA_EXACT(pi, c->l2, gi);
        pi = pi * c->decay;
        float mi = bf16_to_f32(m[i]);
        mi = FMA_EXACT(c->lerp_w, gi - mi, c->lerp_from_end ? gi : mi);
        float vi = FMA_EXACT(c->one_minus_beta2 * gi, gi, bf16_to_f32(v[i]) * c->beta2);
        float denom = FMA_EXACT(sqrtf(vi), c->inv_bc2_sqrt, c->eps);
        pi = FMA_EXACT(c->neg_step_size, mi / denom, pi);
        uint32_t idx = index + (uint32_t)i, hpm = hash32(idx ^ k->pm), hv = hash32((idx >> 1) ^ k->v);
        p[i] = bf16_stochastic(pi, hpm >> 16);
        m[i] = bf16_stochastic(mi, hpm & 0xffffu);
        v[i] = bf16_stochastic(vi, idx & 1u ? hv & 0xffffu : hv >> 16); /* a pair shares one v hash */
    }
}

static void adam_bf16state(const lzo_adam_consts *c, const lzo_sr_keys *k, uint32_t index, uint16_t *p,
                           const void *g, uint16_t *m, uint16_t *v, int64_t n, int gdt, int64_t prefetch)
{
    (void)prefetch; /* the scalar loop is compute-bound: nothing to hide */
    switch (gdt) {
    case LZO_BFLOAT16:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_BFLOAT16);
        return;
    case LZO_FLOAT16:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_FLOAT16);
        return;
    default:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_FLOAT32);
    }
}

const lzo_kernel_table lzo_kernels_scalar = {adam, accumulate, undo, adam_bf16state};
