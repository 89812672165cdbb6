#version 450
// vkmoe-variants: idot=-DEXL3_IDOT
// Dequantize a trellis to its (k, n) fp16 matrix Ŵ (no scales) so the GPU decoder can be checked bit for bit.
// One invocation decodes one lane (two columns x 16 rows) of one tile; each output element is one uint
// holding the fp16 bits (scattered 16-bit stores would need 16-bit storage).
#include "common.glsl"
layout(local_size_x = 256) in;
layout(constant_id = 0) const int K = 4;
layout(constant_id = 1) const int CB = 2;
layout(std430, binding = 0) readonly buffer Trellis { uint trellis[]; };
layout(std430, binding = 1) writeonly buffer W { uint w_bits[]; };   // (k, n)
layout(push_constant) uniform Push { uint k; uint n; } pc;
#include "exl3_decode.glsl"

void main() {
    uint lane = gl_GlobalInvocationID.x;
    uint tiles_n = pc.n / 16u;
    uint tile = lane >> 3, q = lane & 7u;
    if (tile >= (pc.k / 16u) * tiles_n) return;
    uint kt = tile / tiles_n, nt = tile % tiles_n;
    uint tile_words = 8u * uint(K), first = uint(K) * q, base = tile * tile_words;
    uint words[8];
    [[unroll]] for (int i = 0; i < 8; ++i) words[i] = i < K ? trellis[base + first + uint(i)] : 0u;
    uint prev = trellis[base + (first + tile_words - 1u) % tile_words];
    float vals[32];
    decode_lane(K, CB, words, prev, vals);
    [[unroll]] for (int j = 0; j < 32; ++j) {
        uint row = kt * 16u + uint(lane_row(j));
        uint col = nt * 16u + q + ((j & 4) != 0 ? 8u : 0u);
        w_bits[row * pc.n + col] = packHalf2x16(vec2(vals[j], 0.0)) & 0xFFFFu;
    }
}
