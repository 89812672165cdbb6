#version 450
// Split path, dispatch 1 of 3 (of 4 with the token-sum pass): routing prep (workgroup 0) beside stage 1, the
// gather + input Hadamard (all other workgroups: stage 1 indexes rows by (token, slot), so it needs no routing
// result). Grid: 1 + an upper bound of stage-1 items, as (x, y).
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#define MOE_ROUTE
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() {
    uint wg = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (wg == 0u) moe_route();
    else if (wg - 1u < stage1_items()) moe_stage1(wg - 1u);
}
