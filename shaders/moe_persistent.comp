#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16 clock=-DMOE_CLOCK idot_clock=-DEXL3_IDOT,-DMOE_CLOCK f16_clock=-DEXL3_IDOT,-DEXL3_F16,-DMOE_CLOCK
#ifdef MOE_CLOCK  // the timing build (layout.CLOCK_MARKS): the same kernel, with clock marks
#extension GL_EXT_shader_realtime_clock : require
#endif
// The persistent MoE kernel: ONE dispatch of at most the co-resident number of workgroups of THIS pipeline (the
// host measures it with this very binary in its discovery mode, pc.mode = MOE_MODE_DISCOVER) running every stage
// of moe_stages.glsl. There is no grid-wide barrier: work items are dealt out statically (round robin, in the
// order routing + stage 1, gate/up, down) and a GEMM item waits only for the counter its input depends on, after
// issuing its first weight loads (MOE_DEPENDENCY_WAITS in moe_stages.glsl). In direct mode there is no routing
// and no stage 1, and gate/up items wait for nothing:
//   routing (workgroup 0) + stage 1 (the others)  ->  SYNC_ROUTED, SYNC_STAGE1_DONE
//   gate/up item (chunk c)  waits for every workgroup's stage-1 share; its stage 3 counts chunk c's bands
//   down item (chunk c)     waits for chunk c's I/128 bands only, so experts finish independently
// Why it cannot deadlock while every workgroup is resident: each workgroup runs its items in that order and an
// item only waits for items earlier in it, which resident workgroups finish without waiting for anything later.
// Safety net: every wait is bounded (pc.spin_limit each, pc.loop_budget in total, below lavapipe 22.3's loop cap);
// a failed wait sets the abort flag, waits that see it give up at once, and the host re-runs the inputs in split
// mode. The last workgroup out resets the counters, so the next launch needs no host-side clearing.
#include "common.glsl"
#define WG_SIZE 256u
#define MOE_ROUTE
#define ROUTE_MAX_E 256   // keeps this kernel inside the 16 KiB of shared memory Vulkan guarantees
#define MOE_DEPENDENCY_WAITS
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#define SYNC_BUF sync_words
#define SYNC_POLLS 32
#include "sync.glsl"
#include "occupancy.glsl"
#include "moe_stages.glsl"

shared bool s_last_out;

// Discovery mode: the sync binding holds one 16-word measurement (occupancy.glsl) whose words OCC_PARAMS.. carry
// the poll bounds the host chose; pc.num_workgroups is the grid launched.
// Every invocation stays until invocation 0 is done: a workgroup must hold ALL its resources while it counts
// itself (registers are freed per subgroup as subgroups exit, so a workgroup reduced to invocation 0 let more
// workgroups in than the kernel itself can keep resident: the H200 counted 396 for a pipeline that deadlocked
// at 300 and ran at 264).
void discover() {
    if (gl_LocalInvocationIndex == 0u)
        occupancy_discover(0u, pc.num_workgroups, sync_words[OCC_PARAMS], sync_words[OCC_PARAMS + 1u],
                           sync_words[OCC_PARAMS + 2u], pc.loop_budget);
    barrier();
}

// The last workgroup out of a launch that was not aborted resets the persistent counters (an aborted launch is
// cleared by the host before anything else runs).
void retire() {
    uint tid = gl_LocalInvocationIndex;
    SYNC_WG_BARRIER();
    if (tid == 0u) s_last_out = sync_add(SYNC_RETIRED, 1u) == pc.num_workgroups - 1u && !sync_aborted();
    SYNC_WG_BARRIER();
    if (wg_uniform(uint(s_last_out)) == 0u) return;
    uint chunks = routed_chunks();
    for (uint c0 = 0u; c0 < chunks; c0 += WG_SIZE) {
        uint c = c0 + tid;
        if (c < chunks) sync_store_relaxed(counters_chunk_done() + c, 0u);
    }
    if (tid == 0u) {
        sync_store_relaxed(SYNC_ROUTED, 0u);
        sync_store_relaxed(SYNC_STAGE1_DONE, 0u);
        sync_store(SYNC_RETIRED, 0u);
    }
}

void main() {
    if (pc.mode == MOE_MODE_DISCOVER) {
        discover();
        return;
    }
    MOE_CLOCK_START();
    uint G = pc.num_workgroups, wg = wg_uniform(gl_WorkGroupID.x);
    if (!DIRECT) {
        // Routing needs nothing and stage 1 needs only the expert ids (rows by (token, slot)): workgroup 0 routes
        // while the others share stage 1 (all of it is workgroup 0's when the grid is 1).
        if (wg == 0u) {
            moe_route();
            moe_signal(SYNC_ROUTED);
        }
        uint s1_items = stage1_items();
        uint s1_first = G == 1u ? 0u : wg == 0u ? s1_items : wg - 1u;
        uint s1_step = G == 1u ? 1u : G - 1u;
        for (uint u = s1_first; u < s1_items; u += s1_step) moe_stage1(u);
        moe_signal(SYNC_STAGE1_DONE);
        // The chunk table says which gate/up and down items exist (usually long written by now).
        moe_wait(SYNC_ROUTED, 1u);
    }
    uint gu_items = moe_launch_failed ? 0u : routed_chunks() * gu_items_per_chunk();
    for (uint i = wg; i < gu_items; i += G) {
        moe_gate_up(i);
        if (moe_launch_failed) break;
    }
    MOE_CLOCK_MARK(CLOCK_GATE_UP_DONE);
    // Down items continue the round robin where gate/up left off, so the workgroups with fewer gate/up items
    // start on them first.
    uint d_items = moe_launch_failed ? 0u : routed_chunks() * down_items_per_chunk();
    for (uint i = (wg + G - gu_items % G) % G; i < d_items; i += G) {
        moe_down(i);
        if (moe_launch_failed) break;
    }
    MOE_CLOCK_MARK(CLOCK_DOWN_DONE);
    retire();
    MOE_CLOCK_MARK(CLOCK_RETIRED);
}
