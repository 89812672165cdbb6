#version 450
// Input Hadamard of a linear (spec section 5, had_in): y = RN16(FWHT(RN16(x * suh)) * r) per 128-block of each
// row. One workgroup transforms HAD_IN_UNITS_PER_WG (row, block) units, one per Hadamard row, HAD_PASS_ROWS at a
// time (hadamard128.glsl).
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"

layout(std430, binding = 0) readonly buffer X { uint x[]; };        // (m, k) fp16
layout(std430, binding = 1) readonly buffer Suh { uint suh[]; };    // (k,) fp16
layout(std430, binding = 2) writeonly buffer Y { uint y[]; };       // (m, k) fp16
layout(push_constant) uniform Push { uint m; uint k; } pc;
#define HAD_IN_X(i) x[i]
#define HAD_IN_SUH(i) suh[i]
#include "hadamard128.glsl"

void main() {
    // The grid is folded into (x, y) within the smallest maxComputeWorkGroupCount (layout.fold_grid); the last
    // row of workgroups may run past the units (dropped below).
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    uint units = pc.m * (pc.k / 128u), c0 = had_col0();
    for (uint r0 = 0u; r0 < HAD_IN_UNITS_PER_WG; r0 += HAD_PASS_ROWS) {
        uint unit = wg * HAD_IN_UNITS_PER_WG + r0 + had_row();
        // Units past the end, or past this workgroup's (a pass of more rows than HAD_IN_UNITS_PER_WG), transform
        // unit 0 and are dropped; this invocation's columns of the row start at word w (whole fp16 pairs: c0 is
        // even).
        bool mine = r0 + had_row() < HAD_IN_UNITS_PER_WG && unit < units;
        uint w = (mine ? unit * 128u + c0 : c0) >> 1, sw = w % (pc.k / 2u);
        had_in_load(w, sw);
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
            if (mine) y[w + j / 2u] = had_scaled_word(j);
    }
}
