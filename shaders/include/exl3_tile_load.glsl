// Loading one lane's trellis words of a 16x16 tile (see exl3_decode.glsl for the lane split), shared by the FMA
// GEMM core (exl3_gemm.glsl) and the cooperative-matrix one (exl3_gemm_coop.glsl). The includer defines
// uint gemm_b_word(int src, uint index) and uvec4 gemm_b_word4(int src, uint index4) first.
#ifndef EXL3_TILE_LOAD_GLSL
#define EXL3_TILE_LOAD_GLSL

// This lane's K trellis words of a tile starting at word `index`: 16-byte loads where K allows (K = 4, 8: the
// lane's words are 16-byte aligned), else one word at a time.
void gemm_load_lane(int b_src, int K, uint index, out uint words[8]) {
    [[unroll]] for (int i = 0; i < 8; ++i) words[i] = 0u;
    if (K == 4 || K == 8) {
        uvec4 v = gemm_b_word4(b_src, index >> 2);
        words[0] = v.x; words[1] = v.y; words[2] = v.z; words[3] = v.w;
        if (K == 8) {
            v = gemm_b_word4(b_src, (index >> 2) + 1u);
            words[4] = v.x; words[5] = v.y; words[6] = v.z; words[7] = v.w;
        }
    } else {
        [[unroll]] for (int i = 0; i < 8; ++i) if (i < K) words[i] = gemm_b_word(b_src, index + uint(i));
    }
}

#endif
