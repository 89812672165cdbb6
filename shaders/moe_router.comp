#version 450
// The MoE router in one dispatch. Grid (ceil(E / ROUTER_EXPERTS_PER_WG), m): each workgroup computes the logits
// of its experts for one token (router_gemv.glsl) and counts its arrival on the token's counter; the last to
// arrive, which sees every logit of the token, runs the selection (router_select.glsl). Nobody waits, and the
// counter resets itself (last_arrival.glsl). A token's result does not depend on m or on the order of arrival.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "generated/moe_layout.glsl"
layout(constant_id = SPEC_ROUTER_FAMILY) const uint FAMILY = ROUTER_STD;

layout(std430, binding = 0) readonly buffer X4 { uvec4 x4[]; };      // (m, H) fp16, or fp32
layout(std430, binding = 1) readonly buffer W4 { uvec4 w4[]; };      // (E, H) fp16 / bf16, or fp32
// Written and read by different workgroups of the dispatch: nonprivate, so that release/acquire covers them.
layout(std430, binding = 2) nonprivate buffer Logits { float logits[]; };  // (m, E) fp32
layout(std430, binding = 3) readonly buffer Bias { float bias[]; };      // (E,) selection bias (has_bias)
layout(std430, binding = 4) readonly buffer Scale { float expert_scale[]; };  // (E,) per_expert_scale
layout(std430, binding = 5) readonly buffer Table { int tid2eid[]; };    // (V, top_k) hash layers
layout(std430, binding = 6) readonly buffer Tokens { int input_ids[]; }; // (m,) hash layers
layout(std430, binding = 7) writeonly buffer Ids { int ids_out[]; };     // (m, top_k)
layout(std430, binding = 8) writeonly buffer Weights { float weights_out[]; };  // (m, top_k)
layout(std430, binding = 9) nonprivate buffer Counters { uint counters[]; };  // (m,), start at 0
layout(push_constant) uniform Push {
    uint m; uint E; uint H; uint top_k; uint n_group; uint topk_group; uint norm; uint has_bias; uint has_scale;
    uint vocab; float routed_scaling_factor; float op_scale;
} pc;
#include "router_gemv.glsl"
#include "router_select.glsl"
#define LAST_ARRIVAL_BUF counters
#include "last_arrival.glsl"

void main() {
    uint t = gl_WorkGroupID.y;
    router_gemv(t, gl_WorkGroupID.x * ROUTER_EXPERTS_PER_WG);
    if (wg_last_arrival(t, gl_NumWorkGroups.x)) router_select(t);
}
