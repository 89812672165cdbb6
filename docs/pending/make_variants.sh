#!/usr/bin/env bash
# Builds the SPIR-V sets that docs/pending/device_call.sh swaps in, from a clean checkout of main, and leaves the
# tree with the three patches applied and their SPIR-V built (what the device call checks and times).
# Sets (folders under exp/, which .git/info/exclude should ignore; carry `exp` to the device). exp/ is emptied first:
# it travels with the call, whose carry is limited to 64 MiB.
#   land   every kernel, all three patches        fma1d  the FMA kernels without the FMA patch (split sum patch in)
#   based  the coop kernels without the coop patch (split sum patch in)
#   epw1/2/4  the router kernels with layout.ROUTER_EXPERTS_PER_WG = 1, 2, 4 (router_parts.py's EPW)
# Usage (repository root): bash docs/pending/make_variants.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then echo "make_variants: the tree has changes; start from a clean main" >&2; exit 1; fi
P=docs/pending
tmp=$(mktemp -d); cp -r "$P"/. "$tmp"   # the patches and scripts, kept while the tree changes under them
P=$tmp
# On a failure, give the tree back as it was (clean main) instead of leaving a half-patched one.
trap 'git checkout -- .; rm -rf "$tmp"; echo "make_variants: failed; the tree is back to main" >&2' ERR
fma='exl3_linear exl3_linear_f16 exl3_linear_idot moe_down moe_down_f16 moe_down_idot moe_gate_up moe_gate_up_f16 moe_gate_up_idot moe_persistent moe_persistent_clock moe_persistent_f16 moe_persistent_f16_clock moe_persistent_idot moe_persistent_idot_clock'
rm -rf exp; mkdir -p exp
for n in 1 2 4; do
  sed -i "s/^ROUTER_EXPERTS_PER_WG = .*/ROUTER_EXPERTS_PER_WG = $n/" vkmoe/layout.py
  make -s shaders >/dev/null
  rm -rf exp/spv_epw$n; mkdir -p exp/spv_epw$n; cp vkmoe/_spv/moe_router*.spv exp/spv_epw$n/
done
git checkout -- vkmoe/layout.py
git apply $P/split-sum-one-copy.patch
make -s shaders >/dev/null
rm -rf exp/spv_fma1d exp/spv_based; mkdir -p exp/spv_fma1d exp/spv_based
for n in $fma; do cp vkmoe/_spv/$n.spv exp/spv_fma1d/; done
cp vkmoe/_spv/*coop*.spv exp/spv_based/
git checkout -- .
for p in coop-two-steps-in-flight fma-two-tiles-in-flight split-sum-one-copy; do git apply $P/$p.patch; done
make -s shaders >/dev/null
rm -rf exp/spv_land; mkdir -p exp/spv_land; cp vkmoe/_spv/*.spv exp/spv_land/
cp $P/device_call.sh $P/router_parts.py exp/
trap - ERR; rm -rf "$tmp"
echo "make_variants: exp/spv_{land,fma1d,based,epw1,epw2,epw4} built; the tree holds the three patches"
