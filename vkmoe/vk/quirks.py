"""Driver quirks found by measurement, cached per (driver, device) in the vkmoe cache directory."""

import os
import warnings

import numpy as np

from .. import forksafe
from .cachefile import cache_dir, read_json, warn, write_json  # noqa: F401 - cache_dir: the caches' home

_lock = forksafe.Lock()
PROBE_ITERATIONS = 200_000  # well past lavapipe 22.3's 65,535 cap, cheap everywhere
FILENAME = "quirks.json"
_measured = {}  # device identity -> quirks measured by this process (what counts when the file cannot be written)


def _run_probe_shader(device, shader, words, groups, push=None):
    """Run a one-buffer probe shader over `words` (uint32, uploaded first) and return the buffer afterwards."""
    from .commands import CommandRecorder
    from .pipeline import Pipeline

    pipe = Pipeline(device, shader, push=type(push) if push is not None else None)
    buf = device.memory.allocate(4 * len(words))
    try:
        buf.upload(np.asarray(words, dtype=np.uint32))
        with CommandRecorder(device) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(buf), groups, push)
            rec.end()
            rec.submit(wait=True)  # a fresh recording: the compile bound (a lazy compile at the first dispatch)
        return buf.download(np.uint32)
    finally:
        buf.close()
        pipe.close()


def measure_loop_iteration_cap(device):
    """Run one invocation through a loop of PROBE_ITERATIONS; return the iteration count where the driver
    stopped it, or None when the loop ran to the end."""
    from .pipeline import PushConstants

    class LoopProbePush(PushConstants):
        fields = [("iterations", "<u4")]

    init = np.full(1026, 0xFFFFFFFF, dtype=np.uint32)  # 1024 words the exit test reads, then the result
    init[1024:] = 0
    ran = int(_run_probe_shader(device, "loop_probe", init, 1, LoopProbePush(iterations=PROBE_ITERATIONS))[1024])
    return None if ran >= PROBE_ITERATIONS else ran


def measure_f16_fma_rounds_once(device, first, count, c1, c0):
    """True when the driver's fp16 fma(a, c1, c0) equals the exact a * c1 + c0 rounded once to fp16 for the
    `count` consecutive fp16 values a from bit pattern `first` (c1, c0: fp16 values the caller picks); None when
    the device has no fp16 arithmetic."""
    from .pipeline import PushConstants

    if not device.features.get("shaderFloat16"):
        return None

    class FmaProbePush(PushConstants):
        fields = [("first", "<u4"), ("count", "<u4"), ("c1_c0", "<u4")]

    c1_bits, c0_bits = (int(np.float16(c).view(np.uint16)) for c in (c1, c0))
    push = FmaProbePush(first=first, count=count, c1_c0=c1_bits | c0_bits << 16)
    got = _run_probe_shader(device, "f16_fma_probe", np.zeros(count, np.uint32), (count + 63) // 64, push)
    a = np.arange(first, first + count, dtype=np.uint16).view(np.float16).astype(np.float64)
    exact = a * np.float64(np.float16(c1)) + np.float64(np.float16(c0))  # exact in float64: 11-bit operands
    return bool(np.array_equal(got.astype(np.uint16), exact.astype(np.float16).view(np.uint16)))


def cooperative_matrix_error(device, seed=0):
    """Run coopmat_probe (C = A · B through cooperative matrices) on random fp16 A, B; return max |C - A·B| /
    max |A·B| (fp32 accumulation: about 1e-7 when right). For devices with VK_KHR_cooperative_matrix only."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 32)).astype(np.float16)
    b = rng.standard_normal((32, 16)).astype(np.float16)
    words = np.concatenate([a.reshape(-1).view(np.uint32), b.reshape(-1).view(np.uint32), np.full(256, 0x7FC00000, np.uint32)])
    got = _run_probe_shader(device, "coopmat_probe", words, 1)[512:].view(np.float32).reshape(16, 16)
    want = a.astype(np.float64) @ b.astype(np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def b_fragment_order_expected():
    """[256] the element (k * 16 + n) that invocation L = 4g + t of a subgroup holds as element i of a 16x16 fp16 B
    fragment, at index 8 L + i, in the order the B-register build decodes them (exl3_gemm_coop.glsl, COOP_BREG):
    EXL3 tile positions 8 L .. 8 L + 7, k-rows 2t, 2t+1, 2t+8, 2t+9 of column g, then of column g + 8."""
    lane, i = np.divmod(np.arange(256), 8)
    g, t = lane // 4, lane % 4
    k = 2 * t + (i & 1) + 8 * ((i >> 1) & 1)
    n = g + 8 * (i >> 2)
    return k * 16 + n


def b_fragment_order_matches(words):
    """True when a coopmat_b_order_probe result (257 words) is the B-register build's order."""
    words = np.asarray(words, dtype=np.uint32)
    return bool(words[256] == 8 and np.array_equal(words[:256], b_fragment_order_expected()))


def measure_cooperative_matrix_b_order(device):
    """True when this device's 16x16 fp16 B fragments hold their elements in the order the B-register build fills
    them (b_fragment_order_expected), False when not; None without cooperative matrices (or without the probe's
    SPIR-V, which needs glslang 13+ to build)."""
    from .pipeline import SPV_DIR

    if not device.features.get("cooperativeMatrix") or not os.path.exists(
            os.path.join(SPV_DIR, "coopmat_b_order_probe.spv")):
        return None
    return b_fragment_order_matches(_run_probe_shader(device, "coopmat_b_order_probe",
                                                      np.full(257, 0xFFFFFFFF, np.uint32), 1))


def measure_subgroups_linear(device):
    """True when a 256-invocation workgroup's subgroups are laid out linearly over its invocations."""
    return bool(_run_probe_shader(device, "subgroup_layout_probe", np.zeros(256, np.uint32), 1).all())


MEASUREMENTS = {"loop_iteration_cap": measure_loop_iteration_cap, "subgroups_linear": measure_subgroups_linear}
_b_orders = {}  # device identity -> measure_cooperative_matrix_b_order's answer in this process


def cooperative_matrix_b_order(device):
    """measure_cooperative_matrix_b_order, once per device and process, on first use (not at device open: only a
    cooperative-matrix MoE plan asks). A probe that fails to run counts as False (the shared-memory builds stay),
    with a warning, and the device stays usable."""
    from .errors import VkmoeError

    with _lock:
        if device.identity not in _b_orders:
            try:
                _b_orders[device.identity] = measure_cooperative_matrix_b_order(device)
            except VkmoeError as e:
                warnings.warn(f"{device.name}: the cooperative-matrix B order probe failed ({e}); the B-register "
                              "builds stay off", RuntimeWarning, stacklevel=2)
                _b_orders[device.identity] = False
        return _b_orders[device.identity]


def _bad_value(name, value):
    """Why a cached quirk value cannot be used (None when it can)."""
    if name == "loop_iteration_cap":
        ok = value is None or (type(value) is int and value > 0)
    else:
        ok = value is None or type(value) is bool
    return None if ok else f"{name}={value!r}"


def _cached_entry(key):
    """The cached quirks of `key` when complete and well-formed; else None (with a warning when malformed)."""
    entry = read_json(FILENAME).get(key)
    if entry is None:
        return None
    if not isinstance(entry, dict):
        warn(f"ignoring the cached quirks of {key}: expected an object, found {type(entry).__name__}")
        return None
    if not set(MEASUREMENTS) <= set(entry):
        return None  # written before a quirk existed: measured again
    bad = [why for why in (_bad_value(name, entry[name]) for name in MEASUREMENTS) if why]
    if bad:
        warn(f"ignoring the cached quirks of {key}: invalid {', '.join(bad)}; measuring again")
        return None
    return {name: entry[name] for name in MEASUREMENTS}


def detect_quirks(device, refresh=False):
    key = device.identity
    if not refresh:
        with _lock:
            quirks = _measured.get(key) or _cached_entry(key)
        if quirks is not None:
            return dict(quirks)
    quirks = {name: measure(device) for name, measure in MEASUREMENTS.items()}
    with _lock:
        _measured[key] = quirks
        entries = read_json(FILENAME)
        entries[key] = quirks
        write_json(FILENAME, entries)
    return dict(quirks)
