#version 450
// vkmoe-variants: idot=-DEXL3_IDOT f16=-DEXL3_IDOT,-DEXL3_F16
// The persistent MoE kernel: ONE dispatch of at most the co-resident number of workgroups (the launch plan in
// vkmoe/sched guarantees it) running every stage of moe_stages.glsl. Workgroups draw work items from a device
// atomic ticket counter per phase (greedy load balance: no workgroup idles while items remain) and meet at a
// spin barrier between phases - two per launch, however many experts:
//   route (workgroup 0) + stage 1 items | gate/up items (+ activation) | down items (+ weighted output)
// Safety net: every spin is bounded (pc.spin_limit per barrier, pc.loop_budget in total, below lavapipe 22.3's loop
// cap); a timeout sets the abort flag, every workgroup checks it at each barrier and ticket draw and leaves, and
// the host re-runs the same inputs in split mode. The last workgroup out resets the tickets, so the next launch
// needs no host-side clearing.
#include "common.glsl"
#define WG_SIZE 256u
#define HAD_ROWS 4u
#define MOE_ROUTE
#define ROUTE_MAX_E 256   // keeps this kernel inside the 16 KiB of shared memory Vulkan guarantees
layout(local_size_x = 256) in;
#include "moe_bindings.glsl"
#define SYNC_BUF sync_words
#define SYNC_POLLS 32
#include "sync.glsl"
#include "moe_stages.glsl"

uint spin_spent = 0u;   // loop iterations this invocation has spent spinning (invocation 0 only)
shared uint s_ticket;
shared bool s_abort;

bool grid_barrier() {
    bool ok = sync_group_barrier_wg(SYNC_BARRIER, pc.num_workgroups, pc.spin_limit, pc.loop_budget, spin_spent);
    return wg_uniform(uint(ok)) != 0u;
}

// Draw tickets of `phase` until they run out (true) or the launch is aborted (false).
bool run_phase(uint phase, uint items) {
    for (;;) {
        barrier();
        if (gl_LocalInvocationIndex == 0u) {
            s_ticket = sync_add_relaxed(SYNC_TICKETS + phase, 1u);
            s_abort = sync_aborted();
        }
        barrier();
        if (wg_uniform(uint(s_abort)) != 0u) return false;
        uint ticket = wg_uniform(s_ticket);
        if (ticket >= items) return true;
        if (phase == 1u) moe_stage1(ticket);
        else if (phase == 2u) moe_gate_up(ticket);
        else moe_down(ticket);
    }
}

void main() {
    // Stage 1 needs no routing result (rows by (token, slot)): workgroup 0 routes, then joins the others.
    if (gl_WorkGroupID.x == 0u) moe_route();
    bool ok = run_phase(1u, stage1_items());
    if (ok) ok = grid_barrier();
    if (ok) ok = run_phase(2u, routed_chunks() * gu_items_per_chunk());
    if (ok) ok = grid_barrier();
    if (ok) ok = run_phase(3u, routed_chunks() * down_items_per_chunk());
    // Retire. The last workgroup out (of a launch that was not aborted) resets the tickets; after an abort the
    // host clears the whole sync area before anything else runs.
    SYNC_WG_BARRIER();
    if (gl_LocalInvocationIndex == 0u) {
        uint retired = sync_add(SYNC_RETIRED, 1u);
        if (retired == pc.num_workgroups - 1u && !sync_aborted()) {
            sync_store_relaxed(SYNC_TICKETS + 1u, 0u);
            sync_store_relaxed(SYNC_TICKETS + 2u, 0u);
            sync_store_relaxed(SYNC_TICKETS + 3u, 0u);
            sync_store(SYNC_RETIRED, 0u);
        }
    }
}
