#version 450
// y = a * x + y + bias: `a` and `n` come from a typed push-constant block, `bias` is a specialization constant.
layout(local_size_x = 64) in;
layout(constant_id = 0) const float BIAS = 0.0;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) buffer Y { float y[]; };
layout(push_constant) uniform Push { float a; uint n; } pc;

void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) y[i] = pc.a * x[i] + y[i] + BIAS;
}
