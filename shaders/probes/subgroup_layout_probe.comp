#version 450
// Do this device's subgroups tile a 256-invocation workgroup linearly (invocation index = subgroup id x
// subgroup size + subgroup invocation id)? The packed-fp16 decode fetches a tile's wrap word from the previous
// lane by subgroup shuffle and relies on it; every driver seen so far does so, but Vulkan does not promise it.
#extension GL_KHR_shader_subgroup_basic : require
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer Out { uint ok[]; };
void main() {
    uint linear = gl_SubgroupID * gl_SubgroupSize + gl_SubgroupInvocationID;
    ok[gl_LocalInvocationIndex] = linear == gl_LocalInvocationIndex ? 1u : 0u;
}
