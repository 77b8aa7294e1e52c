/* The memory roofline of an fp32 Adam step, for the benchmarks: reads p, g, m, v and writes p, m, v
 * (28 B/element) with no arithmetic worth the name, so it runs at the rate memory allows.
 *
 * Not part of the package: benchmarks/roofline.py compiles it on first use. It is the loop the kernels
 * are compared with, so it keeps their shape: the vector width of the backend being measured (the same
 * unaligned loads and stores as native/kernels_avx2.c and kernels_avx512.c; plain C, auto-vectorised,
 * for the portable backend) and the same split of the work over threads as native/dispatch.c. */
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN ((int64_t)1 << 15) /* native/dispatch.c */
#define CHUNK ((int64_t)1 << 16)

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 }; /* native/lzo.h LZO_ISA_* */

/* The elements after the last full vector. */
#define TAIL                                                                                       \
    for (; i < n; ++i) {                                                                           \
        p[i] += g[i];                                                                              \
        m[i] += g[i];                                                                              \
        v[i] += g[i];                                                                              \
    }

static void probe_scalar(float *restrict p, const float *restrict g, float *restrict m,
                         float *restrict v, int64_t n)
{
    for (int64_t i = 0; i < n; ++i) {
        p[i] += g[i];
        m[i] += g[i];
        v[i] += g[i];
    }
}

#if defined(__x86_64__) || defined(__i386__)
__attribute__((target("avx2,fma,f16c"))) static void probe_avx2(float *p, const float *g, float *m,
                                                                 float *v, int64_t n)
{
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_loadu_ps(g + i);
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gi));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
    }
    TAIL
}

__attribute__((target("avx512f"))) static void probe_avx512(float *p, const float *g, float *m,
                                                            float *v, int64_t n)
{
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 gi = _mm512_loadu_ps(g + i);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
    }
    TAIL
}
#endif

/* isa: one the CPU runs (the caller asks the package's kernels which). */
void roofline(int isa, float *p, const float *g, float *m, float *v, int64_t n, int num_threads)
{
    void (*probe)(float *, const float *, float *, float *, int64_t) = probe_scalar;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == ISA_AVX512)
        probe = probe_avx512;
    else if (isa == ISA_AVX2)
        probe = probe_avx2;
#endif
    int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && n >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        int64_t len = n - lo < CHUNK ? n - lo : CHUNK;
        probe(p + lo, g + lo, m + lo, v + lo, len);
    }
}
