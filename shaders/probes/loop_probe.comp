#version 450
// Counts how many iterations one invocation's loop really runs. Mesa 22.3's lavapipe silently ends every loop
// after 65,535 iterations; the exit condition reads memory so the compiler cannot fold the loop away.
layout(local_size_x = 1) in;
layout(std430, binding = 0) buffer Data { uint words[]; };   // 1024 words of 0xFFFFFFFF, then the result
layout(push_constant) uniform Push { uint iterations; } pc;

void main() {
    uint n = 0u;
    uint acc = 0u;
    for (;;) {
        acc ^= words[n & 1023u];
        n += 1u;
        if (n >= pc.iterations && words[(n * 7u) & 1023u] == 0xFFFFFFFFu) break;
    }
    words[1024] = n;
    words[1025] = acc;
}
