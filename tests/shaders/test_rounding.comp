#version 450
// The shaders' fp16 rounding (common.glsl: rn16, rn16_pair, where a compiler may drop it) as the output tails
// apply it, RN16(RN16(a * r) * s): one value at a time, and a pair at a time through hadamard128.glsl's
// had_out_pair itself (linear_tail.glsl, moe_stages.glsl stage 3); fp16 out, for tests/test_rounding.py to
// compare with numpy bit for bit.
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
#include "hadamard128.glsl"  // HAD_SCALE, had_set_pair, had_out_pair

layout(std430, binding = 0) readonly buffer A { vec2 a[]; };     // fp32 pairs
layout(std430, binding = 1) readonly buffer S { uint s[]; };     // fp16 pairs
layout(std430, binding = 2) writeonly buffer One { uint one[]; };
layout(std430, binding = 3) writeonly buffer Pair { uint pair[]; };
layout(push_constant) uniform Push { uint pairs; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i >= pc.pairs) return;
    vec2 v = a[i], sv = unpackHalf2x16(s[i]);
    one[i] = packHalf2x16(vec2(rn16(rn16(v.x * HAD_SCALE) * sv.x), rn16(rn16(v.y * HAD_SCALE) * sv.y)));
    had_set_pair(0u, v);
    pair[i] = packHalf2x16(had_out_pair(0u, sv));
}
