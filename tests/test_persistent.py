"""The persistent single-dispatch path: bit-identical to split on every golden file, self-resetting scheduler
state, the safety net under forced oversubscription (a real deadlock on Mesa 25 without the spin bound), two
layers used from two threads, the dispatch toggles and the launch plan's decisions."""
import json
import os
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace

import numpy as np
import pytest

import vkmoe
from goldens import golden_files, load_layer, poison_scratch, rel_rms, same_bits
from vkmoe import layout
from vkmoe.exl3 import reference
from vkmoe.ops import kernels
from vkmoe.ops import plan as ops_plan
from vkmoe.sched import plan as sched_plan
from vkmoe.sched import residency
from subproc import python_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def layers(device):
    cache = {}

    def get(path, activation=None):
        key = (path, activation)
        if key not in cache:
            L = load_layer(path)
            cache[key] = (L, vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=activation or L.activation,
                                              act_limit=L.act_limit))
        return cache[key]

    yield get
    for _, moe in cache.values():
        moe.close()


@pytest.mark.parametrize("path", golden_files(), ids=lambda p: os.path.basename(p)[:-4])
def test_golden_persistent_bit_identical_to_split(layers, path):
    L, moe = layers(path)
    for call in L.calls:
        # persistent first, on poisoned scratch (a stage reading scratch before it is written would find split's
        # values after split)
        poison_scratch(moe)
        persistent = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
        run = moe.last_run
        split = moe(call["x"], call["selected"], call["weights"], dispatch="split")
        assert moe.last_run["mode"] == "split"
        assert run["mode"] == "persistent", run
        assert run["fallback_reason"] is None
        assert run["workgroups"] >= 1
        assert np.isfinite(persistent).all()
        assert same_bits(split, persistent), f"{os.path.basename(path)}{call['suffix']}"
        ref = call["ref_out_gelu_tanh"] if L.activation == "gelu" and call["ref_out_gelu_tanh"] is not None \
            else call["ref_out"]
        rel = np.sqrt(np.mean((persistent - ref) ** 2) / np.mean(ref ** 2))
        assert rel < 3e-3


@pytest.mark.parametrize("hadamard", ["shared", "subgroup"])
def test_persistent_matches_split_with_new_inputs_every_call(device, monkeypatch, hadamard):
    """Persistent first, then split, with new inputs on every call, routed (m = 40) and direct (m = 3). A stage
    that read scratch before another workgroup wrote it would pass the golden test above: there split ran first
    with the same inputs, so the scratch already held the right values. On Mesa 22.3 the subgroup Hadamard build
    of the routed persistent kernel failed this in about half of the calls: a chunk's completion was counted
    before every invocation's `inter` stores had landed (moe_signal, moe_stages.glsl)."""
    if hadamard == "subgroup" and kernels.hadamard_subgroup_unfit(device):
        pytest.skip(f"no subgroup transform here: {kernels.hadamard_subgroup_unfit(device)}")
    monkeypatch.setenv("VKMOE_HADAMARD", hadamard)
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "auto")
    monkeypatch.setenv("VKMOE_COOPMAT", "off")  # the cooperative-matrix stages (m = 40 on a GPU) are split's alone
    gate, up, down = vkmoe.random_moe_layer(hidden=256, intermediate=256, experts=8, bits=4, seed=3)
    with vkmoe.Exl3MoeMlp(device, gate, up, down) as moe:
        for m, calls, direct in ((40, 3, False), (3, 2, True)):
            for i in range(calls):
                rng = np.random.default_rng(1000 * m + i)
                x = rng.standard_normal((m, 256)).astype(np.float16)
                ids, w = vkmoe.random_routing(m=m, experts=8, top_k=4, seed=1000 * m + i)
                persistent = moe(x, ids, w, dispatch="persistent")
                run = moe.last_run
                assert run["mode"] == "persistent" and run["plan"]["direct"] is direct, run
                split = moe(x, ids, w, dispatch="split")
                assert np.isfinite(persistent).all()
                assert same_bits(persistent, split), (m, i)
            # the transform asked for ran
            spec = moe._persistent_pipeline(moe._scratch_for(m, 4).plan).spec
            assert spec[layout.SPEC_HAD_SUBGROUP] == kernels.hadamard_subgroup(device)


# (VKMOE_MOE_DIRECT, VKMOE_MOE_SPLITS, m, the plan's (kt_gu, kt_d)) of a layer with hidden 384 (24 k-tiles) and
# intermediate 256 (16): a slot of the GEMM core takes every 4th tile of its item's k-range, so these ranges give
# every slot 3 and 1 tiles (direct, and routed), 2 and a mix of 2 and 1 (routed, kt 6), a mix and 1 (routed). On
# Mesa 22.3 routed ranges are whole 4-tile steps too (ops.plan._slot_uniform): 6 becomes 8 there.
ODD_STEPS = [("on", "2,4", 3, (12, 4)), ("off", "2,4", 40, (12, 4)), ("off", "3,3", 40, (8, 6)),
             ("off", "4,4", 40, (6, 4))]


# Every case in the packed-fp16 build (what both lavapipes and the GPUs measured run); the routed ones (odd and mixed
# tiles per slot, one batch shape: one more persistent pipeline per build) in the fp32 builds, whose tiles load
# their wrap word instead of shuffling it. (No other test runs the persistent kernel in those builds.)
ODD_STEP_CASES = [("f16",) + case for case in ODD_STEPS] + [(build,) + case for build in ("idot", "")
                                                             for case in ODD_STEPS if case[0] == "off"]


@pytest.mark.parametrize("build,direct,splits,m,kts", ODD_STEP_CASES,
                         ids=lambda v: str(v) or "portable")
def test_persistent_k_loop_past_a_slots_last_tile(device, monkeypatch, build, direct, splits, m, kts):
    """The persistent kernel's k-loop steps two tiles at a time (GEMM_TILES_PER_STEP in moe_persistent.comp), the
    split dispatches' one: where a slot's tiles are odd in number, a step's second tile lies past the slot's range
    and must be decoded but not added. Persistent must give split's bits and the float64 reference's values, in
    every decode build (the fp16 one takes a tile's wrap word by subgroup shuffle, the others load it)."""
    if build and not kernels.uses_idot(device):
        pytest.skip("the device has no integer dot product")
    if build == "f16" and kernels.decode_variant(device) != "f16":
        pytest.skip("the device does not run the packed-fp16 build (or VKMOE_DECODE=fp32)")
    monkeypatch.setattr(kernels, "decode_variant", lambda dev: build)
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)
    monkeypatch.setenv("VKMOE_MOE_SPLITS", splits)
    monkeypatch.setenv("VKMOE_COOPMAT", "off")  # the cooperative-matrix stages are split's alone
    if device.quirks.get("loop_iteration_cap"):
        kts = tuple(ops_plan.direct_kt(kt) for kt in kts)
    gate, up, down = vkmoe.random_moe_layer(hidden=384, intermediate=256, experts=8, bits=4, seed=5)
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 384)).astype(np.float16)
    ids, w = vkmoe.random_routing(m=m, experts=8, top_k=4, seed=m)
    with vkmoe.Exl3MoeMlp(device, gate, up, down) as moe:
        moe(-x, np.roll(ids, 1, axis=0), w, dispatch="split")  # plans the shape, fills its scratch: then poisoned
        poison_scratch(moe)
        persistent = moe(x, ids, w, dispatch="persistent")
        run = moe.last_run
        assert run["mode"] == "persistent" and run["fallback_reason"] is None, run
        assert run["plan"]["direct"] is (direct == "on") and (run["plan"]["kt_gu"], run["plan"]["kt_d"]) == kts, run
        split = moe(x, ids, w, dispatch="split")
    assert np.isfinite(persistent).all()
    assert same_bits(persistent, split)
    assert rel_rms(persistent, reference.moe_forward(x, ids, w, gate, up, down)) < 3e-3


@pytest.mark.parametrize("direct", ["on", "off"])
def test_scheduler_state_resets_itself_over_100_launches(device, monkeypatch, direct):
    """Tickets, chunk progress and (routed) the routing flag, stage-1 count and phase count are reset by their
    last users, with no end-of-launch step: after 100 launches of either mode every sync word is 0 again."""
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)  # read when the layer plans a batch shape: a layer of its own
    L = load_layer(golden_files()[0])
    with vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation, act_limit=L.act_limit) as moe:
        call = L.calls[0]
        expected = moe(call["x"], call["selected"], call["weights"], dispatch="split")
        m, top_k = call["selected"].shape
        sync = moe._scratch_for(m, top_k).sync
        for _ in range(100):
            out = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
            assert moe.last_run["mode"] == "persistent"
        assert same_bits(out, expected)
        assert moe.last_run["plan"]["direct"] is (direct == "on")
        words = sync.download(np.uint32)
        # abort flag, ticket counter, routing flag, stage-1 count, every arrival counter, every chunk's progress
        # counter and user count are back to 0
        assert not words.any(), np.nonzero(words)[0][:24]


def test_routed_launches_wait_without_running_out_of_spins(device, monkeypatch):
    """Routed persistent launches of a golden layer, again and again: every one must finish persistent, with
    split's bits. On Mesa 22.3 (a loop cap: spins bounded in iterations) one invocation's polls ran out while the
    other workgroup (one CPU thread) still worked, in 10-15 of 40 such launches on an idle 2-core machine; the
    pipeline is specialized there to spin with the whole workgroup (moe_spin_paced), and only there."""
    path = next(p for p in golden_files() if "b_mixed_bits" in p)
    L = load_layer(path)
    monkeypatch.setenv("VKMOE_MOE_DIRECT", "off")  # routed: routing, stage 1, then the dependency waits
    monkeypatch.setenv("VKMOE_MOE_SPLITS", "2,2")  # test_direct.py's plan of this layer: its pipelines, compiled once
    moe = vkmoe.Exl3MoeMlp(device, L.gate, L.up, L.down, activation=L.activation, act_limit=L.act_limit)
    try:
        call = max(L.calls, key=lambda c: c["selected"].shape[0])
        want = moe(call["x"], call["selected"], call["weights"], dispatch="split")
        assert moe.last_run["plan"]["direct"] is False
        for i in range(16):
            out = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
            assert moe.last_run["mode"] == "persistent", (i, moe.last_run["fallback_reason"])
            assert same_bits(out, want), i
        spec = moe._persistent_pipeline(moe._scratch_for(*call["selected"].shape).plan).spec
        assert bool(spec.get(layout.SPEC_MOE_PACED_SPIN)) is bool(device.quirks.get("loop_iteration_cap"))
    finally:
        moe.close()


def test_forced_oversubscription_falls_back_to_split_quickly(device, tmp_path):
    """6 workgroups on a driver with 2 worker threads: 4 can never run while the first 2 spin. Without the
    bound Mesa 25 would deadlock (Mesa 22.3 would end the loop and return garbage)."""
    if device.device_type != "cpu":
        pytest.skip("oversubscribes lavapipe's 2 worker threads; a GPU keeps 6 workgroups resident")
    script = textwrap.dedent(f"""
        import json, sys, time
        import numpy as np
        sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
        import vkmoe
        from goldens import golden_files, load_layer
        L = load_layer(golden_files()[0])
        call = L.calls[0]
        with vkmoe.Device() as dev:
            moe = vkmoe.Exl3MoeMlp(dev, L.gate, L.up, L.down, activation=L.activation)
            split = moe(call["x"], call["selected"], call["weights"], dispatch="split")
            moe(call["x"], call["selected"], call["weights"], dispatch="persistent")  # compiles
            t = time.perf_counter()
            out = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
            wall = time.perf_counter() - t
            run = moe.last_run
            print(json.dumps({{"wall": wall, "mode": run["mode"], "reason": run["fallback_reason"],
                              "identical": bool(np.array_equal(out.view(np.uint32), split.view(np.uint32))),
                              "grid": run["persistent_plan"]["workgroups"]}}))
            moe.close()
    """)
    env = python_env(LP_NUM_THREADS="2", VKMOE_PERSISTENT_GRID="6", VKMOE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["grid"] == 6
    assert result["mode"] == "split"
    assert "aborted" in result["reason"] and "re-ran in split mode" in result["reason"]
    assert result["identical"]
    # The abort comes when the spinning workgroups' budget is spent: on Mesa 22.3 (paced spins: 8 workgroup barriers
    # per counted iteration) 3.2 s on an idle 2-core machine, on Mesa 25 (2,000,000 iterations of 32 polls: the
    # plan's bound for a CPU device) about 4 s; a deadlock would be the subprocess timeout. The bound counts
    # iterations, so its wall time grows with what else runs on the cores: beside three busy loops on this 2-core
    # machine 6.7 s (Mesa 22.3) and 4.9 s (Mesa 25), and make test runs three suites at once, each with
    # lavapipe's worker threads (up to ~4x the idle time), hence the margin.
    assert result["wall"] < 30.0, result


def test_two_layers_from_two_threads(layers):
    paths = golden_files()
    jobs = []
    for path in (paths[0], paths[2]):
        L, moe = layers(path)
        call = L.calls[0]
        jobs.append((moe, call, moe(call["x"], call["selected"], call["weights"], dispatch="split")))
    errors = []

    def work(moe, call, expected):
        try:
            for _ in range(10):
                out = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
                if not same_bits(out, expected):
                    errors.append("wrong result")
        except Exception as exc:  # collected and reported by the main thread
            errors.append(repr(exc))

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_dispatch_environment_toggles_the_path(layers, monkeypatch):
    L, moe = layers(golden_files()[0])
    call = L.calls[0]
    args = (call["x"], call["selected"], call["weights"])
    monkeypatch.setenv("VKMOE_DISPATCH", "split")
    moe(*args)
    assert moe.last_run["mode"] == "split" and moe.last_run["requested"] == "split"
    monkeypatch.setenv("VKMOE_DISPATCH", "persistent")
    moe(*args)
    assert moe.last_run["mode"] == "persistent"
    monkeypatch.setenv("VKMOE_DISPATCH", "auto")
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", "64")
    moe(*args)
    assert moe.last_run["mode"] == "persistent" and moe.last_run["requested"] == "auto"
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", "0")
    moe(*args)
    assert moe.last_run["mode"] == "split" and "persistent only up to m=0" in moe.last_run["reason"]
    assert moe.last_run["fallback_reason"] is None  # an ordinary auto decision, not a fallback
    # the argument wins over the environment
    monkeypatch.setenv("VKMOE_DISPATCH", "split")
    moe(*args, dispatch="persistent")
    assert moe.last_run["mode"] == "persistent"
    monkeypatch.setenv("VKMOE_DISPATCH", "sometimes")
    with pytest.raises(ValueError, match="VKMOE_DISPATCH"):
        moe(*args)


def test_record_persistent_matches_split(device, layers):
    L, moe = layers(golden_files()[0])
    call = L.calls[0]
    m, top_k = call["selected"].shape
    expected = moe(call["x"], call["selected"], call["weights"], dispatch="split")
    mem = device.memory
    hb, ib, wb, ob = (mem.allocate(m * moe.H * 2), mem.allocate(m * top_k * 4), mem.allocate(m * top_k * 4),
                      mem.allocate(m * moe.H * 4))
    try:
        hb.upload(call["x"])
        ib.upload(call["selected"].astype(np.int32))
        wb.upload(call["weights"].astype(np.float32))
        ob.upload(np.full((m, moe.H), np.nan, np.float32))
        with vkmoe.CommandRecorder(device) as rec:
            rec.begin()
            moe.record(rec, hb, ib, wb, ob, m, top_k, mode="persistent")
            rec.end()
            rec.submit(wait=True)
        assert moe.aborted(m, top_k) == 0
        assert same_bits(ob.download(np.float32, (m, moe.H)), expected)
        with pytest.raises(ValueError, match="mode"):
            moe.record(rec, hb, ib, wb, ob, m, top_k, mode="fast")
    finally:
        for b in (hb, ib, wb, ob):
            b.close()


# ------------------------------------------------------------------------------------------ the launch plan
def _fake_device(name="Fake GPU", compute_units=8, cap=None, device_type="discrete-gpu"):
    return SimpleNamespace(name=name, driver_name="fake", driver_info="", compute_units=compute_units,
                           compute_units_source="test", quirks={"loop_iteration_cap": cap}, device_type=device_type,
                           identity=f"{name}|fake", features={},
                           limits=SimpleNamespace(maxComputeWorkGroupCount=(65535, 65535, 65535)))


def _moe_plan(m=4, E=8):
    from vkmoe.ops.plan import moe_plan

    return moe_plan(_fake_device(), m, 2, E, 256, 128, True)


def test_plan_uses_vendor_count_and_default_deny(tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    p = sched_plan.persistent_plan(_fake_device(), _moe_plan(), 8, 256, 128, True)
    assert p.allowed and p.trusted and p.workgroups == 8 and "compute unit" in p.reason
    for name in ("Apple M2 (MoltenVK)", "Mali-G78"):
        p = sched_plan.persistent_plan(_fake_device(name=name), _moe_plan(), 8, 256, 128, True)
        assert p.allowed and not p.trusted and "off by default" in p.reason
    p = sched_plan.persistent_plan(_fake_device(compute_units=None), _moe_plan(), 8, 256, 128, True)
    assert not p.allowed and "vkmoe probe" in p.reason
    p = sched_plan.persistent_plan(_fake_device(), _moe_plan(E=300), 300, 256, 128, True)
    assert not p.allowed and "at most 256" in p.reason


def test_plan_refuses_a_batch_whose_partials_do_not_fit(tmp_path, monkeypatch):
    """The persistent kernel keeps both GEMMs' partials at once; where that passes maxStorageBufferRange the
    scratch holds only the split path's share and the plan must refuse persistent (else the GEMMs would overlap)."""
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    p = sched_plan.persistent_plan(_fake_device(), _moe_plan(), 8, 256, 128, True, scratch_fits=False)
    assert not p.allowed and not p.trusted and "maxStorageBufferRange" in p.reason
    d = sched_plan.decide(_fake_device(), _moe_plan(), "persistent", 8, 256, 128, True, scratch_fits=False)
    assert d.mode == "split" and "not possible" in d.reason


def test_plan_refuses_work_past_the_loop_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    small = sched_plan.persistent_plan(_fake_device(cap=65536), _moe_plan(m=1), 8, 256, 128, True)
    assert small.allowed and small.loop_budget < 65536 and small.spin_limit == small.loop_budget
    big = sched_plan.persistent_plan(_fake_device(cap=65536), _moe_plan(m=4096, E=8), 8, 256, 128, True)
    assert not big.allowed and "65536" in big.reason


def test_plan_uses_the_pipelines_own_count(tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKMOE_PERSISTENT_WG_PER_CU", raising=False)
    dev = _fake_device(compute_units=8)
    measured = {"min": 24, "median": 24, "samples": [24, 25, 24], "launched": 128}
    p = sched_plan.persistent_plan(dev, _moe_plan(), 8, 256, 128, True, measured)
    assert p.allowed and p.trusted and p.workgroups == 24 and "this pipeline" in p.source
    monkeypatch.setenv("VKMOE_PERSISTENT_WG_PER_CU", "2")
    p = sched_plan.persistent_plan(dev, _moe_plan(), 8, 256, 128, True, measured)
    assert p.workgroups == 16 and "VKMOE_PERSISTENT_WG_PER_CU" in p.source
    monkeypatch.delenv("VKMOE_PERSISTENT_WG_PER_CU")
    p = sched_plan.persistent_plan(dev, _moe_plan(), 8, 256, 128, True, dict(measured, min=0))
    assert not p.allowed and "no co-resident" in p.reason
    # the stand-in probe's failed verdict (litmus violations) keeps the persistent kernel off whatever was measured
    report = {"quirks": {"loop_iteration_cap": None}, "device": {"compute_units": 8}, "dispatch_us": 3.0,
              "variants": [{"workgroup_size": 256, "shared_bytes": 16384,
                            "co_resident": {"min": 24, "median": 24, "samples": [24], "launched": 64},
                            "verdict": {"persistent": False, "grid": 0, "reason": "litmus violations"},
                            "barrier_us": 2.0, "litmus_violations": 3}]}
    residency.store(dev, report)
    p = sched_plan.persistent_plan(dev, _moe_plan(), 8, 256, 128, True, measured)
    assert not p.allowed and "litmus" in p.reason


def test_forced_grid_measures_nothing(device, layers, tmp_path, monkeypatch):
    """VKMOE_PERSISTENT_GRID is not checked against residency, so a persistent call with it runs no discovery
    (seconds on a CPU driver): the forced grid launches, bits as split's."""
    from vkmoe.sched import occupancy

    def no_discovery(*args, **kwargs):
        raise AssertionError("a forced grid ran the co-residency discovery")

    monkeypatch.setattr(occupancy, "measure", no_discovery)
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VKMOE_PERSISTENT_GRID", "2")
    L, moe = layers(golden_files()[0])
    call = L.calls[0]
    split = moe(call["x"], call["selected"], call["weights"], dispatch="split")
    out = moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
    run = moe.last_run
    assert run["persistent_plan"]["workgroups"] == 2 and "VKMOE_PERSISTENT_GRID" in run["persistent_plan"]["source"]
    assert run["mode"] == "persistent" or "aborted" in (run["fallback_reason"] or ""), run
    assert np.array_equal(out.view(np.uint32), split.view(np.uint32))


def test_discovery_measures_the_pipeline_itself(device, layers, tmp_path, monkeypatch):
    """The persistent pipeline's own discovery finds lavapipe's worker threads, the plan launches what it
    measured, and the measurement is cached per pipeline (spec constants included) for the next process."""
    monkeypatch.delenv("VKMOE_PERSISTENT_GRID", raising=False)
    from vkmoe.sched import occupancy

    L, moe = layers(golden_files()[0])
    call = L.calls[0]
    m, top_k = call["selected"].shape
    plan = moe._scratch_for(m, top_k).plan
    # No sample ever counts more workgroups than lavapipe has worker threads, and a measurement finds them all.
    # Not every one does: while the OS keeps a worker off the cores the discovery polls without it (three test
    # processes on two cores measured samples 2, 2, 1 and 1, 1, 2), and the minimum, which the plan launches, is
    # conservative by design. So up to six measurements, each in a cache directory of its own (three were not
    # enough once, with other test processes loading both cores beside CI's three).
    for attempt in range(6):
        cache = tmp_path / f"cache{attempt}"
        monkeypatch.setenv("VKMOE_CACHE_DIR", str(cache))
        occupancy._measured.clear()
        measured = moe.co_resident(plan)
        assert measured["launched"] == occupancy.launch_size(device) > measured["min"] >= 1
        if not device.is_lavapipe:
            break
        assert max(measured["samples"]) <= device.compute_units, measured
        if max(measured["samples"]) == device.compute_units:
            break
    else:
        pytest.fail(f"six measurements never found lavapipe's {device.compute_units} worker threads: {measured}")
    moe(call["x"], call["selected"], call["weights"], dispatch="persistent")
    assert moe.last_run["mode"] == "persistent" and moe.last_run["workgroups"] == measured["min"]
    entries = json.load(open(cache / "residency.json"))
    (pipelines,) = [v["pipelines"]["entries"] for v in entries.values() if "pipelines" in v]
    (key,) = [k for k in pipelines if k.startswith("moe_persistent")]
    assert f"4={plan.rows}" in key and pipelines[key]["min"] == measured["min"]
    occupancy._measured.clear()
    assert moe.co_resident(plan)["min"] == measured["min"]  # from the cache file, not measured again


def test_auto_switch_point_comes_from_measurements(tmp_path, monkeypatch):
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKMOE_PERSISTENT_MAX_M", raising=False)
    dev = _fake_device()
    assert sched_plan.auto_switch_point(dev)[0] == 0
    residency.store_crossover(dev, "qwen3", 16, {"1": {"split": 50.0, "persistent": 40.0}})
    residency.store_crossover(dev, "deepseek", 4, {"1": {"split": 150.0, "persistent": 140.0}})
    limit, source = sched_plan.auto_switch_point(dev)
    assert limit == 4 and "deepseek" in source
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", "nope")
    with pytest.raises(ValueError, match="VKMOE_PERSISTENT_MAX_M"):
        sched_plan.auto_switch_point(dev)


def test_auto_follows_the_wins_measured_on_the_layers_shape(tmp_path, monkeypatch):
    """A crossover stored with its shape's dims: a layer of exactly those dims goes persistent where persistent
    won (between two measured batch sizes only if both won; above the largest measured, split); a layer of other
    dims, or an entry whose wins are malformed, falls back to the smallest max_m over the shapes."""
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VKMOE_PERSISTENT_MAX_M", raising=False)
    dev = _fake_device()
    qwen3 = {"E": 128, "H": 2048, "I": 768, "top_k": 8}
    residency.store_crossover(dev, "qwen3", 0, {}, dims=qwen3, measured=[1, 2, 4, 8, 16, 32, 64], wins=[16, 32])
    residency.store_crossover(dev, "deepseek", 2, {}, dims={"E": 256, "H": 7168, "I": 2048, "top_k": 8},
                              measured=[1, 2, 4], wins=[1, 2])
    wanted = {m: sched_plan.auto_prefers_persistent(dev, m, qwen3)[0] for m in (1, 4, 8, 12, 16, 24, 32, 48, 64, 65)}
    assert wanted == {1: False, 4: False, 8: False, 12: False, 16: True, 24: True, 32: True, 48: False, 64: False,
                      65: False}
    assert "qwen3" in sched_plan.auto_prefers_persistent(dev, 16, qwen3)[1]
    other = dict(qwen3, top_k=6)  # no entry of these dims: the smallest max_m (qwen3's 0)
    assert [sched_plan.auto_prefers_persistent(dev, m, other)[0] for m in (1, 16)] == [False, False]
    deepseek = {"E": 256, "H": 7168, "I": 2048, "top_k": 8}
    assert [sched_plan.auto_prefers_persistent(dev, m, deepseek)[0] for m in (1, 2, 3, 4, 5)] == [
        True, True, False, False, False]
    monkeypatch.setenv("VKMOE_PERSISTENT_MAX_M", "20")  # the knob overrides every measurement
    assert [sched_plan.auto_prefers_persistent(dev, m, qwen3)[0] for m in (1, 20, 21)] == [True, True, False]
    monkeypatch.delenv("VKMOE_PERSISTENT_MAX_M")
    path = residency.cache_path()
    with open(path) as f:
        data = json.load(f)
    for bad in ([16, 17], [[16]]):  # 17 was not measured; [16] is not a count
        data[residency.device_key(dev)][residency.CROSSOVER_KEY]["shapes"]["qwen3"]["wins"] = bad
        with open(path + ".new", "w") as f:
            json.dump(data, f)
        os.replace(path + ".new", path)
        residency.forget_checks()
        with pytest.warns(Warning, match="per-batch-size wins"):
            assert sched_plan.auto_prefers_persistent(dev, 16, qwen3)[0] is False  # the max_m rule: 0
