// occupancy.glsl: in-kernel discovery of how many workgroups of THE INCLUDING PIPELINE are co-resident.
//
// Used by probe_residency.comp (a stand-in with a chosen workgroup size and shared memory) and by the persistent
// MoE kernel itself in its discovery mode, so that the count reflects that pipeline's own register and
// shared-memory footprint (the same binary, another branch at the top of main).
//
// The first workgroup to arrive opens a poll; workgroups arriving while it is open join it and then stay until it
// closes, so a joined workgroup keeps its slot and no later workgroup can reuse it to join twice. The opener
// closes the poll after a bounded wait (or once every launched workgroup joined); late arrivals just count
// themselves and leave. Join/close go through a fair ticket lock so that "is it open?" + "join" is atomic with
// respect to the close. The participant count is a lower bound of the co-resident count (the host takes the min
// over repeats); a joiner whose wait timed out may have let another workgroup join in its slot, so the host
// discards a repeat with timeouts.
//
// Include after sync.glsl, with SYNC_ABORT = base + OCC_ABORT. The 16 words of one measurement start at `base` in
// SYNC_BUF; vkmoe/sched/probe.py reads them (the OCC_* offsets are mirrored there).
#ifndef VKMOE_OCCUPANCY_GLSL
#define VKMOE_OCCUPANCY_GLSL

#define OCC_ABORT 0u          // first, so that a kernel's SYNC_ABORT (word 0 of its sync area) is this word
#define OCC_TICKET 1u         // [1] next ticket, [2] now serving (the fair lock)
#define OCC_STATE 3u          // 0 = not opened yet, 1 = open, 2 = closed
#define OCC_PARTICIPANTS 4u
#define OCC_LATE 5u
#define OCC_TIMEOUTS 6u
#define OCC_ARRIVED 7u
#define OCC_OPENER_SPENT 8u
#define OCC_OPENER_HIT 9u     // 1 when the opener closed early because everyone had joined
#define OCC_PAD_CHECK 10u     // written only if a shared-memory pad check fails (keeps pads alive)
#define OCC_JOINER_SPENT 11u  // the most iterations a joiner used (how close to its bound it came)
#define OCC_PARAMS 12u        // optional: [12] open, [13] wait, [14] lock iterations, written by the host

// Called by invocation 0 of every workgroup of the dispatch.
void occupancy_discover(uint base, uint launched, uint open_iters, uint wait_iters, uint lock_iters, uint budget) {
    uint spent = 0u;
    sync_add_relaxed(base + OCC_ARRIVED, 1u);
    uint role = 0u;  // 0 late, 1 opener, 2 joiner, 3 failed
    if (!sync_ticket_lock(base + OCC_TICKET, lock_iters, budget, spent)) {
        role = 3u;
    } else {
        uint st = sync_load_relaxed(base + OCC_STATE);  // the lock's acquire orders this read
        if (st == 0u) {
            sync_store_relaxed(base + OCC_STATE, 1u);
            sync_store_relaxed(base + OCC_PARTICIPANTS, 1u);
            role = 1u;
        } else if (st == 1u) {
            sync_add_relaxed(base + OCC_PARTICIPANTS, 1u);
            role = 2u;
        } else {
            sync_add_relaxed(base + OCC_LATE, 1u);
        }
        sync_ticket_unlock(base + OCC_TICKET);
    }
    if (role == 1u) {
        // Expected to time out (that is the window); true only when every launched workgroup joined.
        bool all = spin_until_ge(base + OCC_PARTICIPANTS, launched, open_iters, budget, spent);
        bool locked = sync_ticket_lock(base + OCC_TICKET, lock_iters, budget, spent);
        sync_store(base + OCC_STATE, 2u);  // even without the lock: joiners must be released
        if (locked) sync_ticket_unlock(base + OCC_TICKET);
        sync_store_relaxed(base + OCC_OPENER_SPENT, spent);
        sync_store_relaxed(base + OCC_OPENER_HIT, all ? 1u : 0u);
    } else if (role == 2u) {
        if (!spin_until_ge(base + OCC_STATE, 2u, wait_iters, budget, spent)) {
            sync_add_relaxed(base + OCC_TIMEOUTS, 1u);
            sync_set_abort(SYNC_ABORT_SPIN);
        }
        atomicMax(SYNC_BUF[base + OCC_JOINER_SPENT], spent, SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed);
    } else if (role == 3u) {
        sync_add_relaxed(base + OCC_TIMEOUTS, 1u);
    }
}

#endif  // VKMOE_OCCUPANCY_GLSL
