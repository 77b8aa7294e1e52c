/* lzo_adam_undo over one range, included by kernels_scalar.c and kernels_simd.h so that each
 * instruction set compiles it with its own vector width (UNDO_TARGET). dispatch.c computes the
 * constants (lzo_undo_consts) and splits the work over threads.
 *
 * Each line of the Adam step is solved for the old value from the new one and the gradient, in
 * double, in the order of the torch path (kernels/reference.py, TorchBackend.adam_undo), and
 * rounded once: every backend gives the same bits, within about one fp32 ulp of the state before
 * the step. Compute-bound on the double division and square root, hence the per-ISA builds. */
#include <math.h>

UNDO_TARGET static void undo(const lzo_undo_consts *c, float *restrict p, const float *restrict g,
                             float *restrict m, float *restrict v, int64_t n)
{
    /* locals and restrict: the loop then vectorises (through c, every store could change a constant) */
    const double neg_step_size = c->neg_step_size, inv_bc2_sqrt = c->inv_bc2_sqrt, eps = c->eps;
    const double inv_decay = c->inv_decay, l2 = c->l2, w = c->w, inv_one_minus_w = c->inv_one_minus_w;
    const double one_minus_beta2 = c->one_minus_beta2, inv_beta2 = c->inv_beta2;
    const float scale = c->scale;
    for (int64_t i = 0; i < n; ++i) {
        double p1 = p[i], m1 = m[i], v1 = v[i];
        double p0 = (p1 - neg_step_size * m1 / (sqrt(v1) * inv_bc2_sqrt + eps)) * inv_decay;
        /* the product rounded to float, as in the step, plus Adam's L2 term (l2 == 0 for AdamW: adding
         * p0 * 0 changes nothing for the finite states that are speculated, and keeps the loop branch-free) */
        double gi = (double)(g[i] * scale) + p0 * l2;
        double m0 = (m1 - w * gi) * inv_one_minus_w; /* 0 when beta1 == 0: m0 did not matter */
        double v0 = (v1 - one_minus_beta2 * gi * gi) * inv_beta2;
        p[i] = (float)p0;
        m[i] = (float)m0;
        /* clamp at 0 (v0 - v0 is +0), a nan stays nan; written so that no conversion ends up in a
         * branch, which would keep the loop from vectorising */
        v[i] = (float)(v0 + (v0 < 0.0 ? -v0 : 0.0));
    }
}
