// The EXL3 GEMM core shared by the linear op and the MoE stages: C[rows, band] = A[rows, k] · Ŵ[k, band] for one
// 128-column band (8 tiles of 16 columns) and a range of k-tiles, with fp16 weights decoded on the fly and fp32
// accumulation.
//
// Workgroup of 256 invocations = 32 tile slots x 8 lanes: slot s works on n-tile (s & 7) of the band and on
// k-tiles kt0 + (s >> 3), +4, +8, ... (four k-slices in flight). A band is exactly one Hadamard block, so the
// workgroup that finishes a band can apply the output Hadamard itself.
//
// The including shader defines, before including:
//   GEMM_ROWS            max rows per pass (a specialization constant; 1..16)
//   uvec4 gemm_a_word4(const int src, uint index4)   4 packed fp16 pairs of A (pairs of consecutive k of one row)
//   uint gemm_b_word(const int src, uint index)      trellis word
//   uvec4 gemm_b_word4(src, index4)                  the trellis, 16 bytes at a time
// (a prototype is enough: the MoE defines gemm_a_word4 after this file, reading gemm_red for one of its sources)
// and includes exl3_decode.glsl first. Optional: GEMM_AFTER_PREFETCH(a_src), called by the whole workgroup once
// the first weight tiles are requested and before A is read (the persistent MoE kernel waits for its inputs
// there; the MoE's direct mode builds its A row there); GEMM_TILES_PER_STEP (below).

#ifndef EXL3_GEMM_GLSL
#define EXL3_GEMM_GLSL

#define GEMM_WG 256u

#include "exl3_tile_load.glsl"

// The k-slice partials of 4 rows as fp32 bits: gemm_red[(kslice * 4 + row) * 128 + column]. Words, not floats:
// the MoE's direct mode (moe_stages.glsl) keeps a gate/up item's fp16 A row here while the GEMM runs (the
// partials come after the last read of A), and packed fp16 pairs must not pass through float registers.
// GEMM_RED_WORDS = 4 k-slices x 4 rows x 128 columns (vkmoe/layout.py, through the generated header).
shared uint gemm_red[GEMM_RED_WORDS];

// This invocation's accumulators: gemm_acc[r * 2 + c] for row r and its two columns c. A module-level array
// (not a parameter): arrays sized by specialization constants do not survive being passed by value.
float gemm_acc[GEMM_ROWS * 2];

// Where row r of A starts (uint words), set by the caller before gemm_accumulate: rows need not be evenly spaced
// (the MoE gathers its rows by (token, slot)).
uint gemm_row_base[GEMM_ROWS];

void gemm_clear() {
    [[unroll]] for (int i = 0; i < GEMM_ROWS * 2; ++i) gemm_acc[i] = 0.0;
}

// The k-loop's tiles per step (the includer may define GEMM_TILES_PER_STEP 2; default 1). Each step decodes its
// tiles while the next step's loads are in flight, so 2 x GEMM_TILES_PER_STEP tiles' loads per invocation are in
// flight. Measured, two pay in the persistent kernel and not in the split dispatches or the linear, with the same
// workgroups per SM (BENCHMARKS.md, thirty-third session, H100: two in every GEMM took the Qwen3 shape at m = 4
// from 74.5 to 65.0 us persistent and from 64.9 to 71.7 split); three spilled to local memory at 16 rows. Each
// tile's words are a named array: a 2D array of tiles went to local memory on the H100 (thirty-second session).
#ifndef GEMM_TILES_PER_STEP
#define GEMM_TILES_PER_STEP 1
#endif
#if GEMM_TILES_PER_STEP != 1 && GEMM_TILES_PER_STEP != 2
#error "GEMM_TILES_PER_STEP must be 1 or 2"
#endif

// Request this lane's words of the tile at trellis word `base` (and, for the fp32 decode, the word before them).
void gemm_load_tile(int b_src, int K, uint base, uint first, uint prev_index, inout uint words[8], inout uint prev) {
    gemm_load_lane(b_src, K, base + first, words);
#ifndef EXL3_F16
    prev = gemm_b_word(b_src, base + prev_index);
#endif
}

// Decode this lane's 32 values of k-tile kt from its words and add their products with rows r < nr of A into
// gemm_acc (nr = 0: decoded, nothing added; the caller's loops stay uniform).
void gemm_tile(const int a_src, int K, const int cb, uint nr, uint kt, uint words[8], uint prev) {
#ifdef EXL3_F16
    // The word before this lane's words is the last word of the previous lane of the same tile (lane 7 for lane 0:
    // the tail-biting wrap). The 8 lanes of a tile are 8 aligned consecutive subgroup invocations.
    uint sid = gl_SubgroupInvocationID;
    prev = subgroupShuffle(words[K - 1], (sid & ~7u) | ((sid + 7u) & 7u));
    f16vec2 hv[16];
    decode_lane_h(K, cb, words, prev, hv);
#else
    float vals[32];
    decode_lane(K, cb, words, prev, vals);
#endif
    [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r) {
        if (uint(r) < nr) {
            uint xa = gemm_row_base[r] + kt * 8u;
            uvec4 xlo = gemm_a_word4(a_src, xa >> 2), xhi = gemm_a_word4(a_src, (xa >> 2) + 1u);
            uint xw[8] = uint[8](xlo.x, xlo.y, xlo.z, xlo.w, xhi.x, xhi.y, xhi.z, xhi.w);
#ifdef EXL3_F16
            // fp16 products summed in fp16 within the tile (8 pairs per column), then folded into fp32.
            f16vec2 h0 = f16vec2(0.0), h1 = f16vec2(0.0);
            [[unroll]] for (int i = 0; i < 16; ++i) {
                int j = 2 * i, wi = (j >> 3) + 4 * ((j >> 1) & 1);
                f16vec2 x = unpackFloat2x16(xw[wi]);
                if ((j & 4) == 0) h0 = fma(x, hv[i], h0);
                else              h1 = fma(x, hv[i], h1);
            }
            gemm_acc[r * 2] += float(h0.x) + float(h0.y);
            gemm_acc[r * 2 + 1] += float(h1.x) + float(h1.y);
#else
            float s0 = 0.0, s1 = 0.0;
            // Positions j, j+1 hold k-rows (row, row+1) of the tile, packed in A word row/2.
            [[unroll]] for (int j = 0; j < 32; j += 2) {
                int wi = (j >> 3) + 4 * ((j >> 1) & 1);
                vec2 x = unpackHalf2x16(xw[wi]);
                if ((j & 4) == 0) s0 += x.x * vals[j] + x.y * vals[j + 1];
                else              s1 += x.x * vals[j] + x.y * vals[j + 1];
            }
            gemm_acc[r * 2] += s0;
            gemm_acc[r * 2 + 1] += s1;
#endif
        }
    }
}

// Accumulate gemm_acc[r * 2 + c] for rows r < nr, this invocation's two columns c, over its k-tiles.
// Row r of A starts at gemm_row_base[r] (uint words; a row of k fp16 values is k/2 words, a multiple of 64, so
// gemm_row_base[r] + 8 kt is 32-byte aligned); b_base in uint words.
void gemm_accumulate(const int a_src, int b_src, int K, const int cb, uint nr,
                     uint b_base, uint tiles_n, uint band, uint kt0, uint kt1) {
    uint tid = gl_LocalInvocationID.x;
    uint q = tid & 7u, slot = tid >> 3;
    uint nt = band * 8u + (slot & 7u);
    uint tile_words = 8u * uint(K);
    uint first = uint(K) * q;                       // this lane's first word inside the tile
    uint prev_index = (first + tile_words - 1u) % tile_words;
    // Trellis word where k-tile KT of this slot's n-tile starts (tiles are stored k-tile-major, n-tiles inside).
#define GEMM_TILE_BASE(KT) (b_base + ((KT) * tiles_n + nt) * tile_words)
    // The next step's tiles are loaded before this step's are decoded: decode is cheap next to a memory round trip,
    // and a k-slice has only a few tiles per invocation at small batch sizes. Slot tiles kt, kt + 4, ...
    const uint step = 4u * uint(GEMM_TILES_PER_STEP);
    uint kt = kt0 + (slot >> 3);
    uint next_a[8], prev_a = 0u;
    if (kt < kt1)
        gemm_load_tile(b_src, K, GEMM_TILE_BASE(kt), first, prev_index, next_a, prev_a);
#if GEMM_TILES_PER_STEP >= 2
    uint next_b[8] = uint[8](0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u), prev_b = 0u;
    if (kt + 4u < kt1)
        gemm_load_tile(b_src, K, GEMM_TILE_BASE(kt + 4u), first, prev_index, next_b, prev_b);
#endif
#ifdef GEMM_AFTER_PREFETCH
    // The includer's preparation of A (the persistent MoE kernel's wait for the previous stage, or the direct
    // mode's stage 1): the first step's weight loads above are already in flight, and weights depend on nothing.
    GEMM_AFTER_PREFETCH(a_src);
#endif
    for (; kt < kt1; kt += step) {
        uint words_a[8] = next_a, pa = prev_a;
        if (kt + step < kt1)
            gemm_load_tile(b_src, K, GEMM_TILE_BASE(kt + step), first, prev_index, next_a, prev_a);
#if GEMM_TILES_PER_STEP >= 2
        uint words_b[8] = next_b, pb = prev_b;
        if (kt + step + 4u < kt1)
            gemm_load_tile(b_src, K, GEMM_TILE_BASE(kt + step + 4u), first, prev_index, next_b, prev_b);
#endif
        gemm_tile(a_src, K, cb, nr, kt, words_a, pa);
        // A step's second tile past the slot's last one is decoded (from whatever words next_b holds) but not added:
        // no branch around the tile's loops (Mesa 22.3's rule on loops beside barriers, hadamard128.glsl).
#if GEMM_TILES_PER_STEP >= 2
        gemm_tile(a_src, K, cb, kt + 4u < kt1 ? nr : 0u, kt + 4u, words_b, pb);
#endif
    }
#undef GEMM_TILE_BASE
}

// Write the k-slice partials of rows r0 .. r0+3 into gemm_red; after a barrier, gemm_red_sum(row - r0, column)
// adds the four slices in a fixed order (deterministic). Column of an invocation: (slot & 7) * 16 + q (+ 8).
void gemm_stage_rows(uint r0) {
    uint tid = gl_LocalInvocationID.x;
    uint q = tid & 7u, slot = tid >> 3;
    uint kslice = slot >> 3;
    uint col = (slot & 7u) * 16u + q;
    [[unroll]] for (int rr = 0; rr < 4; ++rr) {
        [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r) {
            if (uint(r) == r0 + uint(rr)) {
                gemm_red[(kslice * 4u + uint(rr)) * 128u + col] = floatBitsToUint(gemm_acc[r * 2]);
                gemm_red[(kslice * 4u + uint(rr)) * 128u + col + 8u] = floatBitsToUint(gemm_acc[r * 2 + 1]);
            }
        }
    }
}

float gemm_red_at(uint kslice, uint rr, uint col) { return uintBitsToFloat(gemm_red[(kslice * 4u + rr) * 128u + col]); }

float gemm_red_sum(uint rr, uint col) {
    return ((gemm_red_at(0u, rr, col) + gemm_red_at(1u, rr, col)) + gemm_red_at(2u, rr, col))
           + gemm_red_at(3u, rr, col);
}

#endif
