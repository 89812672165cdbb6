// The router GEMV (moe_router_logits.comp, moe_router.comp): logits[t, e] = x[t] · W[e] in fp32 for the
// ROUTER_EXPERTS_PER_WG experts from e0, W in the checkpoint's own dtype (fp16, bf16 or fp32; WKIND). The 256
// invocations split H in pairs, so the only loop that grows is H / 512. Deterministic: each invocation sums its
// columns in order, then subgroupAdd, then the subgroup sums in order; a token's logits depend on nothing else.
// Loops have the same trip count in every invocation, bodies guarded: Mesa 22.3's lavapipe drops the rest of a
// shader after loops whose trip count differs between invocations (see moe_stages.glsl).
//
// Includer: declares x[] ((m, H) fp16 pairs, or fp32), w[] ((E, H) fp16 / bf16 pairs, or fp32) and logits[]
// ((m, E) fp32), and a push block with E and H.
#ifndef ROUTER_GEMV_GLSL
#define ROUTER_GEMV_GLSL
layout(constant_id = SPEC_ROUTER_WKIND) const uint WKIND = WKIND_FLOAT16;
layout(constant_id = SPEC_ROUTER_X_F32) const bool X_F32 = false;

// One partial per (expert, subgroup): a 256-invocation workgroup has at most 64 subgroups (subgroups of >= 4).
#define ROUTER_SUBGROUP_SLOTS 64u
shared float s_part[ROUTER_EXPERTS_PER_WG * ROUTER_SUBGROUP_SLOTS];

vec2 x_pair(uint t, uint p) {  // columns 2p, 2p + 1 of row t
    uint i = t * (pc.H / 2u) + p;
    return X_F32 ? vec2(uintBitsToFloat(x[2u * i]), uintBitsToFloat(x[2u * i + 1u])) : unpackHalf2x16(x[i]);
}

vec2 w_pair(uint e, uint p) {
    uint i = e * (pc.H / 2u) + p;
    if (WKIND == WKIND_FLOAT32) return vec2(uintBitsToFloat(w[2u * i]), uintBitsToFloat(w[2u * i + 1u]));
    uint word = w[i];
    if (WKIND == WKIND_BFLOAT16) return vec2(uintBitsToFloat(word << 16), uintBitsToFloat(word & 0xFFFF0000u));
    return unpackHalf2x16(word);
}

void router_gemv(uint t, uint e0) {
    uint tid = gl_LocalInvocationID.x;
    uint experts = wg_uniform(min(ROUTER_EXPERTS_PER_WG, pc.E - e0)), pairs = wg_uniform(pc.H / 2u);
    // All experts of the workgroup in one pass over H: their weight loads are independent and in flight
    // together (one memory round trip per pass, not one per expert), x is read once. Same sums, same order.
    float acc[ROUTER_EXPERTS_PER_WG];
    [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) acc[j] = 0.0;
    for (uint p0 = 0u; p0 < pairs; p0 += 256u) {
        uint p = p0 + tid;
        if (p < pairs) {
            vec2 xv = x_pair(t, p);
            [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) {
                if (j < experts) {
                    vec2 wv = w_pair(e0 + j, p);
                    acc[j] += xv.x * wv.x;
                    acc[j] += xv.y * wv.y;
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
