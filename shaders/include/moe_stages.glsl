// The stage bodies of the fused EXL3 MoE MLP (spec section 8.6), written once and used by both the split
// dispatches (moe_route (routing + stage 1) / moe_gate_up / moe_down .comp) and the persistent kernel.
//
// Work is cut into items that need no data from other workgroups except through the GEMM's last-arrival
// counters (which never wait), so stages 3 and 5 run in whichever workgroup completes a 128-column band:
//   route      counting sort of (token, slot) pairs by expert into chunks of <= GEMM_ROWS rows
//   stage 1    gather + input Hadamard (gate.suh, up.suh): one item = STAGE1_PAIRS_PER_ITEM (row, 128-block) pairs
//   stage 2+3  gate/up GEMM item = (chunk, band of I, projection, k-split); the last arrival of a (chunk, band)
//              applies the output Hadamards, the activation and the down projection's input Hadamard
//   stage 4+5  down GEMM item = (chunk, band of H, k-split); the last arrival applies the output Hadamard,
//              routing weight and svh into its (token, slot) row; the last slot of a token to arrive sums the
//              token's rows in slot order (deterministic)
// Only route -> 1 -> 2+3 -> 4+5 need a device-wide barrier (pipeline barrier or spin barrier).
//
// Direct mode (the DIRECT specialization, chosen by the plan for small batches): every (token, slot) row
// f = t * top_k + slot is a chunk of its own, in flat order, with its expert read straight from expert_ids. There is
// no routing and no stage-1 pass: each gate/up item builds its A row (stage 1 for its k-range) in shared memory
// while its first weight tiles load (moe_direct_stage1), so the split path is two dispatches and a persistent
// gate/up item waits for nothing. Per row, every GEMM, Hadamard and sum runs in the same order as in routed mode:
// the bits are the same for the same k-splits.
//
// Includer: defines WG_SIZE 256u and includes common.glsl and moe_bindings.glsl first. With
// MOE_COOP (and COOP_BM, EXL3_F16) the GEMMs of stages 2 and 4 run on cooperative matrices (exl3_gemm_coop.glsl:
// moe_gate_up_coop.comp, moe_down_coop.comp): chunks of up to COOP_BM rows of one expert; the routing, stage 1
// and the band tails (stages 3 and 5) are the same code.

#ifndef MOE_STAGES_GLSL
#define MOE_STAGES_GLSL
#include "block_math.glsl"

// What out[t, col] receives for the routed sum `routed` (0.0 for a token with no valid slot): the sum itself, or
// with a device block's fused shared sum (pc.shared_add) the shared expert's output (· sigmoid(its gate logit))
// added as the block's own sum pass adds it (block_math.glsl): the same bits, one pass and one barrier fewer.
float moe_out_value(uint t, uint col, float routed) {
    if (pc.shared_add == SHARED_ADD_NONE) return routed;
    uint i = t * pc.H + col;
    float gate = pc.shared_add == SHARED_ADD_GATED ? block_sigmoid(shared_gate[t]) : 1.0;
    return block_add_shared(routed, f16_at(shared_out[i >> 1], i), gate);
}

// A sources of the GEMMs: the gate/up inputs (stage 1), the down input (stage 3), or (direct mode) the row a
// gate/up item built in shared memory. The A accessors are defined below the GEMM core, which owns gemm_red.
#define A_STATES 0
#define A_INTER 1
#define A_DIRECT 2
#define A_STAGE3 3  // a down item's own stage-3 output in gemm_red (STAGE3_IN_DOWN)
uvec4 gemm_a_word4(const int src, uint index);
uint gemm_b_word(int src, uint index) {
    return src == 0 ? gate_trellis[index] : src == 1 ? up_trellis[index] : down_trellis[index];
}
uvec4 gemm_b_word4(int src, uint index) {
    return src == 0 ? gate_trellis4[index] : src == 1 ? up_trellis4[index] : down_trellis4[index];
}
#ifdef MOE_CLOCK
// The persistent kernel's timing build: invocation 0 of each workgroup stores the realtime clock at the marks
// CLOCK_* (layout.CLOCK_MARKS) into CLOCK_WORDS_PER_WG words of its own behind both GEMMs' partials (binding 16,
// sized by layout.scratch_bytes(clock=True)). "first" marks: the workgroup's first item of the stage.
layout(std430, binding = 16) nonprivate buffer PartialClock { uint clock_words[]; };
uint moe_clock_base();  // (defined below partial_rows)
uint moe_clock_gate_up_items = 0u, moe_clock_down_items = 0u, moe_clock_waits = 0u, moe_clock_wait_ns = 0u;
uint moe_clock_at(uint word) { return moe_clock_base() + gl_WorkGroupID.x * CLOCK_WORDS_PER_WG + word; }
void moe_clock_put(uint word, uvec2 v) {
    if (gl_LocalInvocationIndex == 0u) {
        clock_words[moe_clock_at(word)] = v.x;
        clock_words[moe_clock_at(word + 1u)] = v.y;
    }
}
void moe_clock_mark(uint mark) { moe_clock_put(2u * mark, clockRealtime2x32EXT()); }
// The launch's start: this workgroup's other words cleared, so a mark it never reaches reads 0.
void moe_clock_start() {
    uint tid = gl_LocalInvocationIndex;
    if (tid >= 2u && tid < CLOCK_WORDS_PER_WG) clock_words[moe_clock_at(tid)] = 0u;
    moe_clock_mark(CLOCK_START);
}
#define MOE_CLOCK_START() moe_clock_start()
#define MOE_CLOCK_MARK(mark) moe_clock_mark(mark)
#define MOE_CLOCK_FIRST_GATE_UP(mark) if (moe_clock_gate_up_items == 0u) moe_clock_mark(mark)
#define MOE_CLOCK_FIRST_DOWN(mark) if (moe_clock_down_items == 0u) moe_clock_mark(mark)
#else
#define MOE_CLOCK_START()
#define MOE_CLOCK_MARK(mark)
#define MOE_CLOCK_FIRST_GATE_UP(mark)
#define MOE_CLOCK_FIRST_DOWN(mark)
#endif

#ifdef MOE_DEPENDENCY_WAITS
// The persistent kernel has no grid-wide barrier: a GEMM item waits only for the counter its inputs depend on
// (gate/up: every workgroup's share of routing + stage 1; down: its chunk's gate/up bands), and only after its
// first weight tiles were requested (GEMM_AFTER_PREFETCH): weights depend on no stage, so their latency overlaps
// the wait. Waits are bounded; a failed wait sets the abort flag and the host re-runs the split path.
#ifndef VKMOE_SYNC_GLSL
#error "MOE_DEPENDENCY_WAITS needs sync.glsl included before moe_stages.glsl"
#endif
uint moe_dep_word = 0u, moe_dep_target = 0u;  // what the next GEMM item waits for
// The last wait satisfied; it stays satisfied: a counter is reset only after every wait for it.
uint moe_seen_word = 0xFFFFFFFFu, moe_seen_target = 0u;
uint moe_wait_spent = 0u;                      // spin iterations invocation 0 used (against pc.loop_budget)
bool moe_launch_failed = false;                // uniform: a wait failed, the launch's results are discarded

// A specialization constant, not a test of pc.loop_budget: the untaken branch alone made the H200's persistent
// launches 1.3x slower at m = 4..16.
layout(constant_id = SPEC_MOE_PACED_SPIN) const bool MOE_PACED_SPIN = false;
shared uint moe_sh_poll[2];  // moe_spin_paced's poll results (moe_paced_poll)

// One poll of moe_spin_paced, whole workgroup: invocation 0 reads into moe_sh_poll[slot], every invocation gets
// its result (1 seen, 2 abort flag set, 0 neither). Polls alternate between two slots, so one barrier a poll
// suffices: a slot is written again only two barriers after it was written, when every invocation has read it.
uint moe_paced_poll(uint word, uint target, uint slot) {
    if (gl_LocalInvocationIndex == 0u)
        moe_sh_poll[slot] = sync_ge(sync_poll(word), target) ? 1u : sync_aborted() ? 2u : 0u;
    barrier();
    return moe_sh_poll[slot];
}

// Polls per counted iteration of moe_spin_paced, written out (not a loop: the cap counts back-edges).
#define MOE_PACED_POLL(slot) seen = moe_paced_poll(word, target, slot); if (seen != 0u) break;
#define MOE_PACED_POLLS_4() MOE_PACED_POLL(0u) MOE_PACED_POLL(1u) MOE_PACED_POLL(0u) MOE_PACED_POLL(1u)

// Whole workgroup, uniform result: spin until sync_words[word] >= target, for a driver whose loop cap counts
// iterations (the bound below is pc.spin_limit iterations, never past pc.loop_budget in total). There a spin's
// iterations, not its time, are what is limited, and one invocation's polls ran out before slow co-resident
// workgroups (one CPU thread each) signalled: routed persistent launches aborted in 10-15 of 40 calls of one golden
// layer on an idle 2-core machine. Here every poll passes a workgroup barrier (lavapipe resumes each group of
// invocations in turn at a barrier), and one counted iteration makes 8 polls, so the bound lasts far longer for
// the same count: with one poll (two barriers) per iteration the same layer still aborted once in 16 launches
// under CI's load (the other lavapipe's suite on the same two cores).
bool moe_spin_paced(uint word, uint target) {
    uint limit = min(pc.spin_limit, pc.loop_budget > moe_wait_spent ? pc.loop_budget - moe_wait_spent : 0u);
    uint n = 0u, seen = 0u;
    while (true) {
        MOE_PACED_POLLS_4() MOE_PACED_POLLS_4()
        if (n >= limit) break;
        n += 1u;
    }
    moe_wait_spent += n + 1u;
    // The acquire that pairs with the signaller's release (the polls were relaxed).
    return seen == 1u && sync_ge(sync_load(word), target);
}
#undef MOE_PACED_POLLS_4
#undef MOE_PACED_POLL

// Whole workgroup: wait until sync_words[word] >= target. A wait already satisfied costs nothing (every
// gate/up item waits for the same stage-1 count); otherwise invocation 0 spins (ending with an acquire) and one
// control barrier with acquire semantics hands what the signallers released to the whole workgroup.
// On a driver with a loop cap (lavapipe 22.3: MOE_PACED_SPIN) the whole workgroup spins instead (moe_spin_paced).
bool moe_wait(uint word, uint target) {
    if (wg_uniform(uint(word == moe_seen_word && target <= moe_seen_target)) != 0u) return true;
#ifdef MOE_CLOCK
    uvec2 clock_begin = clockRealtime2x32EXT();
#endif
    if (MOE_PACED_SPIN) {
        bool hit = moe_spin_paced(word, target);
        if (gl_LocalInvocationIndex == 0u) sync_sh_ok = hit;
    } else if (gl_LocalInvocationIndex == 0u) {
        sync_sh_ok = spin_until_ge(word, target, pc.spin_limit, pc.loop_budget, moe_wait_spent);
    }
    controlBarrier(gl_ScopeWorkgroup, gl_ScopeQueueFamily, gl_StorageSemanticsBuffer | gl_StorageSemanticsShared,
                   gl_SemanticsAcquireRelease | gl_SemanticsMakeVisible);
    bool ok = wg_uniform(uint(sync_sh_ok)) != 0u;
    // Nobody may write sync_sh_ok again before every invocation has read it.
    barrier();
    if (!ok) {
        if (gl_LocalInvocationIndex == 0u) sync_set_abort(SYNC_ABORT_SPIN);
        moe_launch_failed = true;
    } else {
        moe_seen_word = word;
        moe_seen_target = target;
    }
#ifdef MOE_CLOCK
    uvec2 clock_end = clockRealtime2x32EXT();
    if (moe_clock_waits == 0u) {
        moe_clock_put(2u * CLOCK_FIRST_WAIT_BEGIN, clock_begin);
        moe_clock_put(2u * CLOCK_FIRST_WAIT_END, clock_end);
    }
    moe_clock_waits += 1u;
    moe_clock_wait_ns += clock_end.x - clock_begin.x;
    moe_clock_put(CLOCK_WAITS, uvec2(moe_clock_waits, moe_clock_wait_ns));
#endif
    return ok;
}

// Whole workgroup: publish everything written so far and count it at sync_words[word]. As in wg_last_arrival: a
// Workgroup-scope barrier makes every invocation's writes available to invocation 0, whose release (sync_add)
// carries them device-wide. Not SYNC_WG_BARRIER: Mesa 22.3 does not order buffer stores around a QueueFamily-scope
// control barrier (common.glsl), so other invocations' `inter` rows landed after the count, and a down item that
// saw it read stale rows or NaN (routed persistent launches, subgroup Hadamard build, about half the calls with new
// inputs; BENCHMARKS.md, twenty-seventh session).
void moe_signal(uint word) {
    WG_BARRIER_PUBLISH();
    if (gl_LocalInvocationIndex == 0u) sync_add(word, 1u);
}

// The persistent counters reset themselves without an end-of-launch step in which workgroups wait for each other:
// the items that wait for a counter are counted (once each is past its wait) on a user count of its own, in a line
// nobody polls (layout.SYNC_LINE), and the last of them stores both back to 0: every signal was made before any
// wait was satisfied, and every waiter has read the counter before it counts itself. Invocation 0 issues the add
// (moe_users_begin) and checks what it returned later (moe_users_end), so the round trip overlaps other work.
uint moe_users_begin(uint users_word) {
    return gl_LocalInvocationIndex == 0u && !moe_launch_failed ? sync_add(users_word, 1u) : 0xFFFFFFFFu;
}
void moe_users_end(uint users_word, uint before, uint users, uint counter) {
    if (gl_LocalInvocationIndex == 0u && before == users - 1u) {
        sync_store_relaxed(counter, 0u);
        sync_store_relaxed(users_word, 0u);
    }
}
#endif

#ifndef MOE_COOP
// Between a GEMM item's first weight requests and its first read of A (exl3_gemm.glsl): a direct-mode gate/up
// item builds its A row, a persistent item waits for its dependency (if any). Defined below the GEMM core.
void moe_after_prefetch(const int a_src);
#define GEMM_AFTER_PREFETCH(a_src) moe_after_prefetch(a_src)
#endif

#include "exl3_decode.glsl"
#ifdef MOE_COOP
// The A row of each row of the chunk's tile (gate/up: gathered by (token, slot); down: the chunk's own rows).
// 64 words: a multiple of 16 bytes, as every shared variable of a cooperative-matrix shader must be.
shared uint coop_row[COOP_BM];
#define COOP_A_ROW(row0, r) coop_row[r]
// A 16-row tile's A share is one 16-byte load per invocation or none, so it is requested a step ahead (H100: the
// gate/up phase 9-12 % shorter; DESIGN.md, "The MoE stages on cooperative matrices").
#define COOP_A_AHEAD
uvec4 coop_a_word4(int src, uint index) { return gemm_a_word4(src, index); }
#include "exl3_gemm_coop.glsl"
uvec4 gemm_a_word4(const int src, uint index) { return src == A_STATES ? states4[index] : inter4[index]; }
// The shared-memory Hadamard's rows (HAD_SHARED_ROWS x 128 fp32, 2 KiB) lie in the A tile, which holds A only
// inside coop_gemm's k-loop, whose last barrier comes before any tail, and whose first store follows a barrier
// that ends every use of the rows (had_transform's last, the slot sum's): those 2 KiB are what keeps the 32-row
// tile within two workgroups per SM on the H100 (layout.coop_moe_shared_bytes; DESIGN.md).
#define HAD_BUF_LOAD(i) uintBitsToFloat(coop_a4[(i) >> 2u][(i) & 3u])
#define HAD_BUF_STORE(i, v) coop_a4[(i) >> 2u][(i) & 3u] = floatBitsToUint(v)
#include "hadamard128.glsl"
#else
#include "hadamard128.glsl"
#include "exl3_gemm.glsl"
uvec4 gemm_a_word4(const int src, uint index) {
    if (src == A_DIRECT || src == A_STAGE3) {
        uint w = 4u * index;
        return uvec4(gemm_red[w], gemm_red[w + 1u], gemm_red[w + 2u], gemm_red[w + 3u]);
    }
    return src == A_STATES ? states4[index] : inter4[index];
}
#endif

bool valid_expert(int e) { return e >= 0 && uint(e) < pc.E; }

// Mesa 22.3's lavapipe silently drops the rest of a shader after some loops whose trip count differs between
// the invocations of a workgroup (seen in routing: a nested loop in a one-invocation branch, and strided loops
// over a count read from shared memory). Routing therefore uses loops with the same trip count in every
// invocation and guards the body; loops over a token's slots are unrolled to MAX_TOP_K (layout.py).

uint valid_slots(uint t) {
    uint n = 0u;
    [[unroll]] for (int s = 0; s < MAX_TOP_K; ++s)
        if (uint(s) < pc.top_k && valid_expert(expert_ids[t * pc.top_k + uint(s)])) n += 1u;
    return n;
}

// ------------------------------------------------------------------------------------------------- chunks
// Chunk c of the GEMM stages: its expert e, its first row p0 (sorted position in routed mode, the flat row in
// direct mode) and its row count nr (0 in direct mode for a slot with no valid expert). Uniform per workgroup.
void moe_chunk(uint c, out uint e, out uint p0, out uint nr) {
    if (DIRECT) {
        int ex = expert_ids[c];
        bool ok = valid_expert(ex);
        e = wg_uniform(ok ? uint(ex) : 0u);
        p0 = c;
        nr = wg_uniform(ok ? 1u : 0u);
    } else {
        e = wg_uniform(route[route_chunk(c)]);
        p0 = wg_uniform(route[route_chunk(c) + 1u]);
        nr = wg_uniform(route[route_chunk(c) + 2u]);
    }
}
// The flat (token, slot) index of row p, and the number of valid slots of token t.
uint moe_row_flat(uint p) { return DIRECT ? p : route[route_row_flat(p)]; }
uint moe_token_slots(uint t) { return DIRECT ? valid_slots(t) : route[route_valid(t)]; }

// ------------------------------------------------------------------------------------------------ routing
#ifdef MOE_ROUTE  // only the shaders that route pay for its shared counters
// Fixed sizes, not specialization constants: Mesa 22.3's lavapipe lays out shared arrays sized by
// specialization constants inconsistently (they overlapped). The includer may lower ROUTE_MAX_E.
#ifndef ROUTE_MAX_E
#define ROUTE_MAX_E ROUTE_MAX_EXPERTS
#endif
shared uint s_count[ROUTE_MAX_E];
shared uint s_offset[ROUTE_MAX_E + 1];
shared uint s_chunk0[ROUTE_MAX_E + 1];
// Per-subgroup totals: at most 64 subgroups (vkmoe needs a subgroup size >= 4), which keeps the routing
// shader inside the 16 KiB of shared memory Vulkan guarantees.
shared uint s_scan_rows[64];
shared uint s_scan_chunks[64];

// One workgroup. Writes the chunk table, the sorted rows and each token's valid slot count. (The output rows of
// tokens with no valid slot are zeroed by stage 1, see moe_stage1.)
void moe_route() {
    uint tid = gl_LocalInvocationID.x;
    for (uint e0 = 0u; e0 < pc.E; e0 += WG_SIZE) { uint e = e0 + tid; if (e < pc.E) s_count[e] = 0u; }
    barrier();
    for (uint f0 = 0u; f0 < R(); f0 += WG_SIZE) { uint f = f0 + tid; if (f >= R()) continue;
        int e = expert_ids[f];
        if (valid_expert(e))
            atomicAdd(s_count[e], 1u, gl_ScopeWorkgroup, gl_StorageSemanticsShared, gl_SemanticsRelaxed);
    }
    barrier();
    // Exclusive prefix sums of the row counts and chunk counts over experts, WG_SIZE experts at a time:
    // subgroup scans, then the subgroup totals (loops with the same trip count in every invocation, see above).
    uint carry_rows = 0u, carry_chunks = 0u;
    for (uint base = 0u; base < pc.E; base += WG_SIZE) {
        uint e = base + tid;
        uint n = e < pc.E ? s_count[e] : 0u;
        uint c = (n + uint(GEMM_ROWS) - 1u) / uint(GEMM_ROWS);
        uint incl_n = subgroupInclusiveAdd(n), incl_c = subgroupInclusiveAdd(c);
        if (gl_SubgroupInvocationID == gl_SubgroupSize - 1u) {
            s_scan_rows[gl_SubgroupID] = incl_n;
            s_scan_chunks[gl_SubgroupID] = incl_c;
        }
        barrier();
        uint before_n = 0u, before_c = 0u, total_n = 0u, total_c = 0u;
        for (uint sg = 0u; sg < gl_NumSubgroups; ++sg) {
            uint tn = s_scan_rows[sg], tc = s_scan_chunks[sg];
            if (sg < gl_SubgroupID) { before_n += tn; before_c += tc; }
            total_n += tn;
            total_c += tc;
        }
        if (e < pc.E) {
            s_offset[e] = carry_rows + before_n + incl_n - n;
            s_chunk0[e] = carry_chunks + before_c + incl_c - c;
        }
        carry_rows += total_n;
        carry_chunks += total_c;
        barrier();
    }
    if (tid == 0u) {
        s_offset[pc.E] = carry_rows;
        s_chunk0[pc.E] = carry_chunks;
        route[ROUTE_ROWS] = carry_rows;
        route[ROUTE_CHUNKS] = carry_chunks;
    }
    barrier();
    // s_count is reused as the scatter cursor
    for (uint e0 = 0u; e0 < pc.E; e0 += WG_SIZE) { uint e = e0 + tid; if (e < pc.E) s_count[e] = 0u; }
    barrier();
    // Chunk table in parallel: chunk c belongs to the last expert whose first chunk is <= c (binary search).
    for (uint c0 = 0u; c0 < s_chunk0[pc.E]; c0 += WG_SIZE) { uint c = c0 + tid; if (c >= s_chunk0[pc.E]) continue;
        uint lo = 0u, hi = pc.E;  // invariant: s_chunk0[lo] <= c < s_chunk0[hi]
        [[unroll]] for (int step = 0; step < 11; ++step) {  // 2^11 > ROUTE_MAX_E + 1
            uint mid = (lo + hi) >> 1;
            if (hi - lo > 1u) { if (s_chunk0[mid] <= c) lo = mid; else hi = mid; }
        }
        uint first = (c - s_chunk0[lo]) * uint(GEMM_ROWS);
        route[route_chunk(c)] = lo;
        route[route_chunk(c) + 1u] = s_offset[lo] + first;
        route[route_chunk(c) + 2u] = min(uint(GEMM_ROWS), s_offset[lo + 1u] - s_offset[lo] - first);
    }
    for (uint f0 = 0u; f0 < R(); f0 += WG_SIZE) { uint f = f0 + tid; if (f >= R()) continue;
        int e = expert_ids[f];
        if (valid_expert(e)) {
            uint p = s_offset[e] +
                     atomicAdd(s_count[e], 1u, gl_ScopeWorkgroup, gl_StorageSemanticsShared, gl_SemanticsRelaxed);
            route[route_row_flat(p)] = f;
            route[route_row_expert(p)] = uint(e);
        }
    }
    for (uint t0 = 0u; t0 < pc.m; t0 += WG_SIZE) {
        uint t = t0 + tid;
        if (t < pc.m) route[route_valid(t)] = valid_slots(t);
    }
}
#endif

// ----------------------------------------------------------------------------- stage 1: gather + had_in
// Rows are indexed by (token, slot), f = t * top_k + slot, not by sorted position: stage 1 then needs only the
// expert ids, not the routing tables, so it runs beside the routing (same dispatch / same phase) instead of
// after it. The gate/up GEMM finds a sorted row's input through route_row_flat.
uint gu_projections() { return GATED ? 2u : 1u; }
uint stage1_items() { return (R() * (pc.H / BAND) + STAGE1_PAIRS_PER_ITEM - 1u) / STAGE1_PAIRS_PER_ITEM; }
uint routed_chunks() { return DIRECT ? R() : wg_uniform(route[ROUTE_CHUNKS]); }

// had_v = RN16(hidden[t] * suh of projection proj of expert e) for this invocation's columns h0 .. of H; the
// caller passes a valid (t, e) (stage 1's rows without a valid expert clamp theirs and drop the result). In two
// steps, so that a caller may request a row's words before it needs them: stage1_request loads the fp16 pairs of
// hidden and suh, stage1_apply multiplies them into had_v.
struct Stage1Words { uint x[HAD_MAX_VALS / 2u], s[HAD_MAX_VALS / 2u]; };
Stage1Words stage1_request(uint t, uint e, uint proj, uint h0) {
    Stage1Words w;
    uint xw = (t * pc.H + h0) >> 1, sw = (e * pc.H + h0) >> 1;  // h0 is even: whole fp16 pairs
    [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {
        w.x[j / 2u] = hidden[xw + j / 2u];
        w.s[j / 2u] = proj == 0u ? gate_suh[sw + j / 2u] : up_suh[sw + j / 2u];
    }
    return w;
}
void stage1_apply(Stage1Words w) {
    [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
        had_set_pair(j, rn16_pair(unpackHalf2x16(w.x[j / 2u]) * unpackHalf2x16(w.s[j / 2u])));
}
void stage1_load(uint t, uint e, uint proj, uint h0) { stage1_apply(stage1_request(t, e, proj, h0)); }

// Stage 1's row of pass row r of item u: its (token, slot) row f (R() where r is past the item's rows), block
// start h0 (this invocation's first column), projection and expert (-1: none).
struct Stage1Row { uint f, h0, proj; int e; };
Stage1Row stage1_row(uint u, uint r) {
    uint blocks = pc.H / 128u, projs = gu_projections(), rows = STAGE1_PAIRS_PER_ITEM * projs;
    uint pair = STAGE1_PAIRS_PER_ITEM * u + r / projs;
    Stage1Row row;
    row.proj = projs == 2u ? r & 1u : 1u;
    row.f = r < rows ? pair / blocks : R();  // f = R(): not a row
    row.h0 = (pair % blocks) * 128u + had_col0();
    row.e = row.f < R() ? expert_ids[row.f] : -1;
    return row;
}
Stage1Words stage1_request_row(Stage1Row row) {
    return stage1_request(row.f < R() ? row.f / pc.top_k : 0u, valid_expert(row.e) ? uint(row.e) : 0u, row.proj,
                          row.h0);
}

// Item u: (row, block) pairs STAGE1_PAIRS_PER_ITEM * u ..; its rows are (pair, projection), the gate row
// only where the activation is gated, HAD_PASS_ROWS of them per pass (no barrier with the subgroup transform).
// Each pass requests the next pass's words before its own transform, so they travel during it (H100: the
// routing dispatch's phase 100 -> 89.5 us at the Qwen3-30B-A3B shape's m = 1024; BENCHMARKS.md, thirty-ninth session).
void moe_stage1(uint u) {
    uint projs = gu_projections(), rows = STAGE1_PAIRS_PER_ITEM * projs;
    Stage1Row next = stage1_row(u, had_row());
    Stage1Words next_words = stage1_request_row(next);
    for (uint r0 = 0u; r0 < rows; r0 += HAD_PASS_ROWS) {
        uint r = r0 + had_row();
        Stage1Row row = next;
        stage1_apply(next_words);
        if (r0 + HAD_PASS_ROWS < rows) {
            next = stage1_row(u, r + HAD_PASS_ROWS);
            next_words = stage1_request_row(next);
        }
        uint f = row.f, h0 = row.h0;
        bool live = valid_expert(row.e);
        had_transform();
        uint sw = ((row.proj * R() + f) * pc.H + h0) >> 1;
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
            if (live) states[sw + j / 2u] = had_scaled_word(j);
        // A token with no valid slot (possible only through record() / forward_sorted) gets a zero output row:
        // nobody else writes it. Slot 0's first rows own that row, each invocation its columns, so the fill is
        // spread over the stage-1 workgroups with no loop: one routing workgroup sweeping all m*H outputs would
        // run past lavapipe 22.3's per-invocation loop cap and leave rows unwritten.
        bool zero = r % projs == 0u && f < R() && f % pc.top_k == 0u && !live && valid_slots(f / pc.top_k) == 0u;
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
            if (zero) out_h[(f / pc.top_k) * pc.H + h0 + j] = moe_out_value(f / pc.top_k, h0 + j, 0.0);
    }
}

// ------------------------------------------------------------------------------------------ activations
// Spec 8.6, fp16 semantics: every step rounds to fp16 as the CUDA arm's half2 math does, here a pair of columns
// at a time (one conversion for two values, as the tail around them).
vec2 act_silu(vec2 g) {
    vec2 e = rn16_pair(exp(-g));
    vec2 s = rn16_pair(1.0 + e);
    return rn16_pair(g * rn16_pair(1.0 / s));
}
vec2 act_gelu_tanh(vec2 x) { return rn16_pair(0.5 * x * (1.0 + tanh(0.797884560803 * (x + 0.044715 * x * x * x)))); }
vec2 act_gelu_erf(vec2 x) {
    vec2 e = vec2(erf_approx(x.x * 0.70710678118654752), erf_approx(x.y * 0.70710678118654752));
    return rn16_pair(0.5 * x * (1.0 + e));
}

// p = RN16(act(g) * u) with act_limit semantics (vkmoe/exl3/reference.py): g, u are pairs of fp16 values.
vec2 activate(vec2 g, vec2 u) {
    float L = pc.act_limit;
    if (ACT == ACT_SWIGLU_OAI) {
        if (L != 0.0) { g = min_nan(g, L); u = clamp_nan(u, -L, L); }
        return rn16_pair((u + 1.0) * g * (1.0 / (1.0 + exp(-1.702 * g))));
    }
    vec2 a;
    if (ACT == ACT_SILU) a = act_silu(g);
    else if (ACT == ACT_GELU) a = act_gelu_tanh(g);
    else if (ACT == ACT_GELU_ERF) a = act_gelu_erf(g);
    else a = max_nan(u, 0.0);
    if (L != 0.0) {
        float L16 = rn16(L);
        u = clamp_nan(u, -L16, L16);
        a = min_nan(a, L16);
    }
    return rn16_pair(a * u);
}

// ------------------------------------------------------------------- shared GEMM plumbing of stages 2 and 4
#define LAST_ARRIVAL_BUF sync_words
#include "last_arrival.glsl"
#include "split_sum.glsl"
// The most rows of one chunk: the cooperative-matrix tile's (the routing cuts chunks of that many), or GEMM_ROWS's
// largest value.
#ifdef MOE_COOP
#define MOE_CHUNK_ROWS_MAX COOP_BM
#else
#define MOE_CHUNK_ROWS_MAX MOE_ROWS_MAX
#endif
shared uint s_token_done[MOE_CHUNK_ROWS_MAX];  // stage 5, per row of the chunk; a multiple of 16 bytes (see coop_row)

// Rows of one k-split's GEMM partial. The FMA core stores a chunk's rows at their sorted positions p0 ..; the
// cooperative-matrix core stores whole 16-row m-tiles, so chunk c starts at row p0 + COOP_MOE_ROW_SLACK * c
// (its last m-tile then ends before the next chunk's first row) and a split holds R + 15 max_chunks rows
// (layout.moe_partial_rows).
#ifdef MOE_COOP
uint partial_rows() { return R() + COOP_MOE_ROW_SLACK * pc.max_chunks; }
uint partial_row0(uint c, uint p0) { return p0 + COOP_MOE_ROW_SLACK * c; }
#else
uint partial_rows() { return R(); }
uint partial_row0(uint c, uint p0) { return p0; }
#endif
#ifdef MOE_CLOCK
// layout.clock_offset
uint moe_clock_base() { return 2u * pc.splits_gu * partial_rows() * pc.I + pc.splits_d * partial_rows() * pc.H; }
#endif

// --------------------------------------------------------------------- stage 2 (+3): gate/up GEMM, activation
uint gu_items_per_chunk() { return (pc.I / 128u) * gu_projections() * pc.splits_gu; }

void moe_stage3(uint e, uint p0, uint q0, uint nr, uint b0, uint nb, bool to_red);

#ifndef MOE_COOP
// The direct-mode gate/up item in flight: (row f, expert, projection, kt1) and kt0, set before its GEMM.
uvec4 moe_direct_item = uvec4(0u);
uint moe_direct_kt0 = 0u;

// Direct mode, whole workgroup: stage 1 of row f for one projection (the same arithmetic as moe_stage1) over the
// 128-blocks that hold k-tiles [kt0, kt1), into gemm_red as packed fp16 words from kt0's block on, one block per
// Hadamard row. At most GEMM_RED_WORDS / 64 blocks: the plan keeps kt_gu within layout.DIRECT_MAX_KT. gemm_red is
// free here: the previous item's last reads of it were followed by its arrival's barrier.
void moe_direct_stage1(uint f, uint e, uint proj, uint kt0, uint kt1) {
    uint b0 = kt0 / 8u, nb = wg_uniform((kt1 + 7u) / 8u - b0), c0 = had_col0();
    for (uint r0 = 0u; r0 < nb; r0 += HAD_PASS_ROWS) {  // around barriers (shared-memory transform): nb uniform
        uint r = r0 + had_row();
        stage1_load(f / pc.top_k, e, proj, (b0 + min(r, nb - 1u)) * 128u + c0);
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
            if (r < nb) gemm_red[r * 64u + (c0 + j) / 2u] = had_scaled_word(j);
    }
    barrier();  // the GEMM reads the whole row
}

// The down item in flight with STAGE3_IN_DOWN: (expert, first sorted row, first partial row, rows) and the
// 128-blocks of I its k-range spans (first, count), set before its GEMM.
uvec4 moe_stage3_item = uvec4(0u);
uvec2 moe_stage3_blocks = uvec2(0u);

void moe_after_prefetch(const int a_src) {
    if (a_src == A_DIRECT) {
        moe_direct_stage1(moe_direct_item.x, moe_direct_item.y, moe_direct_item.z, moe_direct_kt0, moe_direct_item.w);
        return;
    }
#ifdef MOE_DEPENDENCY_WAITS
    if (moe_dep_target != 0u) moe_wait(moe_dep_word, moe_dep_target);
#endif
    if (a_src == A_STAGE3) {  // the gate/up partials of this item's blocks are complete: stage 3 into gemm_red
        moe_stage3(moe_stage3_item.x, moe_stage3_item.y, moe_stage3_item.z, moe_stage3_item.w,
                   moe_stage3_blocks.x, moe_stage3_blocks.y, true);
        barrier();  // the GEMM reads every unit
    }
}
#endif

void moe_gate_up(uint item) {
    uint s = item % pc.splits_gu;
    uint rest = item / pc.splits_gu;
    uint proj = GATED ? rest % 2u : 1u;
    rest = GATED ? rest / 2u : rest;
    uint band = rest % (pc.I / 128u), c = rest / (pc.I / 128u);
    uint e, p0, nr;
    moe_chunk(c, e, p0, nr);
    // Direct mode only: a slot with no valid expert (a routed chunk always has rows; no branch on them there).
    if (DIRECT && nr == 0u) return;
    uint tiles_k = pc.H / 16u, tiles_n = pc.I / 16u;
    uint kt0 = s * pc.kt_gu, kt1 = min(tiles_k, kt0 + pc.kt_gu);
    // One GEMM call, not one per projection in an if/else: Mesa 22.3's lavapipe skips a loop inside a branch of
    // a shader with barriers. K folds to a constant when gate and up share their bit width.
    int k_bits = proj == 0u ? K_GATE : K_UP;
    uint b_base = e * tiles_k * tiles_n * 8u * uint(k_bits), q0 = partial_row0(c, p0);
    uint counter = counters_gu() + c * (pc.I / 128u) + band, arrivals = gu_projections() * pc.splits_gu;
#ifndef MOE_COOP
    // Split dispatches with stage 3 in the down items: nothing follows a band's partials in this dispatch, so no
    // arrival is counted (gemm_finish_partial: 0 arrivals); the pipeline barrier publishes them.
    if (STAGE3_IN_DOWN && pc.num_workgroups == 0u) arrivals = 0u;
#endif
    uint base = (proj * pc.splits_gu + s) * partial_rows() * pc.I;
    // Each row's input lives at its (token, slot) index (see stage 1).
#ifdef MOE_COOP
    uint tid = gl_LocalInvocationID.x;
    if (tid < COOP_BM) coop_row[tid] = proj * R() + moe_row_flat(p0 + min(tid, nr - 1u));
    barrier();
    coop_gemm(A_STATES, int(proj), k_bits, b_base, 0u, nr, pc.H, tiles_n, band, kt0, kt1,
              base + q0 * pc.I + band * BAND, pc.I, false);  // stage 3 reads the gate and the up items' tiles
    bool last = wg_last_arrival(counter, arrivals);
#else
    // Direct mode: the one row's A is built in gemm_red for whole 128-blocks from kt0's block on
    // (moe_direct_stage1), so A word index 8 kt of the GEMM maps to gemm_red word 8 (kt - 8 (kt0 / 8)).
    [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r)
        gemm_row_base[r] = DIRECT ? 0u - (kt0 / 8u) * 64u
                                  : (proj * R() + moe_row_flat(p0 + min(uint(r), nr - 1u))) * (pc.H / 2u);
    gemm_clear();
    moe_direct_item = uvec4(p0, e, proj, kt1);
    moe_direct_kt0 = kt0;
#ifdef MOE_DEPENDENCY_WAITS
    moe_dep_word = SYNC_STAGE1_DONE;   // routed mode: the rows' states, written by every workgroup's stage-1 share
    moe_dep_target = DIRECT ? 0u : pc.num_workgroups;
#endif
    gemm_accumulate(DIRECT ? A_DIRECT : A_STATES, int(proj), k_bits, CB, nr, b_base, tiles_n, band, kt0, kt1);
    MOE_CLOCK_FIRST_GATE_UP(CLOCK_FIRST_GATE_UP_GEMM);
    bool last = gemm_finish_partial(base, pc.I, p0, nr, band, counter, arrivals);
    MOE_CLOCK_FIRST_GATE_UP(CLOCK_FIRST_GATE_UP_ARRIVAL);
#endif
    if (last) {
        // With STAGE3_IN_DOWN the down items apply stage 3 themselves; the last arrival only says the band is done.
        if (!STAGE3_IN_DOWN) moe_stage3(e, p0, q0, nr, band, 1u, false);
#ifdef MOE_DEPENDENCY_WAITS
        moe_signal(counters_chunk_done() + c);  // one more 128-band of this chunk's down input is written
#endif
        MOE_CLOCK_FIRST_GATE_UP(CLOCK_FIRST_STAGE3_END);
    }
#ifdef MOE_CLOCK
    moe_clock_gate_up_items += 1u;
#endif
}

// The first element of this invocation's columns n0 .. of I in partial row q (partial_row0) of projection proj's
// k-split 0 (split s is s * partial_rows() * I further on).
uint gu_partial(uint proj, uint q, uint n0) { return (proj * pc.splits_gu * partial_rows() + q) * pc.I + n0; }

// stage 3: g of this invocation's columns while up is transformed (module level and fixed size, as had_v)
float s3_gate[HAD_MAX_VALS];

// Units (row, 128-block of I) of one chunk, one unit per Hadamard lane group and HAD_PASS_ROWS per pass:
// u = had_out(Iu, up.svh), g = had_out(Ig, gate.svh), p = act(g) * u, inter = had_in(p, down.suh), where Ig and
// Iu are the k-split sums of the GEMM partials (split order) rounded to fp16. The chunk's rows are sorted rows
// p0 .., their partials rows q0 .. (partial_row0); the blocks b0 .. b0 + nb - 1, unit u = (row u / nb, block
// b0 + u % nb). Written to inter (a gate/up band tail: nb = 1), or with to_red to gemm_red, unit u at word 64 u
// (a down item's A under STAGE3_IN_DOWN: the same fp16 values inter would hold). Units past nr * nb run on the
// last one, dropped. Every lane runs the same loops (on a valid unit: Mesa 22.3's rule on loops beside barriers,
// see hadamard128.glsl).
// Every load of a pass (both projections' partials and the three scale vectors) is issued before its first
// transform: this tail is on the critical path of every decode step, and with each load behind the previous
// transform it waited for several round trips to memory (4.7 of the 17.5 us of the Qwen3 shape's gate/up phase
// at m = 1 on the H200, persistent kernel: BENCHMARKS.md).
void moe_stage3(uint e, uint p0, uint q0, uint nr, uint b0, uint nb, bool to_red) {
    uint units = nr * nb, stride = partial_rows() * pc.I;
    for (uint u0 = 0u; u0 < units; u0 += HAD_PASS_ROWS) {
        uint unit = u0 + had_row(), uc = min(unit, units - 1u), r = uc / nb, q = q0 + r;
        uint n0 = (b0 + uc % nb) * 128u + had_col0(), se = e * pc.I + n0;
        float gate_sv[HAD_MAX_VALS], up_sv[HAD_MAX_VALS], down_su[HAD_MAX_VALS], up_sum[HAD_MAX_VALS];
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) {
            gate_sv[j] = GATED ? f16_at(gate_svh[(se + j) >> 1], se + j) : 0.0;
            up_sv[j] = f16_at(up_svh[(se + j) >> 1], se + j);
            down_su[j] = f16_at(down_suh[(se + j) >> 1], se + j);
        }
        if (GATED) {
            split_sum_had_pair(gu_partial(0u, q, n0), gu_partial(1u, q, n0), stride, pc.splits_gu, up_sum);
        } else {
            split_sum_had(gu_partial(1u, q, n0), stride, pc.splits_gu);
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) up_sum[j] = had_v[j];
        }
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) s3_gate[j] = 0.0;  // g of a gateless activation
        if (GATED) {
            had_round_pairs();  // the fp16 GEMM output Ig
            had_transform();
            [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {
                vec2 g = had_out_pair(j, vec2(gate_sv[j], gate_sv[j + 1u]));
                s3_gate[j] = g.x;
                s3_gate[j + 1u] = g.y;
            }
        }
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] = up_sum[j];
        had_round_pairs();  // Iu
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {
            vec2 u = had_out_pair(j, vec2(up_sv[j], up_sv[j + 1u]));
            vec2 a = activate(vec2(s3_gate[j], s3_gate[j + 1u]), u);
            had_set_pair(j, rn16_pair(a * vec2(down_su[j], down_su[j + 1u])));
        }
        had_transform();
        uint iw = to_red ? unit * 64u + had_col0() / 2u : ((p0 + r) * pc.I + n0) >> 1;
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {
            uint w = had_scaled_word(j);
            if (unit < units) {
#ifndef MOE_COOP  // (the cooperative-matrix builds have no gemm_red and never pass to_red)
                if (to_red) gemm_red[iw + j / 2u] = w;
                else
#endif
                    inter[iw + j / 2u] = w;
            }
        }
    }
}

// ------------------------------------------------------------------ stage 4 (+5): down GEMM, weighted output
uint down_items_per_chunk() { return (pc.H / 128u) * pc.splits_d; }
// In the persistent kernel (num_workgroups > 0) the down partials follow the gate/up partials ([2][splits_gu][R][I])
// instead of reusing them: a chunk's down GEMM runs while other chunks are still in gate/up. The split dispatches
// are separated by pipeline barriers and reuse the space (layout.scratch_bytes sizes both).
// Stage 3 in the down items reads the gate/up partials during the down dispatch too.
// A down item with one k-split (and, on the FMA core, one block of <= 4 rows) keeps its band's sums in shared
// memory (moe_down), and stage 5 reads the pass row's row stage5_tile_row there (down_tile_at) instead of its
// partial: no round trip through partial[] and no device-scope barrier between the GEMM and its tail.
bool down_tile_in_shared = false;
uint stage5_tile_row = 0u;
float down_tile_at(uint r, uint col) {
#ifdef MOE_COOP
    return coop_c_at(r, col);
#else
    return gemm_red_sum(r, col);  // gemm_finish_partial's value, from the k-slices gemm_stage_rows(0) left there
#endif
}

uint partial_down() {
    return pc.num_workgroups != 0u || STAGE3_IN_DOWN ? 2u * pc.splits_gu * partial_rows() * pc.I : 0u;
}

void moe_stage5(uint e, uint p0, uint q0, uint nr, uint band);
void moe_stage5_token(uint t, uint band);

void moe_down(uint item) {
    uint s = item % pc.splits_d;
    uint rest = item / pc.splits_d;
    uint band = rest % (pc.H / 128u), c = rest / (pc.H / 128u);
    uint e, p0, nr;
    moe_chunk(c, e, p0, nr);
    if (DIRECT && nr == 0u) {  // a slot with no valid expert; slot 0 zeroes the row of a token with none
        uint t = c / pc.top_k, tid = gl_LocalInvocationID.x;
        if (s == 0u && c % pc.top_k == 0u && tid < 128u && moe_token_slots(t) == 0u)
            out_h[t * pc.H + band * 128u + tid] = moe_out_value(t, band * 128u + tid, 0.0);
        return;
    }
    uint tiles_k = pc.I / 16u, tiles_n = pc.H / 16u;
    uint kt0 = s * pc.kt_d, kt1 = min(tiles_k, kt0 + pc.kt_d);
    uint b_base = e * tiles_k * tiles_n * 8u * uint(K_DOWN), q0 = partial_row0(c, p0);
    uint counter = counters_d() + c * (pc.H / 128u) + band, base = partial_down() + s * partial_rows() * pc.H;
    uint t = c / pc.top_k;  // direct mode: the chunk's token
#ifdef MOE_COOP
    uint tid = gl_LocalInvocationID.x;
    if (tid < COOP_BM) coop_row[tid] = p0 + min(tid, nr - 1u);  // inter rows are the chunk's sorted rows
    barrier();
    // With one k-split the tile is its band's whole sum and stage 5 its only reader: it stays in shared memory
    // instead of a round trip through partial[] (DESIGN.md, "The MoE stages on cooperative matrices").
    down_tile_in_shared = pc.splits_d == 1u;
    coop_gemm(A_INTER, 2, K_DOWN, b_base, 0u, nr, pc.I, tiles_n, band, kt0, kt1,
              base + q0 * pc.H + band * BAND, pc.H, down_tile_in_shared);
    bool last = true;
    if (down_tile_in_shared) barrier();
    else last = wg_last_arrival(counter, pc.splits_d);
#else
    // STAGE3_IN_DOWN: A is the item's own stage-3 output in gemm_red, row r's blocks b0 .. at unit r * nb, so A
    // word 8 kt of row r is gemm_red word 64 (r nb + kt / 8 - b0) + 8 (kt % 8).
    uint b0 = kt0 / 8u, nb = (kt1 + 7u) / 8u - b0;
    [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r)
        gemm_row_base[r] = STAGE3_IN_DOWN ? (uint(r) * nb - b0) * 64u : (p0 + uint(r)) * (pc.I / 2u);
    moe_stage3_item = uvec4(e, p0, partial_row0(c, p0), nr);
    moe_stage3_blocks = uvec2(b0, nb);
    gemm_clear();
#ifdef MOE_DEPENDENCY_WAITS
    moe_dep_word = counters_chunk_done() + c;  // every 128-band of the chunk's inter (the down k dimension)
    moe_dep_target = pc.I / 128u;
#endif
    gemm_accumulate(STAGE3_IN_DOWN ? A_STAGE3 : A_INTER, 2, K_DOWN, CB, nr, b_base, tiles_n, band, kt0, kt1);
#ifdef MOE_DEPENDENCY_WAITS
    // Past its wait (or a wait this workgroup already passed): one more of the chunk's down items is done with the
    // chunk's progress counter.
    uint dep_before = moe_users_begin(counters_chunk_users() + c);
#endif
    // Direct mode counts every (slot, k-split) of the token's band on one counter (moe_stage5_token), also with
    // one k-split: each item finishing its own row (moe_stage5) and only the token sum waiting was slower (H200,
    // Qwen3 shape, split, m = 2: 44.8 vs 41.4 us; m = 1 with one down split 32.7 vs 30.3; BENCHMARKS.md).
    uint arrivals = DIRECT ? moe_token_slots(t) * pc.splits_d : pc.splits_d;
    if (DIRECT) counter = counters_tok() + t * (pc.H / 128u) + band;
    MOE_CLOCK_FIRST_DOWN(CLOCK_FIRST_DOWN_GEMM);
    // One k-split of one row block (routed mode: the direct mode's token tail sums every slot's partial) stays in
    // gemm_red: gemm_finish_partial writes nothing and counts nothing (0 rows, 0 arrivals) and the rows are staged
    // here (a branch with barriers but no loop: Mesa 22.3, see moe_gate_up).
    down_tile_in_shared = !DIRECT && pc.splits_d == 1u && nr <= 4u;
    bool last = gemm_finish_partial(base, pc.H, p0, down_tile_in_shared ? 0u : nr, band, counter,
                                    down_tile_in_shared ? 0u : arrivals);
    if (down_tile_in_shared) {
        barrier();
        gemm_stage_rows(0u);
        barrier();
        last = true;
    }
#ifdef MOE_DEPENDENCY_WAITS
    moe_users_end(counters_chunk_users() + c, dep_before, down_items_per_chunk(), counters_chunk_done() + c);
#endif
    MOE_CLOCK_FIRST_DOWN(CLOCK_FIRST_DOWN_ARRIVAL);
#endif
    if (last) {
        if (DIRECT) moe_stage5_token(t, band);
        else moe_stage5(e, p0, q0, nr, band);
        MOE_CLOCK_FIRST_DOWN(CLOCK_FIRST_STAGE5_END);
    }
#ifdef MOE_CLOCK
    moe_clock_down_items += 1u;
#endif
}

// One pass row of a down tail, into had_v: the k-split sum of the row's down partials (from word `partial`, split
// order; or the only split's row stage5_tile_row of the tile in shared memory, see down_tile_in_shared) rounded
// to fp16 (the down GEMM output), the output Hadamard, then the routing weight (rounded to fp16) and svh (from
// element se of down_svh). The weight and svh are requested with the partials, before the transform (as in stage
// 3). Every lane calls it: split_sum's loop and the transform must not diverge.
void stage5_row_out(uint partial, uint se, float weight) {
    float w16 = rn16(weight), sv[HAD_MAX_VALS];
    [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) sv[j] = f16_at(down_svh[(se + j) >> 1], se + j);
    // The sum's loop runs outside any branch (no split to add when the tile is in shared memory: Mesa 22.3, rule 2
    // in DESIGN.md); the tile's value is split_sum_had's arithmetic for one split, 0.0 + x (the same bits).
    split_sum_had(partial, partial_rows() * pc.H, down_tile_in_shared ? 0u : pc.splits_d);
    if (down_tile_in_shared) {
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] = 0.0 + down_tile_at(stage5_tile_row, had_col0() + j);
    }
    had_round_pairs();
    had_transform();
    [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] = (had_v[j] * (HAD_SCALE * w16)) * sv[j];
}

// Direct mode: the last of all (slot, k-split) arrivals of token t's band applies each slot's output Hadamard,
// routing weight and svh and sums the slots in slot order into out_h: the same arithmetic as moe_stage5, in one
// reduction level instead of a tail per slot and then a token sum after a second counter (that second level cost
// 5.2 us of the 17.8 us down phase of the Qwen3 shape at m = 1 on the H200: BENCHMARKS.md). Slot s0 + had_row() of
// a pass is a pass row, so with the subgroup transform all 8 slots of a top-8 token are one pass without a barrier;
// the slot sum then goes through the transform's shared rows, HAD_SHARED_ROWS rows at a time. (It ran the
// shared-memory transform on 4 slots per pass before: about 22 workgroup barriers per band at top-8, on the critical
// path of every decode step.)
void moe_stage5_token(uint t, uint band) {
    uint tid = gl_LocalInvocationID.x, h0 = band * 128u + had_col0();
    float acc = 0.0;  // invocations < 128: column band * 128 + tid
    for (uint s0 = 0u; s0 < pc.top_k; s0 += HAD_PASS_ROWS) {
        uint rr = had_row(), f = t * pc.top_k + min(s0 + rr, pc.top_k - 1u);
        int e = expert_ids[f];
        bool live = s0 + rr < pc.top_k && valid_expert(e);  // else the row gives 0 and writes nothing
        // a dead slot's partials are never written: summed all the same (every lane runs the pass), then dropped
        stage5_row_out(partial_down() + f * pc.H + h0, uint(live ? e : 0) * pc.H + h0, expert_weights[f]);
        // the (token, slot) rows too: forward_rows (a sharded layer) reads them
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
            if (live) rows_out[f * pc.H + h0 + j] = had_v[j];
        // The slot sum: rows g .. g + HAD_SHARED_ROWS - 1 of the pass through the shared rows, then added in slot order
        for (uint g = 0u; g < HAD_PASS_ROWS && s0 + g < pc.top_k; g += HAD_SHARED_ROWS) {
            if (rr >= g && rr < g + HAD_SHARED_ROWS) {
                [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
                    HAD_BUF_STORE((rr - g) * 128u + had_col0() + j, had_v[j]);
            }
            barrier();
            if (tid < 128u) {
                [[unroll]] for (uint r = 0u; r < HAD_SHARED_ROWS; ++r) {
                    uint s = s0 + g + r;
                    if (g + r < HAD_PASS_ROWS && s < pc.top_k && valid_expert(expert_ids[t * pc.top_k + s]))
                        acc += HAD_BUF_LOAD(r * 128u + tid);
                }
            }
            barrier();
        }
    }
    if (tid < 128u) out_h[t * pc.H + band * 128u + tid] = moe_out_value(t, band * 128u + tid, acc);
}

// Token t's output at column col: its valid slots' rows of rows_out summed in slot order (the same bits whichever
// expert finished last), through moe_out_value. The last tail of the token's band runs it, or the token-sum pass.
// Each group of 8 slots requests all its rows before adding any, so the sum waits one round trip to memory per 8
// slots instead of one per slot; a slot past top_k reads slot top_k - 1's row (in bounds) and is never added.
#if MAX_TOP_K % 8 != 0
#error moe_token_out groups the slots by 8
#endif
void moe_token_out(uint t, uint col) {
    float v = 0.0;
    uint base = t * pc.top_k;
    [[unroll]] for (int s0 = 0; s0 < MAX_TOP_K; s0 += 8) {
        if (uint(s0) < pc.top_k) {
            float row[8];
            [[unroll]] for (int j = 0; j < 8; ++j) {
                uint s = min(uint(s0 + j), pc.top_k - 1u);
                row[j] = rows_out[(base + s) * pc.H + col];
            }
            [[unroll]] for (int j = 0; j < 8; ++j)
                if (uint(s0 + j) < pc.top_k && valid_expert(expert_ids[base + uint(s0 + j)])) v += row[j];
        }
    }
    out_h[t * pc.H + col] = moe_out_value(t, col, v);
}

// Rows of one chunk, one 128-band of H, HAD_PASS_ROWS per pass: the down output Hadamard, routing weight and svh
// into each row's (token, slot) row of rows_out; then each row arrives at its token's band counter, and the last
// slot of a token to arrive sums the token's rows.
void moe_stage5(uint e, uint p0, uint q0, uint nr, uint band) {
    uint tid = gl_LocalInvocationID.x, h0 = band * 128u + had_col0(), se = e * pc.H + h0;
    for (uint r0 = 0u; r0 < nr; r0 += HAD_PASS_ROWS) {
        uint r = r0 + had_row(), q = q0 + min(r, nr - 1u);  // every lane loops the same (see moe_stage3)
        uint fidx = moe_row_flat(p0 + min(r, nr - 1u));
        stage5_tile_row = min(r, nr - 1u);  // the chunk's row r is the tile's
        stage5_row_out(partial_down() + q * pc.H + h0, se, expert_weights[fidx]);
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
            if (r < nr) rows_out[fidx * pc.H + h0 + j] = had_v[j];
    }
    if (TOKEN_SUM_PASS) return;  // moe_token_sum.comp sums the tokens after this dispatch
    // Every row of the chunk is written before any is counted: one round of arrivals and token sums per tail, not
    // one per Hadamard pass (each round is two device-scope barriers and a round trip through L2; per pass they
    // were most of the down phase at prefill sizes: BENCHMARKS.md, sixth session).
    WG_BARRIER_DEVICE();
    if (tid < MOE_CHUNK_ROWS_MAX) {  // one invocation per row counts the row's arrival
        bool done = false;
        if (tid < nr) {
            uint t = moe_row_flat(p0 + tid) / pc.top_k;
            uint counter = counters_tok() + t * (pc.H / 128u) + band;
            uint arrived = atomicAdd(sync_words[counter], 1u, gl_ScopeQueueFamily, gl_StorageSemanticsBuffer,
                                     gl_SemanticsAcquireRelease | gl_SemanticsMakeAvailable | gl_SemanticsMakeVisible);
            done = arrived + 1u == moe_token_slots(t);
            if (done) {
                atomicStore(sync_words[counter], 0u, gl_ScopeQueueFamily, gl_StorageSemanticsBuffer,
                            gl_SemanticsRelaxed);
            }
        }
        s_token_done[tid] = uint(done);
    }
    WG_BARRIER_DEVICE();
    // The token sums of the rows whose token this tail completed, one column per invocation; the bound is a whole
    // number of workgroup strides, so every invocation runs the same trip count (Mesa 22.3, see above).
    for (uint i = tid; i < ((nr * 128u + WG_SIZE - 1u) / WG_SIZE) * WG_SIZE; i += WG_SIZE) {
        uint rr = i >> 7, col = band * 128u + (i & 127u);
        if (rr < nr && s_token_done[rr] != 0u) moe_token_out(moe_row_flat(p0 + rr) / pc.top_k, col);
    }
    barrier();  // s_token_done is read before the next tail writes it
}

#endif
