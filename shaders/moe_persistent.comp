#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16 clock=-DMOE_CLOCK idot_clock=-DEXL3_IDOT,-DMOE_CLOCK f16_clock=-DEXL3_IDOT,-DEXL3_F16,-DMOE_CLOCK
#ifdef MOE_CLOCK  // the timing build (layout.CLOCK_MARKS): the same kernel, with clock marks
#extension GL_EXT_shader_realtime_clock : require
#endif
// The persistent MoE kernel: ONE dispatch of at most the co-resident number of workgroups of THIS pipeline (the
// host measures it with this very binary in its discovery mode, pc.mode = MOE_MODE_DISCOVER) running every stage
// of moe_stages.glsl. There is no grid-wide barrier. Work items are numbered gate/up first, then down (both in
// chunk order); workgroup w starts on item w and then takes tickets (item = grid + ticket, SYNC_TICKET), so the
// workgroups that finish early take the next items whatever the others' items cost. A GEMM item waits only for
// the counter its input depends on, after issuing its first weight loads (MOE_DEPENDENCY_WAITS in
// moe_stages.glsl). In direct mode there is no routing and no stage 1, and gate/up items wait for nothing:
//   routing (workgroup 0) + stage 1 (the others)  ->  SYNC_ROUTED, SYNC_STAGE1_DONE
//   gate/up item (chunk c)  waits for every workgroup's stage-1 share; its stage 3 counts chunk c's bands
//   down item (chunk c)     waits for chunk c's I/128 bands only, so experts finish independently
// Why it cannot deadlock while every workgroup is resident: an item only waits for items of lower number (or for
// stage 1, which every workgroup finishes before its first item), and items are handed out in increasing order,
// so every item waited for is held by a running workgroup that does not wait for anything later.
// Safety net: every wait is bounded (pc.spin_limit each, pc.loop_budget in total, below lavapipe 22.3's loop cap);
// a failed wait sets the abort flag, waits that see it give up at once, and the host re-runs the inputs in split
// mode. Every counter is stored back to 0 by the last of its known number of users (moe_users_begin), so the
// next launch needs no host-side clearing and no workgroup waits for the others at the end of a launch.
#include "common.glsl"
#define WG_SIZE 256u
#define MOE_ROUTE
#define ROUTE_MAX_E 256   // keeps this kernel inside the 16 KiB of shared memory Vulkan guarantees
#define MOE_DEPENDENCY_WAITS
// Two k-tiles per step of the GEMM k-loop (exl3_gemm.glsl): 4 tiles' loads in flight per invocation instead of 2.
// Faster here, slower in the split dispatches, which keep one (BENCHMARKS.md, thirty-third session, H100: the Qwen3
// shape at m = 4, persistent 74.5 -> 68.5 us; split 64.9 -> 71.7 when its dispatches had two as well).
#define GEMM_TILES_PER_STEP 2
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#define SYNC_BUF sync_words
#define SYNC_POLLS 32
#include "sync.glsl"
#include "occupancy.glsl"
// The ticket a workgroup took for its next item (16 bytes, as every shared variable: see last_arrival.glsl).
shared uint s_ticket[4];
bool moe_ticket_taken = false;  // invocation 0: this item's arrival took the next ticket
// Invocation 0, right after a GEMM item's arrival atomic (LAST_ARRIVAL_ALSO): the next item's ticket, so the two
// round trips overlap and taking work costs no extra wait.
void moe_take_ticket() {
    s_ticket[0] = sync_add_relaxed(SYNC_TICKET, 1u);
    moe_ticket_taken = true;
}
#define LAST_ARRIVAL_ALSO() moe_take_ticket()

#include "moe_stages.glsl"

#include "moe_discover.glsl"

// Whole workgroup, after an item (which may have ended without an arrival: a direct-mode slot with no
// valid expert): the next item, item = grid + ticket. The ticket that closes the count (every item handed out
// takes one ticket: T items, T tickets) is the counter's last user and stores it back to 0.
uint moe_next_item(uint items) {
    barrier();  // every invocation has read s_ticket for this item (an item without barriers may end here)
    if (gl_LocalInvocationIndex == 0u && !moe_ticket_taken) s_ticket[0] = sync_add_relaxed(SYNC_TICKET, 1u);
    moe_ticket_taken = false;
    barrier();
    uint ticket = wg_uniform(s_ticket[0]);
    if (gl_LocalInvocationIndex == 0u && ticket == items - 1u) sync_store_relaxed(SYNC_TICKET, 0u);
    return pc.num_workgroups + ticket;
}

// Whole workgroup, once, when it has no gate/up item left: in routed mode it no longer waits for the routing flag
// or the stage-1 count (it waited for the flag before its first item and for the count before any gate/up item, and
// signalled the count before), and the last workgroup to say so resets all three words.
void moe_gate_up_phase_done() {
    MOE_CLOCK_MARK(CLOCK_GATE_UP_DONE);
    if (DIRECT || moe_launch_failed) return;
    if (gl_LocalInvocationIndex == 0u && sync_add(SYNC_PHASE1_USERS, 1u) == pc.num_workgroups - 1u) {
        sync_store_relaxed(SYNC_ROUTED, 0u);
        sync_store_relaxed(SYNC_STAGE1_DONE, 0u);
        sync_store_relaxed(SYNC_PHASE1_USERS, 0u);
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
    uint items = moe_launch_failed ? 0u : gu_items + routed_chunks() * down_items_per_chunk();
    // The loop structure is what the H200 ran fastest (BENCHMARKS.md, ninth session): in routed mode one loop per
    // stage (the items of a workgroup only grow; a loop around both GEMMs made routed launches 10-25 % slower, and
    // its driver binary 216 instead of 142 KB), in direct mode one loop around both (two loops there made the
    // Qwen3 shape's m = 1 launch 33 -> 42 us). DIRECT is a specialization constant: each pipeline has one of them.
    uint i = wg;
    if (DIRECT) {
        bool gate_up_done = false;
        for (; i < items; i = moe_next_item(items)) {
            if (i < gu_items) {
                moe_gate_up(i);
            } else {
                if (!gate_up_done) moe_gate_up_phase_done();
                gate_up_done = true;
                moe_down(i - gu_items);
            }
            if (moe_launch_failed) break;
        }
        if (!gate_up_done) moe_gate_up_phase_done();
    } else {
        for (; i < gu_items; i = moe_next_item(items)) {
            moe_gate_up(i);
            if (moe_launch_failed) break;
        }
        if (moe_launch_failed) i = items;
        moe_gate_up_phase_done();
        for (; i < items; i = moe_next_item(items)) {
            moe_down(i - gu_items);
            if (moe_launch_failed) break;
        }
    }
    MOE_CLOCK_MARK(CLOCK_DOWN_DONE);
    MOE_CLOCK_MARK(CLOCK_END);
}
