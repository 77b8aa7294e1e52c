/* C API of the lightning_zero_offload CPU kernels.
 *
 * The part above LZO_INTERNAL is also the cffi cdef (native/build.py drops the preprocessor lines),
 * so it holds only plain declarations. Pointers are raw tensor storage: the Python layer checks
 * devices, dtypes, sizes and contiguity before calling, and the kernels trust it.
 */
#ifndef LZO_H
#define LZO_H

#include <stddef.h>
#include <stdint.h>

/* Element types of gradients and of the low-precision param copy (LZO_NONE: no copy). */
enum { LZO_NONE = -1, LZO_FLOAT32 = 0, LZO_BFLOAT16 = 1, LZO_FLOAT16 = 2 };

/* Instruction-set paths. One shared object holds all of them; Python selects one at import. */
enum { LZO_ISA_SCALAR = 0, LZO_ISA_AVX2 = 1, LZO_ISA_AVX512 = 2 };

/* The hyperparameters of one Adam/AdamW param group: kernels.AdamArgs, field for field. */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int adamw_mode, maximize;
} lzo_adam_hparams;

int lzo_isa_supported(int isa); /* 1 if this CPU can run the path */
int lzo_set_isa(int isa);       /* 0 on success, -1 if unsupported */
int lzo_has_openmp(void);       /* 0: built without OpenMP, num_threads is ignored */

/* One tensor of an Adam call. Addresses are integers so that Python can build the whole table in
 * one allocation. param_out is 0 when there is no low-precision copy. The step number is `step`,
 * or, if step_counter is not 0, the float32 count at that address (torch's state["step"]) plus one,
 * which the call stores back: optimizers then need no per-tensor Python work to count steps. */
typedef struct {
    int64_t param, grad, exp_avg, exp_avg_sq, param_out;
    int64_t numel, step, step_counter;
} lzo_adam_tensor;

/* One Adam/AdamW step over `count` tensors, all with grads of grad_dtype, each multiplied by
 * grad_scale first. If out_dtype is not LZO_NONE, every param_out receives the updated param
 * rounded to nearest even, in the same pass; with extrapolate not 0 it receives
 * p_new + extrapolate * (p_new - p_old) instead, the weights predicted one update ahead (Delayed
 * Parameter Update's weight prediction).
 * Returns 0, i + 1 if tensor i's step number is below 1, or -2 if out of memory (then nothing was
 * changed). */
int64_t lzo_adam_step(const lzo_adam_hparams *hp, double grad_scale, double extrapolate,
                      const lzo_adam_tensor *tensors, size_t count, int grad_dtype, int out_dtype,
                      int num_threads);

/* lzo_adam_step for fp32 grads without a low-precision copy, applied only if every gradient is
 * finite: each 256 KiB chunk of gradients is summed (squares) as it is brought into cache and then
 * updated from there, so the gradient norm and the inf/nan check cost no pass over memory of their
 * own. *sumsq receives the sum of squares of the gradients (inf if one is not finite). Returns 0
 * (applied, counters advanced), i + 1 (tensor i's step number is below 1; nothing changed), -1 (a
 * gradient is inf/nan: the chunks updated before that was seen are taken back with the undo, to
 * within about one fp32 ulp, and no counter moves) or -2 (out of memory; nothing changed).
 * The caller ensures the step can be undone (no AdamW decay of exactly 1). */
int64_t lzo_adam_step_checked(const lzo_adam_hparams *hp, double grad_scale,
                              const lzo_adam_tensor *tensors, size_t count, int num_threads,
                              double *sumsq);

/* dst = src * scale (overwrite) or dst + src * scale. Returns the sum of squares of the new dst,
 * accumulated in double in fixed blocks (same result for any thread count). It is finite exactly
 * when every element of dst is finite: a finite float squared is below 2^256. */
double lzo_grad_accumulate(float *dst, const void *src, int64_t n, int src_dtype, float scale,
                           int overwrite, int num_threads);

/* The sum of squares of src, exactly as lzo_grad_accumulate(overwrite, scale 1) would return it
 * for the same n, without writing anything: the norm of a gradient that stays where it is. */
double lzo_sum_squares(const void *src, int64_t n, int src_dtype, int num_threads);

/* Take one lzo_adam_step with fp32 grads and this step number back, in place (native/undo_body.h):
 * p, m and v return to within about one fp32 ulp of their values before the step. */
void lzo_adam_undo(const lzo_adam_hparams *hp, double grad_scale, double step, float *p,
                   const float *g, float *m, float *v, int64_t n, int num_threads);

/* One Adam/AdamW step on bf16 state (native/kernels_simd.h, adam_bf16state): p, m and v are bf16,
 * widened to fp32 and updated exactly as lzo_adam_step computes (same constants, same operations),
 * then stored back in place with stochastic rounding: 16 random bits added below the kept mantissa,
 * then truncated. The bits are a counter-based hash of (seed, step, offset + i), element i being the
 * global element offset + i, so any split over calls or threads and every instruction set give the
 * same bits. NaN is stored as the quiet NaN 0x7fc0; inf stays inf; a finite value becomes inf only
 * if it lies above the largest finite bf16, with the probability of rounding up. step >= 1, offset >= 0
 * (the caller checks). grad_dtype: LZO_FLOAT32, LZO_BFLOAT16 or LZO_FLOAT16. */
void lzo_adam_step_bf16state(const lzo_adam_hparams *hp, double grad_scale, uint64_t seed, int64_t step,
                             int64_t offset, uint16_t *p, const void *g, uint16_t *m, uint16_t *v,
                             int64_t n, int grad_dtype, int num_threads);

/* Elements of each stream the bf16-state step prefetches ahead into L1 (the AVX2 and AVX-512 backends;
 * the scalar one does not prefetch); the AVX-512 one also four times as far ahead into L2. The default
 * keeps the four streams' lines in flight within a third of the L1 data cache: further ahead, lines are
 * evicted before they are used (docs/kernels.md, "bf16 state against the fp32-state step").
 * lzo_set_bf16_prefetch sets it, rounded down to whole 64-byte lines of bf16, at most 2^20 (0: no
 * software prefetch); a negative value restores the default. Both return the value in effect. The
 * results do not depend on it. */
int64_t lzo_bf16_prefetch(void);
int64_t lzo_set_bf16_prefetch(int64_t elements);

/* Position-weighted checksum of n 16-bit words, sum of x[i] * (i + 1) mod 2^64 with x signed
 * (native/fingerprint.c): tells whether device parameters were written between two points. */
uint64_t lzo_fingerprint16(const void *src, int64_t n, int num_threads);

#ifdef LZO_INTERNAL
/* Per-tensor Adam constants, rounded to float once, the way torch rounds its Python scalars. */
typedef struct {
    float grad_scale;   /* negated for maximize */
    float l2;           /* Adam: g += l2 * p (0: off) */
    float decay;        /* AdamW: p *= decay (1: off) */
    float lerp_w;       /* m = lerp(m, g, 1 - beta1), torch's two-sided formula */
    int lerp_from_end;  /* 1 - beta1 >= 0.5: m = g + (1 - beta1 - 1) * (g - m) */
    float beta2, one_minus_beta2, bc2_sqrt, neg_step_size, eps;
    float inv_bc2_sqrt; /* bf16 state: denom = sqrt(v) * inv_bc2_sqrt + eps, one division fewer */
    float extrapolate;  /* param_out = p_new + extrapolate * (p_new - p_old) (0: off) */
} lzo_adam_consts;

/* lzo_adam_undo's constants: the step's, rounded to float as the step rounds them, then widened;
 * divisions by them are multiplications by their double reciprocals. */
typedef struct {
    double neg_step_size, inv_bc2_sqrt, eps, inv_decay, l2, w, inv_one_minus_w, one_minus_beta2, inv_beta2;
    float scale;
} lzo_undo_consts;

/* The hash keys of one piece of a bf16-state step (from seed, step and the high 32 bits of the
 * global element index): the p and m bits are the two halves of lowbias32(index ^ pm), the v bits one
 * half of lowbias32((index >> 1) ^ v), which elements 2k and 2k + 1 share (the high half for the even
 * one). */
typedef struct {
    uint32_t pm, v;
} lzo_sr_keys;

/* What accumulate does with dst: dst += src * scale, dst = src * scale, or nothing (dst is not
 * read or written, only the sum of squares of src * scale is returned). */
enum { LZO_ACC_ADD = 0, LZO_ACC_OVERWRITE = 1, LZO_ACC_READ = 2 };

/* Kernels of one instruction set over a contiguous range. */
typedef struct {
    void (*adam)(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v, void *out,
                 int64_t n, int grad_dtype, int out_dtype);
    double (*accumulate)(float *dst, const void *src, int64_t n, int src_dtype, float scale,
                         int mode, int stream);
    void (*undo)(const lzo_undo_consts *c, float *p, const float *g, float *m, float *v, int64_t n);
    /* n elements whose global indices have the same high 32 bits; `index` is the low 32 of the first;
     * `prefetch`: elements ahead, a multiple of 32 */
    void (*adam_bf16state)(const lzo_adam_consts *c, const lzo_sr_keys *k, uint32_t index, uint16_t *p,
                           const void *g, uint16_t *m, uint16_t *v, int64_t n, int grad_dtype,
                           int64_t prefetch);
} lzo_kernel_table;

extern const lzo_kernel_table lzo_kernels_scalar;
#if defined(__x86_64__) || defined(__i386__)
extern const lzo_kernel_table lzo_kernels_avx2;
extern const lzo_kernel_table lzo_kernels_avx512;
#endif

#endif /* LZO_INTERNAL */
#endif /* LZO_H */
