"""Pipelines of the EXL3 shaders, cached per device, with the variant that suits the device chosen here
(the integer-dot-product build where the device has shaderIntegerDotProduct)."""
import functools
import hashlib
import os
import threading
import weakref

from .. import knobs
from ..exl3.decode import MUL1_C0, MUL1_C1
from ..layout import COOP_ROWS_WIDE, SPEC_F16_FMA_FUSED
from ..vk import Pipeline, PushConstants, VkmoeError
from ..vk.pipeline import SPV_DIR, load_spirv
from ..vk.quirks import measure_f16_fma_rounds_once

_lock = threading.Lock()
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
    fields = [("m", "<u4"), ("k", "<u4"), ("n", "<u4"), ("splits", "<u4"), ("kt_per_split", "<u4")]


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


def coop_linear_name(device, rows):
    """The build of exl3_linear_coop.comp for `device` and a tile of `rows` rows (ops.plan.coop_rows)."""
    return "exl3_linear_coop" + ("_idot" if uses_idot(device) else "") + ("_wide" if rows == COOP_ROWS_WIDE else "")


def coop_moe_name(device, stage):
    """The build of moe_{stage}_coop.comp ("gate_up" or "down") for `device`."""
    return f"moe_{stage}_coop" + ("_idot" if uses_idot(device) else "")


def pipeline(device, shader, push, spec=None, decode=False, binding_count=None):
    """The cached pipeline `shader` with specialization `spec`; `decode` shaders get the idot build when the
    device supports it. Pipelines live until the device closes."""
    if getattr(device, "missing_subgroup_ops", None):
        raise VkmoeError(f"{device.name}: vkmoe's kernels need subgroup ballot, arithmetic and shuffle operations "
                         f"in compute shaders; this device lacks: {', '.join(device.missing_subgroup_ops)}")
    variant = decode_variant(device) if decode else ""
    if variant == "f16" and not os.path.exists(os.path.join(SPV_DIR, f"{shader}_f16.spv")):
        variant = "idot"  # this shader has no packed-fp16 build (e.g. the fp32 dequantizer)
    name = shader + (f"_{variant}" if variant else "")
    if variant == "f16":
        # the exact fused fp16 fma for mul1 only where the driver was measured to fuse it
        spec = dict(spec or {})
        spec[SPEC_F16_FMA_FUSED] = f16_fma_fused(device)
    key = (name, tuple(sorted((spec or {}).items())))
    with _lock:
        cache = _pipelines.setdefault(device, {})
        pipe = cache.get(key)
        if pipe is None or pipe.handle is None:
            pipe = cache[key] = Pipeline(device, name, push=push, spec=spec, binding_count=binding_count,
                                         allow_unused_spec=binding_count is not None)
        return pipe


@functools.lru_cache(maxsize=None)
def binary_digest(name):
    """A short hash of the SPIR-V of pipeline `name`: measurements of a pipeline (its co-residency) are cached
    under it, so a rebuilt shader is measured again."""
    return hashlib.sha256(load_spirv(name)).hexdigest()[:12]
