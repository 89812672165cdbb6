/* vkmoe native CPU tier: EXL3 decode, linear and fused MoE MLP in fp32 (C99, libc/libm/pthreads only). */
#ifndef VKN_H
#define VKN_H
#include <stdint.h>

/* One EXL3 linear. lut: the 65536 decoded codebook values (GPU form, as fp32) for the scalar path;
   codebook: VKN_CB_* (used by the SIMD path, which decodes arithmetically).
   suh/svh/bias are fp32 copies; bias may be NULL. */
typedef struct {
    const uint16_t *trellis;
    const float *suh;
    const float *svh;
    const float *bias;
    const float *lut;
    int k, n, bits, codebook;
} vkn_tensor;

/* Codes shared with the shaders: vkmoe/layout.py owns them (ACTIVATIONS, CODEBOOKS); tests/test_layout.py
   checks these copies. */
enum { VKN_CB_3INST = 0, VKN_CB_MCG = 1, VKN_CB_MUL1 = 2 };
enum { VKN_ACT_SILU = 0, VKN_ACT_GELU = 1, VKN_ACT_RELU2 = 2, VKN_ACT_SWIGLU_OAI = 3, VKN_ACT_GELU_ERF = 4 };
enum { VKN_ISA_SCALAR = 0, VKN_ISA_AVX512 = 2, VKN_ISA_AVX512_VNNI = 3 };

/* Highest ISA tier this CPU supports, and the tier in use (capped by vkn_set_max_isa). */
int vkn_isa_supported(void);
int vkn_isa_active(void);
void vkn_set_max_isa(int isa);

/* Ŵ (k x n, row-major) as fp32 through the active ISA path. */
void vkn_dequant(const vkn_tensor *t, float *out);
/* y (m x n) = x (m x k) · W + bias. Returns 0 or a negative error code. */
int vkn_linear(const vkn_tensor *t, const float *x, int m, float *y, int threads);
/* Fused MoE MLP (gate may be NULL: gateless relu2). ids out of [0, E) are skipped.
   out (m x H) is overwritten. Returns 0 or a negative error code. */
int vkn_moe(const vkn_tensor *gate, const vkn_tensor *up, const vkn_tensor *down, int num_experts,
            int m, int top_k, const float *hidden, const int64_t *ids, const float *weights,
            int act, float act_limit, float *out, int threads);

#endif
