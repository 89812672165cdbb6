#version 450
// The shared-expert gate's 1-row GEMV (E = 1) and any router GEMV alone: logits (m, E) fp32 = x · Wᵀ
// (router_gemv.glsl). Grid (ceil(E / ROUTER_EXPERTS_PER_WG), m). moe_router.comp is the router proper.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"

layout(std430, binding = 0) readonly buffer X4 { uvec4 x4[]; };      // (m, H) fp16, or fp32
layout(std430, binding = 1) readonly buffer W4 { uvec4 w4[]; };      // (E, H) fp16 / bf16, or fp32
layout(std430, binding = 2) writeonly buffer Logits { float logits[]; };  // (m, E) fp32
layout(push_constant) uniform Push { uint m; uint E; uint H; } pc;
#include "router_gemv.glsl"

void main() {
    router_gemv(gl_WorkGroupID.y, gl_WorkGroupID.x * ROUTER_EXPERTS_PER_WG);
}
