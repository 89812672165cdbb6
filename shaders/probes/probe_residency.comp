#version 450
// A stand-in pipeline for the co-residency discovery of shaders/include/occupancy.glsl: a chosen workgroup size
// and shared-memory footprint (tools/probe_residency measures both the 16 KiB Vulkan guarantees and the maximum).
#pragma use_vulkan_memory_model
#extension GL_KHR_memory_scope_semantics : require

layout(local_size_x_id = 0) in;
// Shared words: the variant's shared memory (minus what sync.glsl declares), held for the whole run so that the
// driver's occupancy is the one of a kernel using that much.
layout(constant_id = 1) const uint SHARED_WORDS = 4092u;
shared uint occupancy_pad[SHARED_WORDS];

layout(std430, binding = 0) nonprivate buffer Words { uint words[]; } state;
layout(push_constant) uniform Push {
    uint slot;        // which repeat: its words are [slot * 16, +16)
    uint launched;    // workgroups in this dispatch: the opener closes early once all joined
    uint open_iters;  // how long the poll stays open (spin iterations)
    uint wait_iters;  // a joiner's bound while waiting for the close
    uint lock_iters;  // bound for taking the ticket lock
    uint budget;      // per-invocation total of loop iterations (below lavapipe 22.3's cap)
} pc;

#define SYNC_BUF state.words
#define SYNC_ABORT (pc.slot * 16u)  // OCC_ABORT is word 0 of a slot
// Long iterations: the poll must stay open for milliseconds (a CPU driver's worker thread may need an OS time
// slice to start) within lavapipe 22.3's per-invocation loop budget.
#define SYNC_POLLS 64
#include "sync.glsl"
#include "occupancy.glsl"

void main() {
    uint lid = gl_LocalInvocationIndex;
    uint base = pc.slot * 16u;
    for (uint i = lid; i < SHARED_WORDS; i += gl_WorkGroupSize.x) occupancy_pad[i] = i ^ gl_WorkGroupID.x;
    barrier();
    if (lid == 0u) occupancy_discover(base, pc.launched, pc.open_iters, pc.wait_iters, pc.lock_iters, pc.budget);
    barrier();
    // Keeps the shared array alive (the value never matches: words are < SHARED_WORDS ^ id).
    if (occupancy_pad[(lid * 7u) % SHARED_WORDS] == 0xFFFFFFFFu) sync_add_relaxed(base + OCC_PAD_CHECK, 1u);
}
