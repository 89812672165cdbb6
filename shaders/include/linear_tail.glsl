// The tail of an EXL3 linear (spec section 6), shared by exl3_linear.comp and exl3_linear_coop.comp: the last
// k-split of a band sums the fp32 partials (in a fixed order: deterministic), applies the output Hadamard, the
// scale svh and the bias, and writes fp16 y. The includer declares partial[], svh[], bias[], y[], pc.n,
// pc.splits, HAS_BIAS, WG_SIZE and includes hadamard128.glsl first. Optional: LINEAR_TAIL_SCRATCH(i), a uint
// lvalue of shared memory (i < LINEAR_SHARE_GROUPS * 128) free during the tail, for the shared split sums below.
#ifndef LINEAR_TAIL_GLSL
#define LINEAR_TAIL_GLSL

#include "split_sum.glsl"

// Lane groups (a row's HAD_LANES invocations) that share the split sum of a one-row band: a pass holds
// HAD_PASS_ROWS rows, so at m = 1 all but one group would sum the same partials. With LINEAR_SHARE_MIN_SPLITS
// k-splits or more (where the plain sum takes two or more rounds of SPLIT_SUM_BATCH loads), group g of
// LINEAR_SHARE_GROUPS sums splits g, g + G, ... (one round up to 32 splits), then every group adds the G sums in
// group order. H200 (BENCHMARKS.md, nineteenth session): 7168 x 2048 (24 splits) at m = 1 13.8 -> 12.7 us; with 6
// or 7 splits (8192 x 8192, 2048 x 7168) the exchange cost 0.2-0.4 us, so fewer splits keep the plain sum. (Two
// rows sharing by two groups each read 0.4 us faster at 7168 x 2048, m = 2, but that build was never checked for
// correctness on the H200: not taken.) The rule reads the row and split counts only, not the Hadamard geometry,
// so both transforms keep the same bits (both have HAD_PASS_ROWS >= 4 up to subgroups of 64; with 128-wide
// subgroups, or no scratch, there are no groups to share and the plain split order runs).
const uint LINEAR_SHARE_GROUPS = 4u;
const uint LINEAR_SHARE_MIN_SPLITS = 2u * SPLIT_SUM_BATCH;
#ifdef LINEAR_TAIL_SCRATCH
const bool LINEAR_CAN_SHARE = HAD_PASS_ROWS >= LINEAR_SHARE_GROUPS;
#else
const bool LINEAR_CAN_SHARE = false;
#endif
uint linear_share_groups(uint nr, uint splits) {
    return LINEAR_CAN_SHARE && nr == 1u && splits >= LINEAR_SHARE_MIN_SPLITS ? LINEAR_SHARE_GROUPS : 1u;
}

// Rows row0 .. row0+nr-1 of one band, HAD_PASS_ROWS per pass (nr uniform); split s of a row's partial is at
// s * split_stride + row * n + column. Rows past nr run on row nr - 1 and are dropped.
void linear_output_band(uint band, uint row0, uint nr, uint split_stride) {
    uint c = band * BAND + had_col0();
    uint G = linear_share_groups(nr, pc.splits), g = had_row() % G;
    for (uint r0 = 0u; r0 < nr; r0 += HAD_PASS_ROWS) {
        uint r = r0 + had_row() / G, e = (row0 + min(r, nr - 1u)) * pc.n + c;
        if (G == 1u) {
            split_sum_had(e, split_stride, pc.splits);  // every lane the same trip count
        } else {
#ifdef LINEAR_TAIL_SCRATCH
            // One row: pass row q's lanes are group g = q % G of it. Groups 0..G-1 write their shares to scratch
            // rows 0..G-1, and every lane adds them in group order (pass rows past the first are dropped).
            split_sum_had_share(e, split_stride, pc.splits, g, G);
            if (had_row() < G) {
                [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
                    LINEAR_TAIL_SCRATCH(had_row() * 128u + had_col0() + j) = floatBitsToUint(had_v[j]);
            }
            barrier();
            [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
                had_v[j] = uintBitsToFloat(LINEAR_TAIL_SCRATCH(had_col0() + j));
            for (uint h = 1u; h < G; ++h) {
                [[unroll]] for (uint j = 0u; j < HAD_VALS; ++j)
                    had_v[j] += uintBitsToFloat(LINEAR_TAIL_SCRATCH(h * 128u + had_col0() + j));
            }
#endif
        }
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {  // fp16 pairs of the band
            vec2 v = had_out_pair(j, unpackHalf2x16(svh[(c + j) >> 1]));
            if (HAS_BIAS) v += unpackHalf2x16(bias[(c + j) >> 1]);
            if (r < nr && g == 0u) y[(e + j) >> 1] = packHalf2x16(v);
        }
    }
}

#endif
