#version 450
// vkmoe-compiler: glslang
// Does this toolchain's cooperative-matrix SPIR-V run right on this driver? One subgroup computes C = A · B for
// A (16 x 32 fp16) and B (32 x 16 fp16) with two 16x16x16 multiply-adds into an fp32 accumulator, staged through
// shared fp16 arrays like exl3_gemm_coop.glsl. Buffer: A (256 words, two fp16 each, row-major), B (256 words,
// row-major), then C (256 fp32, row-major) written here; the host compares with numpy.
#extension GL_GOOGLE_include_directive : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#pragma use_vulkan_memory_model
layout(local_size_x = 32) in;
layout(std430, binding = 0) buffer Words { uint words[]; };
layout(std430, binding = 0) buffer Floats { float floats[]; };
shared float16_t a_s[16 * 40];  // rows padded by 8, as in the GEMM
shared float16_t b_s[32 * 24];
coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[1];
void main() {
    uint t = gl_LocalInvocationID.x;
    for (uint w = t; w < 256u; w += 32u) {
        f16vec2 a = unpackFloat2x16(words[w]), b = unpackFloat2x16(words[256u + w]);
        uint ai = (w / 16u) * 40u + (w % 16u) * 2u, bi = (w / 8u) * 24u + (w % 8u) * 2u;
        a_s[ai] = a.x; a_s[ai + 1u] = a.y;
        b_s[bi] = b.x; b_s[bi + 1u] = b.y;
    }
    barrier();
    acc[0] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    for (uint kk = 0u; kk < 2u; ++kk) {
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ma;
        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> mb;
        coopMatLoad(ma, a_s, kk * 16u, 40u, gl_CooperativeMatrixLayoutRowMajor);
        coopMatLoad(mb, b_s, kk * 16u * 24u, 24u, gl_CooperativeMatrixLayoutRowMajor);
        acc[0] = coopMatMulAdd(ma, mb, acc[0]);
    }
    coopMatStore(acc[0], floats, 512u, 16u, gl_CooperativeMatrixLayoutRowMajor);
}
