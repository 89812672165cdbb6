// The MoE kernels' co-residency discovery mode (pc.mode = MOE_MODE_DISCOVER): the persistent kernel's, and the
// discovery builds of the cooperative-matrix stages (moe_*_coop.comp with MOE_DISCOVERY: `_discover`, counted by
// tools/profile_moe --co-resident; the split path itself needs no co-residency), so that each count reflects that
// pipeline's own registers and shared memory. Include after moe_bindings.glsl (and after sync.glsl where the
// kernel uses it itself, as the persistent one does).
#ifndef MOE_DISCOVER_GLSL
#define MOE_DISCOVER_GLSL

#ifndef VKMOE_SYNC_GLSL
#define SYNC_BUF sync_words
#define SYNC_POLLS 32
#include "sync.glsl"
#endif
#include "occupancy.glsl"

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

#endif
