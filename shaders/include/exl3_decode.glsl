// EXL3 trellis decoding (spec sections 3 and 4): 16-bit state extraction for K = 1..8 and the three codebooks.
//
// Work split (one "lane" = one invocation): a 16x16 tile is decoded by 8 lanes. Lane q of a tile reads the
// tile's 32-bit words K*q .. K*q+K-1 plus the word before them (the tail-biting wrap for q = 0) and decodes
// positions 32q .. 32q+31, which under the tensor-core permutation are all 16 k-rows of the two n-columns q
// and q+8. So a lane produces two complete column dot products per tile and needs no cross-lane reduction.
//
// The caller includes this after declaring nothing special; every function is pure.

#ifndef EXL3_DECODE_GLSL
#define EXL3_DECODE_GLSL

#include "generated/moe_layout.glsl"  // CB_*, SPEC_F16_FMA_FUSED

#ifdef EXL3_IDOT
// OpUDot with the 4x8-bit packed format: the byte sum of a word in one instruction (2.2x faster than
// shifts and masks in an H200 calibration kernel).
#extension GL_EXT_spirv_intrinsics : require
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4451)
uint spv_udot_packed(uint a, uint b, spirv_literal int packed_format);
uint byte_sum(uint x) { return spv_udot_packed(x, 0x01010101u, 0); }
#else
uint byte_sum(uint x) {
    uint pairs = (x & 0x00FF00FFu) + ((x >> 8) & 0x00FF00FFu);
    return (pairs & 0xFFFFu) + (pairs >> 16);
}
#endif

// Codebook value of a 16-bit state, before the final fp16 rounding (exact in fp32 for every codebook):
//  mul1: (1024 + B) * c1 + c0 with c1 = fp16 0x1EEE, c0 = fp16 0xC931. Each step is exact in fp32 (products
//        are multiples of 2^-18 below 2^4), so one rounding to fp16 afterwards equals the CUDA fused fp16 fma,
//        on any driver, fused or not.
//  3inst/mcg: a + b of the two fp16 halves of (x & 0x8FFF8FFF) ^ 0x3B603B60; exact in fp32, so rounding the
//        fp32 sum once equals the fp16 add.
float codebook_unrounded(uint state, int cb) {
    if (cb == CB_MUL1) {
        uint x = state * 0x83DCD12Du;
        return float(1024u + byte_sum(x)) * 0.00676727294921875 + (-10.3828125);
    }
    uint x = (cb == CB_MCG) ? state * 0xCBAC1FEDu : state * 89226354u + 64248484u;
    vec2 ab = unpackHalf2x16((x & 0x8FFF8FFFu) ^ 0x3B603B60u);
    return ab.x + ab.y;
}

// The 16 stream bits ending at bit e of a lane's segment (MSB-first). w[0] is the word before the segment,
// w[1 .. K] the segment's words. e and everything derived from it are constants after unrolling.
uint lane_state(const uint w[9], const int e) {
    int ia = (e - 16 + 32) >> 5;       // word holding the state's first bit (0 = previous word)
    int ic = ((e - 1) >> 5) + 1;       // word holding its last bit
    int shift = 32 * ic - e;
    uint lo = w[ic] >> shift;
    uint hi = shift == 0 ? 0u : (w[ia] << (32 - shift));
    return (lo | hi) & 0xFFFFu;
}

// The 32 states of a lane: st[j] = lane_state(w, (j + 1) * K) with w = (prev, words). Where K = 4, every other
// state starts 4 bits off a byte boundary; those are read from a copy of the segment shifted right by 4 bits (one
// funnel shift per word), so that every state is a byte-aligned 16-bit field of two words (on NVIDIA one byte
// permute instead of a funnel shift and a mask). K = 8 states are byte-aligned as they are.
// words: the lane's K words, prev: the word before them within the tile.
void lane_states(const int K, uint words[8], uint prev, out uint st[32]) {
    uint w[9];
    w[0] = prev;
    for (int i = 0; i < 8; ++i) w[i + 1] = words[i];
    if (K == 4) {
        uint u[9];  // u = the segment 4 bits later: state ending at bit e of w ends at bit e + 4 of u
        u[0] = w[0] >> 4;
        [[unroll]] for (int i = 1; i < 9; ++i) u[i] = (w[i] >> 4) | (w[i - 1] << 28);
        [[unroll]] for (int j = 0; j < 32; ++j) {
            int e = (j + 1) * 4;
            st[j] = (e & 7) == 0 ? lane_state(w, e) : lane_state(u, e + 4);
        }
    } else {
        [[unroll]] for (int j = 0; j < 32; ++j) st[j] = lane_state(w, (j + 1) * K);
    }
}

// Row (k index inside the tile, 0..15) of lane position j (0..31); the column is q for j & 4 == 0, else q + 8.
int lane_row(const int j) { return 2 * (j >> 3) + (j & 1) + 8 * ((j >> 1) & 1); }

// Decode the 32 values of one lane into fp16-exact floats: vals[j] for j = 0..31 (words, prev: as lane_states).
void decode_lane(const int K, const int cb, uint words[8], uint prev, out float vals[32]) {
    uint st[32];
    lane_states(K, words, prev, st);
    [[unroll]] for (int j = 0; j < 32; j += 2) {
        float a = codebook_unrounded(st[j], cb);
        float b = codebook_unrounded(st[j + 1], cb);
        vec2 r = rn16_pair(vec2(a, b));  // (common.glsl)
        vals[j] = r.x;
        vals[j + 1] = r.y;
    }
}

#ifdef EXL3_F16
// Packed fp16 decoding (16 % faster again there). Pair i of a lane = positions (2i, 2i+1) = k-rows (row, row+1) of one
// column. mcg/3inst: the fp16 add of the two halves is one correctly rounded operation, so exact everywhere.
// mul1: the fused fp16 fma of the CUDA arm is exact only where the driver really fuses it (quirk
// f16_fma_fused, measured); elsewhere the exact fp32 form is rounded once to fp16.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(constant_id = SPEC_F16_FMA_FUSED) const bool F16_FMA_FUSED = false;

// The fp16 pair of two consecutive states (s0, s1) of a lane: its positions (2i, 2i+1).
f16vec2 decode_pair_h(uint s0, uint s1, const int cb) {
    if (cb == CB_MUL1) {
        uint b0 = byte_sum(s0 * 0x83DCD12Du), b1 = byte_sum(s1 * 0x83DCD12Du);
        if (F16_FMA_FUSED) {
            // exactly 1024 + B in each half (B <= 1020, so no carry crosses): written as adds so that the
            // compiler may fold the constant into the dot product's accumulator and the shift into one add
            f16vec2 h = unpackFloat2x16((b1 << 16) + (b0 + 0x64006400u));
            return fma(h, f16vec2(float16_t(0.00676727294921875)), f16vec2(float16_t(-10.3828125)));
        }
        vec2 v = vec2(float(1024u + b0), float(1024u + b1)) * 0.00676727294921875 + (-10.3828125);
        return f16vec2(v);
    }
    uint mult = cb == CB_MCG ? 0xCBAC1FEDu : 89226354u, add = cb == CB_MCG ? 0u : 64248484u;
    uint y0 = ((s0 * mult + add) & 0x8FFF8FFFu) ^ 0x3B603B60u;
    uint y1 = ((s1 * mult + add) & 0x8FFF8FFFu) ^ 0x3B603B60u;
    return unpackFloat2x16((y0 & 0xFFFFu) | (y1 << 16)) + unpackFloat2x16((y0 >> 16) | (y1 & 0xFFFF0000u));
}

void decode_lane_h(const int K, const int cb, uint words[8], uint prev, out f16vec2 hv[16]) {
    uint st[32];
    lane_states(K, words, prev, st);
    [[unroll]] for (int i = 0; i < 16; ++i) hv[i] = decode_pair_h(st[2 * i], st[2 * i + 1], cb);
}
#endif

#endif
