#version 450
// Is the fp16 fma of the mul1 codebook fused on this driver? Computes fma(1024 + B, c1, c0) in fp16 for every
// byte sum B (0..1020, all the mul1 codebook can produce); the host compares with the single-rounding result.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { uint bits[]; };
void main() {
    uint b = gl_GlobalInvocationID.x;
    if (b > 1020u) return;
    f16vec2 h = unpackFloat2x16((0x6400u + b) * 0x10001u);
    f16vec2 w = fma(h, f16vec2(float16_t(0.00676727294921875)), f16vec2(float16_t(-10.3828125)));
    bits[b] = packFloat2x16(w) & 0xFFFFu;
}
