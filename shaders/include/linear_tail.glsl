// The tail of an EXL3 linear (spec section 6), shared by exl3_linear.comp and exl3_linear_coop.comp: the last
// k-split of a band sums the fp32 partials (in split order: deterministic), applies the output Hadamard, the
// scale svh and the bias, and writes fp16 y. The includer declares partial[], svh[], bias[], y[], pc.n,
// pc.splits, HAS_BIAS, WG_SIZE and includes hadamard128.glsl first.
#ifndef LINEAR_TAIL_GLSL
#define LINEAR_TAIL_GLSL

#include "split_sum.glsl"

// Rows row0 .. row0+nr-1 of one band, HAD_PASS_ROWS per pass (nr uniform); split s of a row's partial is at
// s * split_stride + row * n + column. Rows past nr run on row nr - 1 and are dropped.
void linear_output_band(uint band, uint row0, uint nr, uint split_stride) {
    uint c = band * BAND + had_col0();
    for (uint r0 = 0u; r0 < nr; r0 += HAD_PASS_ROWS) {
        uint r = r0 + had_row(), e = (row0 + min(r, nr - 1u)) * pc.n + c;
        split_sum_had(e, split_stride, pc.splits);  // every lane the same trip count
        had_transform();
        [[unroll]] for (uint j = 0u; j < HAD_VALS; j += 2u) {  // fp16 pairs of the band
            vec2 s = unpackHalf2x16(svh[(c + j) >> 1]);
            vec2 v = vec2(rn16(rn16(had_v[j] * HAD_SCALE) * s.x), rn16(rn16(had_v[j + 1u] * HAD_SCALE) * s.y));
            if (HAS_BIAS) v += unpackHalf2x16(bias[(c + j) >> 1]);
            if (r < nr) y[(e + j) >> 1] = packHalf2x16(v);
        }
    }
}

#endif
