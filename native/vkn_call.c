/* The native call path (vkn_call.h): host copies, fence reset, submit and wait of a recorded op call. */
#define _POSIX_C_SOURCE 200112L /* clock_gettime under strict -std=c99 */
#include "vkn_call.h"

#include <string.h>
#include <time.h>

/* fp16 bits -> fp32, exactly (every fp16 value, subnormals, infinities and NaN payloads as numpy converts). */
static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: shift the leading one into the implicit bit, one exponent step per shift */
        uint32_t e = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* count elements from src to dst under conversion conv; elem_bytes is the size of a plain copy's element. */
static void convert(void *dst, const void *src, uint64_t count, uint32_t elem_bytes, uint32_t conv)
{
    switch (conv) {
    case VKN_CONV_I64_TO_I32: {
        const int64_t *s = (const int64_t *)src;
        int32_t *d = (int32_t *)dst;
        for (uint64_t i = 0; i < count; i++) d[i] = (int32_t)s[i]; /* wraps as numpy's cast does */
        break;
    }
    case VKN_CONV_F64_TO_F32: {
        const double *s = (const double *)src;
        float *d = (float *)dst;
        for (uint64_t i = 0; i < count; i++) d[i] = (float)s[i]; /* round to nearest even, as numpy */
        break;
    }
    case VKN_CONV_F16_TO_F32: {
        const uint16_t *s = (const uint16_t *)src;
        float *d = (float *)dst;
        for (uint64_t i = 0; i < count; i++) d[i] = f16_to_f32(s[i]);
        break;
    }
    default:
        memcpy(dst, src, count * elem_bytes);
    }
}

/* VKN_RULE_INDEX: with a bound up to this many bits, a bitmap finds repeats in a row (else a pairwise scan). */
#define VKN_SEEN_BITS 4096

static int64_t index_at(const void *src, uint64_t i, int wide)
{
    return wide ? ((const int64_t *)src)[i] : (int64_t)((const int32_t *)src)[i];
}

/* VKN_RULE_INDEX on count int32 (wide 0) or int64 (wide 1) elements. */
static int indices_ok(const vkn_slot *s, const void *src, int wide)
{
    const uint64_t row = s->row ? s->row : 1;
    const int64_t bound = s->bound;
    const int bitmap = bound <= VKN_SEEN_BITS;
    uint64_t seen[VKN_SEEN_BITS / 64];
    if (bitmap) memset(seen, 0, sizeof seen);
    for (uint64_t r = 0; r < s->count; r += row) {
        const uint64_t n = s->count - r < row ? s->count - r : row;
        for (uint64_t j = 0; j < n; j++) {
            const int64_t v = index_at(src, r + j, wide);
            if (v < 0 || v >= bound) return 0;
            if (bitmap) {
                const uint64_t bit = 1ull << (v & 63);
                if (seen[v >> 6] & bit) return 0;
                seen[v >> 6] |= bit;
            } else {
                for (uint64_t k = 0; k < j; k++)
                    if (index_at(src, r + k, wide) == v) return 0;
            }
        }
        if (bitmap) /* clear this row's bits for the next (every value is in range by now) */
            for (uint64_t j = 0; j < n; j++) seen[index_at(src, r + j, wide) >> 6] = 0;
    }
    return 1;
}

/* VKN_RULE_BOUNDED: every element finite with |v| <= limit (a NaN fails both comparisons). */
#define VKN_BOUNDED_LOOP(type, load)                                                                          \
    do {                                                                                                      \
        const type *p = (const type *)src;                                                                    \
        for (uint64_t i = 0; i < s->count; i++) {                                                             \
            const double v = (double)(load);                                                                  \
            if (!(v <= s->limit && v >= -s->limit)) return 0;                                                 \
        }                                                                                                     \
        return 1;                                                                                             \
    } while (0)

static int bounded_ok(const vkn_slot *s, const void *src, uint32_t conv)
{
    if (conv == VKN_CONV_F16_TO_F32 || (conv == VKN_CONV_COPY && s->elem_bytes == 2))
        VKN_BOUNDED_LOOP(uint16_t, f16_to_f32(p[i]));
    if (conv == VKN_CONV_F64_TO_F32 || (conv == VKN_CONV_COPY && s->elem_bytes == 8)) VKN_BOUNDED_LOOP(double, p[i]);
    if (conv == VKN_CONV_COPY && s->elem_bytes == 4) VKN_BOUNDED_LOOP(float, p[i]);
    return 0; /* a source type the rule does not read: the caller's check decides */
}

/* Whether slot s's source elements (read as conversion conv reads them) keep its rule. */
static int keeps_rule(const vkn_slot *s, const void *src, uint32_t conv)
{
    switch (s->rule) {
    case VKN_RULE_INDEX:
        if (conv == VKN_CONV_I64_TO_I32 || (conv == VKN_CONV_COPY && s->elem_bytes == 8)) return indices_ok(s, src, 1);
        if (conv == VKN_CONV_COPY && s->elem_bytes == 4) return indices_ok(s, src, 0);
        return 0;
    case VKN_RULE_BOUNDED:
        return bounded_ok(s, src, conv);
    default:
        return 1;
    }
}

static uint32_t conv_of(uint32_t convs, int i)
{
    return (convs >> (VKN_CONV_BITS * i)) & ((1u << VKN_CONV_BITS) - 1u);
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int32_t vkn_call_submit(vkn_call *c, const void *submit, uint32_t convs, uint32_t checks, const void *src0,
                        const void *src1, const void *src2, const void *src3)
{
    const void *src[VKN_CALL_INPUTS] = {src0, src1, src2, src3};
    for (int i = 0; i < VKN_CALL_INPUTS; i++) { /* all checks before any copy: a rejected call writes nothing */
        if ((checks >> i) & 1u && (src[i] == NULL || !keeps_rule(&c->in[i], src[i], conv_of(convs, i)))) {
            c->rejected = i;
            return VKN_REJECTED;
        }
    }
    for (int i = 0; i < VKN_CALL_INPUTS; i++)
        if (src[i] != NULL) convert(c->in[i].mapped, src[i], c->in[i].count, c->in[i].elem_bytes, conv_of(convs, i));
    int32_t r = c->reset_fences(c->device, 1, c->fence);
    if (r != VKN_VK_SUCCESS) {
        c->failed = VKN_FAILED_RESET;
        return r;
    }
    r = c->queue_submit(c->queue, 1, submit, c->fence[0]);
    if (r != VKN_VK_SUCCESS) c->failed = VKN_FAILED_SUBMIT;
    return r;
}

int32_t vkn_call_finish(vkn_call *c, uint32_t conv, void *dst)
{
    double end = c->spin_s > 0 ? now_s() + c->spin_s : 0.0;
    int32_t r;
    do {
        r = c->get_fence_status(c->device, c->fence[0]);
    } while (r == VKN_VK_NOT_READY && c->spin_s > 0 && now_s() < end);
    if (r == VKN_VK_NOT_READY) return VKN_PENDING;
    if (r != VKN_VK_SUCCESS) {
        c->failed = VKN_FAILED_STATUS;
        return r;
    }
    if (dst != NULL) convert(dst, c->out.mapped, c->out.count, c->out.elem_bytes, conv);
    return VKN_VK_SUCCESS;
}
