#version 450
// In-kernel discovery of how many workgroups of THIS pipeline (workgroup size, shared memory) are co-resident.
// The first workgroup to arrive opens a poll; workgroups arriving while it is open join it and then stay until it
// closes, so a joined workgroup keeps its slot and no later workgroup can reuse it to join twice. The opener
// closes the poll after a bounded wait (or once every launched workgroup joined); late arrivals just count
// themselves and leave. Join/close go through a fair ticket lock so that "is it open?" + "join" is atomic with
// respect to the close. The participant count is a lower bound of the co-resident count (the host takes the min
// over repeats); a joiner whose wait timed out may have let another workgroup join in its slot, so the host
// discards a repeat with timeouts.
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

#define W_TICKET 0u
#define W_SERVING 1u
#define W_STATE 2u          // 0 = not opened yet, 1 = open, 2 = closed
#define W_PARTICIPANTS 3u
#define W_LATE 4u
#define W_TIMEOUTS 5u
#define W_ARRIVED 6u
#define W_ABORT 7u
#define W_OPENER_SPENT 8u
#define W_OPENER_HIT 9u     // 1 when the opener closed early because everyone had joined
#define W_PAD_CHECK 10u
#define W_JOINER_SPENT 11u  // the most iterations a joiner used (how close to its bound it came)

#define SYNC_BUF state.words
#define SYNC_ABORT (pc.slot * 16u + W_ABORT)
// Long iterations: the poll must stay open for milliseconds (a CPU driver's worker thread may need an OS time
// slice to start) within lavapipe 22.3's per-invocation loop budget.
#define SYNC_POLLS 64
#include "sync.glsl"

void main() {
    uint lid = gl_LocalInvocationIndex;
    uint base = pc.slot * 16u;
    for (uint i = lid; i < SHARED_WORDS; i += gl_WorkGroupSize.x) occupancy_pad[i] = i ^ gl_WorkGroupID.x;
    barrier();
    if (lid == 0u) {
        uint spent = 0u;
        sync_add_relaxed(base + W_ARRIVED, 1u);
        uint role = 0u;  // 0 late, 1 opener, 2 joiner, 3 failed
        if (!sync_ticket_lock(base + W_TICKET, pc.lock_iters, pc.budget, spent)) {
            role = 3u;
        } else {
            uint st = sync_load_relaxed(base + W_STATE);  // the lock's acquire orders this read
            if (st == 0u) {
                sync_store_relaxed(base + W_STATE, 1u);
                sync_store_relaxed(base + W_PARTICIPANTS, 1u);
                role = 1u;
            } else if (st == 1u) {
                sync_add_relaxed(base + W_PARTICIPANTS, 1u);
                role = 2u;
            } else {
                sync_add_relaxed(base + W_LATE, 1u);
            }
            sync_ticket_unlock(base + W_TICKET);
        }
        if (role == 1u) {
            // Expected to time out (that is the window); true only when every launched workgroup joined.
            bool all = spin_until_ge(base + W_PARTICIPANTS, pc.launched, pc.open_iters, pc.budget, spent);
            bool locked = sync_ticket_lock(base + W_TICKET, pc.lock_iters, pc.budget, spent);
            sync_store(base + W_STATE, 2u);  // even without the lock: joiners must be released
            if (locked) sync_ticket_unlock(base + W_TICKET);
            sync_store_relaxed(base + W_OPENER_SPENT, spent);
            sync_store_relaxed(base + W_OPENER_HIT, all ? 1u : 0u);
        } else if (role == 2u) {
            if (!spin_until_ge(base + W_STATE, 2u, pc.wait_iters, pc.budget, spent)) {
                sync_add_relaxed(base + W_TIMEOUTS, 1u);
                sync_set_abort(SYNC_ABORT_SPIN);
            }
            atomicMax(state.words[base + W_JOINER_SPENT], spent, SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed);
        } else if (role == 3u) {
            sync_add_relaxed(base + W_TIMEOUTS, 1u);
        }
    }
    barrier();
    // Keeps the shared array alive (the value never matches: words are < SHARED_WORDS ^ id).
    if (occupancy_pad[(lid * 7u) % SHARED_WORDS] == 0xFFFFFFFFu) sync_add_relaxed(base + W_PAD_CHECK, 1u);
}
