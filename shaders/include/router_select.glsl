// Router selection for one token (moe_router.comp's last arriving workgroup): the family's scores from the
// token's fp32 logits, group-limited top-k (dots), top-k, normalisation, scales (vkmoe/models/routing.py is the
// numpy twin of every step). Tie rule: equal selection scores pick the LOWER expert index (routing.py's stable
// sort), equal group scores the lower group; slots come out in descending score order. The E loops are split
// over the 256 invocations (E / 256 trips each); top-k ranks every expert against all E in one pass. Writes int32
// ids (m, top_k) and fp32 weights (m, top_k) for the routed experts; a hash token id outside the table gets ids -1,
// weight 0.
//
// Includer: declares FAMILY, logits[], bias[], expert_scale[], tid2eid[], input_ids[], ids_out[],
// weights_out[] and a push block with E, top_k, n_group, topk_group, norm, has_bias, has_scale, vocab,
// routed_scaling_factor and op_scale.
#ifndef ROUTER_SELECT_GLSL
#define ROUTER_SELECT_GLSL
const uint NONE = 0xFFFFFFFFu;
shared float s_score[ROUTE_MAX_EXPERTS];   // the weights' source: softmax / sigmoid / sqrt(softplus)
shared float s_choice[ROUTE_MAX_EXPERTS];  // what selection ranks: score (+ bias), -inf outside kept groups
shared float s_red[256];
shared float s_group[ROUTER_MAX_GROUPS];
shared uint s_sel[MAX_TOP_K];

// (v, i) beats (bv, bi): larger score, or equal score and lower index (the tie rule)
bool better(float v, uint i, float bv, uint bi) { return v > bv || (v == bv && i < bi); }

float wg_sum(float v) {  // deterministic: subgroupAdd, then the subgroup sums in order
    float s = subgroupAdd(v);
    if (subgroupElect()) s_red[gl_SubgroupID] = s;
    barrier();
    float total = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) total += s_red[i];
    barrier();
    return total;
}

float wg_max(float v) {
    float s = subgroupMax(v);
    if (subgroupElect()) s_red[gl_SubgroupID] = s;
    barrier();
    float best = s_red[0];
    for (uint i = 1u; i < gl_NumSubgroups; i++) best = max(best, s_red[i]);
    barrier();
    return best;
}

float sqrt_softplus(float z) {
    if (z > SOFTPLUS_THRESHOLD) return sqrt(z);
    float u = exp(z);
    float d = 1.0 + u;  // log1p(u) accurate for small u: u * log(d) / (d - 1)
    return sqrt(d == 1.0 ? u : log(d) * u / (d - 1.0));
}

// Every loop below has the same trip count in every invocation and guards its body: Mesa 22.3's lavapipe drops
// the rest of a shader after loops whose trip count differs between invocations (see moe_stages.glsl).
void scores(uint t, uint E) {
    uint tid = gl_LocalInvocationID.x;
    float zmax = -1.0 / 0.0, local = 0.0;
    for (uint e0 = 0u; e0 < E; e0 += 256u) { uint e = e0 + tid; if (e < E) zmax = max(zmax, logits[t * E + e]); }
    zmax = FAMILY == ROUTER_STD ? wg_max(zmax) : 0.0;
    for (uint e0 = 0u; e0 < E; e0 += 256u) {
        uint e = e0 + tid;
        if (e < E) {
            float z = logits[t * E + e], s;
            if (FAMILY == ROUTER_STD) { s = exp(z - zmax); local += s; }
            else if (FAMILY == ROUTER_DOTS) s = 1.0 / (1.0 + exp(-z));
            else s = sqrt_softplus(z);
            s_score[e] = s;
        }
    }
    float total = FAMILY == ROUTER_STD ? wg_sum(local) : 1.0;
    for (uint e0 = 0u; e0 < E; e0 += 256u) {
        uint e = e0 + tid;
        if (e < E) {
            float s = FAMILY == ROUTER_STD ? s_score[e] / total : s_score[e];
            s_score[e] = s;
            s_choice[e] = pc.has_bias != 0u ? s + bias[e] : s;
        }
    }
    barrier();
}

// dots with n_group > 1: group score = sum of the group's top two choice values; the best topk_group groups
// (ties: lower group index) stay, the others' experts drop to -inf.
//
// The group scores: where a group is exactly one subgroup (E / n_group == the subgroup size, and every subgroup's
// experts in one group: invocations in subgroups of consecutive ids, checked), two subgroupMax give its top two
// (a NaN taken as -inf: the loop never takes one; a max held twice is also the second value); else invocation g
// loops over group g. The keep set: invocation g ranks group g against all groups (as select_topk ranks experts:
// the same set as topk_group rounds of an argmax under the tie rule, a NaN score never kept), one loop of n_group
// steps instead of topk_group x n_group in every invocation. H100, DeepSeek-V3 shape (8 groups of 32) m = 1, the
// router's dispatch: 2.2 us of 13.4 in the per-invocation loops (BENCHMARKS.md, twenty-ninth session).
shared uint s_keep[ROUTER_MAX_GROUPS];
shared uint s_group_split[4];  // 16 bytes: a subgroup whose experts span two groups (the loop form then runs)

void group_scores(uint E, uint groups, uint per) {
    uint tid = gl_LocalInvocationID.x;
    bool by_subgroup = per == gl_SubgroupSize;  // (uniform)
    if (by_subgroup) {
        if (tid == 0u) s_group_split[0] = 0u;
        barrier();
        for (uint e0 = 0u; e0 < E; e0 += 256u) {
            uint e = e0 + tid, g = e / per;
            float v = e < E ? s_choice[e] : -1.0 / 0.0;
            v = isnan(v) ? -1.0 / 0.0 : v;
            float a = subgroupMax(v);
            uint held = subgroupBallotBitCount(subgroupBallot(v == a));
            float second = subgroupMax(v == a ? -1.0 / 0.0 : v);
            if (subgroupBallot(g != subgroupBroadcastFirst(g)) != uvec4(0u)) s_group_split[0] = 1u;
            if (subgroupElect() && g < groups) s_group[g] = a + (held >= 2u ? a : second);
        }
        barrier();
        by_subgroup = wg_uniform(s_group_split[0]) == 0u;
    }
    if (!by_subgroup) {
        uint g_own = min(tid, groups - 1u);
        float a = -1.0 / 0.0, b = -1.0 / 0.0;
        for (uint j = 0u; j < per; j++) {
            float v = s_choice[g_own * per + j];
            if (v > a) { b = a; a = v; } else if (v > b) b = v;
        }
        if (tid < groups) s_group[tid] = per >= 2u ? a + b : a;
    }
    barrier();
}

void limit_groups(uint E) {
    uint tid = gl_LocalInvocationID.x, groups = wg_uniform(pc.n_group), per = wg_uniform(E / pc.n_group);
    group_scores(E, groups, per);
    uint g_own = min(tid, groups - 1u), rank = 0u;
    float own = s_group[g_own];
    for (uint h = 0u; h < groups; h++) rank += better(s_group[h], h, own, g_own) ? 1u : 0u;
    if (tid < groups) s_keep[tid] = uint(!isnan(own) && rank < wg_uniform(pc.topk_group));
    barrier();
    for (uint e0 = 0u; e0 < E; e0 += 256u) {
        uint e = e0 + tid;
        if (e < E && s_keep[e / per] == 0u) s_choice[e] = -1.0 / 0.0;
    }
    barrier();
}

// Top-k in one pass: every expert counts the experts that beat it under the tie rule; an expert whose count (its
// rank) is below top_k takes slot `rank`. So slots come out in descending order with ties to the lower index, as
// top_k rounds of an argmax would give them, for one barrier instead of top_k. A NaN
// choice value beats nobody and is ranked after every number: a token with fewer than top_k numbers among its
// choice values (a NaN logit makes every softmax score NaN) fills the rest of its slots with its NaN experts in
// index order (fill_nan_slots), as routing.py's stable sort puts NaN last, so their NaN weights reach the output
// instead of the token silently getting no expert (a zero row).
//
// The ranking runs on candidates: first each subgroup ranks its own experts among themselves (subgroup shuffles,
// no shared memory), and only those within its top_k (per_group of them) go on, to be ranked against each other.
// That is the same answer: an expert of global rank r < top_k is beaten only by experts of global rank < r, each of
// which is beaten within its own subgroup by fewer than top_k experts, so all of them are candidates and its rank
// among the candidates is r; an expert of global rank >= top_k is beaten by the top_k best, all candidates. With
// E = 256 and 32-wide subgroups the second ranking reads 64 candidates instead of 256 shared words, one per loop
// step (H200, Qwen3 shape, E = 128: the block's router phase m = 4 12.1 -> 11.4 us, m = 1 9.3 either way;
// BENCHMARKS.md, nineteenth session). Where the candidates would exceed s_cand (E / 256 rows of gl_NumSubgroups
// groups, per_group each: E = 1024 on 8-wide subgroups) every expert is ranked against all E.
// Invocation tid ranks experts tid, tid + 256, ...: at most 4 x E <= 4096 comparisons (E <= ROUTE_MAX_EXPERTS), far
// below Mesa 22.3's loop cap; every invocation runs every loop the same number of times.
shared uint s_cand[256];      // candidate expert ids, NONE where a group had fewer (select_topk)
shared float s_cand_v[256];   // their choice values, NaN for NONE (beats nobody, never taken)

void select_topk(uint E) {
    uint tid = gl_LocalInvocationID.x, top_k = wg_uniform(pc.top_k);
    uint per_group = min(top_k, gl_SubgroupSize), slots = ((E + 255u) / 256u) * gl_NumSubgroups * per_group;
    bool by_candidates = slots <= 256u;  // (uniform)
    if (tid < MAX_TOP_K) s_sel[tid] = NONE;
    s_cand[tid] = NONE;
    s_cand_v[tid] = uintBitsToFloat(0x7FC00000u);
    barrier();
    if (by_candidates) {
        for (uint e0 = 0u; e0 < E; e0 += 256u) {
            uint e = e0 + tid;
            float v = e < E ? s_choice[e] : uintBitsToFloat(0x7FC00000u);  // (past E: NaN, never a candidate)
            uint rank = 0u;
            for (uint j = 0u; j < gl_SubgroupSize; j += 4u) {  // 4 rivals a step: independent shuffles in flight
                [[unroll]] for (uint u = 0u; u < 4u; u++) {
                    uint src = min(j + u, gl_SubgroupSize - 1u);  // (subgroups narrower than 4: counted once)
                    bool beats = better(subgroupShuffle(v, src), subgroupShuffle(e, src), v, e);
                    rank += j + u < gl_SubgroupSize && beats ? 1u : 0u;
                }
            }
            if (!isnan(v) && rank < per_group) {
                uint slot = ((e0 / 256u) * gl_NumSubgroups + gl_SubgroupID) * per_group + rank;
                s_cand[slot] = e;
                s_cand_v[slot] = v;
            }
        }
        barrier();
        uint e = s_cand[tid];
        float v = s_cand_v[tid];
        uint rank = 0u;
        // 8 candidates a step (past `slots` every entry is NONE / NaN, which beats nobody, up to s_cand's 256)
        for (uint j = 0u; j < slots; j += 8u) {
            [[unroll]] for (uint u = 0u; u < 8u; u++) rank += better(s_cand_v[j + u], s_cand[j + u], v, e) ? 1u : 0u;
        }
        if (tid < slots && !isnan(v) && rank < top_k) s_sel[rank] = e;
    } else {
        for (uint e0 = 0u; e0 < E; e0 += 256u) {
            uint e = min(e0 + tid, E - 1u);
            float v = s_choice[e];
            uint rank = 0u;
            for (uint j = 0u; j < E; j++) rank += better(s_choice[j], j, v, e) ? 1u : 0u;
            if (e0 + tid < E && !isnan(v) && rank < top_k) s_sel[rank] = e;
        }
    }
    barrier();
}

// Slots the ranking left NONE (fewer than top_k numbers): the NaN experts in index order, after the numbers. Runs
// only for such a token (a uniform branch); an expert's place among the NaN ones counts the NaN experts below it
// (E comparisons per expert of this invocation, as the ranking's worst case).
void fill_nan_slots(uint E) {
    uint tid = gl_LocalInvocationID.x, top_k = wg_uniform(pc.top_k);
    if (s_sel[top_k - 1u] != NONE) return;  // (read after select_topk's barrier: the same answer everywhere)
    uint filled = 0u;
    for (uint k = 0u; k < top_k; k++) filled += s_sel[k] != NONE ? 1u : 0u;
    barrier();
    for (uint e0 = 0u; e0 < E; e0 += 256u) {
        uint e = min(e0 + tid, E - 1u);
        uint below = 0u;
        for (uint j = 0u; j < E; j++) below += j < e && isnan(s_choice[j]) ? 1u : 0u;
        if (e0 + tid < E && isnan(s_choice[e]) && filled + below < top_k) s_sel[filled + below] = e;
    }
    barrier();
}

void hash_ids(uint t, uint E) {  // ids = tid2eid[input_ids[t]], in table order
    uint tid = gl_LocalInvocationID.x;
    int tok = input_ids[t];
    bool ok = tok >= 0 && uint(tok) < pc.vocab;
    if (tid < pc.top_k) {
        int e = ok ? tid2eid[uint(tok) * pc.top_k + tid] : -1;
        s_sel[tid] = e >= 0 && uint(e) < E ? uint(e) : NONE;
    }
    barrier();
}

// The chosen experts' scores, normalised over them (sum in slot order) and scaled; invocation s writes slot s.
void write_weights(uint t) {
    uint tid = gl_LocalInvocationID.x, top_k = wg_uniform(pc.top_k);
    bool norm = FAMILY == ROUTER_SQRTSP || FAMILY == ROUTER_SQRTSP_HASH || pc.norm != 0u;
    float total = 0.0;
    for (uint k0 = 0u; k0 < top_k; k0 += 4u) {  // in slot order, 4 slots' reads in flight a step
        [[unroll]] for (uint u = 0u; u < 4u; u++) {
            uint k = k0 + u, e = k < top_k ? s_sel[min(k, MAX_TOP_K - 1u)] : NONE;
            total += e == NONE ? 0.0 : s_score[e];
        }
    }
    if (FAMILY != ROUTER_STD) total += 1e-20;
    if (tid < top_k) {
        uint e = s_sel[tid];
        float w = e == NONE ? 0.0 : s_score[e];
        if (norm) w = w / total;
        if (FAMILY != ROUTER_STD) w *= pc.routed_scaling_factor;
        if (pc.has_scale != 0u && e != NONE) w *= expert_scale[e];
        ids_out[t * top_k + tid] = e == NONE ? -1 : int(e);
        weights_out[t * top_k + tid] = w * pc.op_scale;
    }
}

void router_select(uint t) {
    uint E = wg_uniform(pc.E);
    scores(t, E);
    if (FAMILY == ROUTER_SQRTSP_HASH) {
        hash_ids(t, E);
    } else {
        if (FAMILY == ROUTER_DOTS && wg_uniform(pc.n_group) > 1u) limit_groups(E);
        select_topk(E);
        fill_nan_slots(E);
    }
    write_weights(t);
}
#endif
