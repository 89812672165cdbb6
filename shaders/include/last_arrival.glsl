// The last-arrival reduction of a k-split GEMM, shared by exl3_linear.comp and moe_stages.glsl: each workgroup
// writes its fp32 k-split partial of a band to `partial[]`, then counts its arrival on an atomic counter; the
// one that sees `arrivals - 1` is the last, and alone goes on to sum the partials and finish the band. Nobody
// waits. The counter is stored back to 0 by the last arrival, so a recorded command buffer can run again.
//
// Includer: defines LAST_ARRIVAL_BUF (a uint[] lvalue in a nonprivate storage buffer) before including this;
// for gemm_finish_partial also declares `partial[]` (fp32, nonprivate) and includes exl3_gemm.glsl first.
// wg_last_arrival alone serves any workgroups that publish results for a last one (moe_router.comp).
// Optional: LAST_ARRIVAL_ALSO(), a statement invocation 0 runs right after its arrival's atomic (it may write shared
// memory, which the barrier after the arrival publishes).
#ifndef LAST_ARRIVAL_GLSL
#define LAST_ARRIVAL_GLSL

#ifndef LAST_ARRIVAL_BUF
#error "last_arrival.glsl: define LAST_ARRIVAL_BUF (the arrival counters' uint[]) before including"
#endif

// 16 bytes, not a bool: with every shared variable a multiple of 16 bytes, the cooperative-matrix kernel's fp16
// tiles start 16-byte aligned whatever order the driver lays shared memory out in (coopMatLoad reads rows
// of 16 bytes).
shared uint s_last[4];

// Count this workgroup's arrival on LAST_ARRIVAL_BUF[counter] after its buffer writes; returns, identically in
// every invocation, whether it was the last of `arrivals` (which then sees every other arrival's writes).
bool wg_last_arrival(uint counter, uint arrivals) {
    // Makes this workgroup's writes available to invocation 0, whose atomic below releases them device-wide; the
    // acquire side (the atomic and the device barrier after it) makes the other workgroups' writes visible to the
    // last arrival.
    WG_BARRIER_PUBLISH();
    if (gl_LocalInvocationID.x == 0u) {
        // A single arrival (one k-split) is always the last: no round trip to the counter, which stays 0. The
        // barriers still publish this workgroup's writes to its own invocations (the tail reads them).
        uint arrived = arrivals == 1u ? 0u :
            atomicAdd(LAST_ARRIVAL_BUF[counter], 1u, gl_ScopeQueueFamily, gl_StorageSemanticsBuffer,
                      gl_SemanticsAcquireRelease | gl_SemanticsMakeAvailable | gl_SemanticsMakeVisible);
#ifdef LAST_ARRIVAL_ALSO
        // The includer's own atomic (the persistent kernel takes its next work item's ticket), issued before the
        // arrival's result is used: both round trips to memory overlap.
        LAST_ARRIVAL_ALSO();
#endif
        s_last[0] = uint(arrived == arrivals - 1u);
        if (s_last[0] != 0u && arrivals != 1u)
            atomicStore(LAST_ARRIVAL_BUF[counter], 0u, gl_ScopeQueueFamily, gl_StorageSemanticsBuffer,
                        gl_SemanticsRelaxed);
    }
    WG_BARRIER_DEVICE();
    return wg_uniform(s_last[0]) != 0u;  // callers branch on it around code with barriers (Mesa 22.3)
}

#ifdef EXL3_GEMM_GLSL  // the FMA core's accumulators (exl3_gemm.glsl)
// Write this workgroup's k-split partial of rows p0 .. p0+nr-1 for one band to partial[] (row r at
// partial_base + r * row_stride + band * BAND), then count the arrival on LAST_ARRIVAL_BUF[counter]; returns,
// identically in every invocation, whether this was the last of `arrivals`.
bool gemm_finish_partial(uint partial_base, uint row_stride, uint p0, uint nr, uint band, uint counter,
                         uint arrivals) {
    uint tid = gl_LocalInvocationID.x;
    for (uint r0 = 0u; r0 < nr; r0 += 4u) {
        barrier();
        gemm_stage_rows(r0);
        barrier();
        for (uint i = tid; i < 4u * BAND; i += WG_SIZE) {
            uint rr = i / BAND, col = i % BAND;
            if (r0 + rr < nr)
                partial[partial_base + (p0 + r0 + rr) * row_stride + band * BAND + col] = gemm_red_sum(rr, col);
        }
    }
    if (arrivals == 0u) return false;  // the caller needs no arrival: only the partial is written
    return wg_last_arrival(counter, arrivals);
}
#endif

#endif
