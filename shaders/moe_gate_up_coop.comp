#version 450
// vkmoe-compiler: glslang
// vkmoe-variants: idot=-DEXL3_IDOT emulate=-DCOOP_EMULATE discover=-DMOE_DISCOVERY idot_discover=-DEXL3_IDOT,-DMOE_DISCOVERY emulate_discover=-DCOOP_EMULATE,-DMOE_DISCOVERY wide=-DCOOP_MOE_WIDE idot_wide=-DEXL3_IDOT,-DCOOP_MOE_WIDE emulate_wide=-DCOOP_EMULATE,-DCOOP_MOE_WIDE wide_discover=-DCOOP_MOE_WIDE,-DMOE_DISCOVERY idot_wide_discover=-DEXL3_IDOT,-DCOOP_MOE_WIDE,-DMOE_DISCOVERY emulate_wide_discover=-DCOOP_EMULATE,-DCOOP_MOE_WIDE,-DMOE_DISCOVERY breg=-DCOOP_BREG breg_discover=-DCOOP_BREG,-DMOE_DISCOVERY wide_breg=-DCOOP_MOE_WIDE,-DCOOP_BREG wide_breg_discover=-DCOOP_MOE_WIDE,-DCOOP_BREG,-DMOE_DISCOVERY idot_breg=-DEXL3_IDOT,-DCOOP_BREG idot_breg_discover=-DEXL3_IDOT,-DCOOP_BREG,-DMOE_DISCOVERY idot_wide_breg=-DEXL3_IDOT,-DCOOP_MOE_WIDE,-DCOOP_BREG idot_wide_breg_discover=-DEXL3_IDOT,-DCOOP_MOE_WIDE,-DCOOP_BREG,-DMOE_DISCOVERY emulate_breg=-DCOOP_EMULATE,-DCOOP_BREG emulate_breg_discover=-DCOOP_EMULATE,-DCOOP_BREG,-DMOE_DISCOVERY emulate_wide_breg=-DCOOP_EMULATE,-DCOOP_MOE_WIDE,-DCOOP_BREG emulate_wide_breg_discover=-DCOOP_EMULATE,-DCOOP_MOE_WIDE,-DCOOP_BREG,-DMOE_DISCOVERY
// Split path, dispatch 2 of 4, on cooperative matrices (moe_stages.glsl with MOE_COOP): the gate/up GEMM; the last
// k-split of a band runs the activation (stage 3).
// Chunks of up to COOP_MOE_ROWS rows of one expert, COOP_MOE_ROWS_WIDE in the _wide builds (the routing ran with
// GEMM_ROWS = that). Grid as in moe_gate_up.comp. The emulate build replaces only the matrix-unit multiply (tests on
// devices without it).
#extension GL_GOOGLE_include_directive : require  // implied by glslc, not by glslangValidator
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#define EXL3_F16
#include "common.glsl"
#define WG_SIZE 256u
layout(local_size_x = 256) in;
#define MOE_COOP
#include "moe_bindings.glsl"
#ifdef COOP_MOE_WIDE  // the _wide builds: chunks of up to COOP_MOE_ROWS_WIDE rows
#define COOP_BM COOP_MOE_ROWS_WIDE
#else
#define COOP_BM COOP_MOE_ROWS
#endif
#include "moe_stages.glsl"
#ifdef MOE_DISCOVERY  // the discovery build (`_discover`: moe_discover.glsl)
#include "moe_discover.glsl"
#endif
void main() {
#ifdef MOE_DISCOVERY
    if (pc.mode == MOE_MODE_DISCOVER) {
        discover();
        return;
    }
#endif
    if (gl_WorkGroupID.y < routed_chunks()) moe_gate_up(gl_WorkGroupID.y * gu_items_per_chunk() + gl_WorkGroupID.x);
}
