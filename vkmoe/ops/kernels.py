"""Pipelines of the EXL3 shaders, cached per device, with the variant that suits the device chosen here
(the integer-dot-product build where the device has shaderIntegerDotProduct)."""
import threading

from ..vk import Pipeline, PushConstants

_lock = threading.Lock()
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}


class DequantPush(PushConstants):
    fields = [("k", "<u4"), ("n", "<u4")]


class HadInPush(PushConstants):
    fields = [("m", "<u4"), ("k", "<u4")]


class LinearPush(PushConstants):
    fields = [("m", "<u4"), ("k", "<u4"), ("n", "<u4"), ("splits", "<u4"), ("kt_per_split", "<u4")]


def uses_idot(device):
    return bool(device.features.get("shaderIntegerDotProduct"))


def pipeline(device, shader, push, spec=None, decode=False, binding_count=None):
    """The cached pipeline `shader` with specialization `spec`; `decode` shaders get the idot build when the
    device supports it. Pipelines live until the device closes."""
    name = shader + ("_idot" if decode and uses_idot(device) else "")
    key = (name, tuple(sorted((spec or {}).items())))
    with _lock:
        cache = device.__dict__.setdefault("_vkmoe_pipelines", {})
        pipe = cache.get(key)
        if pipe is None or pipe.handle is None:
            pipe = cache[key] = Pipeline(device, name, push=push, spec=spec, binding_count=binding_count,
                                         allow_unused_spec=binding_count is not None)
        return pipe
