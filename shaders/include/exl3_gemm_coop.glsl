// The EXL3 GEMM core on cooperative matrices (GL_KHR_cooperative_matrix): C[BM rows, band] = A · Ŵ for one
// 128-column band and a range of k-tiles, fp16 x fp16 products accumulated in fp32 by the subgroup's matrix
// unit. The k-loop decodes a k-step (COOP_KSTEP k-tiles x the band's 8 n-tiles = 32 tiles: one lane of one tile
// per invocation, exl3_decode.glsl's split) into shared fp16, stages the step's A rows beside it, then the 8
// subgroups multiply: subgroup (sm, sn) of a COOP_SG_M x COOP_SG_N grid owns COOP_SMT m-tiles x COOP_SNT n-tiles
// of the workgroup tile, so a fragment loaded from shared memory feeds several products. The next step's weights
// are loaded before the multiplications, so their memory round trip overlaps them; A rows are loaded in their own
// step (coop_gemm says why).
//
// Shared layout (both padded by COOP_PAD fp16 per line so that 8 consecutive lines fall on distinct 16-byte bank
// groups): A row-major (a line = one row's k-step), Ŵ column-major (a line = one column's k-step). Both are
// uvec4 arrays: every store is 16 bytes (a lane's decoded column half is 16 consecutive k of one column), and
// coopMatLoad reads them with element and stride counted in uvec4 (GL_KHR_cooperative_matrix allows a component
// type other than the array's).
//
// With COOP_BREG (the MoE stages' _breg builds) the weights skip shared memory instead: each subgroup decodes its
// own n-tile into B fragments, and A is staged in blocks of several k-steps (the second coop_gemm below).
//
// Not bit-identical with the FMA core (exl3_gemm.glsl): the matrix unit sums products in its own order.
// COOP_EMULATE builds the same data flow with a plain fp32 multiply in place of the matrix unit (no
// cooperative-matrix capability): what lavapipe tests (tests/test_coopmat.py).
//
// The includer defines COOP_BM (rows per tile, a multiple of 16), WG_SIZE = 256, CB, gemm_b_word /
// gemm_b_word4 (exl3_tile_load.glsl), uvec4 coop_a_word4(int src, uint index4) (A as packed fp16, 16 bytes at a
// time) and the fp32 buffer partial[] the results go to, and includes exl3_decode.glsl with EXL3_F16 defined.
// Optional: COOP_A_ROW(row0, r), the index in A of the tile's row r (default row0 + r: contiguous rows; the MoE
// gathers its rows by (token, slot)); COOP_A_AHEAD, to request each step's A rows one step ahead (coop_gemm).
// Needs subgroups of COOP_SUBGROUP (32) invocations, 8 per workgroup, whose invocations 8g .. 8g+7 are
// consecutive (the tail-biting previous word comes from a shuffle, as in the FMA core).
// The weights (source b_src, K = kb bits, starting at word b_base) and A (source a_src) are arguments, so one
// shader may run several projections (the MoE's gate, up and down experts).
#ifndef EXL3_GEMM_COOP_GLSL
#define EXL3_GEMM_COOP_GLSL

#include "exl3_tile_load.glsl"

#ifndef COOP_A_ROW
#define COOP_A_ROW(row0, r) ((row0) + (r))
#endif

#define COOP_KDEPTH (COOP_KSTEP * 16u)           // k per step
#define COOP_LINE4 ((COOP_KDEPTH + COOP_PAD) / 8u)  // uvec4 per shared line (a row of A, a column of Ŵ)
#define COOP_MT (COOP_BM / 16u)                   // m-tiles per workgroup tile
#define COOP_A_VEC4 (COOP_BM * COOP_KDEPTH / 8u)  // 16-byte A loads per step
#define COOP_A_PER ((COOP_A_VEC4 + WG_SIZE - 1u) / WG_SIZE)  // per invocation (a 16-row tile: half of them load one)

// The subgroup grid: two subgroups along m once a tile has 8 m-tiles (each then loads 4 A and 2 Ŵ fragments for
// 8 products instead of 8 and 1), else all 8 along n.
#ifndef COOP_SG_M
#define COOP_SG_M (COOP_MT >= 8u ? 2u : 1u)
#endif
#define COOP_SG_N (8u / COOP_SG_M)
#define COOP_SMT (COOP_MT / COOP_SG_M)            // m-tiles per subgroup
#define COOP_SNT (8u / COOP_SG_N)                 // n-tiles per subgroup

#ifdef COOP_BREG
// The B-register build keeps no weights here, only A blocks and the down's tile in shared memory (COOP_BM lines of
// BAND / 4 + 1 uvec4 each). The 16-row tile shrinks to that (8.4 KB instead of 18.4; with it the 16-row build ran
// 9-10 % faster than with 512-k A blocks in the full array, H100, forty-fifth session); the 32-row tile keeps the
// full array, as measured (its tile and blocks take 16.9 of the 18.4 KB; the smaller array is not measured there).
#define COOP_B4_LEN (COOP_BM == 16u ? COOP_BM * (BAND / 4u + 1u) : BAND * COOP_LINE4)
#else
#define COOP_B4_LEN (BAND * COOP_LINE4)
#endif
shared uvec4 coop_b4[COOP_B4_LEN];
shared uvec4 coop_a4[COOP_BM * COOP_LINE4];

// A tile's fp32 results kept in shared memory (coop_gemm with c_in_shared; a tail that is the tile's only reader,
// e.g. one k-split): row r, band column c at float r * 4 COOP_C_LINE4 + c of coop_b4, which holds no weights once
// the k-loop's last barrier has passed (COOP_BM lines of 33 uvec4 fit its BAND lines of COOP_LINE4 >= 9). Lines
// padded by 4 floats, so that a matrix store's 16 rows start on distinct bank groups.
#define COOP_C_LINE4 (BAND / 4u + 1u)
#define COOP_C_INDEX(r, c) ((r) * COOP_C_LINE4 * 4u + (c))  // the float of row r, column c
float coop_c_at(uint r, uint c) {
    uint i = COOP_C_INDEX(r, c);
    return uintBitsToFloat(coop_b4[i >> 2][i & 3u]);
}

#ifdef COOP_EMULATE
// The data flow without cooperative matrices (a test build for devices without them, e.g. lavapipe): emulated
// subgroup tid >> 5 owns the same tiles as a real one; its invocation tid & 31 holds elements (tid & 31) * 8 ..
// +7 of each of them, summed in fp32.
float coop_emu[COOP_SMT * COOP_SNT * 8u];
#define COOP_SG (gl_LocalInvocationID.x >> 5)
#else
#extension GL_KHR_cooperative_matrix : require
#define COOP_SG gl_SubgroupID
#endif

// This invocation's lane of one tile of step kt: its K words (the word before them comes from a shuffle when the
// step is decoded).
void coop_load_lane(int b_src, int kb, uint b_base, uint kt, uint tiles_n, uint band, out uint words[8]) {
    uint tid = gl_LocalInvocationID.x, q = tid & 7u, t = tid >> 3;
    uint tile_words = 8u * uint(kb);
    uint base = b_base + ((kt + (t >> 3)) * tiles_n + band * 8u + (t & 7u)) * tile_words;
    gemm_load_lane(b_src, kb, base + uint(kb) * q, words);
}

// Decode the lane into coop_b4: pair i of the lane holds k-rows (row, row + 1) of column q (i & 2 == 0) or q + 8,
// row = 2 (i >> 2) + 8 (i & 1); so k-pair j of a column is pair 4 (j & 3) + (j >> 2) (+ 2 for column q + 8).
void coop_decode_lane(int kb, uint words[8]) {
    uint tid = gl_LocalInvocationID.x, q = tid & 7u, t = tid >> 3;
    // The word before this lane's words is the last word of the previous lane of the tile (lane 7 for lane 0).
    uint sid = gl_SubgroupInvocationID;
    uint prev = subgroupShuffle(words[kb - 1], (sid & ~7u) | ((sid + 7u) & 7u));
    f16vec2 hv[16];
    decode_lane_h(kb, CB, words, prev, hv);
    uint line = (t & 7u) * 16u + q, k4 = (t >> 3) * 2u;  // column, and its first uvec4 of this k-tile
    [[unroll]] for (uint half8 = 0u; half8 < 2u; ++half8) {
        uint c = half8 * 2u;
        coop_b4[(line + 8u * half8) * COOP_LINE4 + k4] =
            uvec4(packFloat2x16(hv[0 + c]), packFloat2x16(hv[4 + c]), packFloat2x16(hv[8 + c]),
                  packFloat2x16(hv[12 + c]));
        coop_b4[(line + 8u * half8) * COOP_LINE4 + k4 + 1u] =
            uvec4(packFloat2x16(hv[1 + c]), packFloat2x16(hv[5 + c]), packFloat2x16(hv[9 + c]),
                  packFloat2x16(hv[13 + c]));
    }
}

// This invocation's share of the step's A rows (zeros past row nr): COOP_A_PER 16-byte loads.
void coop_load_a(int a_src, uint row0, uint nr, uint k, uint kt, out uvec4 a[COOP_A_PER]) {
    [[unroll]] for (uint p = 0u; p < COOP_A_PER; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_KDEPTH / 8u), c8 = idx % (COOP_KDEPTH / 8u);
        a[p] = r < nr && idx < COOP_A_VEC4 ? coop_a_word4(a_src, (COOP_A_ROW(row0, r) * k + kt * 16u) / 8u + c8)
                                          : uvec4(0u);
    }
}

void coop_store_a(uvec4 a[COOP_A_PER]) {
    [[unroll]] for (uint p = 0u; p < COOP_A_PER; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_KDEPTH / 8u), c8 = idx % (COOP_KDEPTH / 8u);
        if (idx < COOP_A_VEC4) coop_a4[r * COOP_LINE4 + c8] = a[p];
    }
}

#ifdef COOP_EMULATE
// fp16 element e of shared line `line` of ARR, lines of line4 uvec4 (COOP_EMU_AT: the k-step's lines, coop_a4: an A
// row, coop_b4: a weight column). A macro: GLSL passes arrays by value, so a function would copy the shared tile.
#define COOP_EMU_AT_LINE4(ARR, line4, line, e) \
    unpackHalf2x16(ARR[(line) * (line4) + (e) / 8u][((e) / 2u) % 4u])[(e) % 2u]
#define COOP_EMU_AT(ARR, line, e) COOP_EMU_AT_LINE4(ARR, COOP_LINE4, line, e)

void coop_emu_multiply_step() {
    uint lane = gl_LocalInvocationID.x & 31u, sm = COOP_SG / COOP_SG_N, sn = COOP_SG % COOP_SG_N;
    for (uint i = 0u; i < COOP_SMT; ++i)
        for (uint j = 0u; j < COOP_SNT; ++j)
            for (uint e = 0u; e < 8u; ++e) {
                uint row = (sm * COOP_SMT + i) * 16u + (lane * 8u + e) / 16u;
                uint col = (sn * COOP_SNT + j) * 16u + (lane * 8u + e) % 16u;
                for (uint kx = 0u; kx < COOP_KDEPTH; ++kx)
                    coop_emu[(i * COOP_SNT + j) * 8u + e] +=
                        COOP_EMU_AT(coop_a4, row, kx) * COOP_EMU_AT(coop_b4, col, kx);
            }
}

void coop_emu_store(uint base, uint stride, uint nr, bool c_in_shared) {
    uint lane = gl_LocalInvocationID.x & 31u, sm = COOP_SG / COOP_SG_N, sn = COOP_SG % COOP_SG_N;
    for (uint i = 0u; i < COOP_SMT; ++i)
        for (uint j = 0u; j < COOP_SNT; ++j) {
            uint mt = sm * COOP_SMT + i, nt = sn * COOP_SNT + j;
            for (uint e = 0u; e < 8u; ++e) {
                uint row = mt * 16u + (lane * 8u + e) / 16u, col = nt * 16u + (lane * 8u + e) % 16u;
                float v = coop_emu[(i * COOP_SNT + j) * 8u + e];
                if (mt * 16u >= nr) continue;
                if (c_in_shared) {
                    uint f = COOP_C_INDEX(row, col);
                    coop_b4[f >> 2][f & 3u] = floatBitsToUint(v);
                } else {
                    partial[base + row * stride + col] = v;
                }
            }
        }
}
#endif

#ifdef COOP_BREG
// The B-register build (the _breg variants, VKMOE_COOPMAT_B_REGS=on; DESIGN.md, "B fragments decoded in
// registers"): the weights decoded straight into B fragments (no weights in shared memory, no per-step barriers).
// Lane L = 4g + t of a subgroup decodes stream positions 8L .. 8L+7 of a 16x16 tile: k-rows (2t, 2t+1), (2t+8,
// 2t+9) of columns g and g+8, which is the order NVIDIA's matrix unit keeps a 16x16 fp16 B matrix in (fragment
// element i of lane L). Subgroup sg owns n-tile sg of the band (COOP_SG_M = 1: tiles of fewer than 128 rows) and
// every m-tile. A is staged COOP_ABLK k at a time in coop_b4 (which holds no weights here), one barrier pair per
// block. Right only where the device's fragments use that order (vkmoe.vk.quirks.cooperative_matrix_b_order, by
// coopmat_b_order_probe.comp; kernels.coop_b_in_registers).
#define COOP_ABLK 256u                     // k per A block (16 k-tiles): an A line = a line of the down's tile
#define COOP_ABLK_T (COOP_ABLK / 16u)      // k-tiles per block, a multiple of COOP_KSTEP
#define COOP_ALINE4 (COOP_ABLK / 8u + 1u)  // uvec4 per A line (an odd count: 8 consecutive lines, distinct bank groups)

// The words a lane's 8 positions need: its window starts at the word holding the bit 16 before its first bit
// (the previous state's tail; for lane 0 the tile's last word: tail-biting), and spans 2 words at K = 4, 3 at
// K = 8, at most 4 otherwise (word-unaligned segments).
int coop_br_window(int K, uint lane) { return (8 * K * int(lane) - 16) >> 5; }  // may be -1 (wraps)

void coop_br_load(int b_src, int K, uint tile_base, uint lane, out uint w[4]) {
    int ws = coop_br_window(K, lane), nw = K == 4 ? 2 : (K == 8 ? 3 : 4);
    uint tw = 8u * uint(K);
    [[unroll]] for (int j = 0; j < 4; ++j)
        w[j] = j < nw ? gemm_b_word(b_src, tile_base + uint(ws + j + int(tw)) % tw) : 0u;
}

// The 16 bits ending at bit `end` of the window (MSB-first; 16 <= end, end - 16 < 96).
uint coop_br_bits16(uint w[4], int end) {
    int start = end - 16, i = start >> 5, off = start & 31;
    uint x = w[i] << off;
    if (off != 0) x |= w[i + 1] >> (32 - off);
    return x >> 16;
}

// The lane's 8 values of the tile as 4 fp16 pairs: pair p = fragment elements 2p, 2p + 1.
void coop_br_decode(int K, uint w[4], uint lane, out f16vec2 h[4]) {
    int e0 = (K & 3) == 0 ? 32 : 8 * K * int(lane) - 32 * coop_br_window(K, lane);  // the lane's first bit
    uint st[8];
    [[unroll]] for (int i = 0; i < 8; ++i) st[i] = coop_br_bits16(w, e0 + (i + 1) * K);
    [[unroll]] for (int p = 0; p < 4; ++p) h[p] = decode_pair_h(st[2 * p], st[2 * p + 1], CB);
}

// The block's A rows (zeros past row nr) into coop_b4: kbn k-tiles from kb0, loaded into registers, then stored.
#define COOP_BR_A_PER (COOP_BM * COOP_ABLK / 8u / WG_SIZE)
void coop_br_load_a(int a_src, uint row0, uint nr, uint k, uint kb0, uint kbn, out uvec4 a[COOP_BR_A_PER]) {
    [[unroll]] for (uint p = 0u; p < COOP_BR_A_PER; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_ABLK / 8u), c8 = idx % (COOP_ABLK / 8u);
        a[p] = r < nr && c8 < kbn * 2u ? coop_a_word4(a_src, (COOP_A_ROW(row0, r) * k + kb0 * 16u) / 8u + c8)
                                       : uvec4(0u);
    }
}
void coop_br_store_a(uint kbn, uvec4 a[COOP_BR_A_PER]) {
    [[unroll]] for (uint p = 0u; p < COOP_BR_A_PER; ++p) {
        uint idx = p * WG_SIZE + gl_LocalInvocationID.x, r = idx / (COOP_ABLK / 8u), c8 = idx % (COOP_ABLK / 8u);
        if (c8 < kbn * 2u) coop_b4[r * COOP_ALINE4 + c8] = a[p];
    }
}

#ifdef COOP_EMULATE
// The emulated subgroups' B tiles, column-major (half n * 16 + k of subgroup sg at uint sg * 128 + (n*16 + k) / 2).
shared uint coop_emu_b[8u * 128u];
void coop_br_emu_multiply(uint sg, uint lane, uint a_k0, f16vec2 h[4]) {
    uint g = lane >> 2, t = lane & 3u;
    [[unroll]] for (uint p = 0u; p < 4u; ++p)
        coop_emu_b[sg * 128u + ((g + 8u * (p >> 1)) * 16u + 2u * t + 8u * (p & 1u)) / 2u] = packFloat2x16(h[p]);
    barrier();
    for (uint i = 0u; i < COOP_SMT; ++i)
        for (uint e = 0u; e < 8u; ++e) {
            uint row = i * 16u + (lane * 8u + e) / 16u, col = (lane * 8u + e) % 16u;
            for (uint kx = 0u; kx < 16u; ++kx) {
                float av = COOP_EMU_AT_LINE4(coop_b4, COOP_ALINE4, row, a_k0 + kx);  // the A block's line
                float bv = unpackHalf2x16(coop_emu_b[sg * 128u + (col * 16u + kx) / 2u])[kx % 2u];
                coop_emu[i * 8u + e] += av * bv;
            }
        }
    barrier();
}
#endif

void coop_gemm(int a_src, int b_src, int kb, uint b_base, uint row0, uint nr, uint k, uint tiles_n, uint band,
               uint kt0, uint kt1, uint out_base, uint out_stride, bool c_in_shared) {
    uint lane = gl_LocalInvocationID.x & 31u, sg = COOP_SG;
#ifdef COOP_EMULATE
    for (uint i = 0u; i < COOP_SMT * COOP_SNT * 8u; ++i) coop_emu[i] = 0.0;
#else
    uint sm = 0u, sn = sg;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[COOP_SMT];
    [[unroll]] for (uint i = 0u; i < COOP_SMT; ++i)
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
#endif
    uint tile_words = 8u * uint(kb), col_tile = band * 8u + sg;
    uint w[COOP_KSTEP][4];
    if (kt0 < kt1)
        [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk)
            coop_br_load(b_src, kb, b_base + ((kt0 + kk) * tiles_n + col_tile) * tile_words, lane, w[kk]);
    uvec4 a[COOP_BR_A_PER];
    for (uint kb0 = kt0; kb0 < kt1; kb0 += COOP_ABLK_T) {
        uint kbn = min(kt1 - kb0, COOP_ABLK_T);
        coop_br_load_a(a_src, row0, nr, k, kb0, kbn, a);
        barrier();  // the previous block's last fragment loads
        coop_br_store_a(kbn, a);
        barrier();
        for (uint kt = kb0; kt < kb0 + kbn; kt += COOP_KSTEP) {
            f16vec2 h[COOP_KSTEP][4];
            [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk) coop_br_decode(kb, w[kk], lane, h[kk]);
            if (kt + COOP_KSTEP < kt1)  // the next step's words fly during this step's multiplications
                [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk)
                    coop_br_load(b_src, kb, b_base + ((kt + COOP_KSTEP + kk) * tiles_n + col_tile) * tile_words,
                                 lane, w[kk]);
            [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk) {
#ifdef COOP_EMULATE
                coop_br_emu_multiply(sg, lane, (kt - kb0 + kk) * 16u, h[kk]);
#else
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                [[unroll]] for (uint p = 0u; p < 4u; ++p) {
                    b[2u * p] = h[kk][p].x;
                    b[2u * p + 1u] = h[kk][p].y;
                }
                [[unroll]] for (uint i = 0u; i < COOP_SMT; ++i) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> am;
                    coopMatLoad(am, coop_b4, i * 16u * COOP_ALINE4 + (kt - kb0 + kk) * 2u, COOP_ALINE4,
                                gl_CooperativeMatrixLayoutRowMajor);
                    acc[i] = coopMatMulAdd(am, b, acc[i]);
                }
#endif
            }
        }
    }
    barrier();  // the A block's last readers, before coop_b4 takes the tile (c_in_shared) or a tail's rows
#ifdef COOP_EMULATE
    coop_emu_store(out_base, out_stride, nr, c_in_shared);
#else
    [[unroll]] for (uint i = 0u; i < COOP_SMT; ++i) {
        if (i * 16u >= nr) continue;
        if (c_in_shared)  // element and stride in uvec4 (4 floats)
            coopMatStore(acc[i], coop_b4, i * 16u * COOP_C_LINE4 + sn * 4u, COOP_C_LINE4,
                         gl_CooperativeMatrixLayoutRowMajor);
        else
            coopMatStore(acc[i], partial, out_base + i * 16u * out_stride + sn * 16u, out_stride,
                         gl_CooperativeMatrixLayoutRowMajor);
    }
#endif
}
#else
// C = A · Ŵ for rows row0 .. row0+nr-1 (A rows of k fp16 values) over k-tiles kt0 .. kt1-1 (a multiple of
// COOP_KSTEP apart), stored to the includer's partial[] (fp32): m-tile mt, n-tile nt of the band at
// out_base + mt * 16 * out_stride + nt * 16, rows out_stride apart (out_base: the band's first column of the
// tile's first row); m-tiles wholly past row nr are not stored (so a partial tile writes only ceil(nr / 16) * 16
// rows). With c_in_shared the tile goes to shared memory instead (coop_c_at reads it after a barrier; out_base and
// out_stride unused). kt0, kt1, nr and c_in_shared are workgroup-uniform. The accumulators are locals of this one
// function (the NVIDIA driver gave wrong sums for a module-level array of them).
void coop_gemm(int a_src, int b_src, int kb, uint b_base, uint row0, uint nr, uint k, uint tiles_n, uint band,
               uint kt0, uint kt1, uint out_base, uint out_stride, bool c_in_shared) {
#ifdef COOP_EMULATE
    for (uint i = 0u; i < COOP_SMT * COOP_SNT * 8u; ++i) coop_emu[i] = 0.0;
#else
    uint sm = COOP_SG / COOP_SG_N, sn = COOP_SG % COOP_SG_N;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[COOP_SMT * COOP_SNT];
    [[unroll]] for (uint i = 0u; i < COOP_SMT * COOP_SNT; ++i)
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
#endif
    uint words[8];
    uvec4 a[COOP_A_PER];
    if (kt0 < kt1) coop_load_lane(b_src, kb, b_base, kt0, tiles_n, band, words);
#ifdef COOP_A_AHEAD
    if (kt0 < kt1) coop_load_a(a_src, row0, nr, k, kt0, a);
#endif
    for (uint kt = kt0; kt < kt1; kt += COOP_KSTEP) {
#ifdef COOP_A_AHEAD
        // The MoE's 16-row tile: its A share (one 16-byte load or none per invocation, gathered rows that need
        // not be in L2) held across the multiplications costs 6-8 registers (which do not limit the stages'
        // occupancy: shared memory does, two workgroups per SM on the H100; DESIGN.md), and
        // waiting for it at every step cost the H100 9-12 % of the gate/up phase (BENCHMARKS.md, thirty-ninth
        // session).
        coop_store_a(a);
        coop_decode_lane(kb, words);
        if (kt + COOP_KSTEP < kt1) coop_load_a(a_src, row0, nr, k, kt + COOP_KSTEP, a);
#else
        // The linear's tiles: A (an L2-resident input, re-read by every band) is loaded at the step that uses it,
        // not one step ahead: holding it across the multiplications cost 20 registers (162 -> 142 on the wide
        // tile) and made the H200's linear 8192 x 8192 17-20 % slower (BENCHMARKS.md, sixteenth session)
        coop_load_a(a_src, row0, nr, k, kt, a);
        coop_decode_lane(kb, words);
        coop_store_a(a);
#endif
        if (kt + COOP_KSTEP < kt1)  // the next step's weights (from HBM) fly during this step's multiplications
            coop_load_lane(b_src, kb, b_base, kt + COOP_KSTEP, tiles_n, band, words);
        barrier();
#ifdef COOP_EMULATE
        coop_emu_multiply_step();
#else
        [[unroll]] for (uint kk = 0u; kk < COOP_KSTEP; ++kk) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b[COOP_SNT];
            [[unroll]] for (uint j = 0u; j < COOP_SNT; ++j)
                coopMatLoad(b[j], coop_b4, (sn * COOP_SNT + j) * 16u * COOP_LINE4 + kk * 2u, COOP_LINE4,
                            gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint i = 0u; i < COOP_SMT; ++i) {
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> am;
                coopMatLoad(am, coop_a4, (sm * COOP_SMT + i) * 16u * COOP_LINE4 + kk * 2u, COOP_LINE4,
                            gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint j = 0u; j < COOP_SNT; ++j)
                    acc[i * COOP_SNT + j] = coopMatMulAdd(am, b[j], acc[i * COOP_SNT + j]);
            }
        }
#endif
        barrier();
    }
#ifdef COOP_EMULATE
    coop_emu_store(out_base, out_stride, nr, c_in_shared);
#else
    [[unroll]] for (uint i = 0u; i < COOP_SMT; ++i) {
        uint mt = sm * COOP_SMT + i;
        [[unroll]] for (uint j = 0u; j < COOP_SNT; ++j) {
            if (mt * 16u >= nr) continue;
            uint nt = sn * COOP_SNT + j;
            if (c_in_shared)  // element and stride in uvec4 (4 floats)
                coopMatStore(acc[i * COOP_SNT + j], coop_b4, mt * 16u * COOP_C_LINE4 + nt * 4u, COOP_C_LINE4,
                             gl_CooperativeMatrixLayoutRowMajor);
            else
                coopMatStore(acc[i * COOP_SNT + j], partial, out_base + mt * 16u * out_stride + nt * 16u,
                             out_stride, gl_CooperativeMatrixLayoutRowMajor);
        }
    }
#endif
}

#endif  // COOP_BREG

#endif
