"""The vk layer on whichever Vulkan device the environment selects (CI: lavapipe, Mesa 22.3 and 25).
With VKMOE_VALIDATION=1 every test also requires zero validation messages."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import vkmoe
from spin import SpinRun, fence_signalled, skip_if_over
from subproc import python_env
from vkmoe.vk import CommandRecorder, Pipeline, PushConstants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Test-only shaders (tests/shaders/*.comp), compiled by `setup.py build_shaders` into tests/_spv, not the package.
SAXPY = os.path.join(ROOT, "tests", "_spv", "test_saxpy.spv")
WG_BARRIER = os.path.join(ROOT, "tests", "_spv", "test_wg_barrier.spv")


class SaxpyPush(PushConstants):
    fields = [("a", "<f4"), ("n", "<u4")]


class WgBarrierPush(PushConstants):
    fields = [("rows_valid", "<u4")]


def _mesa_major(dev):
    return int(dev.mesa_version.split(".")[0]) if dev.mesa_version else None


def test_device_info_keys(dev):
    info = dev.info()
    for key in ("name", "driver", "compute_units", "compute_units_source", "quirks", "limits", "api"):
        assert key in info, key
    assert info["name"] == dev.name and info["driver"]
    assert info["limits"]["max_shared_memory"] >= 16384
    assert "loop_iteration_cap" in info["quirks"]
    if dev.is_lavapipe:
        assert info["mesa_version"]
        assert info["compute_units"] >= 1 and "lavapipe" in info["compute_units_source"]
    if info["compute_units"] is not None:
        assert info["compute_units_source"]


def test_64mib_round_trip(dev):
    n = (64 << 20) // 4
    data = np.random.default_rng(1).integers(0, 2**32, n, dtype=np.uint32)
    with dev.memory.allocate(data.nbytes) as buf:
        buf.upload(data)
        back = buf.download(np.uint32)
    assert back.shape == data.shape and np.array_equal(back, data)


def test_saxpy_spec_and_push(dev):
    n = 1000
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    pipe = Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: 0.25})
    bx, by = dev.memory.allocate(x.nbytes), dev.memory.allocate(y.nbytes)
    try:
        bx.upload(x)
        by.upload(y)
        with CommandRecorder(dev, timestamps=2) as rec:
            rec.begin()
            rec.timestamp()
            rec.dispatch(pipe, pipe.bind(bx, by), (n + 63) // 64, pipe.push(a=3.0, n=n))
            rec.timestamp()
            rec.end()
            rec.submit(timeout=30)
            stamps = rec.timestamps_ms()
        got = by.download(np.float32)
    finally:
        bx.close(), by.close(), pipe.close()
    np.testing.assert_allclose(got, np.float32(3.0) * x + y + np.float32(0.25), rtol=1e-6, atol=1e-6)
    assert stamps[1] > 0


def test_gpu_time_is_read_only_when_asked_and_always_its_own_submission(dev, monkeypatch):
    """CommandRecorder.gpu_time(): no query read unless someone asks (ops make one per call), and a GpuTime still
    held when its results would be overwritten (next submission, re-recording, close) is read first."""
    n = 4096
    pipe = Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: 0.0})
    bx, by = dev.memory.allocate(4 * n), dev.memory.allocate(4 * n)
    reads = []
    try:
        with CommandRecorder(dev, timestamps=2) as rec:
            real_ticks = rec._ticks
            monkeypatch.setattr(rec, "_ticks", lambda: reads.append(1) or real_ticks())

            def record(groups):
                rec.begin()
                rec.timestamp()
                rec.dispatch(pipe, pipe.bind(bx, by), groups, pipe.push(a=1.0, n=n))
                rec.timestamp()
                rec.end()

            record(n // 64)
            rec.submit(timeout=30)
            expect = rec.elapsed_ms()
            held = rec.gpu_time()
            assert rec.gpu_time() is held  # one per submission
            reads.clear()
            rec.submit(timeout=30)
            assert len(reads) == 1  # `held`, read before the submission overwrote its results
            assert held.ms == expect and len(reads) == 1  # read once
            rec.gpu_time()  # dropped at once: nobody can ask for it, the next submission reads nothing
            reads.clear()
            rec.submit(timeout=30)
            assert reads == []
            forgotten = rec.gpu_time()
            forgotten.forget()
            again = rec.gpu_time()  # re-recording and close also read a held one first
            assert again is not forgotten and np.isnan(forgotten.ms)
            expect = rec.elapsed_ms()
            record(1)
            assert again.ms == expect
            rec.submit(timeout=30)
            expect, last = rec.elapsed_ms(), rec.gpu_time()
        assert last.ms == expect and expect >= 0  # read when the recorder closed
    finally:
        bx.close(), by.close(), pipe.close()


def test_host_view_is_kept_and_checked(dev):
    with dev.memory.allocate(64, kind="readback") as buf:
        view = buf.host_view(np.uint32, (4,), 16)
        assert buf.host_view(np.uint32, (4,), 16) is view  # made once
        view[...] = [1, 2, 3, 4]
        assert buf.download(np.uint32, (4,), offset=16).tolist() == [1, 2, 3, 4]
        with pytest.raises(ValueError, match="needs 80 bytes"):
            buf.host_view(np.uint32, (16,), 16)
    with pytest.raises(vkmoe.VkmoeError, match="used after close"):
        buf.host_view(np.uint32, (4,), 16)  # the kept view went with the buffer


def test_typed_push_and_spec_errors(dev):
    pipe = Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: 1.0})
    try:
        with pytest.raises(TypeError):
            pipe.push(a=1.0)  # missing n
        with pytest.raises(TypeError):
            pipe.push(a=1.0, n=1, bogus=2)
        with pytest.raises(ValueError):
            pipe.push(a=1.0, n=-1)  # does not fit uint32
    finally:
        pipe.close()
    with pytest.raises(vkmoe.VkmoeError, match="specialization constant id 7"):
        Pipeline(dev, SAXPY, push=SaxpyPush, spec={7: 1})

    class WrongSize(PushConstants):
        fields = [("a", "<f4")]

    with pytest.raises(vkmoe.VkmoeError, match="push-constant"):
        Pipeline(dev, SAXPY, push=WrongSize)


def test_more_storage_buffers_than_the_device_allows(dev):
    """A descriptor layout past maxPerStageDescriptorStorageBuffers (Vulkan guarantees 4; the MoE shaders bind
    21) is refused by name before any Vulkan object is made, and the device stays usable."""
    limit = dev.limits.maxPerStageDescriptorStorageBuffers
    assert dev.info()["limits"]["max_storage_buffers_per_stage"] == limit >= 4
    with pytest.raises(vkmoe.VkmoeError, match=f"allows {limit} per shader stage"):
        Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: 1.0}, binding_count=limit + 1)
    Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: 1.0}).close()


@pytest.mark.parametrize("rows_valid", [4, 3])
def test_wg_barrier_orders_buffer_stores(dev, rows_valid):
    """WG_BARRIER_DEVICE (common.glsl) orders every invocation's buffer stores before the workgroup's reads after
    it. On Mesa 22.3's lavapipe a control barrier with QueueFamily memory scope alone did not: the rows stored by
    invocations 128..255 read as the poison from every other invocation, 248 of 512 elements per workgroup, every
    run (the MoE stage-5 race: a token's sum read a slot row still being written)."""
    groups = 4
    pipe = Pipeline(dev, WG_BARRIER, push=WgBarrierPush)
    rows, stale = dev.memory.allocate_all([4 * 512 * groups, 4 * 256 * groups])
    try:
        with CommandRecorder(dev) as rec:
            rec.begin()
            rec.fill(rows, 0x7FC00000)  # NaN: never equal to what an invocation stores
            rec.barrier()
            rec.dispatch(pipe, pipe.bind(rows, stale), groups, pipe.push(rows_valid=rows_valid))
            rec.end()
            rec.submit(wait=True)
        seen = stale.download(np.uint32, shape=(groups, 256))
        assert seen.sum() == 0, f"stale reads per workgroup: {seen.sum(axis=1).tolist()}"
        expect = np.arange(512, dtype=np.float32).reshape(4, 128) + 1
        got = rows.download(np.float32, shape=(groups, 4, 128))
        assert np.array_equal(got[:, :rows_valid], np.broadcast_to(expect[:rows_valid], (groups, rows_valid, 128)))
    finally:
        rows.close()
        stale.close()
        pipe.close()


def test_wait_timeout_raises_then_recovers(dev):
    # A bounded kernel (per-invocation loop below lavapipe 22.3's cap) that runs far longer than 1 ms.
    with SpinRun(dev, groups=1024) as spin:
        spin.rec.submit(wait=False)
        try:
            spin.rec.wait(timeout=0.001)
        except vkmoe.TimeoutError:
            assert spin.rec.pending
        else:
            skip_if_over(spin.rec, "the 1 ms wait gave up")
            raise AssertionError("wait(timeout=0.001) returned while the run was still going")
        spin.rec.wait(timeout=120)  # the device is fine afterwards
        assert not spin.rec.pending
        assert spin.buf.download(np.uint32, shape=(4,), offset=4 * 1024).any()


def test_a_submission_queued_behind_another_threads_first_run_waits_for_it(dev, monkeypatch):
    """A submission queued behind another recorder's first run (on lavapipe, which compiles at the first dispatch:
    another thread's new recording) gets its own VKMOE_TIMEOUT once that run is done, instead of timing out while
    it has not started (CI, Mesa 25, cold shader cache: two threads' persistent calls both raised 'the GPU did not
    finish within 60 s'). A caller's explicit timeout stays a hard bound."""
    import threading
    import time

    # twice test_wait_timeout_raises_then_recovers's run: seconds on lavapipe, well past the timeout below
    groups, iterations = 2048, 20000
    spin = SpinRun(dev, groups, iterations)  # (its pipeline and buffer; the recordings below are new ones)
    pipe, buf = spin.pipe, spin.buf
    made = []  # every recorder, finished before buf is freed (also when an assertion fails midway)

    def long_first_run():
        """A new recording of the long kernel, submitted without waiting; its own thread waits for it."""
        rec = CommandRecorder(dev)
        made.append(rec)
        rec.begin()
        rec.dispatch(pipe, pipe.bind(buf), groups, pipe.push(iterations=iterations))
        rec.end()
        rec.submit(wait=False)
        owner = threading.Thread(target=rec.wait)  # (a first run: its wait gets the compile allowance)
        owner.start()
        return rec, owner

    try:
        with CommandRecorder(dev) as short_rec:
            made.append(short_rec)
            short_rec.begin()
            short_rec.dispatch(pipe, pipe.bind(buf), 1, pipe.push(iterations=1))
            short_rec.end()
            short_rec.submit(wait=True)  # its first run done: the next ones are not fresh
            # (far shorter than the long run, but long enough for the short run to finish once the long one is
            # done on 2 loaded cores: 0.05 s timed out there once, CI running three test processes)
            timeout = 0.25
            monkeypatch.setenv("VKMOE_TIMEOUT", str(timeout))
            long_rec, owner = long_first_run()
            t0 = time.monotonic()
            short_rec.submit(wait=True)  # queued behind the long first run: waits for it, no TimeoutError
            elapsed = time.monotonic() - t0
            owner.join(timeout=120)
            assert not owner.is_alive() and not long_rec.pending
            if elapsed <= 2 * timeout:
                pytest.skip(f"the long run took {elapsed:.3f} s: too short on this device to outlast the timeout")
            long_rec.close()
            long_rec, owner = long_first_run()
            short_rec.submit(wait=False)
            with pytest.raises(vkmoe.TimeoutError):  # a caller's own timeout is not extended
                short_rec.wait(timeout=0.05)
            short_rec.wait(timeout=120)
            owner.join(timeout=120)
            long_rec.close()
        assert buf.download(np.uint32, shape=(4,), offset=4 * 1024).any()
    finally:
        for rec in made:
            if rec.handle is not None and rec.pending:
                rec.wait(timeout=120)
        spin.close()


def test_loop_cap_quirk(dev):
    cap = dev.quirks["loop_iteration_cap"]
    major = _mesa_major(dev)
    if dev.is_lavapipe and major == 22:
        assert cap is not None and 65000 <= cap <= 66000
    elif dev.is_lavapipe and major is not None and major >= 25:
        assert cap is None


def test_bad_inputs(dev, monkeypatch):
    with dev.memory.allocate(64) as buf:
        with pytest.raises(TypeError):
            buf.upload([1, 2, 3])
        with pytest.raises(TypeError):
            buf.upload(np.array([object(), object()], dtype=object))
        with pytest.raises(ValueError):
            buf.upload(np.zeros(17, dtype=np.float32))  # 68 bytes into 64
        with pytest.raises(ValueError):
            buf.download(np.float32, shape=(17,))
    with pytest.raises(vkmoe.VkmoeError, match="used after close"):
        buf.upload(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError):
        dev.memory.allocate(0)
    with pytest.raises(vkmoe.DeviceSelectionError, match="nonexistent"):
        vkmoe.Device("nonexistent")
    with pytest.raises(vkmoe.DeviceSelectionError, match="out of range"):
        vkmoe.Device("99")
    # these were looked up as name substrings ("no Vulkan device name contains '1.5'")
    with pytest.raises(vkmoe.DeviceSelectionError, match="selector: a device index is >= 0, got -1"):
        vkmoe.Device(-1)
    for bad in (1.5, True, b"llvm"):
        with pytest.raises(TypeError, match="selector: expected a device index or a substring of its name"):
            vkmoe.Device(bad)
    monkeypatch.setenv("VKMOE_DEVICE", "nonexistent")
    with pytest.raises(vkmoe.DeviceSelectionError):
        vkmoe.Device()
    with pytest.raises(vkmoe.VkmoeError, match="not found"):
        Pipeline(dev, "no_such_shader")


def test_recorded_copies_and_fills_are_checked(dev):
    """copy() / fill() ranges, buffers and sizes are checked when recorded: a copy past a buffer's end, of a freed
    buffer or between overlapping ranges was recorded and submitted (undefined on a GPU), and allocate() took "64"
    and 1.5. The recorder still records and runs right afterwards."""
    other = vkmoe.Device()
    try:
        with dev.memory.allocate(64) as a, dev.memory.allocate(64) as b, other.memory.allocate(64) as foreign, \
                CommandRecorder(dev) as rec:
            closed = dev.memory.allocate(16)
            closed.close()
            rec.begin()
            for call, error, match in (
                    (lambda: rec.copy(a, b, 1000), ValueError, "src: 1000 bytes at offset 0 do not fit its 64 bytes"),
                    (lambda: rec.copy(a, b, 16, dst_offset=56), ValueError, "dst: 16 bytes at offset 56 do not fit"),
                    (lambda: rec.copy(a, b, -4), ValueError, "src: -4 bytes at offset 0 do not fit"),
                    (lambda: rec.copy(a, b, 0), ValueError, "src: 0 bytes"),
                    (lambda: rec.copy(a, b, 8, src_offset=-8), ValueError, "src: 8 bytes at offset -8"),
                    (lambda: rec.copy(a, a, 32, 0, 16), ValueError, "the src and dst ranges overlap"),
                    (lambda: rec.copy(closed, b, 4), vkmoe.VkmoeError, "src is a closed Buffer"),
                    (lambda: rec.copy(a, foreign, 4), ValueError, "dst is a Buffer of another vkmoe.Device"),
                    (lambda: rec.copy(np.zeros(4), b, 4), TypeError, "src: expected a vkmoe Buffer, got ndarray"),
                    (lambda: rec.copy(a, b, 4.0), TypeError, "src: nbytes must be an integer, got float"),
                    (lambda: rec.fill(a, 0, 1000), ValueError, "buf: 1000 bytes at offset 0 do not fit"),
                    (lambda: rec.fill(a, 0, 8, offset=100), ValueError, "buf: 8 bytes at offset 100 do not fit"),
                    (lambda: rec.fill(a, 0, 8, offset=2), ValueError, "offset must be a multiple of 4"),
                    (lambda: rec.fill(closed, 0), vkmoe.VkmoeError, "buf is a closed Buffer"),
                    (lambda: dev.memory.allocate("64"), TypeError, "nbytes: expected an integer number of bytes"),
                    (lambda: dev.memory.allocate(1.5), TypeError, "nbytes: expected an integer number of bytes")):
                with pytest.raises(error, match=match):
                    call()
            a.upload(np.arange(16, dtype=np.uint32))
            b.upload(np.full(16, 0xDEADBEEF, np.uint32))  # poisoned: the copy and the fill must write it
            rec.copy(a, b, 32, src_offset=16, dst_offset=0)
            rec.fill(b, 7, 16, offset=32)
            rec.end()
            rec.submit(wait=True)
            got = b.download(np.uint32, (16,))
            assert got[:8].tolist() == list(range(4, 12)) and got[8:12].tolist() == [7] * 4
            assert got[12:].tolist() == [0xDEADBEEF] * 4
    finally:
        other.close()


def test_a_descriptor_set_freed_by_a_finalizer_inside_bind_does_not_hang(monkeypatch):
    """A garbage collection inside bind() (cffi allocates there) finalized a layer whose descriptor sets came from
    the same pipeline's pools; its free() took the pools' lock again on the same thread, which hung the test suite.
    Here the collection is simulated deterministically: the first descriptor write of a bind() frees another set
    of the pool. A device of its own, left open if bind() hangs (its close would wait for the stuck call)."""
    import threading

    import vulkan as vk

    d = vkmoe.Device()
    pipe = Pipeline(d, SAXPY, push=SaxpyPush)
    bx, by = d.memory.allocate(256), d.memory.allocate(256)
    victim = pipe.bind(bx, by)
    real = vk.VkDescriptorBufferInfo
    calls = []

    def finalizer_inside(*args, **kw):
        if not calls:
            calls.append(1)
            victim.free()  # what a finalizer run by a collection here does
        return real(*args, **kw)

    monkeypatch.setattr(vk, "VkDescriptorBufferInfo", finalizer_inside)
    made = []
    t = threading.Thread(target=lambda: made.append(pipe.bind(bx, by)), daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        pytest.fail("bind() hung on the descriptor pools' lock")
    monkeypatch.setattr(vk, "VkDescriptorBufferInfo", real)
    with d:
        assert calls and victim.closed and len(made) == 1 and not made[0].closed
        # the pools' counts stayed right: sets keep coming, and the bound set runs
        n = 64
        x, y = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
        bx.upload(x)
        by.upload(y)
        with CommandRecorder(d) as rec:
            rec.begin()
            rec.dispatch(pipe, made[0], 1, pipe.push(a=2.0, n=n))
            rec.end()
            rec.submit()
        np.testing.assert_array_equal(by.download(np.float32), 2.0 * x + 1.0)
        sets = [pipe.bind(bx, by) for _ in range(70)]  # past one pool of 64
        for ds in sets + made:
            ds.free()
        bx.close(), by.close(), pipe.close()
        assert not d.take_validation_messages()


def test_dispatch_checks_its_pipeline_and_descriptor_set(dev):
    """A closed pipeline crashed the driver in vkCmdBindPipeline, and a buffer of another Device object bound into a
    descriptor set crashed it in vkUpdateDescriptorSets; a freed set, a set whose buffer was closed after bind()
    and groups of the wrong kind were recorded or failed obscurely. Each now raises, naming what is wrong, and the
    recorder still records and runs right afterwards."""
    other = vkmoe.Device()
    try:
        pipe = Pipeline(dev, SAXPY, push=SaxpyPush)
        closed_pipe = Pipeline(dev, SAXPY, push=SaxpyPush)
        closed_pipe.close()
        foreign_pipe = Pipeline(other, SAXPY, push=SaxpyPush)
        with dev.memory.allocate(64) as x, dev.memory.allocate(64) as y, other.memory.allocate(64) as foreign, \
                CommandRecorder(dev) as rec:
            with pytest.raises(ValueError, match=r"binding 1 is a Buffer of another vkmoe\.Device"):
                pipe.bind(x, foreign)  # (was a segmentation fault)
            freed = pipe.bind(x, y)
            freed.free()
            late = dev.memory.allocate(64)
            stale = pipe.bind(late, y)
            late.close()
            push = pipe.push(a=2.0, n=16)
            rec.begin()
            for call, error, match in (
                    (lambda: rec.dispatch(closed_pipe, pipe.bind(x, y), 1, push), vkmoe.VkmoeError, "is closed"),
                    (lambda: rec.dispatch(foreign_pipe, foreign_pipe.bind(foreign, foreign), 1, push), ValueError,
                     "pipeline .* is a Pipeline of another vkmoe.Device"),
                    (lambda: rec.dispatch(pipe, foreign_pipe.bind(foreign, foreign), 1, push), ValueError,
                     "binding 0 is a Buffer of another vkmoe.Device"),
                    (lambda: rec.dispatch(pipe, freed, 1, push), vkmoe.VkmoeError, "the descriptor set is freed"),
                    (lambda: rec.dispatch(pipe, stale, 1, push), vkmoe.VkmoeError, "binding 0 is a closed Buffer"),
                    (lambda: rec.dispatch(pipe, pipe.bind(x, y), 1.5, push), TypeError, "groups must be an integer"),
                    (lambda: rec.dispatch(pipe, pipe.bind(x, y), (1, 1, 1, 1), push), TypeError,
                     "groups must be an integer or 1 to 3 integers"),
                    (lambda: rec.dispatch(pipe, pipe.bind(x, y), -1, push), vkmoe.VkmoeError,
                     r"-1 workgroups on axis 0: expected 0 \.\. ")):
                with pytest.raises(error, match=match):
                    call()
            x.upload(np.arange(16, dtype=np.float32))
            y_before = np.ones(16, np.float32)  # (saxpy reads y: y = a x + y)
            y.upload(y_before)
            rec.dispatch(pipe, pipe.bind(x, y), 1, push)
            rec.end()
            rec.submit(wait=True)
            assert np.allclose(y.download(np.float32, (16,)), 2.0 * np.arange(16) + y_before)
        pipe.close()
        foreign_pipe.close()
    finally:
        other.close()


def test_close_of_a_recorder_whose_run_outlasts_the_wait_frees_nothing_in_use(dev, monkeypatch):
    """close() waits for the last submission; when that wait gives up (VKMOE_TIMEOUT) the command buffer is still in
    use, and freeing it was undefined (the validation layer: 'Attempt to free VkCommandBuffer ... which is in use').
    Now the recorder is closed for use at once and its objects are freed by a later close()."""
    with SpinRun(dev, groups=1024) as spin:  # seconds on lavapipe, as test_wait_timeout_raises_then_recovers
        rec = spin.rec
        rec.submit(wait=False)
        monkeypatch.setenv("VKMOE_TIMEOUT", "0.05")
        rec.close()
        skip_if_over(rec, "close()'s wait gave up")
        assert rec.handle is not None and rec.pending  # still running: nothing freed
        with pytest.raises(vkmoe.VkmoeError, match=r"CommandRecorder used after close\(\)"):
            rec.submit()
        monkeypatch.setenv("VKMOE_TIMEOUT", "120")
        rec.close()  # the run is over (or this close waits for it): now freed
        assert rec.handle is None


def test_a_buffer_closed_under_a_running_submission_outlives_the_run(dev):
    """Closing a Buffer that a submitted command buffer still used gave its memory back at once: a buffer of its
    own block crashed the process (segfault in the driver; the validation layer: VUID-vkDestroyBuffer-buffer-00922),
    and one in a shared block was handed to the next allocation while the run still wrote into it. Now close()
    waits for the run (vk.in_flight), the next buffer in that memory keeps what the host wrote, and the recording
    refuses to run again, naming why."""
    with SpinRun(dev) as spin:  # long enough that the run is still going when close() comes
        keep = dev.memory.allocate(64)  # (in the same block, which stays: the next buffer gets the closed range)
        words, buf, rec = spin.buf.size // 4, spin.buf, spin.rec
        block, offset = buf.block, buf.offset
        rec.submit(wait=False)
        skip_if_over(rec, "the close")
        buf.close()
        assert fence_signalled(rec)  # close() came back only after the run
        with pytest.raises(vkmoe.VkmoeError, match="a Buffer that was closed after it was recorded"):
            rec.submit()
        with dev.memory.allocate(4 * words) as reused:
            assert (reused.block, reused.offset) == (block, offset)
            sentinel = np.full(words, 0xA5A5A5A5, np.uint32)
            reused.upload(sentinel)
            rec.wait(timeout=120)
            assert np.array_equal(reused.download(np.uint32, (words,)), sentinel)
        rec.begin()  # recorded again without the buffer: runs
        rec.end()
        rec.submit(wait=True)
        keep.close()


def test_a_pipeline_and_a_descriptor_set_closed_under_a_run_outlive_it(dev):
    """vkDestroyPipeline and vkFreeDescriptorSets under a running submission were undefined too; both wait for it."""
    with SpinRun(dev) as spin:
        for close in ("set", "pipeline"):
            with CommandRecorder(dev) as rec:
                dset = spin.pipe.bind(spin.buf)
                rec.begin()
                rec.dispatch(spin.pipe, dset, 256, spin.pipe.push(iterations=20000))
                rec.end()
                rec.submit(wait=True, timeout=600)
                rec.submit(wait=False)
                skip_if_over(rec, "the close")
                (dset.free if close == "set" else spin.pipe.close)()
                assert fence_signalled(rec)
                what = "a descriptor set" if close == "set" else "a Pipeline"
                with pytest.raises(vkmoe.VkmoeError, match=f"{what} that was closed after it was recorded"):
                    rec.submit()
        assert spin.pipe.closed and spin.pipe.handle is None
        with pytest.raises(vkmoe.VkmoeError, match="the pipeline is closed"):
            spin.pipe.bind(spin.buf)  # (was a TypeError from the driver binding: "an integer is required")


def test_a_close_whose_run_outlasts_the_wait_frees_the_memory_later(dev, monkeypatch):
    """When the wait for the run gives up (VKMOE_TIMEOUT: a hung or very busy device), the buffer is closed for use
    but its memory is kept until the run is over: the next buffer does not get it, a later close() gives it back."""
    with SpinRun(dev, groups=1024) as spin:  # seconds on lavapipe
        keep = dev.memory.allocate(64)
        buf, rec = spin.buf, spin.rec
        block, offset, nbytes = buf.block, buf.offset, buf.size
        rec.submit(wait=False)
        monkeypatch.setenv("VKMOE_TIMEOUT", "0.05")
        buf.close()
        skip_if_over(rec, "close()'s wait gave up")
        assert buf.closed
        with pytest.raises(vkmoe.VkmoeError, match="buffer used after close"):
            buf.upload(np.zeros(4, np.uint32))
        with dev.memory.allocate(nbytes) as other:
            assert (other.block, other.offset) != (block, offset)  # the range is still the run's
        monkeypatch.setenv("VKMOE_TIMEOUT", "120")
        dev.wait_idle()  # (the run and the close's own fence behind it: rec.wait() alone may see the run end first)
        dev.memory.allocate(16).close()  # any later close gives back what waited for a finished run
        with dev.memory.allocate(nbytes) as again:
            assert (again.block, again.offset) == (block, offset)
        keep.close()


def test_a_device_array_read_waits_for_a_run_that_uses_it(dev, monkeypatch):
    """DeviceArray.numpy() right after submit(wait=False) read the buffer under the run: it waits for the run now,
    and raises vkmoe.TimeoutError (the device stays usable) when the run outlasts VKMOE_TIMEOUT."""
    from vkmoe.ops.device_array import DeviceArray

    with SpinRun(dev, groups=1024) as spin:
        arr = DeviceArray(spin.buf, (spin.buf.size // 4,), np.uint32)
        done = arr.numpy()  # (the first run's output; the runs below write the same words again)
        spin.buf.upload(np.arange(spin.buf.size // 4, dtype=np.uint32))
        spin.rec.submit(wait=False)
        monkeypatch.setenv("VKMOE_TIMEOUT", "0.05")
        try:
            arr.numpy()
        except vkmoe.TimeoutError as exc:
            assert "did not finish within 0.05 s" in str(exc)
        else:  # (numpy() returned: it must have waited for the run, which ended within the timeout)
            assert fence_signalled(spin.rec)
            skip_if_over(spin.rec, "numpy()'s wait gave up")
        monkeypatch.setenv("VKMOE_TIMEOUT", "120")
        assert np.array_equal(arr.numpy(), done)
        spin.buf.upload(np.arange(spin.buf.size // 4, dtype=np.uint32))
        spin.rec.submit(wait=False)
        assert np.array_equal(arr.numpy(), done) and fence_signalled(spin.rec)


def test_one_recorder_or_buffer_closed_from_two_threads_is_freed_once(dev):
    """A recorder closed by its owner while the device's close (or another thread) closed it too freed its fence and
    command buffer twice (the validation layer: "Invalid VkFence"; then a TypeError from the binding), and a buffer
    closed twice at once gave its range back twice, so two later buffers could share memory."""
    import threading

    for _ in range(200):
        rec, buf = CommandRecorder(dev), dev.memory.allocate(256)
        rec.begin()
        rec.fill(buf, 7)
        rec.end()
        rec.submit(wait=False)
        go = threading.Barrier(2)
        errors = []

        def close_both():
            try:
                go.wait()
                rec.close()
                buf.close()
            except Exception as exc:  # (collected: an exception in a thread would not fail the test)
                errors.append(repr(exc))

        threads = [threading.Thread(target=close_both) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and rec.handle is None and buf.closed
    ranges = [dev.memory.allocate(256) for _ in range(64)]
    try:
        assert len({(id(b.block), b.offset) for b in ranges}) == len(ranges)  # no range handed out twice
    finally:
        for b in ranges:
            b.close()


def test_a_recording_that_uses_a_closed_buffer_is_not_submitted(dev):
    """A recording made with a buffer closed later (no run in flight) ran with the freed buffer: submit() and a
    submission carrying it as a rider raise instead; begin() ... end() makes it usable again."""
    pipe = Pipeline(dev, SAXPY, push=SaxpyPush)
    x, y = dev.memory.allocate(64), dev.memory.allocate(64)
    try:
        with CommandRecorder(dev) as rec, CommandRecorder(dev) as rider:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(x, y), 1, pipe.push(a=1.0, n=16))
            rec.end()
            tmp = dev.memory.allocate(64)
            rider.begin()
            rider.copy(tmp, y, 64)
            rider.end()
            tmp.close()
            with pytest.raises(vkmoe.VkmoeError, match="a recording there cannot run again: it uses a Buffer"):
                rec.submit(before=[rider])
            rec.submit(wait=True)  # (its own recording is fine)
            x.close()
            with pytest.raises(vkmoe.VkmoeError, match=r"submit\(\): this recording cannot run again: it uses a "
                                                        r"Buffer that was closed after it was recorded"):
                rec.submit()
            rec.begin()
            rec.fill(y, 0)
            rec.end()
            rec.submit(wait=True)
    finally:
        x.close()
        y.close()
        pipe.close()


def test_recorder_arguments_are_checked(dev):
    """timestamps=10**9 allocated 8 GB of host memory at once (the process was killed), -1 raised an OverflowError
    and "4" was taken; a recorder riding on its own submission reached vkQueueSubmit (invalid: one command buffer
    twice), a non-recorder rider an AttributeError; a NaN timeout failed deep in the wait; timestamps read before any
    submission raised VK_NOT_READY."""
    for bad in (10**9, -1, "4", 2.5, True):
        with pytest.raises(ValueError, match=r"timestamps: expected an integer number of slots in 0 \.\. "):
            CommandRecorder(dev, timestamps=bad)
    with CommandRecorder(dev, timestamps=2) as rec, CommandRecorder(dev) as other:
        rec.begin()
        rec.timestamp()
        rec.timestamp()
        rec.end()
        with pytest.raises(vkmoe.VkmoeError, match=r"timestamps_ms\(\): this recording has not been submitted yet"):
            rec.timestamps_ms()
        other.begin()
        other.end()
        for kwargs, error, match in (({"after": [rec]}, ValueError, "each recorder at most once, and not the "
                                                                    "submitting one"),
                                     ({"before": [other, other]}, ValueError, "each recorder at most once"),
                                     ({"before": [1]}, TypeError, "takes CommandRecorders, got int"),
                                     ({"timeout": float("nan")}, ValueError, "timeout: expected a number of seconds"),
                                     ({"timeout": -1}, ValueError, "timeout: expected a number of seconds"),
                                     ({"timeout": "1"}, ValueError, "timeout: expected a number of seconds")):
            with pytest.raises(error, match=match):
                rec.submit(**kwargs)
        rec.submit(before=[other], timeout=60)  # the recorder still runs
        stamps = rec.timestamps_ms()
        assert len(stamps) == 2 and stamps[0] == 0.0 and stamps[1] >= 0.0
        with pytest.raises(ValueError, match="timeout: expected a number of seconds"):
            rec.wait(timeout=float("nan"))


def test_a_corrupt_spirv_file_raises_instead_of_hanging(tmp_path, dev):
    """reflect() looped forever on an instruction with word count 0 (a corrupt or truncated .spv)."""
    for name, data in (("zero_count", b"\x03\x02\x23\x07" + b"\x00" * 60),
                       ("past_end", b"\x03\x02\x23\x07" + b"\x00" * 16 + b"\x0b\x00\x50\x00"),
                       ("empty", b""), ("odd", b"\x03\x02\x23\x07" + b"\x00" * 17),
                       ("text", b"#version 450\nvoid main() {}\n" + b" " * 32)):
        path = tmp_path / f"{name}.spv"
        path.write_bytes(data)
        raised = []

        def make(path=path):
            try:
                Pipeline(dev, str(path))
            except vkmoe.VkmoeError as exc:
                raised.append(str(exc))

        _run_bounded(make, seconds=10.0)  # (the loop ran forever here)
        assert len(raised) == 1 and re.search(rf"{name}\.spv: (malformed SPIR-V module|not a SPIR-V module)",
                                              raised[0]), raised


def _run_bounded(fn, seconds=20.0):
    """fn() in a thread; fails (instead of hanging the suite) if it does not return within `seconds`."""
    import threading

    done = threading.Event()
    errors = []

    def body():
        try:
            fn()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=body, daemon=True).start()
    assert done.wait(seconds), "deadlock: the call did not return"
    assert not errors, errors


@pytest.mark.parametrize("inside", ["release", "allocate"])
def test_a_finalizer_releasing_buffers_inside_the_memory_manager_does_not_deadlock(dev, monkeypatch, inside):
    """A garbage collection can run a dropped layer's finalizer in the middle of MemoryManager.allocate() or
    release() (any Python allocation may start one); the finalizer closes buffers, which re-enters release() on
    the same thread. That deadlocked the full suite once (a plain lock); now such a release waits until the
    outer call is done with the blocks, and the memory is still freed."""
    from vkmoe.vk import memory

    mm = dev.memory
    victim = mm.allocate(4096)
    others = [mm.allocate(4096) for _ in range(2)]
    free_before = sum(sz for b in mm._blocks["device"] for _, sz in b.free)
    fired = []
    target = memory._Block.release if inside == "release" else memory._Block.allocate

    def reentering(self, *args, **kwargs):
        if not fired:  # what a finalizer run by the collector here would do
            fired.append(True)
            victim.close()
            assert mm._deferred == [victim]  # deferred: the outer call is still working on the blocks
        return target(self, *args, **kwargs)

    monkeypatch.setattr(memory._Block, inside, reentering)

    def work():
        if inside == "release":
            others[0].close()
        else:
            others.append(mm.allocate(4096))

    _run_bounded(work)
    monkeypatch.undo()
    assert fired and victim.closed and not mm._deferred
    free_after = sum(sz for b in mm._blocks["device"] for _, sz in b.free)
    # the victim's space came back (and, for release, others[0]'s; for allocate, one more 4096 was taken)
    expected = free_before + 4096 + (4096 if inside == "release" else -4096)
    assert free_after == expected
    for b in others[1:]:
        b.close()


def test_no_leak_over_1000_cycles(dev):
    x = np.arange(256, dtype=np.float32)
    blocks = children = None
    for i in range(1001):
        if i == 1:  # after one warm-up cycle: the manager keeps one empty block per memory kind for reuse
            blocks, children = dev.memory.block_count(), len(dev._children)
        pipe = Pipeline(dev, SAXPY, push=SaxpyPush, spec={0: float(i)})
        bx, by = dev.memory.allocate(x.nbytes), dev.memory.allocate(x.nbytes, host_visible=(i % 2 == 0))
        bx.upload(x)
        by.upload(x)
        with CommandRecorder(dev) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(bx, by), 4, pipe.push(a=1.0, n=256))
            rec.end()
            rec.submit(timeout=30)
        assert by.download(np.float32)[1] == np.float32(2.0 + i)
        bx.close(), by.close(), pipe.close()
    assert dev.memory.block_count() == blocks
    assert len(dev._children) == children


def test_close_waits_for_use_blocks_and_refuses_new_ones():
    """Device.use() (no lock on its way in and out): close() waits until a block running in another thread (nested
    here) has left, a block started meanwhile raises DeviceClosedError, and close() then returns."""
    import threading

    from vkmoe.vk import DeviceClosedError

    d = vkmoe.Device()
    inside, leave, closed = threading.Event(), threading.Event(), threading.Event()

    def block():
        with d.use(), d.use():
            inside.set()
            leave.wait(20)

    user = threading.Thread(target=block)
    user.start()
    assert inside.wait(20)
    closer = threading.Thread(target=lambda: (d.close(), closed.set()))
    closer.start()
    assert not closed.wait(0.5), "close() did not wait for the running block"
    with pytest.raises(DeviceClosedError):
        with d.use():
            pass
    assert not closed.is_set()
    leave.set()
    user.join(20)
    closer.join(20)
    assert closed.is_set() and not d._holds


def test_device_create_destroy_cycles():
    # In a subprocess so that the RSS measured is this loop's alone.
    code = r"""
import resource, sys, vkmoe, numpy as np
from vkmoe.vk import CommandRecorder, Pipeline, PushConstants
SAXPY = sys.argv[1]
class P(PushConstants):
    fields = [("a", "<f4"), ("n", "<u4")]
def cycle():
    d = vkmoe.Device()
    b = d.memory.allocate(1 << 16)
    b.upload(np.ones(16, np.float32))
    p = Pipeline(d, SAXPY, push=P, spec={0: 1.0})
    rec = CommandRecorder(d)
    rec.begin(); rec.dispatch(p, p.bind(b, b), 1, p.push(a=1.0, n=16)); rec.end(); rec.submit(timeout=30)
    d.close()  # closes what it still tracks: the buffer, the pipeline and the recorder
    m = d.take_validation_messages()
    assert m == [], m
for _ in range(20):
    cycle()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for _ in range(200):
    cycle()
r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((r1 - r0) // 1024)
"""
    out = subprocess.run([sys.executable, "-c", code, SAXPY], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=python_env())
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib = int(out.stdout.strip().splitlines()[-1])
    assert grown_mib < 64, f"RSS grew {grown_mib} MiB over 200 device cycles"


def test_failed_pipeline_creation_leaks_nothing():
    # Under VKMOE_VALIDATION=1 (make test) destroying the device reports any object a failed constructor left.
    dev = vkmoe.Device()
    dev.take_validation_messages()
    with pytest.raises(vkmoe.VkmoeError, match="specialization constant id 7"):
        Pipeline(dev, SAXPY, push=SaxpyPush, spec={7: 1})
    dev.close()
    assert dev.take_validation_messages() == []


@pytest.mark.parametrize("what", ["upload", "download"])
def test_buffer_upload_and_download_wait_for_an_unwaited_run_that_uses_the_buffer(dev, what):
    """Buffer.upload() under a run of the caller's submit(wait=False) that reads the buffer changed what the run
    read, and download() under a run that writes it returned the contents from before: both wait for such a run
    first. The run here is a spin and then a copy from (upload) or into (download) the buffer."""
    n = 4096
    old, new = np.arange(n, dtype=np.uint32), np.arange(n, dtype=np.uint32)[::-1] * 3
    groups, iterations = (64, 5000) if dev.device_type == "cpu" else (1024, 400000)
    with SpinRun(dev, groups, iterations) as spin, dev.memory.allocate(4 * n) as buf, \
            dev.memory.allocate(4 * n) as other, CommandRecorder(dev) as rec:
        buf.upload(old)
        other.upload(new if what == "download" else np.zeros(n, np.uint32))
        rec.begin()
        rec.barrier()  # (after the spin riding ahead of it)
        if what == "upload":
            rec.copy(buf, other, 4 * n)  # the run reads buf: it must see `old`
        else:
            rec.copy(other, buf, 4 * n)  # the run writes buf: download() must see `new`
        rec.end()
        rec.submit(wait=False, before=[spin.rec])
        skip_if_over(rec, f"the {what}")
        if what == "upload":
            buf.upload(new)
            assert fence_signalled(rec)
            assert np.array_equal(other.download(np.uint32), old)
            assert np.array_equal(buf.download(np.uint32), new)
        else:
            assert np.array_equal(buf.download(np.uint32), new)
        rec.wait()


def test_a_run_whose_wait_gave_up_is_still_waited_for_by_reads(dev):
    """A submission whose wait raised (a timeout, an interrupt) may still run: DeviceArray.numpy() and
    Buffer.download() of what it writes wait for it as for a submit(wait=False) (they look only at those)."""
    from vkmoe.ops.device_array import DeviceArray

    n = 4096
    new = np.arange(n, dtype=np.uint32)[::-1] * 3
    groups, iterations = (64, 5000) if dev.device_type == "cpu" else (1024, 400000)
    with SpinRun(dev, groups, iterations) as spin, dev.memory.allocate(4 * n) as src, \
            DeviceArray.empty(dev, (n,), np.uint32) as arr, CommandRecorder(dev) as rec:
        src.upload(new)
        arr.buffer.upload(np.zeros(n, np.uint32))
        rec.begin()
        rec.barrier()  # (after the spin riding ahead of it)
        rec.copy(src, arr.buffer, 4 * n)
        rec.end()
        with pytest.raises(vkmoe.TimeoutError):
            rec.submit(wait=True, timeout=0.001, before=[spin.rec])
        skip_if_over(rec, "the read")
        assert np.array_equal(arr.numpy(), new)
        assert fence_signalled(rec)
