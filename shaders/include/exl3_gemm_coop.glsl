// The EXL3 GEMM core on cooperative matrices (GL_KHR_cooperative_matrix): C[BM rows, band] = A · Ŵ for one
// 128-column band and a range of k-tiles, fp16 x fp16 products accumulated in fp32 by the subgroup's matrix
// unit. The k-loop decodes a k-step (COOP_KSTEP k-tiles x the band's 8 n-tiles = 32 tiles: one lane of one tile
// per invocation, exl3_decode.glsl's split) into shared fp16, stages the step's A rows beside it, then each of the
// 8 subgroups multiplies its 16-column n-tile with every 16-row m-tile. The weights and A rows of the next step
// are loaded before the multiplications, so their memory round trip overlaps them.
//
// Not bit-identical with the FMA core (exl3_gemm.glsl): the matrix unit sums products in its own order.
// COOP_EMULATE builds the same data flow with a plain fp32 multiply in place of the matrix unit (no
// cooperative-matrix capability): what lavapipe tests (tests/test_coopmat.py).
//
// The includer defines COOP_BM (rows per tile, a multiple of 16), WG_SIZE = 256, CB, gemm_b_word /
// gemm_b_word4 (exl3_tile_load.glsl), uvec4 coop_a_word4(int src, uint index4) (A as packed fp16, 16 bytes at a
// time) and the fp32 buffer partial[] the results go to, and includes exl3_decode.glsl with EXL3_F16 defined.
// Optional: COOP_A_ROW(row0, r), the index in A of the tile's row r (default row0 + r: contiguous rows; the MoE
// gathers its rows by (token, slot)). Needs subgroups of COOP_SUBGROUP (32) invocations: one per n-tile of the
// band. The weights (source b_src, K = kb bits, starting at word b_base) and A (source a_src) are arguments, so
// one shader may run several projections (the MoE's gate, up and down experts).
#ifndef EXL3_GEMM_COOP_GLSL
#define EXL3_GEMM_COOP_GLSL

#include "exl3_tile_load.glsl"

#ifndef COOP_A_ROW
#define COOP_A_ROW(row0, r) ((row0) + (r))
#endif

#define COOP_KDEPTH (COOP_KSTEP * 16u)           // k per step
#define COOP_B_STRIDE (BAND + COOP_PAD)           // fp16 elements per k-row of the decoded step
#define COOP_A_STRIDE (COOP_KDEPTH + COOP_PAD)    // fp16 elements per row of the staged A
#define COOP_MT (COOP_BM / 16u)                   // m-tiles per workgroup tile
#define COOP_A_VEC4 (COOP_BM * COOP_KDEPTH / 8u)  // 16-byte A loads per step

shared float16_t coop_b[COOP_KDEPTH * COOP_B_STRIDE];
shared float16_t coop_a[COOP_BM * COOP_A_STRIDE];

#ifdef COOP_EMULATE
// The data flow without cooperative matrices (a test build for devices without them, e.g. lavapipe): invocation
// tid holds elements (tid & 31) * 8 .. +7 of each m-tile of n-tile tid >> 5, summed in fp32.
float coop_emu[COOP_MT * 8u];
#define COOP_NT (gl_LocalInvocationID.x >> 5)
#else
#extension GL_KHR_cooperative_matrix : require
#define COOP_NT gl_SubgroupID
#endif

// This invocation's lane of one tile of step kt: its K words and the word before them (the tail-biting wrap).
void coop_load_lane(int b_src, int kb, uint b_base, uint kt, uint tiles_n, uint band, out uint words[8],
                    out uint prev) {
    uint tid = gl_LocalInvocationID.x, q = tid & 7u, t = tid >> 3;
    uint tile_words = 8u * uint(kb);
    uint base = b_base + ((kt + (t >> 3)) * tiles_n + band * 8u + (t & 7u)) * tile_words;
    gemm_load_lane(b_src, kb, base + uint(kb) * q, words);
    prev = gemm_b_word(b_src, base + (uint(kb) * q + tile_words - 1u) % tile_words);
}

// Decode the lane into coop_b: pair i of the lane holds k-rows (row, row + 1) of column q or q + 8 of its tile.
void coop_decode_lane(int kb, uint words[8], uint prev) {
    uint tid = gl_LocalInvocationID.x, q = tid & 7u, t = tid >> 3;
    f16vec2 hv[16];
    decode_lane_h(kb, CB, words, prev, hv);
    uint k0 = (t >> 3) * 16u, c0 = (t & 7u) * 16u + q;
    [[unroll]] for (int i = 0; i < 16; ++i) {
        uint row = k0 + 2u * uint(i >> 2) + 8u * uint(i & 1), col = c0 + 8u * uint((i >> 1) & 1);
        coop_b[row * COOP_B_STRIDE + col] = hv[i].x;
        coop_b[(row + 1u) * COOP_B_STRIDE + col] = hv[i].y;
    }
}

// This invocation's share of the step's A rows (zeros past row nr): COOP_A_VEC4 / WG_SIZE 16-byte loads.
void coop_load_a(int a_src, uint row0, uint nr, uint k, uint kt, out uvec4 a[COOP_A_VEC4 / WG_SIZE]) {
    [[unroll]] for (uint p = 0u; p < COOP_A_VEC4 / WG_SIZE; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_KDEPTH / 8u), c8 = idx % (COOP_KDEPTH / 8u);
        a[p] = r < nr ? coop_a_word4(a_src, (COOP_A_ROW(row0, r) * k + kt * 16u) / 8u + c8) : uvec4(0u);
    }
}

void coop_store_a(uvec4 a[COOP_A_VEC4 / WG_SIZE]) {
    [[unroll]] for (uint p = 0u; p < COOP_A_VEC4 / WG_SIZE; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_KDEPTH / 8u), c8 = idx % (COOP_KDEPTH / 8u);
        uint base = r * COOP_A_STRIDE + c8 * 8u;
        uint w[4] = uint[4](a[p].x, a[p].y, a[p].z, a[p].w);
        [[unroll]] for (int j = 0; j < 4; ++j) {
            f16vec2 h = unpackFloat2x16(w[j]);
            coop_a[base + 2u * uint(j)] = h.x;
            coop_a[base + 2u * uint(j) + 1u] = h.y;
        }
    }
}

#ifdef COOP_EMULATE
void coop_emu_multiply_step() {
    uint lane = gl_LocalInvocationID.x & 31u;
    for (uint mt = 0u; mt < COOP_MT; ++mt)
        for (uint e = 0u; e < 8u; ++e) {
            uint row = mt * 16u + (lane * 8u + e) / 16u, col = COOP_NT * 16u + (lane * 8u + e) % 16u;
            for (uint kx = 0u; kx < COOP_KDEPTH; ++kx)
                coop_emu[mt * 8u + e] += float(coop_a[row * COOP_A_STRIDE + kx]) * float(coop_b[kx * COOP_B_STRIDE + col]);
        }
}

void coop_emu_store(uint base, uint stride, uint nr) {
    uint lane = gl_LocalInvocationID.x & 31u;
    for (uint mt = 0u; mt < COOP_MT; ++mt)
        for (uint e = 0u; e < 8u; ++e)
            if (mt * 16u < nr) partial[base + (mt * 16u + (lane * 8u + e) / 16u) * stride + (lane * 8u + e) % 16u] = coop_emu[mt * 8u + e];
}
#endif

// C = A · Ŵ for rows row0 .. row0+nr-1 (A rows of k fp16 values) over k-tiles kt0 .. kt1-1 (a multiple of
// COOP_KSTEP apart), stored to the includer's partial[] (fp32): this subgroup's n-tile, m-tile mt at
// out_base + mt * 16 * out_stride, rows out_stride apart; m-tiles wholly past row nr are not stored (so a partial
// tile writes only ceil(nr / 16) * 16 rows). kt0, kt1 and nr are workgroup-uniform. The accumulators are locals
// of this one function (the NVIDIA driver gave wrong sums for a module-level array of them).
void coop_gemm(int a_src, int b_src, int kb, uint b_base, uint row0, uint nr, uint k, uint tiles_n, uint band,
               uint kt0, uint kt1, uint out_base, uint out_stride) {
#ifdef COOP_EMULATE
    for (uint i = 0u; i < COOP_MT * 8u; ++i) coop_emu[i] = 0.0;
#else
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[COOP_MT];
    [[unroll]] for (uint mt = 0u; mt < COOP_MT; ++mt)
        acc[mt] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
#endif
    uint words[8], prev;
    uvec4 a[COOP_A_VEC4 / WG_SIZE];
    if (kt0 < kt1) {
        coop_load_lane(b_src, kb, b_base, kt0, tiles_n, band, words, prev);
        coop_load_a(a_src, row0, nr, k, kt0, a);
    }
    for (uint kt = kt0; kt < kt1; kt += COOP_KSTEP) {
        coop_decode_lane(kb, words, prev);
        coop_store_a(a);
        if (kt + COOP_KSTEP < kt1) {  // the next step's loads fly during this step's multiplications
            coop_load_lane(b_src, kb, b_base, kt + COOP_KSTEP, tiles_n, band, words, prev);
            coop_load_a(a_src, row0, nr, k, kt + COOP_KSTEP, a);
        }
        barrier();
#ifdef COOP_EMULATE
        coop_emu_multiply_step();
#else
        // this subgroup's n-tile times every m-tile of the step
        [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
            coopMatLoad(b, coop_b, kk * 16u * COOP_B_STRIDE + COOP_NT * 16u, COOP_B_STRIDE,
                        gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint mt = 0u; mt < COOP_MT; ++mt) {
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> am;
                coopMatLoad(am, coop_a, mt * 16u * COOP_A_STRIDE + kk * 16u, COOP_A_STRIDE,
                            gl_CooperativeMatrixLayoutRowMajor);
                acc[mt] = coopMatMulAdd(am, b, acc[mt]);
            }
        }
#endif
        barrier();
    }
#ifdef COOP_EMULATE
    coop_emu_store(out_base, out_stride, nr);
#else
    [[unroll]] for (uint mt = 0u; mt < COOP_MT; ++mt)
        if (mt * 16u < nr) coopMatStore(acc[mt], partial, out_base + mt * 16u * out_stride, out_stride, gl_CooperativeMatrixLayoutRowMajor);
#endif
}

#endif
