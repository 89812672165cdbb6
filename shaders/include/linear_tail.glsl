// The tail of an EXL3 linear (spec section 6), shared by exl3_linear.comp and exl3_linear_coop.comp: the last
// k-split of a band sums the fp32 partials (in split order: deterministic), applies the output Hadamard, the
// scale svh and the bias, and writes fp16 y. The includer declares partial[], svh[], bias[], y[], pc.n,
// pc.splits, HAS_BIAS, WG_SIZE and includes hadamard128.glsl with HAD_ROWS = 4 first.
#ifndef LINEAR_TAIL_GLSL
#define LINEAR_TAIL_GLSL

#include "split_sum.glsl"

// Rows row0 .. row0+nr-1 of one band; split s of a row's partial is at s * split_stride + row * n + column.
void linear_output_band(uint band, uint row0, uint nr, uint split_stride) {
    uint tid = gl_LocalInvocationID.x;
    for (uint r0 = 0u; r0 < nr; r0 += 4u) {
        for (uint i = tid; i < 4u * BAND; i += WG_SIZE) {
            uint rr = i / BAND, col = i % BAND;
            // Every lane sums (split_sum's loop must not diverge); rows past the chunk read a valid row, dropped.
            float v = split_sum((row0 + min(r0 + rr, nr - 1u)) * pc.n + band * BAND + col, split_stride, pc.splits);
            had_buf[i] = r0 + rr < nr ? v : 0.0;
        }
        barrier();
        had_fwht(4u);
        for (uint i = tid; i < 4u * 64u; i += WG_SIZE) {  // 4 rows x 64 fp16 pairs of the band
            uint rr = i >> 6, c = band * BAND + (i & 63u) * 2u;
            if (r0 + rr < nr) {
                uint b = rr * BAND + (i & 63u) * 2u;
                vec2 s = unpackHalf2x16(svh[c >> 1]);
                vec2 v = vec2(rn16(rn16(had_buf[b] * HAD_SCALE) * s.x), rn16(rn16(had_buf[b + 1u] * HAD_SCALE) * s.y));
                if (HAS_BIAS) v += unpackHalf2x16(bias[c >> 1]);
                y[((row0 + r0 + rr) * pc.n + c) >> 1] = packHalf2x16(v);
            }
        }
        barrier();
    }
}

#endif
