#version 450
// The device block's elementwise steps, one pair of elements per invocation (grid folded into (x, y)):
//   ELEM_TO_F16      c = fp16(a)                        an fp32 hidden rounded for the experts (a: fp32, c: fp16)
//   ELEM_ACTIVATE    c = fp16(act(a, b))                shared expert: a = gate, b = up (fp16), in fp32 as
//                                                       vkmoe/exl3/reference.py's _activate (act_limit included)
//   ELEM_ADD_SHARED  c += a (· sigmoid(b[row]))         out (fp32) += shared output (fp16) · its gate
//   ELEM_TO_F32      c = fp32(a)                        LatentMoE: out (fp32) = fc2_latent_proj's output (fp16)
#include "common.glsl"
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
#include "block_math.glsl"

layout(std430, binding = 0) readonly buffer A { uint a[]; };
layout(std430, binding = 1) readonly buffer B { uint b[]; };
layout(std430, binding = 2) buffer C { uint c[]; };
layout(push_constant) uniform Push { uint pairs; uint cols; uint mode; uint act; float limit; uint has_gate; } pc;

void main() {
    uint p = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * 256u + gl_LocalInvocationID.x;
    if (p >= pc.pairs) return;
    if (pc.mode == ELEM_TO_F16) {
        c[p] = packHalf2x16(vec2(uintBitsToFloat(a[2u * p]), uintBitsToFloat(a[2u * p + 1u])));
    } else if (pc.mode == ELEM_ACTIVATE) {
        c[p] = block_activate_pair(a[p], b[p], pc.act, pc.limit);
    } else if (pc.mode == ELEM_TO_F32) {
        vec2 v = unpackHalf2x16(a[p]);
        c[2u * p] = floatBitsToUint(v.x);
        c[2u * p + 1u] = floatBitsToUint(v.y);
    } else {
        float gate = pc.has_gate != 0u ? block_sigmoid(uintBitsToFloat(b[(2u * p) / pc.cols])) : 1.0;
        vec2 s = unpackHalf2x16(a[p]);
        c[2u * p] = floatBitsToUint(block_add_shared(uintBitsToFloat(c[2u * p]), s.x, gate));
        c[2u * p + 1u] = floatBitsToUint(block_add_shared(uintBitsToFloat(c[2u * p + 1u]), s.y, gate));
    }
}
