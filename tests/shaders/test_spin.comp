#version 450
// A long but bounded kernel for the timeout test: every invocation mixes `iterations` values. Bounded, so an
// abandoned wait never leaves the device hung; long enough that a 1 ms wait times out on any CPU driver.
layout(local_size_x = 64) in;
layout(std430, binding = 0) buffer Data { uint words[]; };
layout(push_constant) uniform Push { uint iterations; } pc;

void main() {
    uint h = gl_GlobalInvocationID.x;
    for (uint i = 0u; i < pc.iterations; ++i) h = h * 1664525u + words[(h >> 8) & 1023u];
    words[1024u + gl_GlobalInvocationID.x] = h;
}
