"""Shared access to the golden test vectors (tests/data/golden/*.npz; tests/data/golden/README.md explains them).

A missing golden directory is an error, not a skip: silently skipping would hide that nothing was checked.
"""
from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import numpy as np

import vkmoe
from vkmoe.exl3 import Exl3Tensor

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN_DIR = os.environ.get("VKMOE_GOLDEN_DIR") or os.path.join(_REPO, "tests", "data", "golden")
from vkmoe.layout import ACTIVATIONS

# The goldens store exllamav3's MOE_ACT_* ids, which vkmoe's ACT_* ids follow.
ACTIVATION_NAMES = {value: name for name, value in ACTIVATIONS.items()}


def golden_files() -> list:
    """Sorted paths of every golden .npz; raises if there are none."""
    files = sorted(glob.glob(os.path.join(GOLDEN_DIR, "*.npz")))
    if not files:
        raise FileNotFoundError(
            f"no golden vectors (*.npz) in {GOLDEN_DIR!r}; they ship in tests/data/golden/ (VKMOE_GOLDEN_DIR "
            "overrides the directory)")
    return files


def _experts(z, proj: str, codebook: str):
    key = f"{proj}_trellis"
    if key not in z.files:
        return None
    tr, suh, svh = z[key], z[f"{proj}_suh"], z[f"{proj}_svh"]
    return [Exl3Tensor(tr[e], suh[e], svh[e], codebook=codebook) for e in range(tr.shape[0])]


def load_layer(path: str) -> SimpleNamespace:
    """One golden layer: experts as Exl3Tensor lists plus every call's inputs and reference outputs.

    For c_gelu (activation 1) `ref_out` is the erf GELU; the tanh form (what "gelu" means) is
    `ref_out_gelu_tanh`. Each call dict: suffix, x, selected, weights, ref_out, ref_out_gelu_tanh (or None),
    exl3_out (or None).
    """
    z = np.load(path)
    codebook = str(z["codebook"])
    calls = []
    suffixes = [""] + [str(s) for s in z["extra_calls"]]
    for sfx in suffixes:
        def opt(name):
            return z[name + sfx] if name + sfx in z.files else None

        calls.append({
            "suffix": sfx,
            "x": z["x" + sfx],
            "selected": z["selected" + sfx],
            "weights": z["weights" + sfx],
            "ref_out": z["ref_out" + sfx],
            "ref_out_gelu_tanh": opt("ref_out_gelu_tanh"),
            "exl3_out": opt("exl3_out"),
        })
    return SimpleNamespace(
        name=os.path.splitext(os.path.basename(path))[0],
        path=path,
        gate=_experts(z, "gate", codebook),
        up=_experts(z, "up", codebook),
        down=_experts(z, "down", codebook),
        activation=ACTIVATION_NAMES[int(z["activation"])],
        act_limit=float(z["act_limit"]),
        codebook=codebook,
        hidden_size=int(z["hidden_size"]),
        intermediate_size=int(z["intermediate_size"]),
        num_experts=int(z["num_experts"]),
        top_k=int(z["top_k"]),
        calls=calls,
        npz=z,
    )


def same_bits(a, b) -> bool:
    """Whether two fp32 arrays hold the same bits (NaNs included): the bit-for-bit comparisons of two paths."""
    bits = [np.ascontiguousarray(x).view(np.uint32) for x in (a, b)]
    return np.array_equal(*bits)


def golden_moe(device, layer: SimpleNamespace, **options):
    """An Exl3MoeMlp of a golden layer with its activation and act_limit (options: further constructor arguments)."""
    import vkmoe

    return vkmoe.Exl3MoeMlp(device, layer.gate, layer.up, layer.down, activation=layer.activation,
                            act_limit=layer.act_limit, **options)


def rel_rms(a, b) -> float:
    """rms(a - b) / rms(b), in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def reference_targets(layer: SimpleNamespace, call: dict):
    """[(activation name to run, expected output)] for a call: 'gelu' -> tanh ref, 'gelu_erf' -> erf ref."""
    if layer.activation == "gelu" and call["ref_out_gelu_tanh"] is not None:
        return [("gelu", call["ref_out_gelu_tanh"]), ("gelu_erf", call["ref_out"])]
    return [(layer.activation, call["ref_out"])]


def moe_call_args(layer: SimpleNamespace, **changes) -> dict:
    """Keyword arguments of a moe_forward (reference or CPU tier) for the layer's first call, silu, with
    `changes` applied: what the argument-error tests start from."""
    c = layer.calls[0]
    args = dict(hidden=c["x"], expert_ids=c["selected"], expert_weights=c["weights"], gate=layer.gate, up=layer.up,
                down=layer.down, activation="silu")
    args.update(changes)
    return args


def _poison(buf) -> None:
    """All-ones bits into a device buffer: NaN in fp32 and fp16, -1 as an int32 id."""
    buf.upload(np.full(buf.size // 4, 0xFFFFFFFF, np.uint32))


def poison_scratch(moe) -> None:
    """Fill the float scratch of every batch shape `moe` (an Exl3MoeMlp) has planned (states, inter, partials,
    rows) with all-ones bits, NaN in fp32 and fp16, before a call that is checked. A stage that reads scratch
    before this call wrote it then gives NaN rather than an earlier run's values: after a run of the same inputs
    those are the right ones, which hid such a read on Mesa 22.3 (moe_signal, DESIGN.md). The routing table and
    the sync words are left as they are (the kernels' indices and counters)."""
    for scratch in moe._scratch.values():
        for buf in (scratch.states, scratch.inter, scratch.partial, scratch.rows):
            _poison(buf)


def run_golden_call(moe, call, mode):
    """moe's output for a golden call (load_layer) in dispatch `mode`, checking that mode ran. A persistent run
    poisons the scratch first: after a split run of the same inputs it would hold the right values already."""
    if mode == "persistent":
        poison_scratch(moe)
    out = moe(call["x"], call["selected"], call["weights"], dispatch=mode)
    assert moe.last_run["mode"] == mode, moe.last_run
    return out


def record_run(device, moe, x, ids, w, mode: str = "split"):
    """moe.record() of one forward in `mode` into a caller-owned command buffer with caller-owned buffers (ids
    outside [0, E) are skipped there); the output poisoned with NaN first."""
    m, top_k = ids.shape
    mem = device.memory
    bufs = [mem.allocate(x.nbytes), mem.allocate(ids.size * 4), mem.allocate(w.size * 4), mem.allocate(m * moe.H * 4)]
    try:
        for buf, a in zip(bufs, (x.astype(np.float16), ids.astype(np.int32), w.astype(np.float32),
                                 np.full((m, moe.H), np.nan, np.float32))):
            buf.upload(np.ascontiguousarray(a))
        with vkmoe.CommandRecorder(device) as cmd:
            cmd.begin()
            moe.record(cmd, *bufs, m, top_k, mode=mode)
            cmd.end()
            cmd.submit(wait=True)
        return bufs[3].download(np.float32, (m, moe.H))
    finally:
        for b in bufs:
            b.close()


def poison_block_scratch(block) -> None:
    """Poison (all-ones bits: NaN, or id -1) every device buffer a SparseMoeBlock's device block writes before it
    reads: the block's own scratch per batch size (router logits, ids, weights, the shared expert's
    intermediates...), its linears' (input Hadamards, k-split partials) and the routed experts' (poison_scratch).
    A recording checked against a call of the same inputs then cannot pass on values the call left there."""
    dblock = block.device_block
    for scratch in dblock._scratch.values():
        for buf in scratch.buffers:
            _poison(buf)
    linears = list((dblock.shared or {}).values()) + list((dblock.latent or {}).values())
    for linear in linears:
        for bufs in linear._scratch.values():
            for buf in bufs[:2]:  # (xh, partial); the counters self-reset and must stay 0
                _poison(buf)
    poison_scratch(dblock.moe)


def other_routing(call: dict, E: int, seed: int):
    """Routing of the same shape as call's with other experts (distinct per token): a first call on it leaves
    other numbers in every buffer of a layer before the call that is checked (poison)."""
    rng = np.random.default_rng(seed)
    m, top_k = call["selected"].shape
    return np.stack([rng.permutation(E)[:top_k] for _ in range(m)])


def calls_on_two_plans(device, layer: SimpleNamespace, settings, seed: int, first_call):
    """For A/B tests of two plans that must give the same bits: yields (call, a, b) for each call of golden
    `layer`, a and b two layers of it (made once, closed at the end), each of which first ran
    first_call(moe, setting, x, ids, weights) with its own of the two `settings` on the call's shape, with other
    routing (other_routing(seed)) and the input negated: that call fixes the layer's plan for the shape and
    leaves other numbers in every buffer (poison) before the checked call."""
    if not layer.calls:  # (a test looping over none would check nothing)
        raise ValueError("a golden layer without calls")
    with golden_moe(device, layer) as a, golden_moe(device, layer) as b:
        for call in layer.calls:
            other = other_routing(call, a.E, seed)
            for moe, setting in zip((a, b), settings):
                first_call(moe, setting, -call["x"], other, call["weights"])
            yield call, a, b


def ids_with_dead_slots(call: dict, E: int):
    """A golden call's routing with slots that pick no valid expert: token 0 none at all (ids -1 and E + 5), token
    1 one slot out of range (id E). Those slots are skipped; token 0's output row must be zero."""
    ids = call["selected"].astype(np.int64).copy()
    ids[0, :] = [-1, E + 5]
    ids[1, 0] = E
    return ids
