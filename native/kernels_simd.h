/* The vector kernels, written once and compiled once per instruction set.
 *
 * Each kernels_<isa>.c includes this file after defining its shim: TARGET (the function
 * attribute of that instruction set), INLINE, W (floats per vector), KERNEL_TABLE (the name of
 * the lzo_kernel_table to define), BF16_L2_AHEAD (0, or how many times the L1 distance the
 * bf16-state step prefetches into L2, adam_bf16_loop) and these types and inline functions:
 *   vfloat  W floats:       vf_load vf_store vf_stream vf_set1 vf_add vf_sub vf_mul vf_div vf_sqrt
 *                           vf_fmadd(a, b, c) = a * b + c rounded once; vf_load_f16 (W halves)
 *                           vf_even_odd(a, b, &even, &odd) (the even and the odd elements of the 2W
 *                           elements a, b, in order)
 *   vint    W int32 lanes:  vi_load_u16 (W uint16, zero-extended) vi_from_bits vf_from_bits vi_set1
 *                           vi_add vi_and vi_or vi_xor vi_mullo (low 32 bits of the product)
 *                           vi_shl16 vi_shr16 vi_shr15 vi_shr1 vi_load (W int32) vi_nan_select(x, a,
 *                           b) (a where x is NaN, else b) vi_add_bits_unless_nan(x, r, a) (x's bits
 *                           + r, a where x is NaN) vi_narrow_u16 (each lane is <= 0xffff)
 *                           vi_xor_and(a, b, c) ((a ^ b) & c) vf_any_nan2(a, b) (1 if a lane of a or b
 *                           is NaN)
 *                           vi_load_words vi_store_words (2W uint16 as W 32-bit words)
 *                           vi_merge_high(a, b) (each word: a's high half low, b's high half high)
 *   vhalf   W 16-bit lanes: vh_store vh_stream vh_from_f32_f16 (round to nearest even)
 *   vdouble W/2 doubles:    vd_zero vd_from_low vd_from_high (half of a vfloat each) vd_add
 *                           vd_fmadd vd_sum (horizontal, in the instruction set's fixed order)
 * Every instruction set then performs the same operations in the same order, so the Adam step
 * gives identical bits on each; only the order of the final double sum of grad_accumulate depends
 * on W. Tails go through zero-padded buffers, so they get the same arithmetic as full vectors. */
#include <string.h>

#define PREFETCH 512                  /* elements ahead */
#define VECS_PER_LINE (64 / (W * 4))  /* vectors per 64-byte cache line of each fp32 stream */
#define STREAM_MIN ((int64_t)1 << 16) /* elements */

INLINE vfloat load_as_f32(const void *src, int64_t i, int dtype)
{
    const uint16_t *h = (const uint16_t *)src + i;
    switch (dtype) {
    case LZO_BFLOAT16:
        return vf_from_bits(vi_shl16(vi_load_u16(h)));
    case LZO_FLOAT16:
        return vf_load_f16(h);
    default:
        return vf_load((const float *)src + i);
    }
}

/* Round to nearest even; NaN stays NaN (quieted). */
INLINE vhalf f32_to_bf16(vfloat x)
{
    vint u = vi_from_bits(x);
    vint hi = vi_shr16(u);
    vint bias = vi_add(vi_and(hi, vi_set1(1)), vi_set1(0x7fff));
    vint r = vi_shr16(vi_add(u, bias));
    return vi_narrow_u16(vi_nan_select(x, vi_or(hi, vi_set1(0x40)), r));
}

/* `stream`: non-temporal store (out + i must be aligned to a whole vhalf), skipping the
 * read-for-ownership of a line that is only written. */
INLINE void store_low_precision(void *out, int64_t i, vfloat x, int dtype, int stream)
{
    uint16_t *dst = (uint16_t *)out + i;
    vhalf h;
    if (dtype == LZO_BFLOAT16)
        h = f32_to_bf16(x);
    else if (dtype == LZO_FLOAT16)
        h = vh_from_f32_f16(x);
    else
        return;
    if (stream)
        vh_stream(dst, h);
    else
        vh_store(dst, h);
}

INLINE void adam_vec(const lzo_adam_consts *c, float *p, const void *g, float *m, float *v,
                     void *out, int64_t i, int gdt, int odt, int stream)
{
    vfloat gi = vf_mul(load_as_f32(g, i, gdt), vf_set1(c->grad_scale));
    vfloat p0 = vf_load(p + i), pi = p0;
    if (c->l2 != 0.0f)
        gi = vf_fmadd(pi, vf_set1(c->l2), gi);
    pi = vf_mul(pi, vf_set1(c->decay));
    vfloat mi = vf_load(m + i);
    vfloat d = vf_sub(gi, mi);
    mi = vf_fmadd(vf_set1(c->lerp_w), d, c->lerp_from_end ? gi : mi);
    vfloat vi = vf_mul(vf_load(v + i), vf_set1(c->beta2));
    vi = vf_fmadd(vf_mul(vf_set1(c->one_minus_beta2), gi), gi, vi);
    vfloat denom = vf_add(vf_div(vf_sqrt(vi), vf_set1(c->bc2_sqrt)), vf_set1(c->eps));
    pi = vf_add(pi, vf_div(vf_mul(vf_set1(c->neg_step_size), mi), denom));
    vf_store(p + i, pi);
    vf_store(m + i, mi);
    vf_store(v + i, vi);
    if (c->extrapolate != 0.0f)
        pi = vf_fmadd(vf_set1(c->extrapolate), vf_sub(pi, p0), pi);
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
 * keep too few cache misses in flight to saturate memory (the gain, against the roofline of
 * benchmarks/roofline.c: docs/benchmarks.md, "CPU-Adam kernels"). */
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
    const int64_t out_align = W * 2; /* bytes of one vhalf, for stream stores */
    int64_t i = 0, gsz = gdt == LZO_FLOAT32 ? 4 : 2;
    /* Stream the low-precision copy of large ranges; a misaligned head goes through the padded path. */
    int stream = odt != LZO_NONE && n >= STREAM_MIN && ((uintptr_t)out & 1) == 0;
    if (stream) {
        i = (int64_t)((out_align - ((uintptr_t)out & (out_align - 1))) & (out_align - 1)) / 2;
        if (i)
            adam_partial(c, p, g, m, v, out, i, gdt, odt);
    }
    for (; i + VECS_PER_LINE * W <= n; i += VECS_PER_LINE * W) { /* one cache line of each stream */
        prefetch(p, g, m, v, i, gdt);
        for (int k = 0; k < VECS_PER_LINE; ++k)
            adam_vec(c, p, g, m, v, out, i + k * W, gdt, odt, stream);
    }
    for (; i + W <= n; i += W)
        adam_vec(c, p, g, m, v, out, i, gdt, odt, stream);
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

/* ---- bf16 state: p, m, v stored as bf16, stochastically rounded (lzo_adam_step_bf16state) ---- */

/* A block is 2W elements, one vector of W 32-bit words per bf16 stream: word k holds element 2k in its
 * low half and 2k + 1 in its high half. Even and odd elements widen in place (a shift, a mask) and
 * narrow back with one merge, with no shuffles across lanes; the arithmetic runs on the even vector
 * and on the odd one. Lane k of the even vector is element 2k. */
static const int32_t LANE_EVEN[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};

/* lowbias32 (C. Wellons' 32-bit integer mix), a bijection with full avalanche and two multiplies:
 * x ^= x >> 16 (stage1); x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16. This takes x after
 * stage1 and stops before the last step, which leaves the high half as it is: the hash's high half is
 * *high = x >> 16 and its low half (x ^ *high) & 0xffff, one vi_xor_and (the caller needs the halves). */
INLINE vint hash32_from_stage1(vint x, vint *high)
{
    x = vi_mullo(x, vi_set1(0x7feb352d));
    x = vi_mullo(vi_xor(x, vi_shr15(x)), vi_set1((int)0x846ca68bu));
    *high = vi_shr16(x);
    return x;
}

INLINE vint stage1(vint x) { return vi_xor(x, vi_shr16(x)); }

/* Stochastic rounding: add r (16 random bits, < 2^16) below the kept mantissa; the high half of the
 * result is the bf16 (the caller's merge truncates). Sign and magnitude are separate, so this rounds
 * the magnitude up with probability (dropped bits) / 2^16, for either sign; a carry out of the mantissa
 * moves to the next binade (or from the largest finite value to inf), and inf (dropped bits 0) stays
 * inf. NaN would carry into the sign: it becomes the one quiet NaN 0x7fc0 instead, which also makes
 * its bits independent of the backend. */
INLINE vint bf16_stochastic(vfloat x, vint r)
{
    return vi_add_bits_unless_nan(x, r, vi_set1(0x7fc00000));
}

/* The update of the even and the odd elements of a block, statement by statement side by side: two
 * independent chains through the square root and the division keep the units busy while one waits
 * on the other's latency (GCC does not interleave them itself; docs/kernels.md has the gain). */
INLINE void adam_bf16_pair(const lzo_adam_consts *c, vfloat *g, vfloat *p, vfloat *m, vfloat *v)
{
    vfloat pd[2], q[2];
    for (int k = 0; k < 2; ++k)
        g[k] = vf_mul(g[k], vf_set1(c->grad_scale));
    if (c->l2 != 0.0f)
        for (int k = 0; k < 2; ++k)
            g[k] = vf_fmadd(p[k], vf_set1(c->l2), g[k]);
    for (int k = 0; k < 2; ++k)
        v[k] = vf_fmadd(vf_mul(vf_set1(c->one_minus_beta2), g[k]), g[k], vf_mul(v[k], vf_set1(c->beta2)));
    for (int k = 0; k < 2; ++k)
        q[k] = vf_sqrt(v[k]);
    for (int k = 0; k < 2; ++k)
        m[k] = vf_fmadd(vf_set1(c->lerp_w), vf_sub(g[k], m[k]), c->lerp_from_end ? g[k] : m[k]);
    for (int k = 0; k < 2; ++k)
        q[k] = vf_div(m[k], vf_fmadd(q[k], vf_set1(c->inv_bc2_sqrt), vf_set1(c->eps)));
    for (int k = 0; k < 2; ++k)
        pd[k] = vf_mul(p[k], vf_set1(c->decay));
    for (int k = 0; k < 2; ++k)
        p[k] = vf_fmadd(vf_set1(c->neg_step_size), q[k], pd[k]);
}

INLINE vfloat even_f32(vint words) { return vf_from_bits(vi_shl16(words)); }
INLINE vfloat odd_f32(vint words) { return vf_from_bits(vi_and(words, vi_set1((int)0xffff0000u))); }

/* One block of 2W elements at i; lane k of `je` holds the low 32 bits of element i + 2k's global index,
 * which is even. The random bits of element j (kernels/reference.py sr_bits): p the high and m the low
 * half of lowbias32(j ^ pm); v one half of lowbias32((j >> 1) ^ v), shared by the pair 2k, 2k + 1 (the
 * high half for the even element): 48 bits per element from one and a half hashes. */
INLINE void adam_bf16_block(const lzo_adam_consts *c, vint kpm, vint kv, vint je, uint16_t *p, const void *g,
                            uint16_t *m, uint16_t *v, int64_t i, int gdt)
{
    vint pw = vi_load_words(p + i), mw = vi_load_words(m + i), vw = vi_load_words(v + i);
    vfloat ge, go;
    if (gdt == LZO_BFLOAT16) {
        vint gw = vi_load_words((const uint16_t *)g + i);
        ge = even_f32(gw);
        go = odd_f32(gw);
    } else {
        vf_even_odd(load_as_f32(g, i, gdt), load_as_f32(g, i + W, gdt), &ge, &go);
    }
    vfloat gs[2] = {ge, go}, ps[2] = {even_f32(pw), odd_f32(pw)}, ms[2] = {even_f32(mw), odd_f32(mw)};
    vfloat vs[2] = {even_f32(vw), odd_f32(vw)};
    adam_bf16_pair(c, gs, ps, ms, vs);
    vfloat pe = ps[0], po = ps[1], me = ms[0], mo = ms[1], ve = vs[0], vo = vs[1];
    /* je is even, so the odd element's hash input is the even one's with the low bit flipped, and so
     * is its first stage (the shift moves no low bit): one xor instead of an index, a key and a stage */
    vint se = stage1(vi_xor(je, kpm)), so = vi_xor(se, vi_set1(1));
    vint he_hi, ho_hi, hv_hi;
    vint he = hash32_from_stage1(se, &he_hi), ho = hash32_from_stage1(so, &ho_hi);
    vint hv = hash32_from_stage1(stage1(vi_xor(vi_shr1(je), kv)), &hv_hi);
    vint low = vi_set1(0xffff), he_lo = vi_xor_and(he, he_hi, low), ho_lo = vi_xor_and(ho, ho_hi, low);
    vint hv_lo = vi_xor_and(hv, hv_hi, low);
    if (!vf_any_nan2(pe, po)) { /* m or v NaN makes p NaN: with none in p, no lane needs the NaN rule */
        vi_store_words(p + i, vi_merge_high(vi_add(vi_from_bits(pe), he_hi), vi_add(vi_from_bits(po), ho_hi)));
        vi_store_words(m + i, vi_merge_high(vi_add(vi_from_bits(me), he_lo), vi_add(vi_from_bits(mo), ho_lo)));
        vi_store_words(v + i, vi_merge_high(vi_add(vi_from_bits(ve), hv_hi), vi_add(vi_from_bits(vo), hv_lo)));
        return;
    }
    vi_store_words(p + i, vi_merge_high(bf16_stochastic(pe, he_hi), bf16_stochastic(po, ho_hi)));
    vi_store_words(m + i, vi_merge_high(bf16_stochastic(me, he_lo), bf16_stochastic(mo, ho_lo)));
    vi_store_words(v + i, vi_merge_high(bf16_stochastic(ve, hv_hi), bf16_stochastic(vo, hv_lo)));
}

INLINE vint even_indices(uint32_t first) { return vi_add(vi_set1((int)first), vi_load(LANE_EVEN)); }

/* Fewer than 2W elements (r + (index & 1) <= 2W), through zero-padded buffers: an odd first index sits
 * at lane 1 of a block that starts one element earlier, so every element gets the bits of its index. */
INLINE void adam_bf16_partial(const lzo_adam_consts *c, vint kpm, vint kv, uint32_t index, uint16_t *p,
                              const void *g, uint16_t *m, uint16_t *v, int64_t n, int gdt)
{
    size_t r = (size_t)n, s = index & 1u, gsz = gdt == LZO_FLOAT32 ? 4 : 2;
    uint16_t pb[2 * W] = {0}, mb[2 * W] = {0}, vb[2 * W] = {0};
    float gb[2 * W] = {0};
    memcpy(pb + s, p, r * 2);
    memcpy((char *)gb + s * gsz, g, r * gsz);
    memcpy(mb + s, m, r * 2);
    memcpy(vb + s, v, r * 2);
    adam_bf16_block(c, kpm, kv, even_indices(index - (uint32_t)s), pb, gb, mb, vb, 0, gdt);
    memcpy(p, pb + s, r * 2);
    memcpy(m, mb + s, r * 2);
    memcpy(v, vb + s, r * 2);
}

#define BF16_LINE 32 /* bf16 elements per 64-byte cache line */

/* `ahead` elements of prefetch into L1 (lzo_bf16_prefetch): a block costs about as much compute as its
 * 14-16 bytes take to arrive, so the lines must be asked for well before the fp32 step's distance, but
 * not so far that the L1 evicts them first; and, where the shim sets BF16_L2_AHEAD, that many times as
 * far with the T1 hint, which those CPUs (Intel's, AMD's from Zen 4) take into L2 only, so that the L1
 * prefetch finds its line there rather than waiting on memory (docs/kernels.md). AMD's cores before
 * Zen 4, which run the AVX2 shim, fill L1 on a T1 hint as on T0, so there it would crowd the L1 with
 * lines four times too early. Prefetches past the end are harmless hints. */

/* a macro, not a function: _mm_prefetch's hint must be a constant even where nothing is inlined */
#define PREFETCH_BF16_LINE(p, g, m, v, i, gsz, hint)                                              \
    do {                                                                                          \
        _mm_prefetch((const char *)((p) + (i)), hint);                                            \
        _mm_prefetch((const char *)((m) + (i)), hint);                                            \
        _mm_prefetch((const char *)((v) + (i)), hint);                                            \
        _mm_prefetch((const char *)(g) + (i) * (gsz), hint);                                      \
        if ((gsz) == 4)                                                                           \
            _mm_prefetch((const char *)(g) + (i) * 4 + 64, hint);                                 \
    } while (0)

INLINE void adam_bf16_loop(const lzo_adam_consts *c, const lzo_sr_keys *k, uint32_t index, uint16_t *p,
                           const void *g, uint16_t *m, uint16_t *v, int64_t n, int gdt, int64_t ahead)
{
    vint kpm = vi_set1((int)k->pm), kv = vi_set1((int)k->v);
    int64_t i = 0, gsz = gdt == LZO_FLOAT32 ? 4 : 2;
    if ((index & 1u) && n > 0) { /* blocks start at even indices: the pairs share their v bits */
        adam_bf16_partial(c, kpm, kv, index, p, g, m, v, 1, gdt);
        i = 1;
    }
    vint je = even_indices(index + (uint32_t)i), block = vi_set1(2 * W); /* a running index: one add a block */
    for (; i + BF16_LINE <= n; i += BF16_LINE) { /* one cache line of each bf16 stream */
        if (ahead) {
            if (BF16_L2_AHEAD)
                PREFETCH_BF16_LINE(p, g, m, v, i + BF16_L2_AHEAD * ahead, gsz, _MM_HINT_T1);
            PREFETCH_BF16_LINE(p, g, m, v, i + ahead, gsz, _MM_HINT_T0);
        }
        for (int j = 0; j < BF16_LINE; j += 2 * W, je = vi_add(je, block))
            adam_bf16_block(c, kpm, kv, je, p, g, m, v, i + j, gdt);
    }
    for (; i + 2 * W <= n; i += 2 * W, je = vi_add(je, block))
        adam_bf16_block(c, kpm, kv, je, p, g, m, v, i, gdt);
    if (i < n)
        adam_bf16_partial(c, kpm, kv, index + (uint32_t)i, p + i, (const char *)g + i * gsz, m + i, v + i,
                          n - i, gdt);
}

TARGET static void adam_bf16state(const lzo_adam_consts *consts, const lzo_sr_keys *k, uint32_t index,
                                  uint16_t *p, const void *g, uint16_t *m, uint16_t *v, int64_t n, int gdt,
                                  int64_t prefetch)
{
    /* A local copy: the vector stores may alias anything, so through the caller's pointer every block
     * would load and broadcast the constants again and test l2 and lerp_from_end again. */
    const lzo_adam_consts local = *consts, *c = &local;
    switch (gdt) {
    case LZO_BFLOAT16:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_BFLOAT16, prefetch);
        return;
    case LZO_FLOAT16:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_FLOAT16, prefetch);
        return;
    default:
        adam_bf16_loop(c, k, index, p, g, m, v, n, LZO_FLOAT32, prefetch);
    }
}

INLINE void accumulate_vec(float *dst, const void *src, int64_t i, int sdt, vfloat scale, int mode,
                           int stream, vdouble *acc_lo, vdouble *acc_hi)
{
    vfloat x = vf_mul(load_as_f32(src, i, sdt), scale);
    if (mode == LZO_ACC_ADD)
        x = vf_add(vf_load(dst + i), x);
    if (mode != LZO_ACC_READ) {
        if (stream)
            vf_stream(dst + i, x);
        else
            vf_store(dst + i, x);
    }
    vdouble lo = vd_from_low(x), hi = vd_from_high(x);
    *acc_lo = vd_fmadd(lo, lo, *acc_lo);
    *acc_hi = vd_fmadd(hi, hi, *acc_hi);
}

/* Fewer than W elements, through zero-padded buffers (zeros add nothing to the sums). */
INLINE void accumulate_partial(float *dst, const void *src, int64_t n, int sdt, vfloat scale,
                               int mode, vdouble *acc_lo, vdouble *acc_hi)
{
    size_t r = (size_t)n, ssz = sdt == LZO_FLOAT32 ? 4 : 2;
    float db[W] = {0}, sb[W] = {0};
    if (mode == LZO_ACC_ADD)
        memcpy(db, dst, r * 4);
    memcpy(sb, src, r * ssz);
    accumulate_vec(db, sb, 0, sdt, scale, mode, 0, acc_lo, acc_hi);
    if (mode != LZO_ACC_READ)
        memcpy(dst, db, r * 4);
}

/* `stream` (overwrite only): dst is only written, so it is stored non-temporally after a head
 * that aligns it to a whole vector. */
INLINE double accumulate_loop(float *dst, const void *src, int64_t n, int sdt, float scale,
                              int mode, int stream)
{
    const uintptr_t align = W * 4; /* bytes of one vfloat */
    vfloat s = vf_set1(scale);
    vdouble acc_lo = vd_zero(), acc_hi = vd_zero();
    int64_t i = 0, ssz = sdt == LZO_FLOAT32 ? 4 : 2;
    stream = stream && mode == LZO_ACC_OVERWRITE && n >= W && ((uintptr_t)dst & 3) == 0;
    if (stream) {
        i = (int64_t)((align - ((uintptr_t)dst & (align - 1))) & (align - 1)) / 4;
        if (i)
            accumulate_partial(dst, src, i, sdt, s, mode, &acc_lo, &acc_hi);
    }
    for (; i + W <= n; i += W)
        accumulate_vec(dst, src, i, sdt, s, mode, stream, &acc_lo, &acc_hi);
    if (i < n)
        accumulate_partial(mode == LZO_ACC_READ ? NULL : dst + i, (const char *)src + i * ssz,
                           n - i, sdt, s, mode, &acc_lo, &acc_hi);
    if (stream)
        _mm_sfence();
    return vd_sum(vd_add(acc_lo, acc_hi));
}

TARGET static double accumulate(float *dst, const void *src, int64_t n, int sdt, float scale,
                                int mode, int stream)
{
    switch (sdt) {
    case LZO_BFLOAT16:
        return accumulate_loop(dst, src, n, LZO_BFLOAT16, scale, mode, stream);
    case LZO_FLOAT16:
        return accumulate_loop(dst, src, n, LZO_FLOAT16, scale, mode, stream);
    default:
        return accumulate_loop(dst, src, n, LZO_FLOAT32, scale, mode, stream);
    }
}

#define UNDO_TARGET TARGET
#include "undo_body.h"

const lzo_kernel_table KERNEL_TABLE = {adam, accumulate, undo, adam_bf16state};
