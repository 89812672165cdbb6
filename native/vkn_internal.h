#ifndef VKN_INTERNAL_H
#define VKN_INTERNAL_H
#include "vkn.h"
#include <stddef.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define VKN_X86 1
#else
#define VKN_X86 0
#endif

#define VKN_MUL1_C1 0.00676727294921875f                   /* fp16 0x1EEE */
#define VKN_MUL1_K0 (1024.0f * 0.00676727294921875f - 10.3828125f) /* 1024·c1 + c0 (c0 = fp16 0xC931), exact */
#define VKN_HAD_SCALE 0.088388347648f                       /* fp32(1/sqrt(128)) */

void vkn_init_tables(void);
/* Raw Y[r][16j..] = X[r]·Ŵ[:, 16j..] for column tiles j0 <= j < j1 and nr rows (ldx = k, ldy = n). */
void vkn_gemv_cols(const vkn_tensor *T, const float *X, int nr, float *Y, int j0, int j1, int isa);

#endif
