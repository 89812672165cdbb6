"""The build's SPIR-V pass (shaders/no_contraction.py): NoContraction on every float arithmetic result, so that no
driver fuses or reassociates differently in two pipelines of one source (the Hadamard builds on an H100)."""
import glob
import importlib.util
import os
import shutil
import subprocess

import numpy as np
import pytest

from vkmoe.vk import CommandRecorder, Pipeline, PushConstants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("no_contraction", os.path.join(ROOT, "shaders", "no_contraction.py"))
no_contraction = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(no_contraction)

BUILT = sorted(glob.glob(os.path.join(ROOT, "vkmoe", "_spv", "*.spv")) + glob.glob(os.path.join(ROOT, "tests", "_spv", "*.spv")))


class SaxpyPush(PushConstants):
    fields = [("a", "<f4"), ("n", "<u4")]


def test_every_built_module_forbids_contraction():
    assert len(BUILT) > 20
    left = {os.path.relpath(p, ROOT): len(no_contraction.undecorated(open(p, "rb").read())) for p in BUILT}
    assert {p: n for p, n in left.items() if n} == {}, "run `python setup.py build_shaders`"


@pytest.fixture
def plain_saxpy(tmp_path):
    """tests/shaders/test_saxpy.comp (y = a * x + y + bias) compiled by glslc without the pass."""
    glslc = shutil.which("glslc")
    if glslc is None:
        pytest.skip("needs glslc")
    out = tmp_path / "saxpy.spv"
    subprocess.run([glslc, "--target-env=vulkan1.2", "-O", os.path.join(ROOT, "tests", "shaders", "test_saxpy.comp"),
                    "-o", str(out)], check=True)
    return out


def test_the_pass_decorates_each_float_operation_once(plain_saxpy):
    plain = plain_saxpy.read_bytes()
    arithmetic = no_contraction.undecorated(plain)
    assert len(arithmetic) >= 2  # a * x, + y (+ bias)
    once = no_contraction.forbid_contraction(plain)
    assert no_contraction.undecorated(once) == []
    assert len(once) == len(plain) + 12 * len(set(arithmetic))  # one 3-word OpDecorate per result
    assert no_contraction.forbid_contraction(once) == once


def test_a_decorated_module_runs_and_rounds_each_operation(dev, plain_saxpy):
    """a * x + y + bias rounded after every operation, as numpy's float32 does: a fused a * x + y would differ in
    the last bit for some of these values. Under VKMOE_VALIDATION the layers check the edited module too."""
    no_contraction.forbid_contraction_in_file(str(plain_saxpy))
    n = 4096
    rng = np.random.default_rng(7)
    x = rng.standard_normal(n).astype(np.float32)
    y = (rng.standard_normal(n) * 1e3).astype(np.float32)
    a, bias = np.float32(1.0000001), np.float32(0.3)
    dev.take_validation_messages()
    pipe = Pipeline(dev, str(plain_saxpy), push=SaxpyPush, spec={0: float(bias)})
    bx, by = dev.memory.allocate(x.nbytes), dev.memory.allocate(y.nbytes)
    try:
        bx.upload(x)
        by.upload(y)
        with CommandRecorder(dev) as rec:
            rec.begin()
            rec.dispatch(pipe, pipe.bind(bx, by), n // 64, pipe.push(a=float(a), n=n))
            rec.end()
            rec.submit(timeout=30)
        got = by.download(np.float32)
    finally:
        bx.close(), by.close(), pipe.close()
    assert dev.take_validation_messages() == []
    want = (a * x + y) + bias  # numpy: a * x rounded, then each sum rounded
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("blob, words", [(b"\x03\x02\x23", "bytes"), (b"\0" * 20, "magic"),
                                         (b"\x03\x02\x23\x07" + b"\0" * 16 + b"\x00\x00\x09\x00", "word count")])
def test_a_module_that_is_not_spirv_is_refused(blob, words):
    with pytest.raises(ValueError, match=words):
        no_contraction.forbid_contraction(blob)
