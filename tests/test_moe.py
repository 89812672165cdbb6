"""vkmoe.Exl3MoeMlp on the Vulkan device: golden vectors, edge cases, the exllamav3-style sorted inputs,
safetensors loading, caller-recorded command buffers, and argument validation.

Every test here runs one dispatch mode explicitly. The golden test is a function of the mode (MODES); the
other tests use SPLIT. Layers are built once per module (pipelines compile on first use of each
specialization, which is slow on lavapipe), so the tests reuse a few (shape, rows, activation, bits) combinations.
"""
import numpy as np
import pytest

import vkmoe
from vkmoe.exl3 import Exl3Tensor, reference, save_exl3_tensor
from goldens import golden_files, load_layer, record_run, rel_rms, reference_targets

MODES = ["split"]  # the persistent path will be added here
SPLIT = "split"
GOLDEN_TOL = 3e-3
EXL3_TOL = 3e-2

GOLDEN_FILES = golden_files()  # raises (not skips) when the golden vectors are missing
_LAYERS = {}


def _layer(path_or_name):
    path = next((p for p in GOLDEN_FILES if path_or_name in (p, _stem(p))), None)
    assert path is not None, f"no golden file {path_or_name!r}"
    if path not in _LAYERS:
        _LAYERS[path] = load_layer(path)
    return _LAYERS[path]


def _stem(path):
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _golden_cases():
    cases = []
    for path in GOLDEN_FILES:
        layer = _layer(path)
        for act, _ in reference_targets(layer, layer.calls[0]):
            cases.append(pytest.param(path, act, id=f"{layer.name}-{act}"))
    return cases


@pytest.fixture(scope="module")
def moe_cache(device):
    """(golden name, activation, mode) -> Exl3MoeMlp, built once per module."""
    cache = {}
    yield cache
    for moe in cache.values():
        moe.close()


def _moe_for(device, cache, name, activation, mode):
    key = (name, activation, mode)
    if key not in cache:
        L = _layer(name)
        cache[key] = vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=activation, act_limit=L.act_limit,
                                      dispatch=mode)
    return cache[key]


def _check_mode(moe, mode):
    run = moe.last_run
    assert run is not None
    if run["mode"] != mode:  # only a persistent request may end up split, and then it must say why; auto says
        # what it decided in `reason` (a fallback_reason only after an aborted launch)
        assert mode in ("persistent", "auto") and run["mode"] == "split", run
        assert run.get("fallback_reason") if mode == "persistent" else run["reason"].startswith("auto"), run


def _run(moe, x, ids, w, mode=SPLIT):
    y = moe(x, ids, w)
    assert y.dtype == np.float32 and y.shape == (x.shape[0], moe.H)
    assert np.isfinite(y).all(), "NaN/Inf in the output (the op poisons it with NaN: an element was not written)"
    _check_mode(moe, mode)
    return y


# ---------------------------------------------------------------------------------------------- goldens
def check_golden(device, cache, mode, path, activation):
    """Every call of one golden layer in one dispatch mode: 3e-3 vs ref_out (matching activation form), 3e-2
    vs exllamav3's CPU MoE where present, no NaN."""
    L = _layer(path)
    moe = _moe_for(device, cache, L.name, activation, mode)
    for call in L.calls:
        targets = dict(reference_targets(L, call))
        y = _run(moe, call["x"], call["selected"], call["weights"], mode)
        err = rel_rms(y, targets[activation])
        assert err < GOLDEN_TOL, f"{L.name}{call['suffix']} {activation} ({mode}): rel RMS {err:.2e} vs ref_out"
        if call["exl3_out"] is not None:
            err = rel_rms(y, call["exl3_out"])
            assert err < EXL3_TOL, f"{L.name}{call['suffix']} ({mode}): rel RMS {err:.2e} vs exl3_out"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path,activation", _golden_cases())
def test_golden(device, moe_cache, mode, path, activation):
    check_golden(device, moe_cache, mode, path, activation)


def test_golden_set_is_complete():
    names = {_stem(p) for p in GOLDEN_FILES}
    assert {"a_tiny_silu_k4", "c_gelu_k4", "d_relu2_gateless_k4", "e_swiglu_oai_lim7_k4"} <= names
    acts = {(c.values[0], c.values[1]) for c in _golden_cases()}
    c_gelu = next(p for p in GOLDEN_FILES if _stem(p) == "c_gelu_k4")
    assert (c_gelu, "gelu") in acts and (c_gelu, "gelu_erf") in acts


# ------------------------------------------------------------------------------------------ edge cases
TINY = "a_tiny_silu_k4"  # H 256, I 128, E 8, top_k 2, silu, mul1 K4


@pytest.fixture(scope="module")
def tiny(device, moe_cache):
    return _layer(TINY), _moe_for(device, moe_cache, TINY, "silu", SPLIT)


def _random_routing(rng, m, top_k, E):
    ids = np.stack([rng.permutation(E)[:top_k] for _ in range(m)]).astype(np.int64)
    w = rng.random((m, top_k)).astype(np.float32) + 0.1
    return ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float16)


def _ref(L, x, ids, w, activation="silu"):
    return reference.moe_forward(x, ids, w, L.gate, L.up, L.down, activation=activation, act_limit=L.act_limit)


def test_m0_returns_empty(tiny):
    L, moe = tiny
    y = moe(np.zeros((0, L.hidden_size), np.float16), np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float16))
    assert isinstance(y, np.ndarray) and y.shape == (0, L.hidden_size) and y.dtype == np.float32


def test_m1(tiny):
    L, moe = tiny
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, L.hidden_size)).astype(np.float16)
    ids, w = _random_routing(rng, 1, L.top_k, L.num_experts)
    y = _run(moe, x, ids, w)
    assert rel_rms(y, _ref(L, x, ids, w)) < GOLDEN_TOL


def test_one_expert_gets_every_token(tiny):
    """Every row routes to expert 0 (in varying slots); the other slot spreads over the rest."""
    L, moe = tiny
    rng = np.random.default_rng(12)
    m, E = 4, L.num_experts
    x = rng.standard_normal((m, L.hidden_size)).astype(np.float16)
    other = rng.permutation(np.arange(1, E))[:m]
    ids = np.stack([[0, other[t]] if t % 2 == 0 else [other[t], 0] for t in range(m)]).astype(np.int64)
    w = np.array([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875], [1.0, 0.0]], np.float16)
    y = _run(moe, x, ids, w)
    assert rel_rms(y, _ref(L, x, ids, w)) < GOLDEN_TOL
    # top_k 1, everything on expert 0
    ids1 = np.zeros((m, 1), np.int64)
    w1 = np.full((m, 1), 0.5, np.float16)
    y1 = _run(moe, x, ids1, w1)
    assert rel_rms(y1, _ref(L, x, ids1, w1)) < GOLDEN_TOL


def test_deterministic(tiny):
    L, moe = tiny
    call = L.calls[0]
    a = _run(moe, call["x"], call["selected"], call["weights"])
    b = _run(moe, call["x"], call["selected"], call["weights"])
    assert np.array_equal(a, b), f"two runs differ: max |a-b| = {np.abs(a - b).max()}"


def _sorted_inputs(selected, weights, E):
    """exllamav3's BlockSparseMLP routing prep (spec 8.1); ids outside [0, E) become the sentinel E."""
    T, top_k = selected.shape
    flat_e = selected.reshape(-1).astype(np.int64)
    flat_e = np.where((flat_e < 0) | (flat_e >= E), E, flat_e)
    flat_t = np.repeat(np.arange(T, dtype=np.int64), top_k)
    flat_w = weights.reshape(-1).astype(np.float16)
    order = np.argsort(flat_e, kind="stable")
    expert_count = np.bincount(flat_e, minlength=E + 1).astype(np.int64)
    assert expert_count.shape == (E + 1,)
    return expert_count, flat_t[order], flat_w[order]


def test_forward_sorted_matches_call(tiny):
    L, moe = tiny
    call = L.calls[0]
    expert_count, token_sorted, weight_sorted = _sorted_inputs(call["selected"], call["weights"], L.num_experts)
    assert expert_count[-1] == 0
    y = moe.forward_sorted(call["x"], expert_count, token_sorted, weight_sorted)
    assert np.isfinite(y).all()
    direct = _run(moe, call["x"], call["selected"], call["weights"])
    assert rel_rms(y, direct) < 1e-6


def test_forward_sorted_sentinel_entries_are_skipped(tiny):
    """Pairs mapped to the sentinel E (an expert-parallel shard's foreign experts) are counted in
    expert_count[E] and sorted last; they contribute nothing. Compared with __call__ on the pairs that remain."""
    L, moe = tiny
    rng = np.random.default_rng(13)
    m, E = 3, L.num_experts
    x = rng.standard_normal((m, L.hidden_size)).astype(np.float16)
    ids, w = _random_routing(rng, m, 2, E)
    sharded = ids.copy()
    sharded[0, 1] = E   # foreign expert: sentinel
    sharded[2, 0] = E + 3
    expert_count, token_sorted, weight_sorted = _sorted_inputs(sharded, w, E)
    assert expert_count[E] == 2
    y = moe.forward_sorted(x, expert_count, token_sorted, weight_sorted)
    assert np.isfinite(y).all()
    keep = (sharded >= 0) & (sharded < E)
    w_kept = np.where(keep, w, 0).astype(np.float16)
    direct = _run(moe, x, ids, w_kept)  # dropped slots keep their (valid, distinct) original id, weight 0
    assert rel_rms(y, direct) < 1e-6
    assert rel_rms(y, _ref(L, x, sharded, w)) < GOLDEN_TOL


def test_from_safetensors_round_trip(device, tiny, tmp_path):
    from safetensors.numpy import save_file

    L, moe = tiny
    prefix = "model.layers.0.mlp"
    tensors = {}
    for e in range(L.num_experts):
        for proj, lst in (("gate", L.gate), ("up", L.up), ("down", L.down)):
            save_exl3_tensor(tensors, f"{prefix}.experts.{e}.{proj}_proj", lst[e])
    path = tmp_path / "layer.safetensors"
    save_file(tensors, str(path))
    call = L.calls[0]
    direct = _run(moe, call["x"], call["selected"], call["weights"])
    with vkmoe.Exl3MoeMlp.from_safetensors(device, str(path), prefix, activation="silu", dispatch=SPLIT) as loaded:
        assert (loaded.E, loaded.H, loaded.I, loaded.codebook) == (L.num_experts, L.hidden_size,
                                                                    L.intermediate_size, "mul1")
        y = _run(loaded, call["x"], call["selected"], call["weights"])
    assert np.array_equal(y, direct)


def test_record_matches_call(device, tiny):
    L, moe = tiny
    call = L.calls[0]
    direct = _run(moe, call["x"], call["selected"], call["weights"])
    y = record_run(device, moe, call["x"], call["selected"], call["weights"])
    assert np.isfinite(y).all()
    assert np.array_equal(y, direct)


def test_record_skips_out_of_range_ids(device, tiny):
    """ids outside [0, E) are skipped on the device (exllamav3's sentinel); a token with no valid slot gets a
    zero row."""
    L, moe = tiny
    rng = np.random.default_rng(14)
    m, E = 3, L.num_experts
    x = rng.standard_normal((m, L.hidden_size)).astype(np.float16)
    ids, w = _random_routing(rng, m, 2, E)
    ids[0, 1] = E
    ids[1, 0] = -1
    ids[2, :] = [E + 5, -7]  # every slot out of range
    y = record_run(device, moe, x, ids, w)
    assert np.isfinite(y).all()
    assert np.array_equal(y[2], np.zeros(L.hidden_size, np.float32))
    ref = _ref(L, x, ids, w)
    assert rel_rms(y[:2], ref[:2]) < GOLDEN_TOL


# ----------------------------------------------------------------------------------------- bad inputs
def _tensor(rng, k, n, bits=4, codebook="mul1"):
    tr = rng.integers(0, 1 << 16, size=(k // 16, n // 16, 16 * bits), dtype=np.uint16)
    suh = (rng.choice([-1.0, 1.0], k) / (8 * np.sqrt(k))).astype(np.float16)
    svh = rng.choice([-1.0, 1.0], n).astype(np.float16)
    return Exl3Tensor(tr, suh, svh, codebook=codebook)


def test_bad_inputs_raise_and_device_survives(device, tiny):
    L, moe = tiny
    H, I, E = L.hidden_size, L.intermediate_size, L.num_experts
    call = L.calls[0]
    x, ids, w = call["x"], call["selected"], call["weights"]
    m = x.shape[0]
    before = _run(moe, x, ids, w)
    rng = np.random.default_rng(15)
    checked = 0

    def bad_call(exc, match, *args):
        nonlocal checked
        with pytest.raises(exc, match=match):
            moe(*args)
        checked += 1

    def bad_build(exc, match, *args, **kw):
        nonlocal checked
        with pytest.raises(exc, match=match):
            vkmoe.Exl3MoeMlp(device, *args, **kw)
        checked += 1

    # --- call arguments
    bad_call(TypeError, "hidden", x.astype(np.float32), ids, w)
    bad_call(ValueError, "hidden", np.zeros((m, H + 128), np.float16), ids, w)
    bad_call(ValueError, "hidden", x[0], ids, w)
    bad_call(TypeError, "expert_ids", x, ids.astype(np.float32), w)
    bad_call(ValueError, "expert_ids", x, ids[:-1], w[:-1])
    bad_call(ValueError, "expert_weights", x, ids, w[:, :1])
    bad_call(TypeError, "expert_weights", x, ids, (w * 10).astype(np.int32))
    for bad_id in (E, -1):
        ids_bad = ids.copy()
        ids_bad[0, 0] = bad_id
        bad_call(ValueError, r"expert_ids.*\[0, %d\)" % E, x, ids_bad, w)
    ids_dup = ids.copy()
    ids_dup[1, 1] = ids_dup[1, 0]
    bad_call(ValueError, "expert_ids row 1", x, ids_dup, w)
    for bad_w in (np.nan, np.inf):
        w_bad = w.copy()
        w_bad[0, 1] = bad_w
        bad_call(ValueError, "expert_weights.*(NaN|Inf)", x, ids, w_bad)
    ids_big = np.tile(np.arange(E + 1), (m, 1))
    bad_call(ValueError, "top_k", x, ids_big, np.ones((m, E + 1), np.float16))
    with pytest.raises(ValueError, match="VKMOE_DISPATCH|dispatch"):
        moe(x, ids, w, dispatch="fastest")
    checked += 1

    # --- construction arguments
    bad_build(ValueError, "activation", L.gate, L.up, L.down, activation="swish")
    bad_build(ValueError, "relu2.*gate=None", L.gate, L.up, L.down, activation="relu2")
    bad_build(ValueError, "gate", None, L.up, L.down, activation="silu")
    mcg_down = [Exl3Tensor(t.trellis, t.suh, t.svh, codebook="mcg") for t in L.down]
    bad_build(ValueError, "codebook", L.gate, L.up, mcg_down)
    up_mixed = list(L.up)
    up_mixed[1] = _tensor(rng, H, I, bits=3)
    bad_build(ValueError, r"up\[1\].*bits", L.gate, up_mixed, L.down)
    bad_build(ValueError, "down has", L.gate, L.up, L.down[:-1])
    gate_wrong_h = list(L.gate)
    gate_wrong_h[2] = _tensor(rng, H + 128, I)
    bad_build(ValueError, r"gate\[2\].*shape", gate_wrong_h, L.up, L.down)
    bad_build(ValueError, "act_limit", L.gate, L.up, L.down, act_limit=-1.0)
    bad_build(ValueError, "dispatch", L.gate, L.up, L.down, dispatch="sometimes")
    gate_junk = list(L.gate)
    gate_junk[1] = np.zeros((H, I), np.float16)
    bad_build(TypeError, r"gate\[1\].*Exl3Tensor", gate_junk, L.up, L.down)
    bad_build(TypeError, "up", L.gate, [np.zeros((H, I), np.float16)] * E, L.down)

    # --- H / I not a multiple of 128: Exl3Tensor itself refuses, naming the argument
    with pytest.raises(ValueError, match=r"trellis.*k.*multiple of 128"):
        _tensor(rng, 192, I)
    with pytest.raises(ValueError, match=r"trellis.*n.*multiple of 128"):
        _tensor(rng, H, 80)
    checked += 2

    assert checked >= 15
    # the device and the layer still work, with the same bits
    after = _run(moe, x, ids, w)
    assert np.array_equal(before, after)
    assert not device.take_validation_messages()
