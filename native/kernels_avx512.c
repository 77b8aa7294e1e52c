/* AVX-512F kernels: 16 floats per vector, fp16 through vcvtps2ph/vcvtph2ps, bf16 by integer
 * round-to-nearest-even. Compiled with a per-function target attribute, so this object is safe to
 * load on any x86 CPU; dispatch.c only calls it when the CPU reports avx512f. The last partial
 * vector of a range goes through zero-padded stack buffers, so tails get the same arithmetic. */
#if defined(__x86_64__) || defined(__i386__)
#define LZO_INTERNAL
#include "lzo.h"

#include <immintrin.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f")))
#define INLINE TARGET __attribute__((always_inline)) static inline
#define W 16
#define PREFETCH 512                  /* elements ahead */
#define OUT_ALIGN 32                  /* bytes, for stream stores */
#define STREAM_MIN ((int64_t)1 << 16) /* elements */

INLINE __m512 load_as_f32(const void *src, int64_t i, int dtype)
{
    const uint16_t *h = (const uint16_t *)src + i;
    switch (dtype) {
    case LZO_BFLOAT16:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
    case LZO_FLOAT16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
    default:
        return _mm512_loadu_ps((const float *)src + i);
    }
}

/* Round to nearest even; NaN stays NaN (quieted). */
INLINE __m256i f32_to_bf16(__m512 x)
{
    __m512i u = _mm512_castps_si512(x);
    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                    _mm512_set1_epi32(0x7fff));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* `stream`: non-temporal store (dst must be 32-byte aligned), skipping the read-for-ownership of a
 * line that is only written. */
INLINE void store_low_precision(void *out, int64_t i, __m512 x, int dtype, int stream)
{
    __m256i *dst = (__m256i *)((uint16_t *)out + i);
    __m256i h;
    if (dtype == LZO_BFLOAT16)
        h = f32_to_bf16(x);
    else if (dtype == LZO_FLOAT16)
        h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    else
        return;
    if (stream)
        _mm256_stream_si256(dst, h);
    else
        _mm256_storeu_si256(dst, h);
}

INLINE void adam_vec(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v,
                     void *out, int64_t i, int gdt, int odt, int stream)
{
    __m512 gi = _mm512_mul_ps(load_as_f32(g, i, gdt), _mm512_set1_ps(c->grad_scale));
    __m512 p0 = _mm512_loadu_ps(p + i), pi = p0;
    if (c->l2 != 0.0f)
        gi = _mm512_fmadd_ps(pi, _mm512_set1_ps(c->l2), gi);
    pi = _mm512_mul_ps(pi, _mm512_set1_ps(c->decay));
    __m512 mi = _mm512_loadu_ps(m + i);
    __m512 d = _mm512_sub_ps(gi, mi);
    mi = _mm512_fmadd_ps(_mm512_set1_ps(c->lerp_w), d, c->lerp_from_end ? gi : mi);
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), _mm512_set1_ps(c->beta2));
    vi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c->one_minus_beta2), gi), gi, vi);
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(c->bc2_sqrt)),
                                 _mm512_set1_ps(c->eps));
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c->neg_step_size), mi), denom));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if (c->extrapolate != 0.0f)
        pi = _mm512_fmadd_ps(_mm512_set1_ps(c->extrapolate), _mm512_sub_ps(pi, p0), pi);
    store_low_precision(out, i, pi, odt, stream);
}

/* Fewer than W elements, through zero-padded buffers: the same arithmetic as full vectors. */
INLINE void adam_partial(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v,
                         void *out, int64_t n, int gdt, int odt)
{
    size_t r = (size_t)n, gsz = gdt == LZO_FLOAT32 ? 4 : 2;
    float pb[W] = {0}, gb[W] = {0}, mb[W] = {0}, vb[W] = {0};
    uint16_t ob[W];
    memcpy(pb, p, r * 4);
    memcpy(gb, g, r * gsz);
    memcpy(mb, m, r * 4);
    memcpy(vb, v, r * 4);
    adam_vec(c, pb, gb, mb, vb, ob, 0, gdt, odt, 0);
    memcpy(p, pb, r * 4);
    memcpy(m, mb, r * 4);
    memcpy(v, vb, r * 4);
    if (odt != LZO_NONE)
        memcpy(out, ob, r * 2);
}

/* Software prefetch PREFETCH elements ahead: the division and square root of each vector otherwise
 * keep too few cache misses in flight to saturate memory (measured: ~92% -> ~99% of the probe). */
INLINE void prefetch(const float *p, const void *g, const float *m, const float *v, int64_t i, int gdt)
{
    _mm_prefetch((const char *)(p + i + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)g + (i + PREFETCH) * (gdt == LZO_FLOAT32 ? 4 : 2), _MM_HINT_T0);
    _mm_prefetch((const char *)(m + i + PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(v + i + PREFETCH), _MM_HINT_T0);
}

INLINE void adam_loop(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v,
                      void *out, int64_t n, int gdt, int odt)
{
    int64_t i = 0, gsz = gdt == LZO_FLOAT32 ? 4 : 2;
    /* Stream the low-precision copy of large ranges; a misaligned head goes through the padded path. */
    int stream = odt != LZO_NONE && n >= STREAM_MIN && ((uintptr_t)out & 1) == 0;
    if (stream) {
        i = (int64_t)((OUT_ALIGN - ((uintptr_t)out & (OUT_ALIGN - 1))) & (OUT_ALIGN - 1)) / 2;
        if (i)
            adam_partial(c, p, g, m, v, out, i, gdt, odt);
    }
    for (; i + W <= n; i += W) {
        prefetch(p, g, m, v, i, gdt);
        adam_vec(c, p, g, m, v, out, i, gdt, odt, stream);
    }
    if (i < n)
        adam_partial(c, p + i, (const char *)g + i * gsz, m + i, v + i,
                     out ? (uint16_t *)out + i : NULL, n - i, gdt, odt);
    if (stream)
        _mm_sfence();
}

#define ADAM_CASE(G, O)                                                                           \
    if (gdt == (G) && odt == (O)) {                                                               \
        adam_loop(c, p, g, m, v, out, n, G, O);                                                   \
        return;                                                                                   \
    }

TARGET static void adam(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v,
                        void *out, int64_t n, int gdt, int odt)
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

INLINE void accumulate_vec(float *dst, const void *src, int64_t i, int sdt, __m512 scale,
                           int overwrite, int stream, __m512d *acc_lo, __m512d *acc_hi)
{
    __m512 x = _mm512_mul_ps(load_as_f32(src, i, sdt), scale);
    if (!overwrite)
        x = _mm512_add_ps(_mm512_loadu_ps(dst + i), x);
    if (stream)
        _mm512_stream_ps(dst + i, x);
    else
        _mm512_storeu_ps(dst + i, x);
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    *acc_lo = _mm512_fmadd_pd(lo, lo, *acc_lo);
    *acc_hi = _mm512_fmadd_pd(hi, hi, *acc_hi);
}

/* Fewer than W elements, through zero-padded buffers (zeros add nothing to the sums). */
INLINE void accumulate_partial(float *dst, const void *src, int64_t n, int sdt, __m512 scale,
                               int overwrite, __m512d *acc_lo, __m512d *acc_hi)
{
    size_t r = (size_t)n, ssz = sdt == LZO_FLOAT32 ? 4 : 2;
    float db[W] = {0}, sb[W] = {0};
    memcpy(db, dst, r * 4);
    memcpy(sb, src, r * ssz);
    accumulate_vec(db, sb, 0, sdt, scale, overwrite, 0, acc_lo, acc_hi);
    memcpy(dst, db, r * 4);
}

/* `stream` (overwrite only): dst is only written, so it is stored non-temporally after a head
 * that aligns it. */
INLINE double accumulate_loop(float *dst, const void *src, int64_t n, int sdt, float scale,
                              int overwrite, int stream)
{
    __m512 s = _mm512_set1_ps(scale);
    __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
    int64_t i = 0, ssz = sdt == LZO_FLOAT32 ? 4 : 2;
    stream = stream && overwrite && n >= W && ((uintptr_t)dst & 3) == 0;
    if (stream) {
        i = (int64_t)((64 - ((uintptr_t)dst & 63)) & 63) / 4;
        if (i)
            accumulate_partial(dst, src, i, sdt, s, overwrite, &acc_lo, &acc_hi);
    }
    for (; i + W <= n; i += W)
        accumulate_vec(dst, src, i, sdt, s, overwrite, stream, &acc_lo, &acc_hi);
    if (i < n)
        accumulate_partial(dst + i, (const char *)src + i * ssz, n - i, sdt, s, overwrite, &acc_lo,
                           &acc_hi);
    if (stream)
        _mm_sfence();
    return _mm512_reduce_add_pd(_mm512_add_pd(acc_lo, acc_hi));
}

TARGET static double accumulate(float *dst, const void *src, int64_t n, int sdt, float scale,
                                int overwrite, int stream)
{
    switch (sdt) {
    case LZO_BFLOAT16:
        return accumulate_loop(dst, src, n, LZO_BFLOAT16, scale, overwrite, stream);
    case LZO_FLOAT16:
        return accumulate_loop(dst, src, n, LZO_FLOAT16, scale, overwrite, stream);
    default:
        return accumulate_loop(dst, src, n, LZO_FLOAT32, scale, overwrite, stream);
    }
}

TARGET static void probe(float *p, const float *g, float *m, float *v, int64_t n)
{
    int64_t i = 0;
    for (; i + W <= n; i += W) {
        __m512 gi = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
    }
    for (; i < n; ++i) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

const lzo_kernel_table lzo_kernels_avx512 = {adam, accumulate, probe};
#endif
