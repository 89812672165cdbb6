// The MoE kernels' co-residency discovery mode (pc.mode = MOE_MODE_DISCOVER): the persistent kernel's, and the
// discovery builds of the cooperative-matrix stages (moe_*_coop.comp with MOE_DISCOVERY), so that each count
// reflects that pipeline's own registers and shared memory. Include after moe_bindings.glsl, sync.glsl and
// occupancy.glsl.
#ifndef MOE_DISCOVER_GLSL
#define MOE_DISCOVER_GLSL

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
