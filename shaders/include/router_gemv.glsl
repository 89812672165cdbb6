// The router GEMV (moe_router_logits.comp, moe_router.comp): logits[t, e] = x[t] · W[e] in fp32 for the
// ROUTER_EXPERTS_PER_WG experts from e0, W in the checkpoint's own dtype (fp16, bf16 or fp32; WKIND). The 256
// invocations split H in groups of 8 columns (16-byte loads; H a multiple of 8), so the only loop that grows
// is H / 8192 (rounds of ROUTER_PASSES_IN_FLIGHT passes). Deterministic: each invocation sums its columns in
// order, then subgroupAdd, then the subgroup sums in order; a token's logits depend on nothing else.
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

// Passes over H (256 octets of columns each) whose loads are issued together before any is used: H <= 8192 is one
// memory round trip per workgroup instead of one per pass (DeepSeek-V3's H = 7168 takes 4 passes).
#define ROUTER_PASSES_IN_FLIGHT 4

// The raw 16 bytes (fp16, bf16) or 32 bytes (fp32: lo and hi) holding columns 8q .. 8q+7 of row r of x / W.
void x_raw(uint t, uint q, out uvec4 lo, out uvec4 hi) {
    if (X_F32) { uint i = t * (pc.H / 4u) + 2u * q; lo = x4[i]; hi = x4[i + 1u]; }
    else { lo = x4[t * (pc.H / 8u) + q]; hi = uvec4(0u); }
}
void w_raw(uint e, uint q, out uvec4 lo, out uvec4 hi) {
    if (WKIND == WKIND_FLOAT32) { uint i = e * (pc.H / 4u) + 2u * q; lo = w4[i]; hi = w4[i + 1u]; }
    else { lo = w4[e * (pc.H / 8u) + q]; hi = uvec4(0u); }
}

vec2 bf16_pair(uint word) { return vec2(uintBitsToFloat(word << 16), uintBitsToFloat(word & 0xFFFF0000u)); }

// The 8 columns of a raw octet as two vec4 (lo, hi), for a 16-bit kind (bf16 or not) or fp32.
void octet(uvec4 a, uvec4 b, bool f32, bool bf16, out vec4 lo, out vec4 hi) {
    if (f32) { lo = uintBitsToFloat(a); hi = uintBitsToFloat(b); }
    else if (bf16) { lo = vec4(bf16_pair(a.x), bf16_pair(a.y)); hi = vec4(bf16_pair(a.z), bf16_pair(a.w)); }
    else { lo = vec4(unpackHalf2x16(a.x), unpackHalf2x16(a.y)); hi = vec4(unpackHalf2x16(a.z), unpackHalf2x16(a.w)); }
}

void router_gemv(uint t, uint e0) {
    uint tid = gl_LocalInvocationID.x;
    uint experts = wg_uniform(min(ROUTER_EXPERTS_PER_WG, pc.E - e0)), octs = wg_uniform(pc.H / 8u);
    // All experts of the workgroup and ROUTER_PASSES_IN_FLIGHT passes over H at a time, 16-byte loads: every load
    // of a round is requested before any is used (one memory round trip per round, not one per expert or pass);
    // x is read once. Each expert's sum still runs over the columns in order, pass after pass.
    float acc[ROUTER_EXPERTS_PER_WG];
    [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) acc[j] = 0.0;
    const uint round_octs = 256u * ROUTER_PASSES_IN_FLIGHT;
    for (uint r0 = 0u; r0 < octs; r0 += round_octs) {
        uvec4 xa[ROUTER_PASSES_IN_FLIGHT], xb[ROUTER_PASSES_IN_FLIGHT];
        uvec4 wa[ROUTER_PASSES_IN_FLIGHT * ROUTER_EXPERTS_PER_WG], wb[ROUTER_PASSES_IN_FLIGHT * ROUTER_EXPERTS_PER_WG];
        [[unroll]] for (uint p = 0u; p < ROUTER_PASSES_IN_FLIGHT; p++) {
            uint q = r0 + 256u * p + tid;
            xa[p] = uvec4(0u); xb[p] = uvec4(0u);
            if (q < octs) x_raw(t, q, xa[p], xb[p]);
            [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) {
                uint k = p * ROUTER_EXPERTS_PER_WG + j;
                wa[k] = uvec4(0u); wb[k] = uvec4(0u);
                if (q < octs && j < experts) w_raw(e0 + j, q, wa[k], wb[k]);
            }
        }
        [[unroll]] for (uint p = 0u; p < ROUTER_PASSES_IN_FLIGHT; p++) {
            uint q = r0 + 256u * p + tid;
            if (q < octs) {
                vec4 xlo, xhi;
                octet(xa[p], xb[p], X_F32, false, xlo, xhi);
                [[unroll]] for (uint j = 0u; j < ROUTER_EXPERTS_PER_WG; j++) {
                    if (j < experts) {
                        uint k = p * ROUTER_EXPERTS_PER_WG + j;
                        vec4 wlo, whi;
                        octet(wa[k], wb[k], WKIND == WKIND_FLOAT32, WKIND == WKIND_BFLOAT16, wlo, whi);
                        [[unroll]] for (int c = 0; c < 4; c++) acc[j] += xlo[c] * wlo[c];  // columns in order
                        [[unroll]] for (int c = 0; c < 4; c++) acc[j] += xhi[c] * whi[c];
                    }
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
