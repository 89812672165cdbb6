#version 450
// vkmoe-compiler: glslang
// vkmoe-variants: wide=-DCOOP_WIDE idot=-DEXL3_IDOT idot_wide=-DEXL3_IDOT,-DCOOP_WIDE emulate=-DCOOP_EMULATE emulate_sg2=-DCOOP_EMULATE,-DCOOP_SG_M=2u
// EXL3 linear GEMM on cooperative matrices (exl3_gemm_coop.glsl), same contract as exl3_linear.comp: grid
// (bands, k-splits, row tiles of COOP_BM rows); each workgroup stores its fp32 partial of a (row tile, band,
// k-split), the last split of a band to arrive finishes it with the output Hadamard (linear_tail.glsl).
// Partials are stored for whole tiles: split s starts at s * m_pad * n with m_pad = m rounded up to COOP_BM.
#extension GL_GOOGLE_include_directive : require  // implied by glslc, not by glslangValidator
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define EXL3_F16
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
#ifdef COOP_WIDE
#define COOP_BM COOP_ROWS_WIDE
#else
#define COOP_BM COOP_ROWS_NARROW
#endif
layout(constant_id = SPEC_LINEAR_K) const int K = 4;
layout(constant_id = SPEC_LINEAR_CB) const int CB = 2;
layout(constant_id = SPEC_LINEAR_HAS_BIAS) const bool HAS_BIAS = false;

layout(std430, binding = 0) readonly buffer XH4 { uvec4 xh4[]; };     // (m, k) fp16, input Hadamard applied
layout(std430, binding = 1) readonly buffer Trellis { uint trellis[]; };
layout(std430, binding = 1) readonly buffer Trellis4 { uvec4 trellis4[]; };
layout(std430, binding = 2) readonly buffer Svh { uint svh[]; };     // (n,) fp16
layout(std430, binding = 3) readonly buffer Bias { uint bias[]; };   // (n,) fp16 (unused without HAS_BIAS)
layout(std430, binding = 4) writeonly buffer Y { uint y[]; };        // (m, n) fp16
layout(std430, binding = 5) nonprivate buffer Partial { float partial[]; };   // (splits, m_pad, n) fp32
layout(std430, binding = 6) nonprivate buffer Counters { uint counters[]; };  // one per (row tile, band)
layout(push_constant) uniform Push {
    uint m; uint k; uint n; uint splits; uint kt_per_split;
    float act_limit;  // (read by the FMA build's direct mode only: one push type for both)
} pc;

uint gemm_b_word(int src, uint index) { return trellis[index]; }
uvec4 gemm_b_word4(int src, uint index) { return trellis4[index]; }
uvec4 coop_a_word4(int src, uint index) { return xh4[index]; }
#include "exl3_decode.glsl"
#include "hadamard128.glsl"
#include "exl3_gemm_coop.glsl"
#define LAST_ARRIVAL_BUF counters
#include "last_arrival.glsl"
#include "linear_tail.glsl"

void main() {
    uint band = gl_WorkGroupID.x, split = gl_WorkGroupID.y, tile = gl_WorkGroupID.z;
    uint row0 = tile * COOP_BM;
    uint nr = min(COOP_BM, pc.m - row0);
    uint m_pad = gl_NumWorkGroups.z * COOP_BM;
    uint tiles_k = pc.k / 16u;
    uint kt0 = split * pc.kt_per_split, kt1 = min(tiles_k, kt0 + pc.kt_per_split);

    coop_gemm(0, 0, K, 0u, row0, nr, pc.k, pc.n / 16u, band, kt0, kt1,
              split * m_pad * pc.n + row0 * pc.n + band * BAND, pc.n, false);

    if (!wg_last_arrival(tile * (pc.n / BAND) + band, pc.splits))
        return;
    linear_output_band(band, row0, nr, m_pad * pc.n);
}
