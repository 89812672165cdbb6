// 128-point Walsh-Hadamard transform with the exact fp32 evaluation order of spec section 5: butterflies of
// width 1, 2, 4, ..., 64, each (a + b, a - b). Every output of a stage depends on exactly two inputs of the
// previous stage, so spreading the pairs over invocations keeps the result bit-identical to the reference.
//
// The including shader defines WG_SIZE (its workgroup size) and HAD_ROWS (rows transformed at once) before
// including; the rows live in `had_buf` (shared). Call from uniform control flow: it contains barriers.

#ifndef HADAMARD128_GLSL
#define HADAMARD128_GLSL

const float HAD_SCALE = 0.088388347648;  // fp32(1/sqrt(128)) = 0x3DB504F3

shared float had_buf[HAD_ROWS * 128];

// In-place FWHT of had_buf rows 0 .. nrows-1 (nrows <= HAD_ROWS). The caller has written the rows and passed a
// barrier(); on return the transformed rows are visible to the whole workgroup.
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
            float a = had_buf[i], b = had_buf[i + w];
            had_buf[i] = a + b;
            had_buf[i + w] = a - b;
        }
        barrier();
    }
}

// fp16 rounding helpers for the Hadamard variants (spec section 5).
float rn16(float v) { return unpackHalf2x16(packHalf2x16(vec2(v, 0.0))).x; }

#endif
