// The device block's shared-expert arithmetic (vkmoe/ops/block.py), one copy for every shader that runs it:
// moe_block_elem.comp (the activation and the shared sum as passes of their own), exl3_linear.comp (the shared
// down's direct mode, which activates its input row itself) and moe_stages.glsl (the routed experts' token sums,
// which add the shared output where the block fuses its sum). Every use gives the same bits: the same
// operations in the same order (and no contraction, setup.py's pass).
// Includer: common.glsl and the generated layout header (ACT_*) first.
#ifndef BLOCK_MATH_GLSL
#define BLOCK_MATH_GLSL

float block_sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }

// The shared expert's activation in fp32, as vkmoe/exl3/reference.py's _activate (act_limit included); the
// caller rounds the result to fp16.
float block_activate(float g, float u, uint act, float limit) {
    if (act == ACT_SWIGLU_OAI) {
        if (limit != 0.0) { g = min_nan(g, limit); u = clamp_nan(u, -limit, limit); }
        return (u + 1.0) * g * block_sigmoid(1.702 * g);
    }
    float x;
    if (act == ACT_SILU) x = g * block_sigmoid(g);
    else if (act == ACT_GELU) x = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
    else if (act == ACT_GELU_ERF) x = 0.5 * g * (1.0 + erf_approx(g * 0.7071067811865476));
    else x = max_nan(u, 0.0);
    if (limit != 0.0) { x = min_nan(x, limit); u = clamp_nan(u, -limit, limit); }
    return x * u;
}

// A packed fp16 pair of the activation: gate word g, up word u (relu2 reads up only).
uint block_activate_pair(uint g, uint u, uint act, float limit) {
    vec2 uv = unpackHalf2x16(u), gv = act == ACT_RELU2 ? uv : unpackHalf2x16(g);
    return packHalf2x16(vec2(block_activate(gv.x, uv.x, act, limit), block_activate(gv.y, uv.y, act, limit)));
}

// out += shared (· sigmoid(gate logit)): the shared output's fp16 value times its gate (1 without one), added to
// the routed sum.
float block_add_shared(float routed, float shared16, float gate) { return routed + shared16 * gate; }

#endif
