#version 450
// Split path with the token-sum pass (MoePlan.token_sum_pass), after the down dispatch: each token's output from
// the (token, slot) rows the down tails wrote, summed in slot order (moe_token_out: the arithmetic the tails run
// when they sum the tokens themselves). One invocation per (token, column); grid folded into (x, y).
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() {
    uint i = (gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x) * WG_SIZE + gl_LocalInvocationID.x;
    if (i < pc.m * pc.H) moe_token_out(i / pc.H, i % pc.H);
}
