#version 450
// Fill a buffer of 32-bit words with a hash of (word index, seed): device-side random EXL3 trellises for
// benchmarks (every bit pattern is a valid trellis). One word per invocation, no loops (lavapipe 22.3 caps
// per-invocation loop iterations). The host dispatches in chunks: word = base + x + y * row_words, where
// row_words = gl_NumWorkGroups.x * 256; words at or past `count` are left alone.
// vkmoe.ops.synthetic.fill_words_numpy is the same function in numpy (tests compare bit for bit).
layout(local_size_x = 256) in;
layout(std430, binding = 0) writeonly buffer Words { uint words[]; };
layout(push_constant) uniform Push { uint base; uint count; uint seed; } pc;

// Chris Wellons' lowbias32 integer hash.
uint lowbias32(uint x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

void main() {
    uint row_words = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    uint i = pc.base + gl_GlobalInvocationID.x + gl_GlobalInvocationID.y * row_words;
    if (i >= pc.count) return;
    words[i] = lowbias32(i + lowbias32(pc.seed ^ 0xa511e9b3u));
}
