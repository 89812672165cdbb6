#version 450
// Gemma 4's block RMSNorms, one workgroup per row: y = x / sqrt(mean(x²) + eps) · w · scale, in fp32 (as
// vkmoe/models/sparse_moe.py's _rms_norm), x and y fp16 pairs or fp32; `accumulate` adds into y instead
// (out += norm(shared)). In place (x = y) is safe: an invocation reads its own columns again before writing them.
// Loops over H have the same trip count in every invocation (Mesa 22.3's rule, moe_stages.glsl).
#include "common.glsl"
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer X { uint x[]; };
layout(std430, binding = 1) readonly buffer W { float w[]; };   // (H,) fp32
layout(std430, binding = 2) buffer Y { uint y[]; };
layout(push_constant) uniform Push { uint H; float eps; float scale; uint x_f32; uint y_f32; uint accumulate; } pc;

shared float s_part[256];

vec2 x_pair(uint i) {
    return pc.x_f32 != 0u ? vec2(uintBitsToFloat(x[2u * i]), uintBitsToFloat(x[2u * i + 1u])) : unpackHalf2x16(x[i]);
}

void main() {
    uint tid = gl_LocalInvocationID.x, row = gl_WorkGroupID.x, pairs = wg_uniform(pc.H / 2u);
    float acc = 0.0;
    for (uint p0 = 0u; p0 < pairs; p0 += 256u) {
        uint p = p0 + tid;
        if (p < pairs) { vec2 v = x_pair(row * pairs + p); acc += v.x * v.x + v.y * v.y; }
    }
    float s = subgroupAdd(acc);
    if (subgroupElect()) s_part[gl_SubgroupID] = s;
    barrier();
    float total = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) total += s_part[i];
    float root = sqrt(total / float(pc.H) + pc.eps);
    for (uint p0 = 0u; p0 < pairs; p0 += 256u) {
        uint p = p0 + tid, i = row * pairs + p;
        if (p < pairs) {
            vec2 v = x_pair(i) / root * vec2(w[2u * p], w[2u * p + 1u]) * pc.scale;
            if (pc.y_f32 == 0u) {
                y[i] = packHalf2x16(v);
            } else {
                if (pc.accumulate != 0u) v += vec2(uintBitsToFloat(y[2u * i]), uintBitsToFloat(y[2u * i + 1u]));
                y[2u * i] = floatBitsToUint(v.x);
                y[2u * i + 1u] = floatBitsToUint(v.y);
            }
        }
    }
}
