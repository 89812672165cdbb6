#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16
// Split path, dispatch 2 of 3: gate/up GEMM; the last k-split of a band runs the activation (stage 3).
// Grid: x = items per chunk, y = max_chunks (chunks beyond the routed count exit).
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() {
    if (gl_WorkGroupID.y < routed_chunks()) moe_gate_up(gl_WorkGroupID.y * gu_items_per_chunk() + gl_WorkGroupID.x);
}
