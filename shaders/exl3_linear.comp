#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16
// EXL3 linear GEMM with fused output Hadamard: y = RN16(RN16(FWHT(xh · Ŵ) * r) * svh) (+ bias), spec section 6.
// Grid: (bands = n / 128, k-splits, row chunks of GEMM_ROWS). Each workgroup writes its fp32 partial for its
// band and k-split; the last of a band's k-splits to arrive (an atomic counter, no waiting) sums the partials
// in split order - deterministic - and applies the output Hadamard. The counter resets itself.
// Direct mode (DIRECT, one row: m = 1): binding 0 holds x itself, and each workgroup builds the input Hadamard
// of the 128-blocks its k-range covers in shared memory while its first weight tiles are in flight (the same
// arithmetic as exl3_had_in.comp, so the same bits), instead of a dispatch and a barrier of their own before it.
// Direct mode with ACT_IN (a device block's shared down, vkmoe/ops/block.py): x is the activation of the shared
// gate (binding 0) and up (binding 8) outputs, computed while the row is built (block_math.glsl: the bits of the
// block's own activation pass), so the shared down needs no pass before it.
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
layout(constant_id = SPEC_LINEAR_K) const int K = 4;
layout(constant_id = SPEC_LINEAR_CB) const int CB = 2;
layout(constant_id = SPEC_LINEAR_ROWS) const int GEMM_ROWS = 16;
layout(constant_id = SPEC_LINEAR_HAS_BIAS) const bool HAS_BIAS = false;
layout(constant_id = SPEC_LINEAR_DIRECT) const bool DIRECT = false;
layout(constant_id = SPEC_LINEAR_ACT_IN) const int ACT_IN = -1;  // direct mode: x = act(binding 0, binding 8); -1: x

layout(std430, binding = 0) readonly buffer XH { uint xh[]; };       // (m, k) fp16, input Hadamard applied (DIRECT: x)
layout(std430, binding = 1) readonly buffer Trellis { uint trellis[]; };
layout(std430, binding = 0) readonly buffer XH4 { uvec4 xh4[]; };          // the same memory, 16 bytes at a time
layout(std430, binding = 1) readonly buffer Trellis4 { uvec4 trellis4[]; };
layout(std430, binding = 2) readonly buffer Svh { uint svh[]; };     // (n,) fp16
layout(std430, binding = 3) readonly buffer Bias { uint bias[]; };   // (n,) fp16 (unused without HAS_BIAS)
layout(std430, binding = 4) writeonly buffer Y { uint y[]; };        // (m, n) fp16
// Written and read by different workgroups of the dispatch: nonprivate, so that release/acquire covers them.
layout(std430, binding = 5) nonprivate buffer Partial { float partial[]; };   // (splits, m, n) fp32
layout(std430, binding = 6) nonprivate buffer Counters { uint counters[]; };  // one per (row chunk, band), start at 0
layout(std430, binding = 7) readonly buffer Suh { uint suh[]; };     // (k,) fp16 (read in DIRECT mode only)
layout(std430, binding = 8) readonly buffer UpIn { uint up_in[]; };  // (1, k) fp16: ACT_IN's up (binding 0: gate)
layout(push_constant) uniform Push {
    uint m; uint k; uint n; uint splits; uint kt_per_split;
    float act_limit;    // ACT_IN: the activation's limit (0: none)
} pc;

uint gemm_b_word(int src, uint index) { return trellis[index]; }
uvec4 gemm_a_word4(const int src, uint index);
uvec4 gemm_b_word4(int src, uint index) { return trellis4[index]; }
// Direct mode: this workgroup's k-range, for its A row (linear_direct_a_row) built after the first weight requests
uint linear_kt0 = 0u, linear_kt1 = 0u;
void linear_direct_a_row(uint kt0, uint kt1);
#define GEMM_AFTER_PREFETCH(a_src) if (DIRECT) linear_direct_a_row(linear_kt0, linear_kt1)
#include "block_math.glsl"
// The activated pair is xor-ed with opaque_zero() (common.glsl) before the Hadamard unpacks it: measured on an H100
// (BENCHMARKS.md, twenty-ninth session), the driver otherwise folds the fp16 pack and unpack together, and the row
// takes the unrounded fp32 activation: other bits than the block's activation pass writes.
uint linear_x_word(uint i) {
    if (ACT_IN < 0) return xh[i];
    return block_activate_pair(xh[i], up_in[i], uint(ACT_IN), pc.act_limit) ^ opaque_zero();
}
#define HAD_IN_X(i) linear_x_word(i)
#define HAD_IN_SUH(i) suh[i]
#include "exl3_decode.glsl"
#include "hadamard128.glsl"
#include "exl3_gemm.glsl"
#define LAST_ARRIVAL_BUF counters
#include "last_arrival.glsl"
#define LINEAR_TAIL_SCRATCH(i) gemm_red[i]  // free after the k-slice reduction
#include "linear_tail.glsl"

// Direct mode's A: gemm_red holds the packed fp16 row from block kt0 / 8 on (gemm_row_base[0] offsets the GEMM's
// word index to it).
uvec4 gemm_a_word4(const int src, uint index) {
    if (DIRECT) {
        uint w = 4u * index;
        return uvec4(gemm_red[w], gemm_red[w + 1u], gemm_red[w + 2u], gemm_red[w + 3u]);
    }
    return xh4[index];
}

// Whole workgroup: the input Hadamard of x's row 0 over the 128-blocks that hold k-tiles [kt0, kt1), into gemm_red
// as packed fp16 words, one block per Hadamard row (at most GEMM_RED_WORDS / 64 blocks: the plan keeps
// kt_per_split within layout.DIRECT_MAX_KT). gemm_red is free until the GEMM's partials (after its last read of A).
void linear_direct_a_row(uint kt0, uint kt1) {
    uint b0 = kt0 / 8u, nb = wg_uniform(kt1 > kt0 ? (kt1 + 7u) / 8u - b0 : 0u), c0 = had_col0();
    for (uint r0 = 0u; r0 < nb; r0 += HAD_PASS_ROWS) {  // around barriers (shared-memory transform): nb uniform
        uint r = r0 + had_row(), col = (b0 + min(r, nb - 1u)) * 128u + c0;
        had_in_load(col / 2u, col / 2u);
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
            if (r < nb) gemm_red[r * 64u + (c0 + j) / 2u] = had_scaled_word(j);
    }
    barrier();  // the GEMM reads the whole row
}

void main() {
    uint band = gl_WorkGroupID.x, split = gl_WorkGroupID.y, chunk = gl_WorkGroupID.z;
    uint row0 = chunk * uint(GEMM_ROWS);
    uint nr = min(uint(GEMM_ROWS), pc.m - row0);
    uint tiles_k = pc.k / 16u, tiles_n = pc.n / 16u;
    uint kt0 = split * pc.kt_per_split, kt1 = min(tiles_k, kt0 + pc.kt_per_split);

    [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r)
        gemm_row_base[r] = DIRECT ? 0u - (kt0 / 8u) * 64u : (row0 + uint(r)) * (pc.k / 2u);
    linear_kt0 = kt0;
    linear_kt1 = kt1;
    gemm_clear();
    gemm_accumulate(0, 0, K, CB, nr, 0u, tiles_n, band, kt0, kt1);

    if (!gemm_finish_partial(split * pc.m * pc.n, pc.n, row0, nr, band, chunk * (pc.n / BAND) + band, pc.splits))
        return;

    linear_output_band(band, row0, nr, pc.m * pc.n);
}
