// Bindings, specialization constants and push constants shared by every MoE shader (split stages and the
// persistent kernel), so one descriptor set serves them all.
#ifndef MOE_BINDINGS_GLSL
#define MOE_BINDINGS_GLSL
// Ids, codes and word offsets below come from vkmoe/layout.py, through the generated header.
#include "generated/moe_layout.glsl"

layout(constant_id = SPEC_MOE_K_GATE) const int K_GATE = 4;
layout(constant_id = SPEC_MOE_K_UP) const int K_UP = 4;
layout(constant_id = SPEC_MOE_K_DOWN) const int K_DOWN = 4;
layout(constant_id = SPEC_MOE_CB) const int CB = 2;          // codebook of all three projections (CB_*)
layout(constant_id = SPEC_MOE_ROWS) const int GEMM_ROWS = 4;   // rows per GEMM pass = rows per expert chunk
layout(constant_id = SPEC_MOE_ACT) const int ACT = 0;         // ACT_*
// Direct mode (moe_stages.glsl): every (token, slot) row is its own chunk; no routing, no stage-1 pass.
layout(constant_id = SPEC_MOE_DIRECT) const bool DIRECT = false;
// Stage 3 in the down items (moe_stages.glsl, FMA builds only): the gate/up band tails only count their arrivals;
// each down item applies stage 3 to the partials of its own k-range and multiplies from shared memory.
layout(constant_id = SPEC_MOE_STAGE3_IN_DOWN) const bool STAGE3_IN_DOWN = false;
// The token-sum pass (split path, routed plans): stage 5 writes each chunk's (token, slot) rows and nothing more;
// a dispatch of its own (moe_token_sum.comp) then sums every token's rows, instead of each tail counting its rows'
// arrivals and summing the tokens it completed.
layout(constant_id = SPEC_MOE_TOKEN_SUM_PASS) const bool TOKEN_SUM_PASS = false;

#define GATED (ACT != ACT_RELU2)

// fp16 data are uint words holding two values. Buffers written and read by different workgroups of one
// dispatch (persistent mode) are nonprivate so that release/acquire makes them visible.
layout(std430, binding = 0) readonly buffer Hidden { uint hidden[]; };        // (m, H) fp16
layout(std430, binding = 1) readonly buffer Ids { int expert_ids[]; };        // (m, top_k)
layout(std430, binding = 2) readonly buffer Wts { float expert_weights[]; };  // (m, top_k), rounded to fp16 here
layout(std430, binding = 3) nonprivate buffer Out { float out_h[]; };         // (m, H) fp32
layout(std430, binding = 4) readonly buffer GT { uint gate_trellis[]; };      // experts back to back
layout(std430, binding = 5) readonly buffer GS { uint gate_suh[]; };          // (E, H) fp16
layout(std430, binding = 6) readonly buffer GV { uint gate_svh[]; };          // (E, I) fp16
layout(std430, binding = 7) readonly buffer UT { uint up_trellis[]; };
layout(std430, binding = 8) readonly buffer US { uint up_suh[]; };
layout(std430, binding = 9) readonly buffer UV { uint up_svh[]; };
layout(std430, binding = 10) readonly buffer DT { uint down_trellis[]; };
layout(std430, binding = 11) readonly buffer DS { uint down_suh[]; };         // (E, I) fp16
layout(std430, binding = 12) readonly buffer DV { uint down_svh[]; };         // (E, H) fp16
// Routing results: [0] rows routed (R'), [1] chunks; then chunk table (expert, first row, rows) x max_chunks;
// then per sorted row its flat index t * top_k + slot, its expert; then per token its number of valid slots.
layout(std430, binding = 13) nonprivate buffer Route { uint route[]; };
layout(std430, binding = 14) nonprivate buffer States { uint states[]; };    // [2][R][H] fp16: gate, up inputs
layout(std430, binding = 15) nonprivate buffer Inter { uint inter[]; };      // [R][I] fp16: down input
layout(std430, binding = 16) nonprivate buffer Partial { float partial[]; }; // GEMM k-split partials, fp32
layout(std430, binding = 17) nonprivate buffer Rows { float rows_out[]; };   // [R][H] fp32 per (token, slot)
layout(std430, binding = 18) nonprivate buffer Sync { uint sync_words[]; };  // counters, tickets, barrier, abort
// A device block's shared expert, added by the token sums where the block fuses its sum (pc.shared_add):
layout(std430, binding = 19) readonly buffer SharedOut { uint shared_out[]; };   // (m, H) fp16
layout(std430, binding = 20) readonly buffer SharedGate { float shared_gate[]; }; // (m,) fp32 gate logits
// The same memory 16 bytes at a time, for the GEMM's vector loads.
layout(std430, binding = 4) readonly buffer GT4 { uvec4 gate_trellis4[]; };
layout(std430, binding = 7) readonly buffer UT4 { uvec4 up_trellis4[]; };
layout(std430, binding = 10) readonly buffer DT4 { uvec4 down_trellis4[]; };
layout(std430, binding = 14) nonprivate buffer States4 { uvec4 states4[]; };
layout(std430, binding = 15) nonprivate buffer Inter4 { uvec4 inter4[]; };

layout(push_constant) uniform MoePush {
    uint m, top_k, E, H, I;
    uint max_chunks;     // bound on the chunk table (fixes the grid without a host round trip)
    uint splits_gu, kt_gu;   // gate/up GEMM: k-splits over H and k-tiles per split
    uint splits_d, kt_d;     // down GEMM: k-splits over I
    float act_limit;
    uint num_workgroups;     // persistent kernel: workgroups launched
    uint spin_limit;         // persistent kernel: iterations of one barrier spin before it gives up
    uint loop_budget;        // persistent kernel: spin iterations allowed in total (below a driver loop cap)
    uint mode;               // persistent kernel: MOE_MODE_RUN, or MOE_MODE_DISCOVER (co-residency discovery)
    uint shared_add;         // SHARED_ADD_*: what the token sums add to out (a device block's shared expert)
} pc;

// The sync buffer (SYNC_* words, layout.py): the header, then the arrival counters, then per-chunk progress.
uint counters_gu() { return SYNC_COUNTERS; }                                   // max_chunks * I/BAND
uint counters_d() { return SYNC_COUNTERS + pc.max_chunks * (pc.I / BAND); }   // max_chunks * H/BAND
uint counters_tok() { return counters_d() + pc.max_chunks * (pc.H / BAND); }  // m * H/BAND
uint counters_chunk_done() { return counters_tok() + pc.m * (pc.H / BAND); }  // max_chunks: I-bands through stage 3
// max_chunks: down items past their wait, from the next 128-byte line on (layout.chunk_users_word)
uint counters_chunk_users() { return (counters_chunk_done() + pc.max_chunks + SYNC_LINE - 1u) / SYNC_LINE * SYNC_LINE; }

uint R() { return pc.m * pc.top_k; }
uint route_chunk(uint c) { return ROUTE_HEADER + ROUTE_CHUNK_WORDS * c; }
uint route_rows_base() { return ROUTE_HEADER + ROUTE_CHUNK_WORDS * pc.max_chunks; }
uint route_row_flat(uint p) { return route_rows_base() + p; }
uint route_row_expert(uint p) { return route_rows_base() + R() + p; }
uint route_valid(uint t) { return route_rows_base() + 2u * R() + t; }

#endif
