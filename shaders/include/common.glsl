// Declarations every vkmoe compute shader shares: the Vulkan memory model and 256-invocation workgroups.
#ifndef COMMON_GLSL
#define COMMON_GLSL
#pragma use_vulkan_memory_model
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_control_flow_attributes : require
#extension GL_KHR_shader_subgroup_ballot : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_shuffle : require

// A value the whole workgroup holds (read from a buffer or shared memory) made visibly uniform to the compiler.
// Loops and branches that contain barriers must depend only on such values: Mesa 22.3's lavapipe miscompiles
// barriers under control flow it thinks divergent (it dropped the rest of the shader, or zeroed results).
uint wg_uniform(uint v) { return subgroupBroadcastFirst(v); }

// fp16 arrays live in buffers as packed uint words (two values per word, low half first): portable without
// 16-bit storage and one load per pair.
float f16_at(uint word, uint index) { vec2 v = unpackHalf2x16(word); return (index & 1u) == 0u ? v.x : v.y; }

// A workgroup barrier that orders the workgroup's buffer and shared-memory accesses: everything written before it
// by any invocation of the workgroup is visible to every invocation after it.
// Mesa 22.3's lavapipe orders memory accesses around a control barrier only when the barrier's memory scope is
// Workgroup or Device: with QueueFamily scope (or no memory semantics) it is an execution barrier alone, and the
// buffer stores before it can land after it (a workgroup's invocations then read each other's stores, and its
// arrival counters count writes, that are not done yet). tests/test_vk.py::test_wg_barrier_orders_buffer_stores.
#define WG_BARRIER_LOCAL() controlBarrier(gl_ScopeWorkgroup, gl_ScopeWorkgroup, \
    gl_StorageSemanticsBuffer | gl_StorageSemanticsShared, gl_SemanticsAcquireRelease)
// Everything written before this call by any invocation of the workgroup is visible device-wide to whoever
// acquires after the release that follows (and the reverse for the acquire side). QueueFamily scope (Device scope
// would need vulkanMemoryModelDeviceScope), followed by WG_BARRIER_LOCAL for Mesa 22.3 (see above).
#define WG_BARRIER_DEVICE() controlBarrier(gl_ScopeWorkgroup, gl_ScopeQueueFamily, \
    gl_StorageSemanticsBuffer | gl_StorageSemanticsShared, \
    gl_SemanticsAcquireRelease | gl_SemanticsMakeAvailable | gl_SemanticsMakeVisible); \
    WG_BARRIER_LOCAL()
// Everything written before this call by any invocation of the workgroup is made available to the workgroup and
// ordered before what follows, so that ONE invocation's device-scope release after it (an atomic with
// MakeAvailable at QueueFamily scope: last_arrival.glsl) carries all of it device-wide (an availability chain),
// without a device-scope fence in every invocation. One Workgroup-scope barrier, which Mesa 22.3 orders (above).
// H200, an EXL3 linear's arrival (the k-loop and the tail left out): 6.1-6.3 -> 5.7-5.9 us.
#define WG_BARRIER_PUBLISH() controlBarrier(gl_ScopeWorkgroup, gl_ScopeWorkgroup, \
    gl_StorageSemanticsBuffer | gl_StorageSemanticsShared, \
    gl_SemanticsAcquireRelease | gl_SemanticsMakeAvailable | gl_SemanticsMakeVisible)
// 0, from a value no compiler knows at build time (no dispatch has 2^31 workgroups in x). An fp16 value packed to a
// word and unpacked again in the same invocation is xor-ed with it in between: otherwise a compiler may fold the
// pack and the unpack together and keep the unrounded fp32 value, and did: the NVIDIA driver on an H100 and Mesa
// 25's lavapipe dropped every rounding of rn16 below (908 of 4096 values of tests/test_rounding.py one fp16 step
// off; BENCHMARKS.md, thirtieth session), and the NVIDIA driver an activation packed for the Hadamard's unpack
// (twenty-ninth session).
uint opaque_zero() { return gl_NumWorkGroups.x >> 31u; }

// Round to fp16 and back (round to nearest even, the spec's RN16): one value, or two at once (one conversion
// instruction for the pair where the device has it, e.g. NVIDIA's packed F2F).
vec2 rn16_pair(vec2 v) { return unpackHalf2x16(packHalf2x16(v) ^ opaque_zero()); }
float rn16(float v) { return rn16_pair(vec2(v, 0.0)).x; }

// min / max / clamp that keep a NaN first operand, as numpy's np.minimum / np.maximum / np.clip do (the float64
// reference's act_limit and relu2): GLSL leaves NaN operands of min / max / clamp undefined, and lavapipe returned
// the other operand, so a NaN hidden value gave a finite output under an act_limit. Numbers get min / max / clamp.
float min_nan(float a, float b) { return isnan(a) ? a : min(a, b); }
float max_nan(float a, float b) { return isnan(a) ? a : max(a, b); }
float clamp_nan(float x, float lo, float hi) { return isnan(x) ? x : clamp(x, lo, hi); }
vec2 min_nan(vec2 a, float b) { return mix(min(a, vec2(b)), a, isnan(a)); }  // the same, per component
vec2 max_nan(vec2 a, float b) { return mix(max(a, vec2(b)), a, isnan(a)); }
vec2 clamp_nan(vec2 x, float lo, float hi) { return mix(clamp(x, vec2(lo), vec2(hi)), x, isnan(x)); }

// erf for the gelu_erf activation (the MoE stages and the device block's shared expert).
float erf_approx(float x) {  // Abramowitz-Stegun 7.1.26, |error| < 1.5e-7 (below fp16 resolution)
    float t = 1.0 / (1.0 + 0.3275911 * abs(x));
    float y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592)
                    * t * exp(-x * x);
    return x < 0.0 ? -y : y;
}
#endif
