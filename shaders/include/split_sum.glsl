// The sum of a band element's fp32 k-split partials, read by the last arrival of a band (last_arrival.glsl) before
// its tail. Shared by the linear's tail (linear_tail.glsl) and the MoE stages 3 and 5 (moe_stages.glsl); the
// includer declares partial[].
#ifndef SPLIT_SUM_GLSL
#define SPLIT_SUM_GLSL

// Partials read per round: independent loads the compiler issues together. A loop over the push-constant split
// count with one load per iteration waited a full round trip to L2 per split, and the tail of a band is on the
// critical path of every decode step (H200, Qwen3 shape, m = 1: BENCHMARKS.md).
#define SPLIT_SUM_BATCH 8u

// partial[first] + partial[first + stride] + ... (n terms), added in split order: the same bits as the plain loop.
// Loads past the last split read the last one again (a valid address) and are not added. Every invocation of a
// workgroup must call it with the same n (the loop's trip count, see hadamard128.glsl on Mesa 22.3).
float split_sum(uint first, uint stride, uint n) {
    float v = 0.0;
    for (uint s0 = 0u; s0 < n; s0 += SPLIT_SUM_BATCH) {
        float x[SPLIT_SUM_BATCH];
        [[unroll]] for (uint j = 0u; j < SPLIT_SUM_BATCH; ++j) x[j] = partial[first + min(s0 + j, n - 1u) * stride];
        [[unroll]] for (uint j = 0u; j < SPLIT_SUM_BATCH; ++j) if (s0 + j < n) v += x[j];
    }
    return v;
}

#ifdef HADAMARD128_GLSL
// had_v[j] (j < HAD_VALS) = the sum over k-splits g, g + G, g + 2G, ... (< n) of partial[first + s * stride + j]
// (each invocation of a Hadamard tail holds HAD_VALS consecutive columns of its row), added in that order: with
// g = 0, G = 1 (split_sum_had) every split in split order, the same bits as the plain loop; the linear's tail
// shares a one-row band's splits over G lane groups (linear_tail.glsl). split_sum's rules: the same n, G in every
// invocation (the trip count); loads past the last split repeat it.
void split_sum_had_share(uint first, uint stride, uint n, uint g, uint G) {
    [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] = 0.0;
    uint per_group = (n + G - 1u) / G;
    for (uint s0 = 0u; s0 < per_group; s0 += SPLIT_SUM_BATCH) {
        float x[SPLIT_SUM_BATCH][HAD_MAX_VALS];
        [[unroll]] for (uint b = 0u; b < SPLIT_SUM_BATCH; ++b) {
            uint base = first + min(g + (s0 + b) * G, n - 1u) * stride;
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) x[b][j] = partial[base + j];
        }
        [[unroll]] for (uint b = 0u; b < SPLIT_SUM_BATCH; ++b)
            if (g + (s0 + b) * G < n) { [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] += x[b][j]; }
    }
}
void split_sum_had(uint first, uint stride, uint n) { split_sum_had_share(first, stride, n, 0u, 1u); }
// Two such sums of the same length at once (stage 3's gate and up rows): had_v = the first, sum_b = the second.
// Every load of both is issued before any add, so the tail waits for one round trip to L2 where two sums one
// after the other (each behind a Hadamard transform) waited for two. Same bits and rules as split_sum_had.
#define SPLIT_SUM_PAIR_BATCH 4u
void split_sum_had_pair(uint first_a, uint first_b, uint stride, uint n, out float sum_b[HAD_MAX_VALS]) {
    [[unroll]] for (uint j = 0u; j < HAD_MAX_VALS; ++j) { had_v[j] = 0.0; sum_b[j] = 0.0; }
    for (uint s0 = 0u; s0 < n; s0 += SPLIT_SUM_PAIR_BATCH) {
        float xa[SPLIT_SUM_PAIR_BATCH][HAD_MAX_VALS], xb[SPLIT_SUM_PAIR_BATCH][HAD_MAX_VALS];
        [[unroll]] for (uint b = 0u; b < SPLIT_SUM_PAIR_BATCH; ++b) {
            uint offset = min(s0 + b, n - 1u) * stride;
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) {
                xa[b][j] = partial[first_a + offset + j];
                xb[b][j] = partial[first_b + offset + j];
            }
        }
        [[unroll]] for (uint b = 0u; b < SPLIT_SUM_PAIR_BATCH; ++b)
            if (s0 + b < n) {
                [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) { had_v[j] += xa[b][j]; sum_b[j] += xb[b][j]; }
            }
    }
}
#endif  // HADAMARD128_GLSL
#endif
