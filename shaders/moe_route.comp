#version 450
// Split path, dispatch 1 of 4: routing prep (one workgroup).
#include "common.glsl"
#define WG_SIZE 256u
#define HAD_ROWS 4u
layout(local_size_x = 256) in;
#define MOE_ROUTE
#include "moe_bindings.glsl"
#include "moe_stages.glsl"
void main() { moe_route(); }
