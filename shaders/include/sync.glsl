// sync.glsl: bounded spins, a ticket lock, tickets, a group barrier over N workgroups and a device abort flag.
//
// Why every spin is bounded: Vulkan promises no forward progress between workgroups, so a spin may wait for a
// workgroup that never runs (a hang), and Mesa 22.3's lavapipe silently ends a loop after 65,535 iterations per
// invocation (all loops of the invocation together), which would turn an unbounded spin into a wrong answer.
// So each spin takes an iteration bound and a running total `spent` (iterations this invocation already used),
// returns false when the bound is hit or the abort flag is set, and the caller makes the whole workgroup exit.
// A spin cut short by the driver's loop cap also returns false: success is only reported from an observed value.
//
// Include contract (before #include "sync.glsl"):
//   #pragma use_vulkan_memory_model
//   #extension GL_KHR_memory_scope_semantics : require
//   #define SYNC_BUF    <uint[] lvalue in a storage buffer>   e.g. locks.words   (declare that buffer `nonprivate`)
//   #define SYNC_ABORT  <index of the abort word in SYNC_BUF> (0 = running; else the first reason set)
// Optional: SYNC_POLLS (polls per loop iteration: 8, 16, 32 or 64; default 8).
//
// Memory model: acquire/release at QueueFamily scope (covers every workgroup of the dispatch and needs no
// vulkanMemoryModelDeviceScope). Release carries MakeAvailable and acquire MakeVisible so that plain (nonprivate)
// data writes made before a release are visible after the matching acquire, not just ordered.
// Uniform control flow: the *_wg functions are called by every invocation of the workgroup; invocation 0 does the
// atomics and the spin while the others wait at the control barrier; the result is broadcast through shared memory.
#ifndef VKMOE_SYNC_GLSL
#define VKMOE_SYNC_GLSL

#ifndef SYNC_BUF
#error "sync.glsl: define SYNC_BUF (a uint[] in a nonprivate storage buffer) before including"
#endif
#ifndef SYNC_ABORT
#error "sync.glsl: define SYNC_ABORT (the abort word's index in SYNC_BUF) before including"
#endif
#ifndef SYNC_POLLS
// Several polls per loop iteration stretch the time one iteration covers without spending the per-invocation
// loop budget of lavapipe 22.3 (unrolled code is not counted); the host calibrates iterations against time.
#define SYNC_POLLS 8
#endif

#define SYNC_SCOPE gl_ScopeQueueFamily
#define SYNC_STORAGE gl_StorageSemanticsBuffer
#define SYNC_ACQ (gl_SemanticsAcquire | gl_SemanticsMakeVisible)
#define SYNC_REL (gl_SemanticsRelease | gl_SemanticsMakeAvailable)
#define SYNC_ACQREL (gl_SemanticsAcquireRelease | gl_SemanticsMakeAvailable | gl_SemanticsMakeVisible)

// Abort reasons (first one set wins): vkmoe/layout.py ABORT_* (tests/test_layout.py keeps them equal).
#define SYNC_ABORT_SPIN 1u     // a spin ran out of its iteration bound
#define SYNC_ABORT_LOCK 2u     // a ticket lock could not be taken in time
#define SYNC_ABORT_BARRIER 3u  // a group barrier timed out

shared bool sync_sh_ok;

uint sync_load(uint i) { return atomicLoad(SYNC_BUF[i], SYNC_SCOPE, SYNC_STORAGE, SYNC_ACQ); }
uint sync_load_relaxed(uint i) { return atomicLoad(SYNC_BUF[i], SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed); }
void sync_store(uint i, uint v) { atomicStore(SYNC_BUF[i], v, SYNC_SCOPE, SYNC_STORAGE, SYNC_REL); }
void sync_store_relaxed(uint i, uint v) { atomicStore(SYNC_BUF[i], v, SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed); }
uint sync_add(uint i, uint v) { return atomicAdd(SYNC_BUF[i], v, SYNC_SCOPE, SYNC_STORAGE, SYNC_ACQREL); }
uint sync_add_relaxed(uint i, uint v) {
    return atomicAdd(SYNC_BUF[i], v, SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed);
}
// The read used inside spin loops. Not atomicLoad: lavapipe 22.3 turns a relaxed atomicLoad into a plain load
// that LLVM hoists out of the loop, so the spin never sees the new value (it then times out, never returns a
// wrong "true", but the probe would measure nothing). A read-modify-write cannot be hoisted on any driver.
uint sync_poll(uint i) { return atomicAdd(SYNC_BUF[i], 0u, SYNC_SCOPE, SYNC_STORAGE, gl_SemanticsRelaxed); }

// Ticket counter: the next value of SYNC_BUF[i] (0, 1, 2, ...), each handed out once.
uint sync_ticket(uint i) { return sync_add(i, 1u); }

bool sync_aborted() { return sync_poll(SYNC_ABORT) != 0u; }
// Keeps the first reason: later failures are usually consequences of the first.
void sync_set_abort(uint reason) {
    atomicCompSwap(SYNC_BUF[SYNC_ABORT], 0u, reason, SYNC_SCOPE, SYNC_STORAGE, SYNC_REL, SYNC_STORAGE,
                   gl_SemanticsRelaxed);
}

// Wrap-safe "a >= b" for counters that may wrap around 2^32 (generations, tickets).
bool sync_ge(uint a, uint b) { return int(a - b) >= 0; }

#define SYNC_POLL_ONCE_(i, target) if (!hit) { hit = sync_ge(sync_poll(i), target); }
#define SYNC_POLL_8_(i, target) SYNC_POLL_ONCE_(i, target) SYNC_POLL_ONCE_(i, target) SYNC_POLL_ONCE_(i, target) \
    SYNC_POLL_ONCE_(i, target) SYNC_POLL_ONCE_(i, target) SYNC_POLL_ONCE_(i, target) SYNC_POLL_ONCE_(i, target) \
    SYNC_POLL_ONCE_(i, target)

// Spin (one invocation) until SYNC_BUF[i] >= target (wrap-safe). At most `max_iters` loop iterations, and never
// past `budget` iterations in total for this invocation (`spent` is updated). Returns true when the value was
// seen; then an acquire load has been done, so what the writer released before reaching `target` is visible.
// Returns false on the bound or when the abort flag is set.
bool spin_until_ge(uint i, uint target, uint max_iters, uint budget, inout uint spent) {
    bool hit = sync_ge(sync_load(i), target);
    uint n = 0u;
    uint limit = min(max_iters, budget > spent ? budget - spent : 0u);
    while (!hit && n < limit) {
        n += 1u;
        SYNC_POLL_8_(i, target)
#if SYNC_POLLS > 8
        SYNC_POLL_8_(i, target)
#endif
#if SYNC_POLLS > 16
        SYNC_POLL_8_(i, target) SYNC_POLL_8_(i, target)
#endif
#if SYNC_POLLS > 32
        SYNC_POLL_8_(i, target) SYNC_POLL_8_(i, target) SYNC_POLL_8_(i, target) SYNC_POLL_8_(i, target)
#endif
        if (!hit && sync_aborted()) break;
    }
    spent += n;
    // The acquire that pairs with the writer's release (the polls were relaxed to keep them cheap).
    return hit && sync_ge(sync_load(i), target);
}

// Fair (FIFO) ticket lock at SYNC_BUF[base] (next ticket) and SYNC_BUF[base + 1] (now serving). One invocation.
// On timeout the lock is left with a ticket that is never served, so every later taker times out too: the caller
// must set the abort flag (sync_ticket_lock does) and the launch is abandoned.
bool sync_ticket_lock(uint base, uint max_iters, uint budget, inout uint spent) {
    uint t = sync_ticket(base);
    bool ok = spin_until_ge(base + 1u, t, max_iters, budget, spent);
    if (!ok) sync_set_abort(SYNC_ABORT_LOCK);
    return ok;
}
void sync_ticket_unlock(uint base) { sync_add(base + 1u, 1u); }

// Group barrier over `n` workgroups at SYNC_BUF[base] (arrival counter) and SYNC_BUF[base + 1] (generation),
// one invocation per workgroup (sense reversal as in exllamav3's MoE kernel, with a generation number instead
// of a 0/1 sense so that a late reader can never confuse two barriers). Self-resetting: the counter ends at 0.
bool sync_group_barrier(uint base, uint n, uint max_iters, uint budget, inout uint spent) {
    // Cannot be stale: the generation only moves on after this workgroup has arrived below.
    uint gen = sync_load_relaxed(base + 1u);
    uint old = sync_add(base, 1u);
    if (old == n - 1u) {
        sync_store_relaxed(base, 0u);    // ordered before the release below
        sync_store(base + 1u, gen + 1u);
        return true;
    }
    bool ok = spin_until_ge(base + 1u, gen + 1u, max_iters, budget, spent);
    if (!ok) sync_set_abort(SYNC_ABORT_BARRIER);
    return ok;
}

// The whole-workgroup barrier. Its control barriers carry QueueFamily-scope release/acquire so that buffer writes by
// any invocation before the call are visible to every invocation of every workgroup after it.
// A single barrier, no WG_BARRIER_LOCAL after it (unlike common.glsl's WG_BARRIER_DEVICE): a second, Workgroup-scope
// barrier around the bounded spins made them run out on Mesa 22.3, deterministically in the barrier probe
// (tests/test_probe.py) and intermittently in persistent launches (fresh-clone CI runs of a357da2 and ed24ca3).
#define SYNC_WG_BARRIER() controlBarrier(gl_ScopeWorkgroup, gl_ScopeQueueFamily, \
    gl_StorageSemanticsBuffer | gl_StorageSemanticsShared, SYNC_ACQREL)

bool sync_group_barrier_wg(uint base, uint n, uint max_iters, uint budget, inout uint spent) {
    SYNC_WG_BARRIER();
    if (gl_LocalInvocationIndex == 0u) sync_sh_ok = sync_group_barrier(base, n, max_iters, budget, spent);
    SYNC_WG_BARRIER();
    return sync_sh_ok;
}

#endif  // VKMOE_SYNC_GLSL
