#version 450
// Does this driver's fp16 fma round once? Computes fma(a, c1, c0) in fp16 for `count` consecutive fp16 values a
// (bit patterns first, first + 1, ...); the host compares with the single-rounding result. The caller picks a, c1
// and c0 (the driver layer knows no codebook; the decoding shaders' caller asks about the mul1 constants).
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { uint bits[]; };
layout(push_constant) uniform Push { uint first; uint count; uint c1_c0; } pc;  // c1_c0: fp16 c1 | fp16 c0 << 16
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i >= pc.count) return;
    f16vec2 a = unpackFloat2x16((pc.first + i) * 0x10001u);
    f16vec2 c = unpackFloat2x16(pc.c1_c0);
    f16vec2 w = fma(a, f16vec2(c.x), f16vec2(c.y));
    bits[i] = packFloat2x16(w) & 0xFFFFu;
}
