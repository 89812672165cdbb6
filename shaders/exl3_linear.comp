#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16
// EXL3 linear GEMM with fused output Hadamard: y = RN16(RN16(FWHT(xh · Ŵ) * r) * svh) (+ bias), spec section 6.
// Grid: (bands = n / 128, k-splits, row chunks of GEMM_ROWS). Each workgroup writes its fp32 partial for its
// band and k-split; the last of a band's k-splits to arrive (an atomic counter, no waiting) sums the partials
// in split order - deterministic - and applies the output Hadamard. The counter resets itself.
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
layout(constant_id = SPEC_LINEAR_K) const int K = 4;
layout(constant_id = SPEC_LINEAR_CB) const int CB = 2;
layout(constant_id = SPEC_LINEAR_ROWS) const int GEMM_ROWS = 16;
layout(constant_id = SPEC_LINEAR_HAS_BIAS) const bool HAS_BIAS = false;

layout(std430, binding = 0) readonly buffer XH { uint xh[]; };       // (m, k) fp16, input Hadamard applied
layout(std430, binding = 1) readonly buffer Trellis { uint trellis[]; };
layout(std430, binding = 0) readonly buffer XH4 { uvec4 xh4[]; };          // the same memory, 16 bytes at a time
layout(std430, binding = 1) readonly buffer Trellis4 { uvec4 trellis4[]; };
layout(std430, binding = 2) readonly buffer Svh { uint svh[]; };     // (n,) fp16
layout(std430, binding = 3) readonly buffer Bias { uint bias[]; };   // (n,) fp16 (unused without HAS_BIAS)
layout(std430, binding = 4) writeonly buffer Y { uint y[]; };        // (m, n) fp16
// Written and read by different workgroups of the dispatch: nonprivate, so that release/acquire covers them.
layout(std430, binding = 5) nonprivate buffer Partial { float partial[]; };   // (splits, m, n) fp32
layout(std430, binding = 6) nonprivate buffer Counters { uint counters[]; };  // one per (row chunk, band), start at 0
layout(push_constant) uniform Push { uint m; uint k; uint n; uint splits; uint kt_per_split; } pc;

uint gemm_b_word(int src, uint index) { return trellis[index]; }
uvec4 gemm_a_word4(const int src, uint index) { return xh4[index]; }
uvec4 gemm_b_word4(int src, uint index) { return trellis4[index]; }
#include "exl3_decode.glsl"
#include "hadamard128.glsl"
#include "exl3_gemm.glsl"
#define LAST_ARRIVAL_BUF counters
#include "last_arrival.glsl"
#include "linear_tail.glsl"

void main() {
    uint band = gl_WorkGroupID.x, split = gl_WorkGroupID.y, chunk = gl_WorkGroupID.z;
    uint row0 = chunk * uint(GEMM_ROWS);
    uint nr = min(uint(GEMM_ROWS), pc.m - row0);
    uint tiles_k = pc.k / 16u, tiles_n = pc.n / 16u;
    uint kt0 = split * pc.kt_per_split, kt1 = min(tiles_k, kt0 + pc.kt_per_split);

    [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r) gemm_row_base[r] = (row0 + uint(r)) * (pc.k / 2u);
    gemm_clear();
    gemm_accumulate(0, 0, K, CB, nr, 0u, tiles_n, band, kt0, kt1);

    if (!gemm_finish_partial(split * pc.m * pc.n, pc.n, row0, nr, band, chunk * (pc.n / BAND) + band, pc.splits))
        return;

    linear_output_band(band, row0, nr, pc.m * pc.n);
}
