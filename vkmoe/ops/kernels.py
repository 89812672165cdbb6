"""Pipelines of the EXL3 shaders, cached per device, with the variant that suits the device chosen here
(the integer-dot-product build where the device has shaderIntegerDotProduct)."""
import functools
import hashlib
import os
import weakref

from .. import forksafe, knobs
from ..exl3.decode import MUL1_C0, MUL1_C1
from ..layout import (COOP_MOE_ROWS, COOP_MOE_ROWS_WIDE, COOP_ROWS_WIDE, HAD_SUBGROUP_MAX, HAD_SUBGROUP_MIN,
                      SPEC_F16_FMA_FUSED, SPEC_HAD_SUBGROUP)
from ..vk import Pipeline, PushConstants, VkmoeError, spirv
from ..vk.pipeline import SPV_DIR, load_spirv
from ..vk.quirks import cooperative_matrix_b_order, measure_f16_fma_rounds_once

_lock = forksafe.Lock()
_pipelines = weakref.WeakKeyDictionary()  # device -> {(name, spec): Pipeline}; the device destroys them on close
_fma_fused = weakref.WeakKeyDictionary()  # device -> f16_fma_fused (one tiny dispatch per device and process)
FP16_1024 = 0x6400  # fp16 bits of 1024.0: mul1 decodes (1024 + B) * c1 + c0 for byte sums B in 0..1020
MUL1_BYTE_SUMS = 1021


def f16_fma_fused(device):
    """Whether the f16 build may decode mul1 with the fp16 fma directly: the driver's fma of (1024 + B, c1, c0)
    rounds once for every byte sum B, giving the CUDA arm's bits (measured; else the exact fp32 form is used)."""
    with _lock:
        if device not in _fma_fused:
            _fma_fused[device] = bool(measure_f16_fma_rounds_once(device, FP16_1024, MUL1_BYTE_SUMS, MUL1_C1, MUL1_C0))
        return _fma_fused[device]


class DequantPush(PushConstants):
    fields = [("k", "<u4"), ("n", "<u4")]


class HadInPush(PushConstants):
    fields = [("m", "<u4"), ("k", "<u4")]


class LinearPush(PushConstants):
    fields = [("m", "<u4"), ("k", "<u4"), ("n", "<u4"), ("splits", "<u4"), ("kt_per_split", "<u4"),
              ("act_limit", "<f4")]


def uses_idot(device):
    return bool(device.features.get("shaderIntegerDotProduct"))


def decode_variant(device):
    """Which build of the decoding shaders runs here: "f16" (packed fp16 decode and products, integer dot
    product, subgroup shuffles), "idot" (fp32 decode with the integer dot product) or "" (portable).
    VKMOE_DECODE=fp32 forces the fp32 decode (for comparisons)."""
    choice = knobs.get("VKMOE_DECODE")
    if not uses_idot(device):
        return ""
    if (choice != "fp32" and device.features.get("shaderFloat16") and device.subgroup_size >= 8
            and device.quirks.get("subgroups_linear")):  # the f16 build shuffles the wrap word between lanes
        return "f16"
    return "idot"


def hadamard_subgroup_unfit(device):
    """Why the subgroup Hadamard transform (hadamard128.glsl: a subgroup owns a 128-element row) cannot run on
    `device`, or None when it can: the subgroup size must be a power of two in [HAD_SUBGROUP_MIN, HAD_SUBGROUP_MAX]
    that the pipeline is sure to get, in full subgroups (the transform shuffles between all of a row's lanes)."""
    size = device.subgroup_size
    if not HAD_SUBGROUP_MIN <= size <= HAD_SUBGROUP_MAX or size & (size - 1):
        return f"its subgroup size {size} is not a power of two in {HAD_SUBGROUP_MIN}..{HAD_SUBGROUP_MAX}"
    if not device.features.get("computeFullSubgroups"):
        return "it cannot promise full subgroups (no computeFullSubgroups)"
    if device.min_subgroup_size != device.max_subgroup_size and not device.can_require_subgroup_size:
        return "its subgroup size varies and a compute pipeline cannot require one"
    return None


def hadamard_subgroup(device):
    """The subgroup size the 128-point Hadamard transforms run on (specialization constant SPEC_HAD_SUBGROUP),
    0 for the shared-memory transform: VKMOE_HADAMARD=shared, or auto where the subgroup one cannot run or the
    device is a CPU. Both give the same bits.

    Why not on a CPU (lavapipe): it runs subgroup shuffles lane by lane, and compiling them is what its cold
    compiles spend most on: Mesa 25's first call of a golden layer took 40 s of CPU (split) and 70 s (persistent)
    with the subgroup transform, 12 s and 41 s with the shared one. The subgroup transform exists for GPUs (no
    barrier per butterfly stage); on lavapipe VKMOE_HADAMARD=subgroup still runs it (tests/test_hadamard.py)."""
    choice = knobs.get("VKMOE_HADAMARD")
    if choice == "shared" or (choice == "auto" and getattr(device, "device_type", None) == "cpu"):
        return 0
    why = hadamard_subgroup_unfit(device)
    if why is not None and choice == "subgroup":
        raise VkmoeError(f"VKMOE_HADAMARD=subgroup: {device.name} cannot run the subgroup transform: {why}")
    return 0 if why is not None else device.subgroup_size


@functools.lru_cache(maxsize=None)
def _declared_spec(name):
    return frozenset(spirv.reflect(load_spirv(name)).spec_constants)


def coop_linear_name(device, rows):
    """The build of exl3_linear_coop.comp for `device` and a tile of `rows` rows (ops.plan.coop_rows)."""
    return "exl3_linear_coop" + ("_idot" if uses_idot(device) else "") + ("_wide" if rows == COOP_ROWS_WIDE else "")


def coop_moe_build(stage, rows, flavor=None, b_regs=False):
    """The name of a build of moe_{stage}_coop.comp ("gate_up" or "down"): flavor None (portable), "idot" or
    "emulate" (no matrix units), chunks of `rows` rows (COOP_MOE_ROWS, or COOP_MOE_ROWS_WIDE: the _wide build),
    b_regs: the B-register k-loop (the _breg builds: exl3_gemm_coop.glsl, COOP_BREG)."""
    wide = "wide" if rows == COOP_MOE_ROWS_WIDE else None
    return "_".join(filter(None, (f"moe_{stage}_coop", flavor, wide, "breg" if b_regs else None)))


def coop_b_in_registers(device, flavor=None):
    """Whether the cooperative-matrix MoE stages decode their weights straight into B fragments (the _breg builds;
    VKMOE_COOPMAT_B_REGS). auto: where the device's B fragments hold their elements in the order those builds fill
    them (vkmoe.vk.quirks.cooperative_matrix_b_order, measured by a probe; 9-22 % faster on the H100,
    docs/DESIGN.md), never for the emulate builds; on: also the emulate builds (their own order), and an error on a
    device of another order."""
    choice = knobs.get("VKMOE_COOPMAT_B_REGS")
    if choice == "off":
        return False
    if flavor == "emulate":
        return choice == "on"
    order = cooperative_matrix_b_order(device)
    if choice == "on" and order is not True:
        raise VkmoeError(f"VKMOE_COOPMAT_B_REGS=on: {device.name}'s cooperative-matrix B fragments do not hold their "
                         f"elements in the order the B-register builds fill them (coopmat_b_order_probe: "
                         f"{order}); unset it or set it to auto or off")
    return order is True


def coop_moe_name(device, stage, rows=COOP_MOE_ROWS, flavor=None):
    """The build of moe_{stage}_coop.comp for `device` and chunks of `rows` rows (MoePlan.rows); flavor "emulate"
    names the build without matrix units (the tests, tools/check_coopmat --emulate), else the device's (idot where
    it has it); the _breg build where coop_b_in_registers says so."""
    return coop_moe_build(stage, rows, flavor or ("idot" if uses_idot(device) else None),
                          coop_b_in_registers(device, flavor))


def pipeline(device, shader, push, spec=None, decode=False, binding_count=None, build=""):
    """The cached pipeline `shader` with specialization `spec`; `decode` shaders get the idot build when the
    device supports it; `build` names a further build of it (e.g. "clock": NAME[_idot|_f16]_clock). Pipelines
    live until the device closes."""
    if getattr(device, "missing_subgroup_ops", None):
        raise VkmoeError(f"{device.name}: vkmoe's kernels need subgroup ballot, arithmetic and shuffle operations "
                         f"in compute shaders; this device lacks: {', '.join(device.missing_subgroup_ops)}")
    variant = decode_variant(device) if decode else ""
    suffix = f"_{build}" if build else ""
    if variant == "f16" and not os.path.exists(os.path.join(SPV_DIR, f"{shader}_f16{suffix}.spv")):
        variant = "idot"  # this shader has no packed-fp16 build (e.g. the fp32 dequantizer)
    name = shader + (f"_{variant}" if variant else "") + suffix
    if variant == "f16":
        # the exact fused fp16 fma for mul1 only where the driver was measured to fuse it
        spec = dict(spec or {})
        spec[SPEC_F16_FMA_FUSED] = f16_fma_fused(device)
    had = 0
    # A shader that runs the 128-point Hadamard transform gets hadamard_subgroup's choice.
    if SPEC_HAD_SUBGROUP in _declared_spec(name):
        spec = dict(spec or {})
        spec[SPEC_HAD_SUBGROUP] = had = hadamard_subgroup(device)
    key = (name, tuple(sorted((spec or {}).items())))
    with _lock:
        cache = _pipelines.setdefault(device, {})
        pipe = cache.get(key)
        if pipe is None or pipe.closed:
            # The subgroup transform needs its subgroups full and of the size it was specialized for.
            required = had if had and device.min_subgroup_size != device.max_subgroup_size else None
            pipe = cache[key] = Pipeline(device, name, push=push, spec=spec, binding_count=binding_count,
                                         allow_unused_spec=binding_count is not None, full_subgroups=bool(had),
                                         required_subgroup_size=required)
        return pipe


@functools.lru_cache(maxsize=None)
def binary_digest(name):
    """A short hash of the SPIR-V of pipeline `name`: measurements of a pipeline (its co-residency) are cached
    under it, so a rebuilt shader is measured again."""
    return hashlib.sha256(load_spirv(name)).hexdigest()[:12]
