/* AVX2 + FMA + F16C: 8 floats per vector, fp16 through vcvtps2ph/vcvtph2ps. This file is only the
 * vector shim; the kernels are kernels_simd.h. The target attribute keeps the object safe to load
 * on any x86 CPU: dispatch.c calls it only when the CPU reports avx2, fma and f16c. */
#if defined(__x86_64__) || defined(__i386__)
#define LZO_INTERNAL
#include "lzo.h"

#include <immintrin.h>

#define TARGET __attribute__((target("avx2,fma,f16c")))
#define INLINE TARGET __attribute__((always_inline)) static inline
#define W 8
#define KERNEL_TABLE lzo_kernels_avx2
/* no L2 prefetch: AMD's cores before Zen 4, most of this shim's servers, fill L1 on a T1 hint */
#define BF16_L2_AHEAD 0

typedef __m256 vfloat;
typedef __m256i vint;
typedef __m128i vhalf;
typedef __m256d vdouble;

INLINE vfloat vf_load(const float *p) { return _mm256_loadu_ps(p); }
INLINE void vf_store(float *p, vfloat x) { _mm256_storeu_ps(p, x); }
INLINE void vf_stream(float *p, vfloat x) { _mm256_stream_ps(p, x); }
INLINE vfloat vf_set1(float x) { return _mm256_set1_ps(x); }
INLINE vfloat vf_add(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
INLINE vfloat vf_sub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
INLINE vfloat vf_mul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
INLINE vfloat vf_div(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
INLINE vfloat vf_sqrt(vfloat a) { return _mm256_sqrt_ps(a); }
INLINE vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vfloat vf_load_f16(const uint16_t *h)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
}

INLINE vint vi_load_u16(const uint16_t *h)
{
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
}
INLINE vint vi_from_bits(vfloat x) { return _mm256_castps_si256(x); }
INLINE vfloat vf_from_bits(vint x) { return _mm256_castsi256_ps(x); }
INLINE vint vi_set1(int x) { return _mm256_set1_epi32(x); }
INLINE vint vi_add(vint a, vint b) { return _mm256_add_epi32(a, b); }
INLINE vint vi_and(vint a, vint b) { return _mm256_and_si256(a, b); }
INLINE vint vi_or(vint a, vint b) { return _mm256_or_si256(a, b); }
INLINE vint vi_shl16(vint a) { return _mm256_slli_epi32(a, 16); }
INLINE vint vi_shr16(vint a) { return _mm256_srli_epi32(a, 16); }
INLINE vint vi_shr15(vint a) { return _mm256_srli_epi32(a, 15); }
INLINE vint vi_shr1(vint a) { return _mm256_srli_epi32(a, 1); }
INLINE vint vi_xor(vint a, vint b) { return _mm256_xor_si256(a, b); }
INLINE vint vi_mullo(vint a, vint b) { return _mm256_mullo_epi32(a, b); }
INLINE vint vi_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vint vi_nan_select(vfloat x, vint if_nan, vint otherwise)
{
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(otherwise, if_nan, _mm256_castps_si256(nan));
}
INLINE vint vi_add_bits_unless_nan(vfloat x, vint r, vint if_nan)
{
    return vi_nan_select(x, if_nan, _mm256_add_epi32(_mm256_castps_si256(x), r));
}
INLINE vint vi_xor_and(vint a, vint b, vint c) { return _mm256_and_si256(_mm256_xor_si256(a, b), c); }
INLINE int vf_any_nan2(vfloat a, vfloat b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q)) != 0; }
/* every lane is <= 0xffff, so unsigned saturation packs exactly */
INLINE vhalf vi_narrow_u16(vint a)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}

INLINE vint vi_load_words(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE void vi_store_words(uint16_t *p, vint a) { _mm256_storeu_si256((__m256i *)p, a); }
INLINE vint vi_merge_high(vint a, vint b) { return _mm256_blend_epi16(_mm256_srli_epi32(a, 16), b, 0xaa); }
/* in-lane shuffles after one 128-bit swap: [a0..3 b0..3 | a4..7 b4..7] -> evens and odds */
INLINE void vf_even_odd(vfloat a, vfloat b, vfloat *even, vfloat *odd)
{
    vfloat lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31);
    *even = _mm256_shuffle_ps(lo, hi, 0x88);
    *odd = _mm256_shuffle_ps(lo, hi, 0xdd);
}

INLINE void vh_store(uint16_t *p, vhalf h) { _mm_storeu_si128((__m128i *)p, h); }
INLINE void vh_stream(uint16_t *p, vhalf h) { _mm_stream_si128((__m128i *)p, h); }
INLINE vhalf vh_from_f32_f16(vfloat x)
{
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

INLINE vdouble vd_zero(void) { return _mm256_setzero_pd(); }
INLINE vdouble vd_from_low(vfloat x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
INLINE vdouble vd_from_high(vfloat x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
INLINE vdouble vd_add(vdouble a, vdouble b) { return _mm256_add_pd(a, b); }
INLINE vdouble vd_fmadd(vdouble a, vdouble b, vdouble c) { return _mm256_fmadd_pd(a, b, c); }
INLINE double vd_sum(vdouble a)
{
    __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
}

#include "kernels_simd.h"
#endif
