#version 450
// `rounds` group barriers over all workgroups of the dispatch (the planned persistent grid), each followed by a
// check that every workgroup really arrived. rounds = 0 makes an empty kernel (the dispatch-cost baseline).
#pragma use_vulkan_memory_model
#extension GL_KHR_memory_scope_semantics : require

layout(local_size_x_id = 0) in;
layout(std430, binding = 0) nonprivate buffer Words { uint words[]; } state;
layout(push_constant) uniform Push {
    uint rounds;
    uint spin_iters;  // bound of one barrier wait
    uint budget;      // per-invocation total of loop iterations
} pc;

#define W_COUNTER 0u
#define W_GEN 1u
#define W_ABORT 2u
#define W_TIMEOUTS 3u
#define W_ARRIVALS 4u
#define W_VIOLATIONS 5u
#define W_COMPLETED 6u   // workgroups that finished every round

#define SYNC_BUF state.words
#define SYNC_ABORT W_ABORT
#include "sync.glsl"

void main() {
    uint n = gl_NumWorkGroups.x;
    uint spent = 0u;
    bool ok = true;
    for (uint r = 0u; r < pc.rounds; ++r) {
        if (gl_LocalInvocationIndex == 0u) {
            spent += 1u;  // this loop's own iteration counts against lavapipe 22.3's cap too
            sync_add_relaxed(W_ARRIVALS, 1u);
        }
        if (!sync_group_barrier_wg(W_COUNTER, n, pc.spin_iters, pc.budget, spent)) { ok = false; break; }
        if (gl_LocalInvocationIndex == 0u) {
            // After barrier r every workgroup has counted its arrival r: at least (r + 1) * n.
            if (!sync_ge(sync_load_relaxed(W_ARRIVALS), (r + 1u) * n)) sync_add_relaxed(W_VIOLATIONS, 1u);
        }
    }
    if (gl_LocalInvocationIndex == 0u) {
        if (!ok) sync_add_relaxed(W_TIMEOUTS, 1u);
        else if (pc.rounds > 0u) sync_add_relaxed(W_COMPLETED, 1u);
    }
}
