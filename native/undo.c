/* lzo_adam_undo: take one Adam/AdamW step back, for a speculated step that validation rejected.
 *
 * Each line of the step (lzo.h, lzo_adam_step) is solved for the old value from the new one and the
 * gradient, which the caller still holds. The arithmetic is done in double, in the order of the torch
 * reference (kernels._torch_adam_undo), with the step's constants rounded to float as the step
 * rounded them, and each result is rounded once: both paths give the same bits, and the restored
 * state is within about one fp32 ulp of the state before the step. One pass (read p, g, m, v; write
 * p, m, v), but compute-bound on the float64 division and square root: about 4 Adam steps with the
 * baseline instruction set the compiler vectorises to here (an AVX2/AVX-512 variant would halve it). */
#define LZO_INTERNAL
#include "lzo.h"

#include <math.h>

#define UNDO_CHUNK ((int64_t)1 << 16)
#define UNDO_PARALLEL_MIN ((int64_t)1 << 15)

/* x rounded to float, the way the step rounds its constants. Through a volatile, because GCC 12's
 * vectoriser was seen to drop a plain (float) cast of a loop-invariant double (the undo then used
 * 1 - beta1 unrounded and differed from the torch path in the last bit). */
static double f32(double x)
{
    volatile float rounded = (float)x;
    return rounded;
}

void lzo_adam_undo(const lzo_adam_hparams *hp, double grad_scale, double step, float *p,
                   const float *g, float *m, float *v, int64_t n, int num_threads)
{
    const double neg_step_size = f32(-(hp->lr / (1.0 - pow(hp->beta1, step))));
    const double bc2_sqrt = f32(sqrt(1.0 - pow(hp->beta2, step)));
    const double eps = f32(hp->eps);
    const double decay = hp->adamw_mode && hp->weight_decay != 0.0 ? f32(1.0 - hp->lr * hp->weight_decay) : 1.0;
    const double l2 = hp->adamw_mode ? 0.0 : f32(hp->weight_decay);
    const double w = f32(1.0 - hp->beta1);
    const double beta2 = f32(hp->beta2), one_minus_beta2 = f32(1.0 - hp->beta2);
    /* Divisions by these constants become multiplications (a division is ~10x the cost of a multiply
     * and this pass is compute-bound); the reciprocal's rounding is far below fp32's. */
    const double inv_bc2_sqrt = 1.0 / bc2_sqrt, inv_decay = 1.0 / decay;
    const double inv_one_minus_w = w != 1.0 ? 1.0 / (1.0 - w) : 0.0, inv_beta2 = beta2 != 0.0 ? 1.0 / beta2 : 0.0;
    const float scale = (float)f32(hp->maximize ? -grad_scale : grad_scale);
    int nt = num_threads > 1 ? num_threads : 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && n >= UNDO_PARALLEL_MIN)
    for (int64_t lo = 0; lo < n; lo += UNDO_CHUNK) {
        int64_t hi = n - lo < UNDO_CHUNK ? n : lo + UNDO_CHUNK;
        for (int64_t i = lo; i < hi; ++i) {
            double p1 = p[i], m1 = m[i], v1 = v[i];
            double p0 = (p1 - neg_step_size * m1 / (sqrt(v1) * inv_bc2_sqrt + eps)) * inv_decay;
            double gi = (double)(g[i] * scale); /* the product rounded to float, as in the step */
            if (l2 != 0.0)
                gi += p0 * l2;
            double m0 = (m1 - w * gi) * inv_one_minus_w; /* 0 when beta1 == 0: m0 did not matter */
            double v0 = (v1 - one_minus_beta2 * gi * gi) * inv_beta2;
            p[i] = (float)p0;
            m[i] = (float)m0;
            v[i] = (float)(v0 < 0.0 ? 0.0 : v0); /* clamp at 0; a nan stays nan */
        }
    }
}
