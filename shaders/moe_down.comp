#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16
// Split path, dispatch 3 of 3: down GEMM; the last k-split of a band writes the weighted (token, slot) rows
// (stage 5) and the last slot of a token sums them (or, with the token-sum pass, moe_token_sum.comp after it).
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() {
    if (gl_WorkGroupID.y < routed_chunks()) moe_down(gl_WorkGroupID.y * down_items_per_chunk() + gl_WorkGroupID.x);
}
