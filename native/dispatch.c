/* The one dispatch point: instruction-set selection, per-tensor Adam constants and the split of
 * work over threads.
 *
 * Threads claim fixed pieces of work dynamically (OpenMP schedule(dynamic)): on a shared machine a
 * descheduled thread then delays only the piece it holds, where a static split would make the
 * whole call wait for it.
 *
 * Determinism: the Adam step is elementwise and every lane gets the same arithmetic (tails go
 * through padded vectors), so any split gives identical bits. The sum of squares in
 * grad_accumulate is reduced over blocks whose size depends only on n, and the block partials are
 * added in block order, so it is also identical for any thread count. */
#define LZO_INTERNAL
#include "lzo.h"

#include <math.h>
#include <stdlib.h>
#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h> /* sysconf: the L1 size, where the C library knows it */
#endif

/* Below this many elements one thread is faster than waking a team. */
#define PARALLEL_MIN ((int64_t)1 << 15)
/* Elements per piece of work a thread claims: 256 KiB of every fp32 stream. */
#define CHUNK ((int64_t)1 << 16)
/* The bf16-state step's pieces grow up to this, keeping 4 per thread: a thread's software prefetches run
 * 2-4 KiB ahead in each stream (on AVX-512 four times that into L2), and every piece it claims away from
 * its last one starts without them. */
#define CHUNK_BF16_MAX ((int64_t)1 << 18)
/* grad_accumulate: at most this many blocks of at least BLOCK_MIN elements. */
#define MAX_BLOCKS 1024
#define BLOCK_MIN ((int64_t)1 << 14)
/* grad_accumulate overwriting at least this many elements (1 MiB, beyond the caches that matter)
 * stores dst non-temporally: it is only written, so reading it into the cache first is waste. */
#define STREAM_MIN ((int64_t)1 << 18)

static const lzo_kernel_table *active = &lzo_kernels_scalar;

int lzo_isa_supported(int isa)
{
    switch (isa) {
    case LZO_ISA_SCALAR:
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    case LZO_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    case LZO_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f");
#endif
    default:
        return 0;
    }
}

int lzo_set_isa(int isa)
{
    if (!lzo_isa_supported(isa))
        return -1;
    switch (isa) {
#if defined(__x86_64__) || defined(__i386__)
    case LZO_ISA_AVX512:
        active = &lzo_kernels_avx512;
        break;
    case LZO_ISA_AVX2:
        active = &lzo_kernels_avx2;
        break;
#endif
    default:
        active = &lzo_kernels_scalar;
    }
    return 0;
}

int lzo_has_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static int element_size(int dtype) { return dtype == LZO_FLOAT32 ? 4 : 2; }

/* Scalars are computed in double and rounded to float once, in torch's order of operations. */
static lzo_adam_consts adam_consts(const lzo_adam_hparams *hp, double grad_scale, double extrapolate,
                                   double step)
{
    lzo_adam_consts c;
    double bc1 = 1.0 - pow(hp->beta1, step);
    double bc2 = 1.0 - pow(hp->beta2, step);
    float w = (float)(1.0 - hp->beta1);
    c.grad_scale = (float)(hp->maximize ? -grad_scale : grad_scale);
    c.l2 = hp->adamw_mode ? 0.0f : (float)hp->weight_decay;
    c.decay = hp->adamw_mode && hp->weight_decay != 0.0 ? (float)(1.0 - hp->lr * hp->weight_decay)
                                                        : 1.0f;
    c.lerp_from_end = !(w < 0.5f);
    c.lerp_w = c.lerp_from_end ? w - 1.0f : w;
    c.beta2 = (float)hp->beta2;
    c.one_minus_beta2 = (float)(1.0 - hp->beta2);
    c.bc2_sqrt = (float)pow(bc2, 0.5);
    c.inv_bc2_sqrt = (float)(1.0 / pow(bc2, 0.5));
    c.neg_step_size = (float)(-(hp->lr / bc1));
    c.eps = (float)hp->eps;
    c.extrapolate = (float)extrapolate;
    return c;
}

/* The step number this call uses for t: `step`, or the counter plus one (in float32, as torch
 * counts). Counters are stored back only after the update, so every thread reads the same value. */
static double next_step(const lzo_adam_tensor *t)
{
    if (!t->step_counter)
        return (double)t->step;
    return (double)(*(const float *)(intptr_t)t->step_counter + 1.0f);
}

/* lzo_adam_undo's constants for a step made with these arguments. */
static lzo_undo_consts undo_consts(const lzo_adam_hparams *hp, double grad_scale, double step)
{
    /* the step's own constants, rounded as the step rounded them; divisions become multiplications */
    lzo_adam_consts a = adam_consts(hp, grad_scale, 0.0, step);
    double w = (float)(1.0 - hp->beta1);
    lzo_undo_consts c;
    c.neg_step_size = a.neg_step_size;
    c.inv_bc2_sqrt = 1.0 / a.bc2_sqrt;
    c.eps = a.eps;
    c.inv_decay = 1.0 / a.decay; /* the caller refuses decay == 0 (kernels.can_undo) */
    c.l2 = a.l2;
    c.w = w;
    c.inv_one_minus_w = w != 1.0 ? 1.0 / (1.0 - w) : 0.0;
    c.one_minus_beta2 = a.one_minus_beta2;
    c.inv_beta2 = a.beta2 != 0.0f ? 1.0 / a.beta2 : 0.0;
    c.scale = a.grad_scale;
    return c;
}

/* Work on tensor j's elements [a, b) of one chunk: the Adam step, its undo, or the sum of squares. */
enum { CHUNK_ADAM, CHUNK_UNDO, CHUNK_SUMSQ };

static double chunk_part(int what, const lzo_adam_hparams *hp, double grad_scale,
                         const lzo_adam_consts *consts, const lzo_adam_tensor *t, int64_t a, int64_t b,
                         int grad_dtype, int out_dtype)
{
    const lzo_kernel_table *k = active;
    int64_t gsz = element_size(grad_dtype);
    const char *g = (const char *)(intptr_t)t->grad + a * gsz;
    float *p = (float *)(intptr_t)t->param + a, *m = (float *)(intptr_t)t->exp_avg + a;
    float *v = (float *)(intptr_t)t->exp_avg_sq + a;
    if (what == CHUNK_SUMSQ)
        return k->accumulate(NULL, g, b - a, grad_dtype, 1.0f, LZO_ACC_READ, 0);
    if (what == CHUNK_UNDO) {
        lzo_undo_consts c = undo_consts(hp, grad_scale, next_step(t));
        k->undo(&c, p, (const float *)g, m, v, b - a);
        return 0.0;
    }
    void *out = out_dtype == LZO_NONE ? NULL : (uint16_t *)(intptr_t)t->param_out + a;
    k->adam(consts, p, g, m, v, out, b - a, grad_dtype, out_dtype);
    return 0.0;
}

/* Apply `what` to the parts of every tensor that lie in chunk [lo, hi) of the concatenation; *i and
 * *start are the caller's cursor (tensor i starts at element start), which only moves forward. */
static double chunk_apply(int what, const lzo_adam_hparams *hp, double grad_scale,
                          const lzo_adam_consts *consts, const lzo_adam_tensor *tensors, size_t count,
                          size_t *i, int64_t *start, int64_t lo, int64_t hi, int grad_dtype,
                          int out_dtype)
{
    double sumsq = 0.0;
    while (*start + tensors[*i].numel <= lo)
        *start += tensors[(*i)++].numel;
    int64_t s = *start;
    for (size_t j = *i; j < count && s < hi; s += tensors[j++].numel) {
        int64_t a = lo > s ? lo - s : 0, b = hi - s < tensors[j].numel ? hi - s : tensors[j].numel;
        if (a < b)
            sumsq += chunk_part(what, hp, grad_scale, consts ? &consts[j] : NULL, &tensors[j], a, b,
                                grad_dtype, out_dtype);
    }
    return sumsq;
}

/* Every tensor's constants, computed once per call (3 pow() each) rather than per piece of work. */
static lzo_adam_consts *consts_table(const lzo_adam_hparams *hp, double grad_scale, double extrapolate,
                                     const lzo_adam_tensor *tensors, size_t count)
{
    lzo_adam_consts *c = malloc((count ? count : 1) * sizeof(lzo_adam_consts));
    for (size_t i = 0; c && i < count; ++i)
        c[i] = adam_consts(hp, grad_scale, extrapolate, next_step(&tensors[i]));
    return c;
}

static int64_t check_steps(const lzo_adam_tensor *tensors, size_t count, int64_t *total)
{
    *total = 0;
    for (size_t i = 0; i < count; ++i) {
        if (!(next_step(&tensors[i]) >= 1.0)) /* also catches a NaN counter */
            return (int64_t)i + 1;
        *total += tensors[i].numel;
    }
    return 0;
}

static void advance_counters(const lzo_adam_tensor *tensors, size_t count)
{
    for (size_t i = 0; i < count; ++i)
        if (tensors[i].step_counter)
            *(float *)(intptr_t)tensors[i].step_counter += 1.0f;
}

int64_t lzo_adam_step(const lzo_adam_hparams *hp, double grad_scale, double extrapolate,
                      const lzo_adam_tensor *tensors, size_t count, int grad_dtype, int out_dtype,
                      int num_threads)
{
    int64_t total, bad = check_steps(tensors, count, &total);
    if (bad)
        return bad;
    lzo_adam_consts *consts = consts_table(hp, grad_scale, extrapolate, tensors, count);
    if (!consts)
        return -2;
    int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1 && total >= PARALLEL_MIN)
    {
        size_t i = 0;
        int64_t start = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t chunk = 0; chunk < (total + CHUNK - 1) / CHUNK; ++chunk) {
            int64_t lo = chunk * CHUNK, hi = lo + CHUNK < total ? lo + CHUNK : total;
            chunk_apply(CHUNK_ADAM, hp, grad_scale, consts, tensors, count, &i, &start, lo, hi,
                        grad_dtype, out_dtype);
        }
    }
    free(consts);
    advance_counters(tensors, count);
    return 0;
}

/* Elements a checked step sums, then updates, at a time: 8 KiB of fp32 gradients, still in L1 when
 * the update reads them again (benchmarks/cpu_adam.py, "ours checked" against "ours sum+step"). */
#define CHECK_BLOCK ((int64_t)1 << 11)

/* Sum and then update [lo, hi) block by block until a block's sum is not finite. Returns how many
 * elements from lo were updated (hi - lo if all); *sumsq receives the sum of the blocks seen. */
static int64_t chunk_checked(const lzo_adam_hparams *hp, double grad_scale,
                             const lzo_adam_consts *consts, const lzo_adam_tensor *tensors,
                             size_t count, size_t *i, int64_t *start, int64_t lo, int64_t hi,
                             double *sumsq)
{
    *sumsq = 0.0;
    for (int64_t a = lo; a < hi; a += CHECK_BLOCK) {
        int64_t b = a + CHECK_BLOCK < hi ? a + CHECK_BLOCK : hi;
        double s = chunk_apply(CHUNK_SUMSQ, hp, grad_scale, NULL, tensors, count, i, start, a, b,
                               LZO_FLOAT32, LZO_NONE);
        *sumsq += s;
        if (!isfinite(s))
            return a - lo;
        chunk_apply(CHUNK_ADAM, hp, grad_scale, consts, tensors, count, i, start, a, b, LZO_FLOAT32,
                    LZO_NONE);
    }
    return hi - lo;
}

int64_t lzo_adam_step_checked(const lzo_adam_hparams *hp, double grad_scale,
                              const lzo_adam_tensor *tensors, size_t count, int num_threads,
                              double *sumsq)
{
    int64_t total, bad = check_steps(tensors, count, &total);
    if (bad)
        return bad;
    int64_t nchunks = (total + CHUNK - 1) / CHUNK;
    double *sums = calloc((size_t)nchunks + 1, sizeof(double));
    int64_t *updated = calloc((size_t)nchunks + 1, sizeof(int64_t)); /* elements updated per chunk */
    lzo_adam_consts *consts = consts_table(hp, grad_scale, 0.0, tensors, count);
    if (!sums || !updated || !consts) {
        free(sums);
        free(updated);
        free(consts);
        return -2;
    }
    int nt = num_threads > 1 ? num_threads : 1, stop = 0;
#pragma omp parallel num_threads(nt) if (nt > 1 && total >= PARALLEL_MIN)
    {
        size_t i = 0;
        int64_t start = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
            int stopped;
#pragma omp atomic read
            stopped = stop;
            if (stopped)
                continue;
            int64_t lo = chunk * CHUNK, hi = lo + CHUNK < total ? lo + CHUNK : total;
            updated[chunk] =
                chunk_checked(hp, grad_scale, consts, tensors, count, &i, &start, lo, hi, &sums[chunk]);
            if (updated[chunk] < hi - lo) {
#pragma omp atomic write
                stop = 1;
            }
        }
    }
    double total_sumsq = 0.0;
    for (int64_t chunk = 0; chunk < nchunks; ++chunk)
        total_sumsq += sums[chunk];
    *sumsq = stop ? INFINITY : total_sumsq;
    if (stop) { /* a gradient holds inf/nan: take back what was updated before that was seen */
#pragma omp parallel num_threads(nt) if (nt > 1 && total >= PARALLEL_MIN)
        {
            size_t i = 0;
            int64_t start = 0;
#pragma omp for schedule(dynamic, 1)
            for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
                if (updated[chunk] > 0)
                    chunk_apply(CHUNK_UNDO, hp, grad_scale, NULL, tensors, count, &i, &start,
                                chunk * CHUNK, chunk * CHUNK + updated[chunk], LZO_FLOAT32, LZO_NONE);
            }
        }
    } else {
        advance_counters(tensors, count);
    }
    free(sums);
    free(updated);
    free(consts);
    return stop ? -1 : 0;
}

/* The block split depends only on n, and block partials are added in block order: the sum is the
 * same for any thread count, and the same for lzo_sum_squares as for an overwriting accumulate. */
static double blocked_accumulate(float *dst, const void *src, int64_t n, int src_dtype, float scale,
                                 int mode, int num_threads)
{
    const lzo_kernel_table *k = active;
    int64_t block = (n + MAX_BLOCKS - 1) / MAX_BLOCKS;
    block = block < BLOCK_MIN ? BLOCK_MIN : (block + 63) / 64 * 64;
    int64_t nblocks = (n + block - 1) / block, ssz = element_size(src_dtype);
    double partial[MAX_BLOCKS];
    int nt = num_threads > 1 ? num_threads : 1, stream = n >= STREAM_MIN;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && nblocks > 1)
    for (int64_t b = 0; b < nblocks; ++b) {
        int64_t start = b * block, len = n - start < block ? n - start : block;
        partial[b] = k->accumulate(dst ? dst + start : NULL, (const char *)src + start * ssz, len,
                                   src_dtype, scale, mode, stream);
    }
    double sumsq = 0.0;
    for (int64_t b = 0; b < nblocks; ++b)
        sumsq += partial[b];
    return sumsq;
}

double lzo_grad_accumulate(float *dst, const void *src, int64_t n, int src_dtype, float scale,
                           int overwrite, int num_threads)
{
    return blocked_accumulate(dst, src, n, src_dtype, scale,
                              overwrite ? LZO_ACC_OVERWRITE : LZO_ACC_ADD, num_threads);
}

double lzo_sum_squares(const void *src, int64_t n, int src_dtype, int num_threads)
{
    return blocked_accumulate(NULL, src, n, src_dtype, 1.0f, LZO_ACC_READ, num_threads);
}

void lzo_adam_undo(const lzo_adam_hparams *hp, double grad_scale, double step, float *p,
                   const float *g, float *m, float *v, int64_t n, int num_threads)
{
    const lzo_kernel_table *k = active;
    lzo_undo_consts c = undo_consts(hp, grad_scale, step);
    int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && n >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < n; lo += CHUNK) {
        int64_t len = n - lo < CHUNK ? n - lo : CHUNK;
        k->undo(&c, p + lo, g + lo, m + lo, v + lo, len);
    }
}

/* The bf16-state step's prefetch distance into L1 (the AVX-512 backend prefetches four times as far
 * into L2: BF16_L2_AHEAD in kernels_simd.h). Lines in flight: 8 bytes per element over the four streams
 * with a bf16 gradient (10 with fp32), kept within a third of the L1 data cache, in whole lines, from
 * 512 (the fp32 step's distance) to 2048 elements (the farthest measured to help: on a 48 KiB L1 4096
 * was slower; on a 32 KiB L1 2048 already was). */
#define BF16_PREFETCH_MIN 512
#define BF16_PREFETCH_MAX 2048
#define BF16_PREFETCH_LIMIT ((int64_t)1 << 20) /* what lzo_set_bf16_prefetch accepts: 2 MiB of a stream */
#define L1D_UNKNOWN 32768 /* the smallest L1 data cache of the x86 cores the SIMD backends run on */

static int64_t bf16_prefetch = -1; /* -1: the default, chosen on first use */

static int64_t default_bf16_prefetch(void)
{
    long l1 = -1;
#ifdef _SC_LEVEL1_DCACHE_SIZE
    l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE);
#endif
    int64_t ahead = (int64_t)(l1 > 0 ? l1 : L1D_UNKNOWN) / 3 / 8 & ~(int64_t)31;
    return ahead < BF16_PREFETCH_MIN ? BF16_PREFETCH_MIN : ahead > BF16_PREFETCH_MAX ? BF16_PREFETCH_MAX : ahead;
}

int64_t lzo_bf16_prefetch(void)
{
    if (bf16_prefetch < 0)
        bf16_prefetch = default_bf16_prefetch();
    return bf16_prefetch;
}

int64_t lzo_set_bf16_prefetch(int64_t elements)
{
    if (elements > BF16_PREFETCH_LIMIT)
        elements = BF16_PREFETCH_LIMIT;
    bf16_prefetch = elements < 0 ? default_bf16_prefetch() : elements & ~(int64_t)31;
    return bf16_prefetch;
}

/* splitmix64's finalizer: the keys of the bf16-state step's hash (kernels/reference.py _sr_keys mirrors it). */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static lzo_sr_keys sr_keys(uint64_t seed, int64_t step, uint64_t high)
{
    uint64_t z = mix64(mix64(mix64(seed + 0x9e3779b97f4a7c15u) + (uint64_t)step) + high);
    lzo_sr_keys k = {(uint32_t)z, (uint32_t)(z >> 32)};
    return k;
}

void lzo_adam_step_bf16state(const lzo_adam_hparams *hp, double grad_scale, uint64_t seed, int64_t step,
                             int64_t offset, uint16_t *p, const void *g, uint16_t *m, uint16_t *v,
                             int64_t n, int grad_dtype, int num_threads)
{
    const lzo_kernel_table *k = active;
    lzo_adam_consts c = adam_consts(hp, grad_scale, 0.0, (double)step);
    int64_t gsz = element_size(grad_dtype), ahead = lzo_bf16_prefetch();
    int nt = num_threads > 1 ? num_threads : 1;
    int64_t piece = n / (4 * nt) & ~(int64_t)63;
    piece = piece < CHUNK ? CHUNK : piece > CHUNK_BF16_MAX ? CHUNK_BF16_MAX : piece;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && n >= PARALLEL_MIN)
    for (int64_t lo = 0; lo < n; lo += piece) {
        int64_t hi = n - lo < piece ? n : lo + piece;
        /* the kernel counts indices in 32 bits: cut where the high half of the global index changes */
        for (int64_t a = lo, b; a < hi; a = b) {
            uint64_t index = (uint64_t)offset + (uint64_t)a, high = index >> 32;
            uint64_t room = ((high + 1) << 32) - index;
            b = (uint64_t)(hi - a) < room ? hi : a + (int64_t)room;
            lzo_sr_keys keys = sr_keys(seed, step, high);
            k->adam_bf16state(&c, &keys, (uint32_t)index, p + a, (const char *)g + a * gsz, m + a, v + a,
                              b - a, grad_dtype, ahead);
        }
    }
}
