#version 450
// WG_BARRIER_DEVICE (common.glsl) must order every invocation's buffer stores before the reads of any other
// invocation of the workgroup after it. Each invocation stores two elements of one of four 128-element rows in
// straight-line code (the shape of the Hadamard callers' output stores), then after the barrier reads two
// elements written by other invocations and counts those that are not yet what the writer stored.
#include "common.glsl"
layout(local_size_x = 256) in;
layout(std430, binding = 0) nonprivate buffer Rows { float rows[]; };   // 4 x 128 per workgroup, poisoned by the host
layout(std430, binding = 1) buffer Stale { uint stale[]; };              // per invocation: elements it saw stale
layout(push_constant) uniform Push { uint rows_valid; } pc;

void main() {
    uint tid = gl_LocalInvocationID.x, base = gl_WorkGroupID.x * 512u;
    uint row = tid / 64u, c0 = (tid % 64u) * 2u;
    [[unroll]] for (uint j = 0u; j < 2u; ++j)
        if (row < pc.rows_valid) rows[base + row * 128u + c0 + j] = float(row * 128u + c0 + j) + 1.0;
    WG_BARRIER_DEVICE();
    uint n = 0u;
    for (uint i = tid; i < 512u; i += 256u)
        if (i / 128u < pc.rows_valid && rows[base + i] != float(i) + 1.0) n += 1u;
    stale[gl_WorkGroupID.x * 256u + tid] = n;
}
