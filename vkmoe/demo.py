"""`vkmoe demo`: one random Qwen3-30B-A3B-shaped EXL3 MoE layer on the Vulkan device, checked against the CPU
tier; then generated Qwen3-MoE and DeepSeek-V4-shaped checkpoints through SparseMoeBlock.

Shape: hidden 2048, intermediate 768, top-8, 4-bit mul1 (as Qwen3-30B-A3B at 4 bpw), but only a few experts
(16 by default, the model has 128) so that it stays quick on lavapipe. The layer and routing come from
vkmoe.exl3.synthetic. Progress goes to the `vkmoe.demo` logger (the `vkmoe` command shows it); the report goes
to `out`.
"""
import logging
import sys
import time

import numpy as np

HIDDEN, INTERMEDIATE, TOP_K, BITS, CODEBOOK = 2048, 768, 8, 4, "mul1"
# Relative RMS error vs the CPU tier: the two accumulate in different orders in fp32 over fp16 inputs; the
# test suite holds every op to the same bound against the float64 reference.
TOLERANCE = 3e-3

log = logging.getLogger(__name__)


def _rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def _dispatch_note(run_info):
    """Why the forward ran as it did: the decision (`reason`), and a fallback only when it is something else
    (a persistent launch that aborted and re-ran split)."""
    reason, fallback = run_info.get("reason"), run_info.get("fallback_reason")
    if fallback and fallback != reason:
        return f"{reason}; fallback: {fallback}" if reason else f"fallback: {fallback}"
    return reason


def _registry_choice():
    try:
        from . import registry

        backend = registry.select_backend(ops=("exl3_moe_mlp",))
        ok, reason = registry.vulkan_status()
        return f"{backend} ({reason})" if ok else f"{backend} (vulkan: {reason})"
    except Exception as exc:  # the demo reports, it does not depend on the registry
        return f"unknown ({type(exc).__name__}: {exc})"


def run(device=None, experts=16, tokens=4, seed=0, out=None):
    """Build, run, compare, print the report to `out` (default sys.stdout). Returns True on PASS."""
    out = sys.stdout if out is None else out
    import vkmoe
    from . import cpu
    from .exl3.synthetic import random_moe_layer, random_routing

    if not TOP_K <= experts:
        raise ValueError(f"--experts must be >= top_k ({TOP_K}), got {experts}")
    if tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    log.info("building %d random experts: hidden %d, intermediate %d, %d-bit %s ...", experts, HIDDEN,
             INTERMEDIATE, BITS, CODEBOOK)
    gate, up, down = random_moe_layer(HIDDEN, INTERMEDIATE, experts, bits=BITS, codebook=CODEBOOK, rng=rng)
    ids, w = random_routing(tokens, experts, TOP_K, seed=seed)
    x = rng.standard_normal((tokens, HIDDEN)).astype(np.float16)
    nbytes = sum(t.nbytes for lst in (gate, up, down) for t in lst)

    log.info("opening the Vulkan device ...")
    with vkmoe.Device(device) as dev:
        info = dev.info()
        log.info(f"uploading {nbytes / 2**20:.1f} MiB of weights to {info['name']} ...")
        with vkmoe.Exl3MoeMlp(dev, gate, up, down, activation="silu") as moe:
            log.info("first run (compiles the pipelines) ...")
            t1 = time.perf_counter()
            moe(x, ids, w)
            first_s = time.perf_counter() - t1
            log.info("second run (timed) ...")
            t1 = time.perf_counter()
            y = moe(x, ids, w)
            wall_ms = (time.perf_counter() - t1) * 1e3
            run_info = dict(moe.last_run or {})
            requested = moe.dispatch
    log.info("CPU tier (vkmoe.cpu.moe_forward) ...")
    t1 = time.perf_counter()
    y_cpu = cpu.moe_forward(x, ids, w, gate, up, down, activation="silu")
    cpu_ms = (time.perf_counter() - t1) * 1e3

    finite = bool(np.isfinite(y).all())
    err = _rel_rms(y, y_cpu) if finite else float("nan")
    ok = finite and err < TOLERANCE
    mode = run_info.get("mode", "?")
    why = _dispatch_note(run_info)
    gpu_ms = run_info.get("gpu_ms")

    def p(line=""):
        print(line, file=out)

    p(f"vkmoe demo: Qwen3-30B-A3B-shaped EXL3 MoE layer (hidden {HIDDEN}, intermediate {INTERMEDIATE}, "
      f"{experts} experts, top-{TOP_K}, {BITS}-bit {CODEBOOK}, silu), {tokens} tokens, seed {seed}")
    p(f"  device:        {info['name']} - {info.get('driver_info') or info.get('driver')} "
      f"(Vulkan {info['api']})")
    p(f"  registry:      would pick backend {_registry_choice()}")
    p(f"  dispatch:      requested {requested}, ran {mode}"
      + (f" ({why})" if why else ""))
    p(f"  GPU time:      {gpu_ms:.3f} ms (second run; timestamps)" if gpu_ms is not None else "  GPU time:      n/a")
    p(f"  wall time:     {wall_ms:.1f} ms (second run); first run incl. compile {first_s:.2f} s; "
      f"CPU tier {cpu_ms:.1f} ms")
    p(f"  output:        {y.shape} float32, rms {float(np.sqrt(np.mean(y.astype(np.float64) ** 2))):.4f}"
      + ("" if finite else ", NOT FINITE"))
    p(f"  vs CPU tier:   relative RMS error {err:.2e} (tolerance {TOLERANCE:.0e})")
    block_ok = run_block(device, experts, tokens, seed, p)
    block_ok = run_deepseek_v4_blocks(device, tokens, seed, p) and block_ok
    p(f"  total:         {time.perf_counter() - t0:.1f} s")
    ok = ok and block_ok
    p("PASS" if ok else "FAIL")
    return ok


def run_block(device, experts, tokens, seed, p):
    """The production path end to end: a generated Qwen3-MoE checkpoint (config.json + exllamav3-named
    safetensors) loaded as vkmoe.models.SparseMoeBlock (router + routed experts), hidden states in, block output
    out, on the backend the registry picks for the device, checked against the same block on the CPU tier."""
    import tempfile

    import vkmoe
    from .models import SparseMoeBlock
    from .models.checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory(prefix="vkmoe-demo-") as tmp:
        log.info(f"writing a Qwen3-MoE checkpoint ({experts} experts, 1 layer) to {tmp} ...")
        write_checkpoint(tmp, arch="qwen3_moe", hidden=HIDDEN, intermediate=INTERMEDIATE, experts=experts,
                         top_k=TOP_K, layers=1, bits=BITS, codebook=CODEBOOK, seed=seed + 1, progress=False)
        hidden = np.random.default_rng(seed + 2).standard_normal((tokens, HIDDEN)).astype(np.float16)
        with vkmoe.Device(device) as dev:
            log.info("SparseMoeBlock on the device ...")
            block = SparseMoeBlock.from_checkpoint(tmp, 0, device=dev)
            block(hidden)  # compiles
            t1 = time.perf_counter()
            y = block(hidden)
            wall_ms = (time.perf_counter() - t1) * 1e3
            run_info = dict(block.last_run or {})
            backend = block.backend
            block.close()
        log.info("SparseMoeBlock on the CPU tier ...")
        y_cpu = SparseMoeBlock.from_checkpoint(tmp, 0, backend="cpu")(hidden)
    finite = bool(np.isfinite(y).all())
    err = _rel_rms(y, y_cpu) if finite else float("nan")
    ok = finite and err < TOLERANCE
    gpu = run_info.get("gpu_ms")
    p(f"  block:         Qwen3-MoE checkpoint -> SparseMoeBlock (router + {experts} experts), {tokens} tokens")
    p(f"  block backend: {backend}, dispatch {run_info.get('mode', '-')}"
      + (f" ({_dispatch_note(run_info)})" if _dispatch_note(run_info) else ""))
    p(f"  block time:    {wall_ms:.1f} ms wall" + (f", block {gpu:.3f} ms GPU" if gpu is not None else ""))
    p(f"  block vs CPU:  relative RMS error {err:.2e} (tolerance {TOLERANCE:.0e})" + ("" if finite else ", NOT FINITE"))
    return ok


# DeepSeek-V4's MoE block shape, scaled down for lavapipe: sqrt(softplus) routing with a selection bias,
# swiglu_limit on routed and shared experts, one shared expert; layer 0 is a hash layer (experts by token id).
DSV4 = dict(arch="deepseek_v4", hidden=1024, intermediate=256, experts=16, top_k=6, layers=2, hash_layers=1,
            act_limit=10.0, shared_experts=1, routed_scaling_factor=1.5, vocab_size=1000)


def run_deepseek_v4_blocks(device, tokens, seed, p):
    """A generated DeepSeek-V4-shaped checkpoint: its hash layer (called with token ids) and its sqrtsp layer
    through SparseMoeBlock on the device, each checked against the same block on the CPU tier."""
    import tempfile

    import vkmoe
    from .models import SparseMoeBlock
    from .models.checkpoint import write_checkpoint

    rng = np.random.default_rng(seed + 3)
    hidden = rng.standard_normal((tokens, DSV4["hidden"])).astype(np.float16)
    input_ids = rng.integers(0, DSV4["vocab_size"], tokens)
    ok = True
    with tempfile.TemporaryDirectory(prefix="vkmoe-demo-dsv4-") as tmp:
        log.info(f"writing a DeepSeek-V4-shaped checkpoint (hash layer + sqrtsp layer) to {tmp} ...")
        write_checkpoint(tmp, bits=BITS, codebook=CODEBOOK, seed=seed + 4, progress=False, **DSV4)
        with vkmoe.Device(device) as dev:
            for layer in (0, 1):
                log.info(f"DeepSeek-V4 layer {layer} on the device and on the CPU tier ...")
                block = SparseMoeBlock.from_checkpoint(tmp, layer, device=dev)
                t1 = time.perf_counter()
                y = block(hidden, input_ids=input_ids)
                wall_ms = (time.perf_counter() - t1) * 1e3
                block.close()
                y_cpu = SparseMoeBlock.from_checkpoint(tmp, layer, backend="cpu")(hidden, input_ids=input_ids)
                finite = bool(np.isfinite(y).all())
                err = _rel_rms(y, y_cpu) if finite else float("nan")
                ok = ok and finite and err < TOLERANCE
                p(f"  dsv4 layer {layer}:  {block.router} router, {DSV4['experts']} experts top-{DSV4['top_k']} "
                  f"+ shared, swiglu_limit {DSV4['act_limit']:g}, backend {block.backend}, {wall_ms:.1f} ms "
                  f"(first call), vs CPU {err:.2e}" + ("" if finite else ", NOT FINITE"))
    return ok
