#version 450
// Split path, dispatch 2 of 4: gather + input Hadamard. Grid: an upper bound of stage-1 items.
#include "common.glsl"
#define WG_SIZE 256u
#define HAD_ROWS 4u
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() {
    uint item = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (item < stage1_items()) moe_stage1(item);
}
