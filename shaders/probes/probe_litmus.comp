#version 450
// Message passing across workgroups under stress. Pair k = workgroups (2k, 2k + 1): the writer stores D plain
// data words for round r, then (after a workgroup barrier) releases flag[k][r]; the reader acquires the flag with
// a bounded spin and checks the data. The other invocations of both, and any unpaired workgroup, hammer the
// words next to the flag and the data (same 64-byte line) with atomics. A stale datum is a violation; on a
// correct driver + shader there are none. Each round has its own line, so nothing needs resetting.
#pragma use_vulkan_memory_model
#extension GL_KHR_memory_scope_semantics : require

layout(local_size_x_id = 0) in;
layout(std430, binding = 0) nonprivate buffer Words { uint words[]; } state;
layout(push_constant) uniform Push {
    uint rounds;
    uint spin_iters;
    uint budget;
    uint pairs;
} pc;

// Header words, then per (pair, round) one 16-word line: [0] flag, [1..7] noise, [8..15] data.
#define W_ABORT 0u
#define W_VIOLATIONS 1u
#define W_TIMEOUTS 2u
#define W_CHECKED 3u
#define HEADER 16u
#define D 8u

#define SYNC_BUF state.words
#define SYNC_ABORT W_ABORT
#include "sync.glsl"

uint line_of(uint pair, uint r) { return HEADER + (pair * pc.rounds + r) * 16u; }
uint expected(uint pair, uint r, uint j) { return ((pair * 0x9E3779B9u) ^ (r * 0x85EBCA6Bu) ^ (j * 0xC2B2AE35u)) | 1u; }

void hammer(uint line, uint lid) {
    // Relaxed atomics on the flag's neighbours: traffic on the same cache line as the message.
    sync_add_relaxed(line + 1u + (lid % 7u), 1u);
    sync_add_relaxed(line + 1u + ((lid + 3u) % 7u), 1u);
}

void main() {
    uint lid = gl_LocalInvocationIndex;
    uint wg = gl_WorkGroupID.x;
    uint pair = wg / 2u;
    bool paired = pair < pc.pairs;
    bool writer = paired && (wg % 2u == 0u);
    uint spent = 0u;
    for (uint r = 0u; r < pc.rounds; ++r) {
        if (lid == 0u) spent += 1u;
        if (!paired) {
            // Stressor: hammer the lines pairs are working on around now.
            hammer(line_of((r + lid) % max(pc.pairs, 1u), r), lid);
            continue;
        }
        uint line = line_of(pair, r);
        if (writer) {
            if (lid < D) state.words[line + 8u + lid] = expected(pair, r, lid);
            else hammer(line, lid);
            SYNC_WG_BARRIER();
            if (lid == 0u) sync_store(line, r + 1u);
        } else {
            if (lid == 0u) sync_sh_ok = spin_until_ge(line, r + 1u, pc.spin_iters, pc.budget, spent);
            else hammer(line, lid);
            SYNC_WG_BARRIER();
            if (!sync_sh_ok) {
                if (lid == 0u) { sync_add_relaxed(W_TIMEOUTS, 1u); sync_set_abort(SYNC_ABORT_SPIN); }
                break;
            }
            if (lid < D) {
                if (state.words[line + 8u + lid] != expected(pair, r, lid)) sync_add_relaxed(W_VIOLATIONS, 1u);
                sync_add_relaxed(W_CHECKED, 1u);
            }
            SYNC_WG_BARRIER();  // sync_sh_ok is rewritten next round
        }
    }
}
