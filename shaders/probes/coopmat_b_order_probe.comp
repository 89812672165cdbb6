#version 450
// vkmoe-compiler: glslang
// Which elements of a 16x16 fp16 B matrix does each invocation of a subgroup hold, in which order? The
// cooperative-matrix MoE stages' B-register build (exl3_gemm_coop.glsl, COOP_BREG) fills B fragments element by
// element and is right only where lane L = 4g + t holds (k, n) = (2t, g), (2t+1, g), (2t+8, g), (2t+9, g), then
// the same rows of column g + 8 (NVIDIA's order; Vulkan leaves it to the implementation). One subgroup loads B with
// element (k, n) = k * 16 + n (exact in fp16) and writes element i of invocation L to word 8 L + i; word 256 gets
// the fragment's length (the host checks for 8, i.e. 32 invocations; vkmoe.vk.quirks.cooperative_matrix_b_order).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#pragma use_vulkan_memory_model
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer Words { uint words[]; };
shared float16_t b_s[256];
void main() {
    uint l = gl_LocalInvocationID.x;
    for (uint e = l; e < 256u; e += 32u) b_s[e] = float16_t(e);
    barrier();
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
    coopMatLoad(mb, b_s, 0u, 16u, gl_CooperativeMatrixLayoutRowMajor);  // row k, column n at k * 16 + n
    uint len = uint(mb.length());
    for (uint i = 0u; i < len && i < 8u; ++i) words[8u * l + i] = uint(float(mb[i]));
    if (l == 0u) words[256] = len;
}
