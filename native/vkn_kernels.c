/* Trellis decode + raw GEMV (Y = X·Ŵ, no scales) for a range of 16-column tiles; scalar and AVX-512 tiers.
 *
 * Tile layout (spec section 4): position t of a tile holds the state that ends at stream bit (t+1)K; it lands
 * on row 2(l&3)+(q&1)+8((q>>1)&1), column (l>>2)+8(q>>2) with l = t>>3, q = t&7.  For a run of 16 positions
 * t = 16c..16c+15 the column only depends on c>>1 and on bit 2 of t, and the row pattern only on c&1, so the
 * SIMD kernel keeps 8 accumulators per input row and permutes x (two patterns per tile) instead of the weights.
 */
#include "vkn_internal.h"

#include <string.h>

static int32_t g_wa[9][256], g_wc[9][256], g_sh[9][256], g_shl[9][256];
static int g_tables_ready = 0;

void vkn_init_tables(void)
{
    if (g_tables_ready) return;
    for (int K = 1; K <= 8; K++) {
        int nw = 8 * K;
        for (int t = 0; t < 256; t++) {
            int e = (t + 1) * K + 256 * K, b = e - 16;
            g_wa[K][t] = (b / 32) % nw;
            g_wc[K][t] = ((e - 1) / 32) % nw;
            g_sh[K][t] = 32 * ((e - 1) / 32 + 1) - e;
            g_shl[K][t] = 32 - g_sh[K][t];
        }
    }
    g_tables_ready = 1;
}

/* ---------------------------------------------------------------- scalar tier (any CPU) */

static void tile_states_scalar(const uint16_t *tile, int K, uint16_t *s)
{
    uint32_t U[64];
    for (int m = 0; m < 8 * K; m++) U[m] = (uint32_t)tile[2 * m] | ((uint32_t)tile[2 * m + 1] << 16);
    for (int t = 0; t < 256; t++) {
        uint64_t win = ((uint64_t)U[g_wa[K][t]] << 32) | U[g_wc[K][t]];
        s[t] = (uint16_t)(win >> g_sh[K][t]);
    }
}

static int tile_row(int t) { int l = t >> 3, q = t & 7; return 2 * (l & 3) + (q & 1) + 8 * ((q >> 1) & 1); }
static int tile_col(int t) { int l = t >> 3, q = t & 7; return (l >> 2) + 8 * (q >> 2); }

/* Decoded tile (i, j) as a row-major 16x16 fp32 block. */
static void tile_decode_scalar(const vkn_tensor *T, int i, int j, float *w)
{
    uint16_t s[256];
    int K = T->bits, nt = T->n / 16;
    tile_states_scalar(T->trellis + ((size_t)i * nt + j) * 16 * K, K, s);
    for (int t = 0; t < 256; t++) w[tile_row(t) * 16 + tile_col(t)] = T->lut[s[t]];
}

static void gemv_cols_scalar(const vkn_tensor *T, const float *X, int nr, float *Y, int j0, int j1)
{
    int kt = T->k / 16;
    float w[256];
    float acc[16];
    for (int j = j0; j < j1; j++) {
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < 16; c++) Y[(size_t)r * T->n + 16 * j + c] = 0.0f;
        for (int i = 0; i < kt; i++) {
            tile_decode_scalar(T, i, j, w);
            for (int r = 0; r < nr; r++) {
                const float *x = X + (size_t)r * T->k + 16 * i;
                float *y = Y + (size_t)r * T->n + 16 * j;
                for (int c = 0; c < 16; c++) acc[c] = 0.0f;
                for (int rr = 0; rr < 16; rr++)
                    for (int c = 0; c < 16; c++) acc[c] += x[rr] * w[rr * 16 + c];
                for (int c = 0; c < 16; c++) y[c] += acc[c];
            }
        }
    }
}

static void dequant_scalar(const vkn_tensor *T, float *out)
{
    float w[256];
    for (int i = 0; i < T->k / 16; i++)
        for (int j = 0; j < T->n / 16; j++) {
            tile_decode_scalar(T, i, j, w);
            for (int r = 0; r < 16; r++) memcpy(out + (size_t)(16 * i + r) * T->n + 16 * j, w + 16 * r, 64);
        }
}

/* ---------------------------------------------------------------- AVX-512 tier (runtime dispatched) */
#if VKN_X86
#include <immintrin.h>

/* Row index (inside the tile) of SIMD lane j for even / odd chunks c. */
static const int32_t g_xperm[2][16] = {
    {0, 1, 8, 9, 0, 1, 8, 9, 2, 3, 10, 11, 2, 3, 10, 11},
    {4, 5, 12, 13, 4, 5, 12, 13, 6, 7, 14, 15, 6, 7, 14, 15},
};
typedef void (*col_fn)(const vkn_tensor *, const float *, float *, int);

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,f16c")))
#define VKN_VNNI 0
#define N(name) name##_avx512
#include "vkn_avx512_body.h"
#undef AVX512_TARGET
#undef VKN_VNNI
#undef N

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))
#define VKN_VNNI 1
#define N(name) name##_vnni
#include "vkn_avx512_body.h"
#undef AVX512_TARGET
#undef VKN_VNNI
#undef N
#endif /* VKN_X86 */

/* ---------------------------------------------------------------- dispatch */

static int g_isa_max = 99;

int vkn_isa_supported(void)
{
#if VKN_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return __builtin_cpu_supports("avx512vnni") ? VKN_ISA_AVX512_VNNI : VKN_ISA_AVX512;
#endif
    return VKN_ISA_SCALAR;
}

int vkn_isa_active(void)
{
    int s = vkn_isa_supported();
    return s < g_isa_max ? s : g_isa_max;
}

void vkn_set_max_isa(int isa) { g_isa_max = isa < 0 ? 99 : isa; }

void vkn_gemv_cols(const vkn_tensor *T, const float *X, int nr, float *Y, int j0, int j1, int isa)
{
#if VKN_X86
    if (isa >= VKN_ISA_AVX512_VNNI) { gemv_cols_vnni(T, X, nr, Y, j0, j1); return; }
    if (isa >= VKN_ISA_AVX512) { gemv_cols_avx512(T, X, nr, Y, j0, j1); return; }
#endif
    (void)isa;
    gemv_cols_scalar(T, X, nr, Y, j0, j1);
}

void vkn_dequant(const vkn_tensor *t, float *out)
{
    vkn_init_tables();
#if VKN_X86
    int isa = vkn_isa_active();
    if (isa >= VKN_ISA_AVX512_VNNI) { dequant_vnni(t, out); return; }
    if (isa >= VKN_ISA_AVX512) { dequant_avx512(t, out); return; }
#endif
    dequant_scalar(t, out);
}
