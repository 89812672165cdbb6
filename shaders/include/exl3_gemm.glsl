// The EXL3 GEMM core shared by the linear op and the MoE stages: C[rows, band] = A[rows, k] · Ŵ[k, band] for one
// 128-column band (8 tiles of 16 columns) and a range of k-tiles, with fp16 weights decoded on the fly and fp32
// accumulation.
//
// Workgroup of 256 invocations = 32 tile slots x 8 lanes: slot s works on n-tile (s & 7) of the band and on
// k-tiles kt0 + (s >> 3), +4, +8, ... (four k-slices in flight). A band is exactly one Hadamard block, so the
// workgroup that finishes a band can apply the output Hadamard itself.
//
// The including shader defines, before including:
//   GEMM_ROWS            max rows per pass (a specialization constant; 1..16)
//   uint gemm_a_word(const int src, uint index)      packed fp16 pair of A (two consecutive k of one row)
//   uint gemm_b_word(const int src, uint index)      trellis word
// and includes exl3_decode.glsl first.

#ifndef EXL3_GEMM_GLSL
#define EXL3_GEMM_GLSL

#define GEMM_WG 256u

// This invocation's accumulators: gemm_acc[r * 2 + c] for row r and its two columns c. A module-level array
// (not a parameter): arrays sized by specialization constants do not survive being passed by value.
float gemm_acc[GEMM_ROWS * 2];

void gemm_clear() {
    [[unroll]] for (int i = 0; i < GEMM_ROWS * 2; ++i) gemm_acc[i] = 0.0;
}

// Accumulate gemm_acc[r * 2 + c] for rows r < nr, this invocation's two columns c, over its k-tiles.
// a_base/a_stride are in uint words (a row of k fp16 values is k/2 words); b_base in uint words.
void gemm_accumulate(const int a_src, int b_src, int K, const int cb,
                     uint a_base, uint a_stride, uint nr,
                     uint b_base, uint tiles_n, uint band, uint kt0, uint kt1) {
    uint tid = gl_LocalInvocationID.x;
    uint q = tid & 7u, slot = tid >> 3;
    uint nt = band * 8u + (slot & 7u);
    uint tile_words = 8u * uint(K);
    uint first = uint(K) * q;                       // this lane's first word inside the tile
    uint prev_index = (first + tile_words - 1u) % tile_words;
    for (uint kt = kt0 + (slot >> 3); kt < kt1; kt += 4u) {
        uint base = b_base + (kt * tiles_n + nt) * tile_words;
        uint words[8];
        [[unroll]] for (int i = 0; i < 8; ++i) words[i] = i < K ? gemm_b_word(b_src, base + first + uint(i)) : 0u;
        uint prev = gemm_b_word(b_src, base + prev_index);
        float vals[32];
        decode_lane(K, cb, words, prev, vals);
        [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r) {
            if (uint(r) < nr) {
                uint xa = a_base + uint(r) * a_stride + kt * 8u;
                float s0 = 0.0, s1 = 0.0;
                // Positions j, j+1 hold k-rows (row, row+1) of the tile, packed in A word row/2.
                [[unroll]] for (int j = 0; j < 32; j += 2) {
                    int wi = (j >> 3) + 4 * ((j >> 1) & 1);
                    vec2 x = unpackHalf2x16(gemm_a_word(a_src, xa + uint(wi)));
                    if ((j & 4) == 0) s0 += x.x * vals[j] + x.y * vals[j + 1];
                    else              s1 += x.x * vals[j] + x.y * vals[j + 1];
                }
                gemm_acc[r * 2] += s0;
                gemm_acc[r * 2 + 1] += s1;
            }
        }
    }
}

// The k-slice partials of 4 rows: gemm_red[(kslice * 4 + row) * 128 + column].
shared float gemm_red[4 * 4 * 128];

// Write the k-slice partials of rows r0 .. r0+3 into gemm_red; after a barrier, gemm_red_sum(row - r0, column)
// adds the four slices in a fixed order (deterministic). Column of an invocation: (slot & 7) * 16 + q (+ 8).
void gemm_stage_rows(uint r0) {
    uint tid = gl_LocalInvocationID.x;
    uint q = tid & 7u, slot = tid >> 3;
    uint kslice = slot >> 3;
    uint col = (slot & 7u) * 16u + q;
    [[unroll]] for (int rr = 0; rr < 4; ++rr) {
        [[unroll]] for (int r = 0; r < GEMM_ROWS; ++r) {
            if (uint(r) == r0 + uint(rr)) {
                gemm_red[(kslice * 4u + uint(rr)) * 128u + col] = gemm_acc[r * 2];
                gemm_red[(kslice * 4u + uint(rr)) * 128u + col + 8u] = gemm_acc[r * 2 + 1];
            }
        }
    }
}

float gemm_red_sum(uint rr, uint col) {
    return ((gemm_red[(0u * 4u + rr) * 128u + col] + gemm_red[(1u * 4u + rr) * 128u + col])
            + gemm_red[(2u * 4u + rr) * 128u + col]) + gemm_red[(3u * 4u + rr) * 128u + col];
}

#endif
