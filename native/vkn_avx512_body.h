/* AVX-512 decode + GEMV kernels. Included by vkn_kernels.c once per ISA variant with
 *   AVX512_TARGET  the __attribute__((target)) of this variant
 *   VKN_VNNI       1: byte sum of mul1 through vpdpbusd, 0: shifts and masks
 *   N(name)        name mangling for this variant
 * Needs g_wa, g_wc, g_sh, g_shl (state index tables) and tile_row/tile_col from vkn_kernels.c. */

#define INLINE static inline __attribute__((always_inline))

/* Gather 16 dwords U[idx] from the tile's 8K words held in nreg zmm registers. */
AVX512_TARGET INLINE __m512i N(pick)(__m512i idx, int nreg, __m512i u0, __m512i u1, __m512i u2, __m512i u3)
{
    if (nreg == 1) return _mm512_permutexvar_epi32(idx, u0);
    if (nreg == 2) return _mm512_permutex2var_epi32(u0, idx, u1);
    __m512i lo = _mm512_permutex2var_epi32(u0, idx, u1);
    __m512i hi = _mm512_permutex2var_epi32(u2, idx, u3);
    __mmask16 m = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    return _mm512_mask_blend_epi32(m, lo, hi);
}

AVX512_TARGET INLINE __m512 N(round_f16)(__m512 v)
{
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* GPU-form codebook on 16 states (spec section 3), exact. */
AVX512_TARGET INLINE __m512 N(decode16)(__m512i s, int cb)
{
    if (cb == VKN_CB_MUL1) {
        __m512i x = _mm512_mullo_epi32(s, _mm512_set1_epi32((int32_t)0x83DCD12Du));
#if VKN_VNNI
        __m512i B = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_set1_epi32(0x01010101));
#else
        __m512i m8 = _mm512_set1_epi32(0x00FF00FF);
        __m512i t = _mm512_add_epi32(_mm512_and_si512(x, m8), _mm512_and_si512(_mm512_srli_epi32(x, 8), m8));
        __m512i B = _mm512_and_si512(_mm512_add_epi32(t, _mm512_srli_epi32(t, 16)), _mm512_set1_epi32(0x7FF));
#endif
        /* (1024 + B)·c1 + c0 is exact in fp32 (integer multiples of 2^-18 below 2^24 ulps), so one fp16
           rounding of it reproduces the GPU's fused fp16 fma. */
        __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(B), _mm512_set1_ps(VKN_MUL1_C1), _mm512_set1_ps(VKN_MUL1_K0));
        return N(round_f16)(v);
    }
    __m512i x;
    if (cb == VKN_CB_MCG)
        x = _mm512_mullo_epi32(s, _mm512_set1_epi32((int32_t)0xCBAC1FEDu));
    else
        x = _mm512_add_epi32(_mm512_mullo_epi32(s, _mm512_set1_epi32(89226354)), _mm512_set1_epi32(64248484));
    /* 0x6A = (a & b) ^ c, the same lop3 the CUDA decoder uses. */
    __m512i y = _mm512_ternarylogic_epi32(x, _mm512_set1_epi32((int32_t)0x8FFF8FFFu), _mm512_set1_epi32(0x3B603B60), 0x6A);
    __m512 a = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(y));
    __m512 b = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(y, 16)));
    return N(round_f16)(_mm512_add_ps(a, b)); /* |a|,|b| in [1/8, 2): the fp32 sum is exact */
}

AVX512_TARGET INLINE void N(load_tile)(const uint16_t *p, int K, int nreg, __m512i *u0, __m512i *u1, __m512i *u2, __m512i *u3)
{
    int nw = 8 * K; /* little-endian: the uint16 pair (T[2m], T[2m+1]) read as uint32 is U[m] */
    *u0 = _mm512_maskz_loadu_epi32(nw >= 16 ? 0xFFFF : (__mmask16)((1u << nw) - 1), p);
    if (nreg > 1) {
        int r = nw - 16;
        *u1 = _mm512_maskz_loadu_epi32(r >= 16 ? 0xFFFF : (__mmask16)((1u << r) - 1), p + 32);
    }
    if (nreg > 2) {
        int r = nw - 32;
        *u2 = _mm512_maskz_loadu_epi32(r >= 16 ? 0xFFFF : (__mmask16)((1u << r) - 1), p + 64);
        r = nw - 48;
        *u3 = r > 0 ? _mm512_maskz_loadu_epi32(r >= 16 ? 0xFFFF : (__mmask16)((1u << r) - 1), p + 96)
                    : _mm512_setzero_si512();
    }
}

AVX512_TARGET INLINE __m512i N(states16)(int K, int c, int nreg, __m512i u0, __m512i u1, __m512i u2, __m512i u3)
{
    __m512i A = N(pick)(_mm512_loadu_si512(g_wa[K] + 16 * c), nreg, u0, u1, u2, u3);
    __m512i C = N(pick)(_mm512_loadu_si512(g_wc[K] + 16 * c), nreg, u0, u1, u2, u3);
    /* (A:C) >> sh, low 16 bits; a left shift by 32 yields 0, which is what sh = 0 needs. 0xA8 = (a | b) & c. */
    return _mm512_ternarylogic_epi32(_mm512_srlv_epi32(C, _mm512_loadu_si512(g_sh[K] + 16 * c)),
                                     _mm512_sllv_epi32(A, _mm512_loadu_si512(g_shl[K] + 16 * c)),
                                     _mm512_set1_epi32(0xFFFF), 0xA8);
}

AVX512_TARGET INLINE void N(col_tile)(const vkn_tensor *T, const float *X, int nr, float *Y, int j, int cb, int nreg)
{
    const int K = T->bits, kt = T->k / 16, nt = T->n / 16;
    const __m512i pe = _mm512_loadu_si512(g_xperm[0]), po = _mm512_loadu_si512(g_xperm[1]);
    __m512 acc0[8], acc1[8];
    for (int p = 0; p < 8; p++) acc0[p] = acc1[p] = _mm512_setzero_ps();
    const float *x0 = X, *x1 = X + (nr > 1 ? T->k : 0);
    for (int i = 0; i < kt; i++) {
        __m512i u0, u1 = _mm512_setzero_si512(), u2 = u1, u3 = u1;
        const uint16_t *tp = T->trellis + ((size_t)i * nt + j) * 16 * K;
        N(load_tile)(tp, K, nreg, &u0, &u1, &u2, &u3);
        if (i + 2 < kt) _mm_prefetch((const char *)(tp + (size_t)2 * nt * 16 * K), _MM_HINT_T0);
        __m512 xb0 = _mm512_loadu_ps(x0 + 16 * i), xb1 = _mm512_loadu_ps(x1 + 16 * i);
        __m512 xe0 = _mm512_permutexvar_ps(pe, xb0), xo0 = _mm512_permutexvar_ps(po, xb0);
        __m512 xe1 = _mm512_permutexvar_ps(pe, xb1), xo1 = _mm512_permutexvar_ps(po, xb1);
        for (int c = 0; c < 16; c++) {
            __m512 w = N(decode16)(N(states16)(K, c, nreg, u0, u1, u2, u3), cb);
            acc0[c >> 1] = _mm512_fmadd_ps(w, (c & 1) ? xo0 : xe0, acc0[c >> 1]);
            if (nr > 1) acc1[c >> 1] = _mm512_fmadd_ps(w, (c & 1) ? xo1 : xe1, acc1[c >> 1]);
        }
    }
    /* Lanes 0-3 and 8-11 of acc[p] belong to column p, lanes 4-7 and 12-15 to column p + 8. */
    for (int r = 0; r < nr; r++) {
        float buf[16];
        float *y = Y + (size_t)r * T->n + 16 * j;
        for (int p = 0; p < 8; p++) {
            _mm512_storeu_ps(buf, r ? acc1[p] : acc0[p]);
            y[p] = (buf[0] + buf[1]) + (buf[2] + buf[3]) + ((buf[8] + buf[9]) + (buf[10] + buf[11]));
            y[p + 8] = (buf[4] + buf[5]) + (buf[6] + buf[7]) + ((buf[12] + buf[13]) + (buf[14] + buf[15]));
        }
    }
}

#define VKN_INST(CB, NREG, NR)                                                                          \
    AVX512_TARGET static void N(col_##CB##_##NREG##_##NR)(const vkn_tensor *T, const float *X, float *Y, int j) \
    {                                                                                                   \
        N(col_tile)(T, X, NR, Y, j, CB, NREG);                                                          \
    }
#define VKN_INST_NR(CB, NREG) VKN_INST(CB, NREG, 1) VKN_INST(CB, NREG, 2)
#define VKN_INST_CB(CB) VKN_INST_NR(CB, 1) VKN_INST_NR(CB, 2) VKN_INST_NR(CB, 4)
VKN_INST_CB(0)
VKN_INST_CB(1)
VKN_INST_CB(2)
#undef VKN_INST
#undef VKN_INST_NR
#undef VKN_INST_CB

static const col_fn N(col_fns)[3][3][2] = {
    {{N(col_0_1_1), N(col_0_1_2)}, {N(col_0_2_1), N(col_0_2_2)}, {N(col_0_4_1), N(col_0_4_2)}},
    {{N(col_1_1_1), N(col_1_1_2)}, {N(col_1_2_1), N(col_1_2_2)}, {N(col_1_4_1), N(col_1_4_2)}},
    {{N(col_2_1_1), N(col_2_1_2)}, {N(col_2_2_1), N(col_2_2_2)}, {N(col_2_4_1), N(col_2_4_2)}},
};

static void N(gemv_cols)(const vkn_tensor *T, const float *X, int nr, float *Y, int j0, int j1)
{
    int nw = 8 * T->bits;
    int ri = nw <= 16 ? 0 : nw <= 32 ? 1 : 2;
    for (int r = 0; r < nr; r += 2) {
        col_fn f = N(col_fns)[T->codebook][ri][nr - r >= 2 ? 1 : 0];
        for (int j = j0; j < j1; j++) f(T, X + (size_t)r * T->k, Y + (size_t)r * T->n, j);
    }
}

AVX512_TARGET static void N(dequant)(const vkn_tensor *T, float *out)
{
    int K = T->bits, kt = T->k / 16, nt = T->n / 16, nw = 8 * K;
    int nreg = nw <= 16 ? 1 : nw <= 32 ? 2 : 4;
    for (int i = 0; i < kt; i++)
        for (int j = 0; j < nt; j++) {
            __m512i u0, u1 = _mm512_setzero_si512(), u2 = u1, u3 = u1;
            N(load_tile)(T->trellis + ((size_t)i * nt + j) * 16 * K, K, nreg, &u0, &u1, &u2, &u3);
            float buf[16];
            for (int c = 0; c < 16; c++) {
                _mm512_storeu_ps(buf, N(decode16)(N(states16)(K, c, nreg, u0, u1, u2, u3), T->codebook));
                for (int l = 0; l < 16; l++) {
                    int t = 16 * c + l;
                    out[(size_t)(16 * i + tile_row(t)) * T->n + 16 * j + tile_col(t)] = buf[l];
                }
            }
        }
}

#undef INLINE
