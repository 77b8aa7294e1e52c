/* AVX-512F: 16 floats per vector, fp16 through vcvtps2ph/vcvtph2ps. This file is only the vector
 * shim; the kernels are kernels_simd.h. The target attribute keeps the object safe to load on any
 * x86 CPU: dispatch.c calls it only when the CPU reports avx512f. */
#if defined(__x86_64__) || defined(__i386__)
#define LZO_INTERNAL
#include "lzo.h"

#include <immintrin.h>

#define TARGET __attribute__((target("avx512f")))
#define INLINE TARGET __attribute__((always_inline)) static inline
#define W 16
#define KERNEL_TABLE lzo_kernels_avx512
/* the CPUs with AVX-512 (Intel's, AMD's from Zen 4) take a T1 prefetch into L2 only */
#define BF16_L2_AHEAD 4

typedef __m512 vfloat;
typedef __m512i vint;
typedef __m256i vhalf;
typedef __m512d vdouble;

INLINE vfloat vf_load(const float *p) { return _mm512_loadu_ps(p); }
INLINE void vf_store(float *p, vfloat x) { _mm512_storeu_ps(p, x); }
INLINE void vf_stream(float *p, vfloat x) { _mm512_stream_ps(p, x); }
INLINE vfloat vf_set1(float x) { return _mm512_set1_ps(x); }
INLINE vfloat vf_add(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
INLINE vfloat vf_sub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
INLINE vfloat vf_mul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
INLINE vfloat vf_div(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
INLINE vfloat vf_sqrt(vfloat a) { return _mm512_sqrt_ps(a); }
INLINE vfloat vf_fmadd(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vfloat vf_load_f16(const uint16_t *h)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
}

INLINE vint vi_load_u16(const uint16_t *h)
{
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h));
}
INLINE vint vi_from_bits(vfloat x) { return _mm512_castps_si512(x); }
INLINE vfloat vf_from_bits(vint x) { return _mm512_castsi512_ps(x); }
INLINE vint vi_set1(int x) { return _mm512_set1_epi32(x); }
INLINE vint vi_add(vint a, vint b) { return _mm512_add_epi32(a, b); }
INLINE vint vi_and(vint a, vint b) { return _mm512_and_si512(a, b); }
INLINE vint vi_or(vint a, vint b) { return _mm512_or_si512(a, b); }
INLINE vint vi_shl16(vint a) { return _mm512_slli_epi32(a, 16); }
INLINE vint vi_shr16(vint a) { return _mm512_srli_epi32(a, 16); }
INLINE vint vi_shr15(vint a) { return _mm512_srli_epi32(a, 15); }
INLINE vint vi_shr1(vint a) { return _mm512_srli_epi32(a, 1); }
INLINE vint vi_xor(vint a, vint b) { return _mm512_xor_si512(a, b); }
INLINE vint vi_mullo(vint a, vint b) { return _mm512_mullo_epi32(a, b); }
INLINE vint vi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
INLINE vint vi_nan_select(vfloat x, vint if_nan, vint otherwise)
{
    return _mm512_mask_mov_epi32(otherwise, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), if_nan);
}
/* one masked add instead of an add and a select */
INLINE vint vi_add_bits_unless_nan(vfloat x, vint r, vint if_nan)
{
    return _mm512_mask_add_epi32(if_nan, _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_castps_si512(x), r);
}
/* (a ^ b) & c in one ternary-logic op; a NaN in a or b in one compare */
INLINE vint vi_xor_and(vint a, vint b, vint c) { return _mm512_ternarylogic_epi32(a, b, c, 0x28); }
INLINE int vf_any_nan2(vfloat a, vfloat b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0; }
INLINE vhalf vi_narrow_u16(vint a) { return _mm512_cvtepi32_epi16(a); }

INLINE vint vi_load_words(const uint16_t *p) { return _mm512_loadu_si512(p); }
INLINE void vi_store_words(uint16_t *p, vint a) { _mm512_storeu_si512(p, a); }
/* (a >> 16) | (b & 0xffff0000) in one ternary-logic op (AVX-512F has no 16-bit blend) */
INLINE vint vi_merge_high(vint a, vint b)
{
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, _mm512_set1_epi32((int)0xffff0000u), 0xf8);
}
INLINE void vf_even_odd(vfloat a, vfloat b, vfloat *even, vfloat *odd)
{
    const __m512i e = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    *even = _mm512_permutex2var_ps(a, e, b);
    *odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(e, _mm512_set1_epi32(1)), b);
}

INLINE void vh_store(uint16_t *p, vhalf h) { _mm256_storeu_si256((__m256i *)p, h); }
INLINE void vh_stream(uint16_t *p, vhalf h) { _mm256_stream_si256((__m256i *)p, h); }
INLINE vhalf vh_from_f32_f16(vfloat x)
{
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

INLINE vdouble vd_zero(void) { return _mm512_setzero_pd(); }
INLINE vdouble vd_from_low(vfloat x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
INLINE vdouble vd_from_high(vfloat x)
{
    return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
INLINE vdouble vd_add(vdouble a, vdouble b) { return _mm512_add_pd(a, b); }
INLINE vdouble vd_fmadd(vdouble a, vdouble b, vdouble c) { return _mm512_fmadd_pd(a, b, c); }
INLINE double vd_sum(vdouble a) { return _mm512_reduce_add_pd(a); }

#include "kernels_simd.h"
#endif
