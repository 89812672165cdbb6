#version 450
// Input Hadamard of a linear (spec section 5, had_in): y = RN16(FWHT(RN16(x * suh)) * r) per 128-block of each
// row. One workgroup transforms 4 (row, block) units.
#include "common.glsl"
#define WG_SIZE 256u
#define HAD_ROWS 4u
layout(local_size_x = 256) in;
#include "hadamard128.glsl"

layout(std430, binding = 0) readonly buffer X { uint x[]; };        // (m, k) fp16
layout(std430, binding = 1) readonly buffer Suh { uint suh[]; };    // (k,) fp16
layout(std430, binding = 2) writeonly buffer Y { uint y[]; };       // (m, k) fp16
layout(push_constant) uniform Push { uint m; uint k; } pc;

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint blocks_per_row = pc.k / 128u;
    uint units = pc.m * blocks_per_row;
    uint unit0 = gl_WorkGroupID.x * HAD_ROWS;
    for (uint i = tid; i < HAD_ROWS * 128u; i += WG_SIZE) {
        uint unit = unit0 + (i >> 7);
        float v = 0.0;
        if (unit < units) {
            uint row = unit / blocks_per_row, col = (unit % blocks_per_row) * 128u + (i & 127u);
            uint e = row * pc.k + col;
            v = rn16(f16_at(x[e >> 1], e) * f16_at(suh[col >> 1], col));
        }
        had_buf[i] = v;
    }
    barrier();
    had_fwht(HAD_ROWS);
    for (uint i = tid; i < HAD_ROWS * 64u; i += WG_SIZE) {  // one packed pair per iteration
        uint unit = unit0 + (i >> 6);
        if (unit < units) {
            uint row = unit / blocks_per_row, col = (unit % blocks_per_row) * 128u + (i & 63u) * 2u;
            uint b = (i >> 6) * 128u + (i & 63u) * 2u;
            y[(row * pc.k + col) >> 1] = packHalf2x16(vec2(had_buf[b], had_buf[b + 1u]) * HAD_SCALE);
        }
    }
}
