"""SparseMoeBlock entirely on the Vulkan device (vkmoe.ops.block): against the float64 block for several
architectures, ONE submission per call, a recorded block equal to block(hidden) bit for bit, a chain of blocks in
one command buffer equal to the blocks run one by one, device arrays between blocks, and bad inputs."""
import numpy as np
import pytest

from goldens import poison_block_scratch
from spin import SpinRun, fence_signalled, skip_if_over
from vkmoe.models import SparseMoeBlock, write_checkpoint
from vkmoe.ops.device_array import DeviceArray
from vkmoe.vk import CommandRecorder, VkmoeError
from vkmoe.vk.commands import submission_count

H = 256
TOL = 3e-3  # relative RMS vs the float64 block, as tests/test_architectures.py

ARCHS = {  # the router families, shared experts with and without a gate, act limits, interm_div, relu2
    "qwen3_moe": dict(experts=8, top_k=2, layers=3),
    "qwen3_next": dict(experts=8, top_k=2, shared_intermediate=256, layers=3),
    "deepseek_v3": dict(experts=8, top_k=2, n_group=4, topk_group=2, shared_experts=1),
    "deepseek_v4": dict(experts=8, top_k=2, layers=2, hash_layers=1, act_limit=1.5, shared_experts=1,
                        routed_scaling_factor=1.5),
    "nemotron_h": dict(experts=4, top_k=2, shared_intermediate=128),
    # LatentMoE: fc1 before the routed experts (width 128), fc2 after them, in the same submission
    "nemotron_h_latent": dict(arch="nemotron_h", experts=4, top_k=2, shared_intermediate=128, latent=128),
    "step3p5": dict(experts=4, top_k=2, shared_intermediate=128, act_limit=1.5, routed_scaling_factor=3.0),
    "laguna": dict(experts=4, top_k=2, shared_intermediate=128, routed_scaling_factor=2.0),
}


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv("VKMOE_BACKEND", raising=False)


@pytest.fixture(scope="module")
def blocks(device, tmp_path_factory):
    """{(arch, layer): block} on the session device, closed at the end."""
    root = tmp_path_factory.mktemp("device_block")
    made = {}
    for i, (name, kw) in enumerate(ARCHS.items()):
        path = write_checkpoint(str(root / name), **dict(dict(arch=name, hidden=H, intermediate=128, seed=20 + i),
                                                         **kw))
        for layer in range(kw.get("layers", 1)):
            made[name, layer] = SparseMoeBlock.from_checkpoint(path, layer, backend="vulkan", device=device)
    yield made
    for block in made.values():
        block.close()


def _hidden(m, seed, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal((m, H)).astype(dtype)


def _tokens(block, m, seed):
    if block.router != "sqrtsp_hash":
        return None
    return np.random.default_rng(seed).integers(0, block.config.vocab_size, m).astype(np.int32)


def _rel_rms(got, want):
    return float(np.sqrt(np.mean((got - want) ** 2)) / np.sqrt(np.mean(want ** 2)))


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("key", [(a, layer) for a, kw in ARCHS.items() for layer in range(min(2, kw.get("layers", 1)))],
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_block_on_device_matches_float64(blocks, key, m):
    block = blocks[key]
    assert block.device_block is not None
    x, ids = _hidden(m, seed=m + key[1]), _tokens(block, m, seed=m)
    got = block(x, input_ids=ids)
    assert block.last_run["where"].startswith("device") and block.last_run["mode"] in ("split", "persistent")
    assert got.dtype == np.float32 and np.isfinite(got).all()
    want = block.reference(x, input_ids=ids)
    assert _rel_rms(got, want) < TOL
    # the device router picked the float64 router's experts (no near ties in random data)
    dev_ids = block.device_block.router(x, ids)[0]
    assert np.array_equal(np.sort(dev_ids, axis=1), np.sort(block.route(x.astype(np.float64), ids,
                                                                        dtype=np.float64)[0], axis=1))


@pytest.mark.parametrize("key", [("qwen3_moe", 0), ("deepseek_v3", 0), ("deepseek_v4", 1)], ids=lambda k: k[0])
def test_a_nan_in_a_token_gives_that_token_nan_not_zeros(blocks, key):
    """A NaN hidden value makes every router logit of its token NaN: the token still takes top_k experts (the
    NaN ones in index order, routing.py's rule) with NaN weights, so its output row is NaN; it used to get no
    expert, and a zero row where no shared expert spread the NaN. Other rows keep their bits."""
    block = blocks[key]
    x, ids = _hidden(3, seed=21), _tokens(block, 3, seed=21)
    clean = block(x, input_ids=ids)
    x[1, 7] = np.nan
    got = block(x, input_ids=ids)
    assert np.isnan(got[1]).all(), got[1]
    assert np.array_equal(got[[0, 2]].view(np.uint32), clean[[0, 2]].view(np.uint32))
    # (the host reference cannot run it: its routed op refuses NaN routing weights, as Exl3MoeMlp's numpy call
    # does; the device block has no host step to raise from, so NaN is what it can give)
    with np.errstate(invalid="ignore", over="ignore"), pytest.raises(ValueError, match="NaN"):
        block.reference(x, input_ids=ids)


def test_fp32_hidden_routes_on_fp32(blocks):
    block = blocks["deepseek_v3", 0]
    x = _hidden(5, seed=3, dtype=np.float32)
    assert _rel_rms(block(x), block.reference(x)) < TOL


def test_one_submission_per_call(blocks, device):
    for key in (("qwen3_moe", 0), ("qwen3_next", 0), ("deepseek_v4", 0), ("nemotron_h_latent", 0)):
        block = blocks[key]
        x, ids = _hidden(3, seed=5), _tokens(block, 3, seed=5)
        first = block(x, input_ids=ids)
        before = submission_count()
        again = block(x, input_ids=ids)
        assert submission_count() - before == 1, key
        assert np.array_equal(first, again)
        with DeviceArray.from_numpy(device, x) as xd, DeviceArray.empty(device, x.shape, np.float32) as out:
            before = submission_count()
            assert block(xd, input_ids=ids, out=out) is out
            assert submission_count() - before == 1
            assert np.array_equal(out.numpy(), first)


def test_gpu_time_is_read_only_when_asked(blocks, monkeypatch):
    """Calls read no timestamps unless last_run["gpu_ms"] (or the device block's last_gpu_ms) is asked for."""
    from vkmoe.vk import commands

    block = blocks["qwen3_next", 0]
    x = _hidden(2, seed=3)
    reads = []
    real = commands.CommandRecorder._ticks
    monkeypatch.setattr(commands.CommandRecorder, "_ticks", lambda rec: reads.append(rec) or real(rec))
    for _ in range(3):
        block(x)
    assert reads == []
    assert block.last_run["gpu_ms"] > 0 and block.device_block.last_gpu_ms == block.last_run["gpu_ms"]
    assert len(reads) == 1


def _poisoned(device, m):
    return DeviceArray.from_numpy(device, np.full((m, H), np.nan, np.float32))


@pytest.mark.parametrize("key", [("qwen3_next", 0), ("deepseek_v4", 0), ("deepseek_v3", 0), ("nemotron_h_latent", 0)],
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_recorded_block_equals_call(blocks, device, key):
    block = blocks[key]
    x, ids = _hidden(4, seed=8), _tokens(block, 4, seed=8)
    want = block(x, input_ids=ids)
    poison_block_scratch(block)  # the recording must not pass on what the call left in the scratch
    xd, out = DeviceArray.from_numpy(device, x), _poisoned(device, 4)
    idd = None if ids is None else DeviceArray.from_numpy(device, ids)
    with CommandRecorder(device) as rec:
        rec.begin()
        block.record(rec, xd, out, input_ids=idd)
        rec.end()
        rec.submit(wait=True)
    assert np.array_equal(out.numpy(), want)
    for a in (xd, out, idd):
        if a is not None:
            a.close()


@pytest.mark.parametrize("key", [("qwen3_next", 0), ("deepseek_v3", 0), ("nemotron_h_latent", 0)],
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_one_token_linears_in_direct_mode_give_the_same_bits(blocks, device, key, monkeypatch):
    """At m = 1 the shared-expert (and latent) linears run in direct mode (each GEMM builds its own input
    Hadamard, no dispatch of its own): a recording made with VKMOE_LINEAR_DIRECT=off gives the same bits."""
    block = blocks[key]
    x, ids = _hidden(1, seed=12), _tokens(block, 1, seed=12)
    want = block(x, input_ids=ids)
    poison_block_scratch(block)
    monkeypatch.setenv("VKMOE_LINEAR_DIRECT", "off")  # read when the linears' stages are recorded
    xd, out = DeviceArray.from_numpy(device, x), _poisoned(device, 1)
    idd = None if ids is None else DeviceArray.from_numpy(device, ids)
    with CommandRecorder(device) as rec:
        rec.begin()
        # (unpinned, as __call__ records: a pinned m = 1 would stay for the module's other tests)
        sets = block.device_block.record_buffers(rec, xd.buffer, False, None if idd is None else idd.buffer,
                                                 out.buffer, 1, pin=False)
        rec.end()
        rec.submit(wait=True)
    assert np.array_equal(out.numpy(), want) and np.all(np.isfinite(want))
    for d in sets:
        d.free()
    for a in (xd, out, idd):
        if a is not None:
            a.close()


def _recorded_phases(device, block, x, m, mode="split", tokens=None):
    """The shaders each phase of block's recording dispatches (phases end at a barrier), and the block's output
    (None where a persistent launch aborted: its output is not valid); tokens: a hash layer's (m,) int32 ids."""
    phases, current = [], []
    with DeviceArray.from_numpy(device, x) as xd, _poisoned(device, m) as out, CommandRecorder(device) as rec, \
            DeviceArray.from_numpy(device, np.zeros(1, np.int32) if tokens is None else tokens) as td:
        dispatch, barrier = rec.dispatch, rec.barrier
        rec.dispatch = lambda pipe, *a, **kw: current.append(pipe.name) or dispatch(pipe, *a, **kw)
        rec.barrier = lambda: (phases.append(list(current)), current.clear(), barrier())
        rec.begin()
        sets = block.device_block.record_buffers(rec, xd.buffer, False, None if tokens is None else td.buffer,
                                                 out.buffer, m, mode=mode, pin=False)
        rec.end()
        rec.submit(wait=True)
        for d in sets:
            d.free()
        if mode == "persistent" and block.device_block.aborted(m):
            block.device_block.moe.reset_after_abort(m, block.config.top_k)
            return phases, None
        return phases, out.numpy()


def _has(phase, shader):  # (a shader's name carries its build: moe_down_f16, exl3_linear_idot, ...)
    return any(n.startswith(shader) for n in phase)


def _fused_and_unfused(device, block, x, mode="split", tokens=None):
    """_recorded_phases of block for one token with its fused shared sum, then with the sum pass (the block's
    fusion turned off for that recording), each on poisoned scratch: ((phases, out), (phases, out))."""
    db = block.device_block
    poison_block_scratch(block)
    fused = _recorded_phases(device, block, x, 1, mode, tokens)
    db._fuse_shared_sum = False
    try:
        poison_block_scratch(block)
        return fused, _recorded_phases(device, block, x, 1, mode, tokens)
    finally:
        db._fuse_shared_sum = True


# Blocks with a shared expert and none of what keeps the sum pass (RMSNorms, latent projections): a plain shared
# expert, a sigmoid-gated one, relu2 (no gate projection), act limits (deepseek_v4's second layer: not hashed).
FUSED = [("deepseek_v3", 0), ("qwen3_next", 0), ("nemotron_h", 0), ("deepseek_v4", 1), ("step3p5", 0)]


@pytest.mark.parametrize("mode", ["split", "persistent"])
@pytest.mark.parametrize("name, layer", FUSED)
def test_fused_shared_sum_gives_the_unfused_bits(device, blocks, name, layer, mode):
    """At m = 1 the shared down builds its row from act(gate, up) and the routed experts' token sums add the
    shared output (x sigmoid(its gate logit)): no activation or sum pass, the shared down beside the routed
    gate/up, the routed down last and alone; the output is bit for bit the unfused recording's (activation pass,
    shared down beside the routed down, sum pass), in split and persistent mode."""
    block = blocks[name, layer]
    db, top_k = block.device_block, block.config.top_k
    assert block.router != "sqrtsp_hash"
    if mode == "persistent" and db.moe.decided_mode(1, top_k, "persistent") != "persistent":
        pytest.skip("the scheduler runs no persistent launch for this layer on this device")
    assert db._fuses_shared_sum(1, mode)  # (else this test could not fail)
    x = _hidden(1, seed=60 + layer)
    for attempt in range(3):  # (a persistent launch that aborted under load is recorded again)
        (phases, fused), (plain_phases, unfused) = _fused_and_unfused(device, block, x, mode)
        if fused is not None and unfused is not None:
            break
    else:
        pytest.fail("three persistent launches in a row aborted")
    assert np.array_equal(fused, unfused) and np.all(np.isfinite(fused))
    assert _rel_rms(fused, block.reference(x)) < TOL
    assert not any(_has(p, "moe_block_elem") for p in phases), phases
    assert _has(plain_phases[-1], "moe_block_elem") and len(plain_phases) == len(phases) + 1 + (mode == "persistent")
    busy = [p for p in phases if p]  # (a persistent record() ends with a barrier of its own: an empty phase)
    routed_last = "moe_down" if mode == "split" else "moe_persistent"
    assert len(busy[-1]) == 1 and busy[-1][0].startswith(routed_last), phases
    assert _has(busy[-2], "exl3_linear"), phases  # the shared down just before it


def test_fused_shared_sum_of_a_token_with_no_routed_expert(device, blocks):
    """A hash layer's token outside the table has no valid slot: the routed experts' down dispatch writes its row,
    which with the fused shared sum is 0 + the shared output, as the unfused sum pass makes it."""
    block = blocks["deepseek_v4", 0]
    db = block.device_block
    assert block.router == "sqrtsp_hash" and db._fuses_shared_sum(1, "split")
    x, tokens = _hidden(1, seed=70), np.array([block.config.vocab_size + 5], np.int32)
    (_, fused), (_, unfused) = _fused_and_unfused(device, block, x, tokens=tokens)
    assert np.array_equal(fused, unfused) and np.all(np.isfinite(fused)) and np.any(fused != 0)
    assert np.array_equal(db.router(x, tokens)[0], [[-1] * block.config.top_k])  # (else this test could not fail)


@pytest.mark.parametrize("direct", ["on", "off"])
@pytest.mark.parametrize("m", [1, 3])
def test_shared_down_gemm_runs_beside_the_routed_down(device, tmp_path, monkeypatch, m, direct):
    """The shared expert's chain ends with the routed experts' (its down GEMM in the routed down GEMM's phase, then
    the sum) whether the routed op has three split dispatches or two (direct mode) and whether the shared down has
    an input Hadamard (m > 1) or not (m = 1): no phase holds the shared down GEMM alone. Output == the call's.
    (The recording of the fused shared sum, direct mode at m = 1, is test_fused_shared_sum_gives_the_unfused_bits's:
    here the block is made to record the sum pass.)"""
    monkeypatch.setenv("VKMOE_MOE_DIRECT", direct)  # (read when the block's routed op first plans this m)
    path = write_checkpoint(str(tmp_path / "ds"), arch="deepseek_v3", hidden=H, intermediate=128, seed=41,
                            **ARCHS["deepseek_v3"])
    block = SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device)
    block.device_block._fuse_shared_sum = False
    try:
        x = _hidden(m, seed=m)
        want = block(x)
        routed = block.device_block.moe
        assert routed._scratch_for(m, ARCHS["deepseek_v3"]["top_k"]).plan.direct is (direct == "on")
        # left to itself the block fuses the shared sum at m = 1 with direct-mode routed experts only (three
        # dispatches zero the rows of tokens with no valid slot in the first, before the shared output exists)
        block.device_block._fuse_shared_sum = True
        assert block.device_block._fuses_shared_sum(m, "split") is (m == 1 and direct == "on")
        block.device_block._fuse_shared_sum = False
        phases, got = _recorded_phases(device, block, x, m)
        assert np.array_equal(got, want)

        has = _has
        router = [i for i, p in enumerate(phases) if has(p, "moe_router")]
        down = [i for i, p in enumerate(phases) if has(p, "moe_down")]
        assert len(router) == 1 and len(down) == 1 and phases[-1] == ["moe_block_elem"], phases
        # the shared down GEMM beside the routed down, and no shared GEMM after it
        assert sum(n.startswith("exl3_linear") for n in phases[down[0]]) == 1, phases
        assert down[0] == len(phases) - 2, phases
        # between the router and the routed down: the routed op's other dispatches (routing unless direct, then
        # gate/up), each phase holding one; before them, at most the shared activation alone (direct mode)
        middle = phases[router[0] + 1:down[0]]
        routed = [i for i, p in enumerate(middle) if has(p, "moe_route") or has(p, "moe_gate_up")]
        assert len(routed) == (1 if direct == "on" else 2) and routed[-1] == len(middle) - 1, phases
        assert all(p == ["moe_block_elem"] for p in middle[:routed[0]]) and routed[0] <= 1, phases
    finally:
        block.close()


def test_shared_up_gate_plan_for_their_share_of_the_device(device, tmp_path, monkeypatch):
    """The shared up and gate GEMMs (side by side, beside the router) plan their k-splits for
    block.SHARED_GEMM_SHARE of the device's workgroups: with a share of one workgroup they run unsplit, and the
    block still matches the float64 one."""
    from vkmoe.ops import block as block_module
    from vkmoe.ops.plan import gemm_plan

    monkeypatch.setattr(block_module, "SHARED_GEMM_SHARE", (1, 10 ** 6))
    path = write_checkpoint(str(tmp_path / "ds"), arch="deepseek_v3", hidden=H, intermediate=128, seed=43,
                            **ARCHS["deepseek_v3"])
    block = SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device)
    try:
        x = _hidden(3, seed=4)
        got = block(x)
        assert _rel_rms(got, block.reference(x)) < TOL
        for name in ("up", "gate"):
            linear = block.device_block.shared[name]
            assert gemm_plan(device, 3, linear.k, linear.n).splits > 1  # (else this test could not fail)
            assert {key[1] for key in linear._scratch if key[0] == 3} == {1}, name
        with pytest.raises(ValueError, match="workgroups: expected a positive integer or None, got 0"):
            linear.stages(linear._suh, linear._suh, 1, workgroups=0)
    finally:
        block.close()


def test_a_block_closed_while_its_recording_runs_waits_for_the_run(device, tmp_path):
    """A runtime records a layer into its own command buffer, submits without waiting, then reads the output array,
    or closes the layer and drops the output array: the read gave what the buffer held before the run, and the
    closes freed the buffers under the queued run (the memory handed to the next allocation; a buffer of a block
    of its own freed: a driver crash). Now numpy() and the closes wait for the run, which still gives the block's
    output, and the recording refuses to run again. The block's commands queue behind a spin dispatch of seconds,
    so they are still to run when the read and the closes come."""
    path = write_checkpoint(str(tmp_path / "ckpt"), arch="qwen3_next", hidden=H, intermediate=128, experts=8,
                            top_k=2, shared_intermediate=256, seed=31)
    block = SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device)
    x = _hidden(3, seed=4)
    want = block(x)
    xd, out = DeviceArray.from_numpy(device, x), _poisoned(device, 3)
    with SpinRun(device) as spin, CommandRecorder(device) as rec:
        rec.begin()
        block.record(rec, xd, out)
        rec.end()
        rec.submit(wait=True)  # (its first run: lavapipe compiles)
        out.buffer.upload(np.full((3, H), np.nan, np.float32))
        rec.submit(wait=False, before=[spin.rec])
        skip_if_over(rec, "the read")
        assert np.array_equal(out.numpy(), want)  # numpy() waits for the run (it read the poison before)
        assert fence_signalled(rec)
        out.buffer.upload(np.full((3, H), np.nan, np.float32))
        rec.submit(wait=False, before=[spin.rec])
        block.close()
        assert fence_signalled(rec)
        out_buffer = out.buffer
        got = out.numpy()
        xd.close()
        out.close()
        assert out_buffer.closed
        assert np.array_equal(got, want)
        with pytest.raises(VkmoeError, match="closed after it was recorded"):
            rec.submit()


@pytest.mark.parametrize("fail_at", ["second", "last"])
def test_a_block_record_that_fails_partway_spoils_the_recording(blocks, device, monkeypatch, fail_at):
    """A block's record() that failed after some of its dispatches (here at its second or its last one) left them
    in the caller's command buffer, which then ran part of a block. Now submit() refuses it, naming what failed,
    until begin() again; the block recorded in full after that gives its call's bits."""
    block = blocks["deepseek_v3", 0]
    x = _hidden(2, seed=8)
    want = block(x)
    dispatch, calls = CommandRecorder.dispatch, []

    def counting(self, *args, **kwargs):
        calls.append(1)
        return dispatch(self, *args, **kwargs)

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise VkmoeError("injected: out of device memory")
        return dispatch(self, *args, **kwargs)

    with DeviceArray.from_numpy(device, x) as xd, _poisoned(device, 2) as out, CommandRecorder(device) as rec:
        rec.begin()
        monkeypatch.setattr(CommandRecorder, "dispatch", counting)
        block.record(rec, xd, out)
        at = 2 if fail_at == "second" else len(calls)
        calls.clear()
        rec.begin()
        monkeypatch.setattr(CommandRecorder, "dispatch", failing)
        with pytest.raises(VkmoeError, match="injected"):
            block.record(rec, xd, out)
        monkeypatch.setattr(CommandRecorder, "dispatch", dispatch)
        rec.end()
        with pytest.raises(VkmoeError, match=r"cannot run again: .*record\(\) failed partway through its commands "
                                             r"\(VkmoeError: injected"):
            rec.submit()
        rec.begin()
        block.record(rec, xd, out)
        rec.end()
        rec.submit()
        assert np.array_equal(out.numpy(), want)


def test_chain_of_blocks_in_one_submission(blocks, device):
    """Three layers recorded back to back (each reads the previous one's fp32 output; the middle one a LatentMoE
    block) == one by one, with device arrays passed between the calls, and == numpy calls."""
    chain = [blocks["qwen3_next", 0], blocks["nemotron_h_latent", 0], blocks["qwen3_next", 2]]
    x = _hidden(2, seed=9)
    outs = [_poisoned(device, 2) for _ in chain]
    with DeviceArray.from_numpy(device, x) as xd, CommandRecorder(device) as rec:
        rec.begin()
        src = xd
        for block, out in zip(chain, outs):
            block.record(rec, src, out)
            src = out
        rec.end()
        before = submission_count()
        rec.submit(wait=True)
        assert submission_count() - before == 1
        chained = outs[-1].numpy()
        for block in chain:
            poison_block_scratch(block)
        step = xd
        for block in chain:
            nxt = block(step, out="device")
            if step is not xd:
                step.close()
            step = nxt
        assert np.array_equal(step.numpy(), chained)
        step.close()
    y = x
    for block in chain:
        y = block(y)
    assert np.array_equal(y, chained)
    for o in outs:
        o.close()


def test_bad_device_inputs(blocks, device, dev):
    block, hash_block = blocks["qwen3_moe", 0], blocks["deepseek_v4", 0]
    x = _hidden(2, seed=1)
    with DeviceArray.from_numpy(dev, x) as foreign:
        with pytest.raises(ValueError, match="hidden is a DeviceArray of another vkmoe.Device"):
            block(foreign)
    with DeviceArray.from_numpy(device, x.astype(np.float64)) as wide:
        with pytest.raises(TypeError, match="hidden must be float16 or float32"):
            block(wide)
    with DeviceArray.from_numpy(device, x[:, :128]) as narrow:
        with pytest.raises(ValueError, match=r"hidden must have shape \(m, 256\)"):
            block(narrow)
    closed = DeviceArray.from_numpy(device, x)
    closed.close()
    with pytest.raises(VkmoeError, match="hidden is a closed DeviceArray"):
        block(closed)
    with DeviceArray.from_numpy(device, x) as xd, CommandRecorder(device) as rec:
        rec.begin()
        with DeviceArray.empty(device, (2, H), np.float16) as half:
            with pytest.raises(TypeError, match="out must be float32"):
                block.record(rec, xd, half)
        with DeviceArray.empty(device, (3, H), np.float32) as rows:
            with pytest.raises(ValueError, match=r"out must have shape \(2, 256\)"):
                block.record(rec, xd, rows)
        with pytest.raises(TypeError, match="out: expected a vkmoe DeviceArray"):
            block.record(rec, xd, np.zeros((2, H), np.float32))
        with DeviceArray.empty(device, (2, H), np.float32) as out:
            with pytest.raises(TypeError, match="input_ids: layer 0 is hash-routed"):
                hash_block.record(rec, xd, out)
            with DeviceArray.from_numpy(device, np.zeros(2, np.int64)) as ids64:
                with pytest.raises(TypeError, match="input_ids must be int32"):
                    hash_block.record(rec, xd, out, input_ids=ids64)
            # a recorder that is not one: an AttributeError from its first dispatch before
            with pytest.raises(TypeError, match="rec: expected a vkmoe CommandRecorder, got NoneType"):
                block.record(None, xd, out)
            with pytest.raises(TypeError, match="cmd: expected a vkmoe CommandRecorder, got str"):
                block.device_block.record("rec", xd, out)
            with CommandRecorder(dev) as foreign:
                with pytest.raises(ValueError, match="rec is a CommandRecorder of another vkmoe.Device"):
                    block.record(foreign, xd, out)
        rec.end()
    # route() of a hidden that is not (m, H): a ValueError from deep in the router before
    for bad in (x[0], x[None]):
        with pytest.raises(ValueError, match=r"hidden: expected shape \(m, 256\)"):
            block.route(bad)
    with pytest.raises(ValueError, match=r"input_ids: expected token ids in \[0, 64\)"):
        hash_block(x, input_ids=np.array([0, 64]))


def test_gemma4_norms_on_the_device(tmp_path, device):
    """Gemma 4: the router pre-norm, routed-in/out and shared-out RMSNorms run on the device too; the residual
    goes in as numpy or a DeviceArray (fp16 or fp32), and record() with it equals the call."""
    path = write_checkpoint(str(tmp_path / "g"), arch="gemma4", hidden=H, intermediate=128, experts=4, top_k=2,
                            shared_intermediate=256, seed=3)
    gemma = SparseMoeBlock.from_checkpoint(path, 0, backend="vulkan", device=device)
    assert gemma.device_block is not None and gemma.norms is not None
    x = _hidden(3, seed=2)
    r = (3 * np.random.default_rng(4).standard_normal((3, H))).astype(np.float32)
    got = gemma(x, residual=r)
    assert gemma.last_run["where"].startswith("device")
    assert _rel_rms(got, gemma.reference(x, residual=r)) < TOL
    r16 = r.astype(np.float16)
    assert _rel_rms(gemma(x, residual=r16), gemma.reference(x, residual=r16)) < TOL
    with pytest.raises(ValueError, match="residual: gemma4 routes"):
        gemma(x)
    with DeviceArray.from_numpy(device, x) as xd, DeviceArray.from_numpy(device, r) as rd, \
            _poisoned(device, 3) as out, CommandRecorder(device) as rec:
        assert np.array_equal(gemma(xd, residual=rd), got)
        rec.begin()
        with pytest.raises(TypeError, match="residual: expected a vkmoe DeviceArray"):
            gemma.record(rec, xd, out)
        gemma.record(rec, xd, out, residual=rd)
        rec.end()
        rec.submit(wait=True)
        assert np.array_equal(out.numpy(), got)
    gemma.close()


def test_cpu_block_keeps_the_host_path(tmp_path):
    path = write_checkpoint(str(tmp_path / "q"), arch="qwen3_moe", hidden=H, intermediate=128, experts=4, top_k=2)
    cpu = SparseMoeBlock.from_checkpoint(path, 0, backend="cpu")
    assert cpu.device_block is None
    x = _hidden(3, seed=2)
    assert _rel_rms(cpu(x), cpu.reference(x)) < TOL and cpu.last_run["mode"] == "cpu"
    cpu.close()  # closed on every backend (the CPU one went on answering)
    for use in (lambda: cpu(x), lambda: cpu.route(x)):
        with pytest.raises(VkmoeError, match="this SparseMoeBlock is closed"):
            use()


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h_latent"])
def test_persistent_routed_experts_inside_the_block(blocks, monkeypatch, name):
    """VKMOE_DISPATCH=persistent: the routed experts run as the scheduler decides (persistent where the device
    allows it, its abort word read in the same submission), the block output still matches."""
    monkeypatch.setenv("VKMOE_DISPATCH", "persistent")
    block = blocks[name, 0]
    x = _hidden(3, seed=21)
    want = block.moe.decided_mode(3, block.config.top_k)
    block(x)
    poison_block_scratch(block)  # the call checked below must not pass on the first call's values
    before = submission_count()
    got = block(x)
    assert submission_count() - before == 1
    assert block.device_block.last_mode == want
    assert _rel_rms(got, block.reference(x)) < TOL


@pytest.mark.parametrize("name", ["deepseek_v3", "nemotron_h_latent"])
def test_shape_cache_bounds_the_calls(blocks, monkeypatch, name):
    """VKMOE_SHAPE_CACHE=2: a block called with many m keeps two recordings, frees the rest with their scratch
    (and unpins them in the routed-expert op and the shared / latent linears), and an m that comes back is
    recorded again with the same result."""
    monkeypatch.setenv("VKMOE_SHAPE_CACHE", "2")
    block = blocks[name, 0]
    dev_block = block.device_block
    first = block(_hidden(1, seed=30))
    for m in (2, 3, 5, 6):
        block(_hidden(m, seed=30 + m))
    assert len(dev_block._calls) == 2 and 1 not in dev_block._scratch
    assert (1, block.config.top_k) not in block.moe._pinned
    for op in [*(block.shared_ops or {}).values(), *(block.latent_ops or {}).values()]:
        assert 1 not in op._pinned
    assert np.array_equal(block(_hidden(1, seed=30)), first)


def test_routed_record_refuses_a_bad_shared(device, blocks):
    """Exl3MoeMlp.record(shared=...): a tuple (fp16 (m, H) output, fp32 (m,) gate logits or None), each an open
    buffer of this device large enough; anything else raises naming the argument, recording nothing."""
    moe = blocks["deepseek_v3", 0].device_block.moe
    m, top_k = 2, 2
    mem = device.memory
    bufs = [mem.allocate(n) for n in (m * H * 2, m * top_k * 4, m * top_k * 4, m * H * 4, m * H * 2, 4)]
    hidden, ids, weights, out, s_out, small = bufs
    try:
        with CommandRecorder(device) as rec:
            rec.begin()
            with pytest.raises(TypeError, match="shared: expected None or"):
                moe.record(rec, hidden, ids, weights, out, m, top_k, shared=s_out)
            with pytest.raises(ValueError, match=r"shared\[0\] \(the shared output\) holds 4 bytes"):
                moe.record(rec, hidden, ids, weights, out, m, top_k, shared=(small, None))
            with pytest.raises(ValueError, match=r"shared\[1\] \(the gate logits\) holds 4 bytes"):
                moe.record(rec, hidden, ids, weights, out, m, top_k, shared=(s_out, small))
            with pytest.raises(ValueError, match=r"shared\[1\]"):
                moe.split_stages(hidden, ids, weights, out, m, top_k, shared=(s_out, small))
            rec.end()
    finally:
        for b in bufs:
            b.close()
