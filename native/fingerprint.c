/* A position-weighted checksum of 16-bit words: sum over i of x[i] * (i + 1), modulo 2^64, x read
 * as signed. The engine compares it before and after user code runs to learn whether the device
 * parameters were written (engine/step/param_writes.py): any single changed element or any swap of two
 * different elements changes it. Integer arithmetic, so the result is the same for any thread count
 * and on any backend (torch computes the same sum from row and column sums on accelerators).
 *
 * Blocks of 256 words keep the inner products in 32 bits (|c * x| < 2^23, 256 of them < 2^31), so
 * the compiler vectorises the block loop; the 64-bit weighting happens once per block. */
#include "lzo.h"

#define BLOCK 256
#define PARALLEL_MIN ((int64_t)1 << 18)

/* Cloned per instruction set and picked at load time (GCC function multiversioning): the baseline
 * x86-64 build has no 32-bit vector multiply, so only the AVX2 clone vectorises the block loop. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static uint64_t block_sum(const int16_t *x, int64_t start, int64_t len)
{
    int32_t plain = 0, weighted = 0;
    for (int64_t c = 0; c < len; c++) {
        plain += x[c];
        weighted += (int32_t)c * x[c];
    }
    /* sum of x[c] * (start + c + 1) = (start + 1) * plain + weighted */
    return (uint64_t)(start + 1) * (uint64_t)(int64_t)plain + (uint64_t)(int64_t)weighted;
}

uint64_t lzo_fingerprint16(const void *src, int64_t n, int num_threads)
{
    const int16_t *x = (const int16_t *)src;
    uint64_t total = 0;
    int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel for reduction(+ : total) schedule(static) num_threads(nt) if (nt > 1 && n >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        total += block_sum(x + lo, lo, len);
    }
    return total;
}
