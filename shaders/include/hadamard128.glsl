// 128-point Walsh-Hadamard transform with the exact fp32 evaluation order of spec section 5: butterflies of
// width 1, 2, 4, ..., 64, each (a + b, a - b). Every output of a stage depends on exactly two inputs of the
// previous stage, so spreading the pairs over invocations keeps the result bit-identical to the reference.
//
// Two transforms of the same rows, chosen by the host through the specialization constant HAD_SUBGROUP
// (vkmoe/ops/kernels.py: hadamard_subgroup; VKMOE_HADAMARD):
// - subgroup (HAD_SUBGROUP = the subgroup size S, 8 .. 128): a subgroup owns a row, invocation l holds its
//   elements l * V .. l * V + V - 1 (V = 128 / S) in registers; stages narrower than V are butterflies inside an
//   invocation, the wider ones pair invocation l with l ^ (w / V) through subgroupShuffleXor. No barrier: the
//   256 / S subgroups of a workgroup transform 256 / S rows at once, each on its own.
// - shared memory (HAD_SUBGROUP = 0): the rows go through shared memory (HAD_BUF_*) and had_fwht (a barrier after
//   each stage), HAD_SHARED_ROWS at a time; "lanes" of HAD_SHARED_LANES invocations stand in for the subgroups.
// Both do the same fp32 additions and subtractions of the same operands, so their outputs are bit-identical
// (tests/test_hadamard.py runs every op both ways).
//
// Callers are written once for both: per pass of HAD_PASS_ROWS rows, invocation (had_row(), had_lane()) fills
// had_v with columns had_col0() .. + HAD_VALS - 1 of pass row had_row(), calls had_transform() and reads had_v.
// The includer defines WG_SIZE (256) and includes the generated layout header first. had_transform() must be
// called from workgroup-uniform control flow (the shared-memory transform has barriers); rows past the caller's
// count are transformed too and dropped (rows are independent).

#ifndef HADAMARD128_GLSL
#define HADAMARD128_GLSL

const float HAD_SCALE = 0.088388347648;  // fp32(1/sqrt(128)) = 0x3DB504F3

layout(constant_id = SPEC_HAD_SUBGROUP) const uint HAD_SUBGROUP = 0u;
const bool HAD_IN_SUBGROUP = HAD_SUBGROUP != 0u;
const uint HAD_LANES = HAD_IN_SUBGROUP ? HAD_SUBGROUP : HAD_SHARED_LANES;  // invocations per row
const uint HAD_VALS = 128u / HAD_LANES;                                     // consecutive elements per invocation
const uint HAD_PASS_ROWS = WG_SIZE / HAD_LANES;                             // rows per pass (<= HAD_MAX_PASS_ROWS)

// This invocation's elements of its pass row (the first HAD_VALS of them). Module level and of a fixed size, the
// largest HAD_VALS: no array here is sized by a specialization constant (docs/DESIGN.md, Mesa 22.3 rule 3).
float had_v[HAD_MAX_VALS];

uint had_row() { return HAD_IN_SUBGROUP ? gl_SubgroupID : gl_LocalInvocationID.x / HAD_LANES; }
uint had_lane() { return HAD_IN_SUBGROUP ? gl_SubgroupInvocationID : gl_LocalInvocationID.x % HAD_LANES; }
uint had_col0() { return had_lane() * HAD_VALS; }

// The shared-memory transform's HAD_SHARED_ROWS rows of 128 fp32, through HAD_BUF_LOAD(i) / HAD_BUF_STORE(i, v).
// Its own array of a fixed size (Mesa 22.3 rule: no shared array sized by a specialization constant), unless the
// includer lends one of its own that is free whenever a transform or a caller's use of the rows runs (defining both
// macros before including this file; the MoE's cooperative-matrix stages lend their A tile: moe_stages.glsl).
#ifndef HAD_BUF_LOAD
shared float had_buf[HAD_SHARED_ROWS * 128];
#define HAD_BUF_LOAD(i) had_buf[i]
#define HAD_BUF_STORE(i, v) had_buf[i] = (v)
#endif

// In-place FWHT of had_buf rows 0 .. nrows-1 (nrows <= HAD_SHARED_ROWS). The caller has written the rows and
// passed a barrier(); on return the transformed rows are visible to the whole workgroup.
void had_fwht(uint nrows) {
    uint pairs = nrows * 64u;
    for (uint w = 1u; w < 128u; w <<= 1) {
        // Same trip count in every invocation (a guard, not a shorter loop): Mesa 22.3's lavapipe drops the
        // rest of the shader when a loop inside a loop with barriers runs a different number of times per lane.
        for (uint p0 = 0u; p0 < pairs; p0 += WG_SIZE) {
            uint p = p0 + gl_LocalInvocationID.x;
            if (p >= pairs) continue;
            uint row = p >> 6, pi = p & 63u;
            uint i = row * 128u + (pi / w) * (2u * w) + (pi % w);
            float a = HAD_BUF_LOAD(i), b = HAD_BUF_LOAD(i + w);
            HAD_BUF_STORE(i, a + b);
            HAD_BUF_STORE(i + w, a - b);
        }
        barrier();
    }
}

// The subgroup transform of had_v: stage st has width w = 2^st, in the spec's order.
void had_fwht_subgroup() {
    [[unroll]] for (uint st = 0u; st < 7u; ++st) {
        uint w = 1u << st;
        if (w < HAD_VALS) {  // both elements of every pair are this invocation's: j and j + w, bit w of j clear
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) {
                if ((j & w) == 0u) {
                    float a = had_v[j], b = had_v[j + w];
                    had_v[j] = a + b;
                    had_v[j + w] = a - b;
                }
            }
        } else {  // element i pairs with i ^ w, the same register of invocation lane ^ (w / HAD_VALS)
            uint mask = w / HAD_VALS;
            bool upper = (had_lane() & mask) != 0u;  // holds b of its pairs: a - b = partner - mine
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) {
                float other = subgroupShuffleXor(had_v[j], mask);
                had_v[j] = upper ? other - had_v[j] : had_v[j] + other;
            }
        }
    }
}

// Transform every pass row in place: had_v of each invocation holds its elements of the transformed row after.
void had_transform() {
    if (HAD_IN_SUBGROUP) {
        had_fwht_subgroup();
    } else {
        uint base = had_row() * 128u + had_col0();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) HAD_BUF_STORE(base + j, had_v[j]);
        barrier();
        had_fwht(HAD_PASS_ROWS);
        [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j) had_v[j] = HAD_BUF_LOAD(base + j);
        barrier();  // nobody writes the next pass's rows before every invocation has read these
    }
}

// Elements j and j + 1 of had_v (j even: HAD_VALS is even for every lane count the plan allows). The fp16 steps
// below go a pair at a time: one conversion for two values (common.glsl's rn16_pair).
vec2 had_pair(uint j) { return vec2(had_v[j], had_v[j + 1u]); }
void had_set_pair(uint j, vec2 p) {
    had_v[j] = p.x;
    had_v[j + 1u] = p.y;
}
// Pair j of the transform's output, times 1/sqrt(128), as one packed fp16 word (an input Hadamard's result).
uint had_scaled_word(uint j) { return packHalf2x16(had_pair(j) * HAD_SCALE); }
// Pair j of an output Hadamard scaled by the fp16 pair s, RN16(RN16(had_v * HAD_SCALE) * s): the spec's tail
// (the linear's svh, stage 3's gate and up svh).
vec2 had_out_pair(uint j, vec2 s) { return rn16_pair(rn16_pair(had_pair(j) * HAD_SCALE) * s); }

// had_v = RN16(had_v) (a GEMM's fp32 sums as its fp16 output).
void had_round_pairs() {
    [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) had_set_pair(j, rn16_pair(had_pair(j)));
}

#ifdef HAD_IN_X
// The input Hadamard's first step (had_in, spec section 5): had_v = RN16(x * suh) for this invocation's columns,
// from packed fp16 word w of x and word sw of suh on. The includer defines HAD_IN_X(i) and HAD_IN_SUH(i), its
// words (exl3_had_in.comp; exl3_linear.comp's direct mode, which builds its own input row).
void had_in_load(uint w, uint sw) {
    [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u)
        had_set_pair(j, rn16_pair(unpackHalf2x16(HAD_IN_X(w + j / 2u)) * unpackHalf2x16(HAD_IN_SUH(sw + j / 2u))));
}
#endif

#endif
