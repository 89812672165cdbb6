// The router GEMV (moe_router_logits.comp, moe_router.comp): logits[t, e] = x[t] · W[e] in fp32 for the
// ROUTER_EXPERTS_PER_WG experts from e0, W in the checkpoint's own dtype (fp16, bf16 or fp32; WKIND). The 256
// invocations split H in groups of 8 columns (16-byte loads; H a multiple of 8), so the only loop that grows is
// H / 2048. Deterministic: each invocation sums its columns in order, then subgroupAdd, then the subgroup sums in
// order; a token's logits depend on nothing else.
// Loops have the same trip count in every invocation, bodies guarded: Mesa 22.3's lavapipe drops the rest of a
// shader after loops whose trip count differs between invocations (see moe_stages.glsl).
//
// Includer: declares x4[] ((m, H) fp16 or fp32, as uvec4), w4[] ((E, H) fp16 / bf16 / fp32, as uvec4) and logits[]
// ((m, E) fp32), and a push block with E and H.
#ifndef ROUTER_GEMV_GLSL
#define ROUTER_GEMV_GLSL
layout(constant_id = SPEC_ROUTER_WKIND) const uint WKIND = WKIND_FLOAT16;
layout(constant_id = SPEC_ROUTER_X_F32) const bool X_F32 = false;

// One partial per (expert, subgroup): a 256-invocation workgroup has at most 64 subgroups (subgroups of >= 4).
#define ROUTER_SUBGROUP_SLOTS 64u
shared float s_part[ROUTER_EXPERTS_PER_WG * ROUTER_SUBGROUP_SLOTS];

// Columns 8q .. 8q+7 of row t of x (lo, hi), 16 bytes (fp16) or 32 bytes (fp32) at a time.
void x_oct(uint t, uint q, out vec4 lo, out vec4 hi) {
    if (X_F32) {
        uint i = t * (pc.H / 4u) + 2u * q;
        lo = uintBitsToFloat(x4[i]);
        hi = uintBitsToFloat(x4[i + 1u]);
    } else {
        uvec4 v = x4[t * (pc.H / 8u) + q];
        lo = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
        hi = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
    }
}

vec2 bf16_pair(uint word) { return vec2(uintBitsToFloat(word << 16), uintBitsToFloat(word & 0xFFFF0000u)); }

// Columns 8q .. 8q+7 of row e of W (lo, hi).
void w_oct(uint e, uint q, out vec4 lo, out vec4 hi) {
    if (WKIND == WKIND_FLOAT32) {
        uint i = e * (pc.H / 4u) + 2u * q;
        lo = uintBitsToFloat(w4[i]);
        hi = uintBitsToFloat(w4[i + 1u]);
    } else {
        uvec4 v = w4[e * (pc.H / 8u) + q];
        if (WKIND == WKIND_BFLOAT16) {
            lo = vec4(bf16_pair(v.x), bf16_pair(v.y));
            hi = vec4(bf16_pair(v.z), bf16_pair(v.w));
        } else {
            lo = vec4(unpackHalf2x16(v.x), unpackHalf2x16(v.y));
            hi = vec4(unpackHalf2x16(v.z), unpackHalf2x16(v.w));
        }
    }
}

void router_gemv(uint t, uint e0) {
    uint tid = gl_LocalInvocationID.x;
    uint experts = wg_uniform(min(ROUTER_EXPERTS_PER_WG, pc.E - e0)), octs = wg_uniform(pc.H / 8u);
    // All experts of the workgroup in one pass over H, 16-byte loads: their weight loads are independent and in
    // flight together (one memory round trip per pass, not one per expert), x is read once.
    float acc[ROUTER_EXPERTS_PER_WG];
    [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) acc[j] = 0.0;
    for (uint q0 = 0u; q0 < octs; q0 += 256u) {
        uint q = q0 + tid;
        if (q < octs) {
            vec4 xlo, xhi;
            x_oct(t, q, xlo, xhi);
            [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) {
                if (j < experts) {
                    vec4 wlo, whi;
                    w_oct(e0 + j, q, wlo, whi);
                    [[unroll]] for (int c = 0; c < 4; c++) acc[j] += xlo[c] * wlo[c];  // columns in order
                    [[unroll]] for (int c = 0; c < 4; c++) acc[j] += xhi[c] * whi[c];
                }
            }
        }
    }
    [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) {
        float s = subgroupAdd(acc[j]);
        if (subgroupElect()) s_part[j * ROUTER_SUBGROUP_SLOTS + gl_SubgroupID] = s;
    }
    barrier();
    // Every invocation runs the loop (on a clamped expert): the same trip count everywhere (Mesa 22.3, above).
    uint j = min(tid, experts - 1u);
    float total = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) total += s_part[j * ROUTER_SUBGROUP_SLOTS + i];
    if (tid < experts) logits[t * pc.E + e0 + tid] = total;
    barrier();
}
#endif
