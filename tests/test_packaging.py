"""What a pip user meets first: the `vkmoe` command, `import vkmoe` on a machine without Vulkan, the message
when there is no driver, and the public random-layer helpers."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import vkmoe
from subproc import python_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code, env_extra=None, drop=(), timeout=300):
    """Run `code` in a fresh interpreter from the repository root; returns the CompletedProcess."""
    extra = dict(env_extra or {})
    env = {k: v for k, v in python_env(*extra.pop("PYTHONPATH", "").split(os.pathsep), **extra).items()
           if k not in drop}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------ the command
def test_version_in_one_place():
    from vkmoe._version import __version__

    assert vkmoe.__version__ == __version__
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'version = { attr = "vkmoe._version.__version__" }' in f.read()
    r = run_python("from vkmoe.cli import main; raise SystemExit(main(['--version']))")
    assert r.returncode == 0 and r.stdout.strip() == f"vkmoe {__version__}", r


@pytest.mark.parametrize("command, option", [("bench", "--store-crossover"), ("check-decode", "--k"),
                                             ("make-checkpoint", "--out")])
def test_tool_commands_reach_their_scripts(command, option):
    r = run_python(f"from vkmoe.cli import main; raise SystemExit(main([{command!r}, '--help']))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: ") and option in r.stdout, r.stdout[:300]


def test_make_checkpoint_command_writes_a_loadable_checkpoint(tmp_path):
    from vkmoe.cli import main
    from vkmoe.models import SparseMoeBlock

    out = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--hidden", "256", "--intermediate", "128", "--experts", "4", "--top-k", "2",
                 "--out", str(out)]) == 0
    block = SparseMoeBlock.from_checkpoint(str(out), 0, backend="cpu")
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float16)
    y, ref = block(x), block.reference(x)
    assert y.shape == (3, 256) and np.abs(ref).max() > 0
    assert np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)) < 3e-3


def test_command_help_lists_every_subcommand():
    r = run_python("from vkmoe.cli import main; raise SystemExit(main(['--help']))")
    assert r.returncode == 0
    for command in ("info", "probe", "demo", "bench", "check-decode", "make-checkpoint"):
        assert command in r.stdout, f"{command} missing from `vkmoe --help`"


def test_unknown_subcommand_is_a_usage_error():
    r = run_python("from vkmoe.cli import main; raise SystemExit(main(['frobnicate']))")
    assert r.returncode == 2 and "invalid choice: 'frobnicate'" in r.stderr


# ------------------------------------------------------------------------------------- no Vulkan loader
NO_LOADER_CODE = """
    import json, sys
    import numpy as np
    import vkmoe
    assert "vulkan" not in sys.modules or not hasattr(sys.modules["vulkan"], "vkCreateInstance")
    report = {"models": hasattr(vkmoe.models, "SparseMoeBlock"), "registry": hasattr(vkmoe.registry, "create")}
    gate, up, down = vkmoe.random_moe_layer(256, 128, experts=4, seed=0)
    ids, w = vkmoe.random_routing(3, 4, 2, seed=0)
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float16)
    y = vkmoe.cpu.moe_forward(x, ids, w, gate, up, down)
    ref = vkmoe.exl3.reference.moe_forward(x, ids, w, gate, up, down)
    report["cpu_rel_rms"] = float(np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2)))
    report["backend"] = vkmoe.registry.select_backend(ops=("exl3_moe_mlp",))
    op = vkmoe.registry.create("exl3_moe_mlp", gate, up, down)
    report["registry_rel_rms"] = float(np.sqrt(np.mean((op(x, ids, w) - ref) ** 2) / np.mean(ref ** 2)))
    try:
        vkmoe.Device()
    except Exception as exc:
        report["device_error"] = [type(exc).__name__, str(exc)]
    print(json.dumps(report))
"""


def test_import_and_cpu_tier_without_a_vulkan_loader(tmp_path):
    # A `vulkan` module that fails as the real binding does when libvulkan.so.1 is missing, first on the path.
    (tmp_path / "vulkan.py").write_text(
        "raise OSError('Cannot find Vulkan SDK version. Please ensure that it is installed and that the "
        "<sdk_root>/<version>/lib/ folder is in the library path')\n")
    r = run_python(NO_LOADER_CODE, env_extra={"PYTHONPATH": str(tmp_path)}, drop=("VKMOE_BACKEND",))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["models"] and report["registry"]
    assert report["cpu_rel_rms"] < 3e-3 and report["registry_rel_rms"] < 3e-3
    assert report["backend"] == "cpu"
    name, message = report["device_error"]
    assert name == "NoVulkanError"
    assert "libvulkan1 mesa-vulkan-drivers" in message and "vkmoe.cpu" in message, message


def test_command_without_a_vulkan_loader_says_what_to_install(tmp_path):
    (tmp_path / "vulkan.py").write_text("raise OSError('Cannot find Vulkan SDK version')\n")
    r = run_python("from vkmoe.cli import main; raise SystemExit(main(['info']))",
                   env_extra={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.startswith("vkmoe info: error: the Vulkan loader (libvulkan.so.1) could not be loaded")
    assert "apt-get install libvulkan1 mesa-vulkan-drivers" in r.stderr and "Traceback" not in r.stderr


def test_demo_command_passes():
    r = run_python("from vkmoe.cli import main; raise SystemExit(main(['demo', '--experts', '8', '--tokens', '2']))")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "PASS" and any(line.strip().startswith("vs CPU tier:") for line in lines)
    assert "[vkmoe.demo] building 8 random experts" in r.stderr  # progress through logging, shown by the command


def test_no_driver_says_what_to_install(tmp_path):
    missing = str(tmp_path / "no-such-icd.json")
    r = run_python("""
        import vkmoe
        try:
            vkmoe.Device()
        except vkmoe.NoVulkanError as exc:
            print("NoVulkanError:", exc)
        """, env_extra={"VK_DRIVER_FILES": missing, "VK_ICD_FILENAMES": missing}, drop=("VKMOE_VALIDATION",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("NoVulkanError: the Vulkan loader found no driver"), r.stdout
    assert "apt-get install libvulkan1 mesa-vulkan-drivers" in r.stdout


def test_lazy_attributes():
    assert set(dir(vkmoe)) >= {"Device", "Exl3MoeMlp", "cpu", "registry", "models", "random_moe_layer"}
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        vkmoe.nonexistent  # noqa: B018


# ------------------------------------------------------------------------------------ random helpers
def test_random_exl3_tensor_has_unit_gain():
    t = vkmoe.random_exl3_tensor(512, 256, bits=3, codebook="mcg", out_scale=0.5, seed=4)
    assert (t.k, t.n, t.bits, t.codebook) == (512, 256, 3, "mcg")
    x = np.random.default_rng(1).standard_normal((16, 512)).astype(np.float16)
    y = vkmoe.exl3.reference.linear_forward(x, t)
    rms = float(np.sqrt(np.mean(np.asarray(y, np.float64) ** 2)))
    assert 0.3 < rms < 0.8, f"output rms {rms}, expected about out_scale 0.5"
    same = vkmoe.random_exl3_tensor(512, 256, bits=3, codebook="mcg", out_scale=0.5, seed=4)
    assert np.array_equal(t.trellis, same.trellis) and np.array_equal(t.suh, same.suh)


def test_random_moe_layer_shapes_and_gateless():
    gate, up, down = vkmoe.random_moe_layer(256, 128, experts=3, bits=(2, 3, 5), seed=1)
    assert [len(gate), len(up), len(down)] == [3, 3, 3]
    assert (gate[0].bits, up[0].bits, down[0].bits) == (2, 3, 5)
    assert (up[0].k, up[0].n, down[0].k, down[0].n) == (256, 128, 128, 256)
    gate, up, down = vkmoe.random_moe_layer(256, 128, experts=2, activation="relu2")
    assert gate is None and len(up) == 2


@pytest.mark.parametrize("call, match", [
    (lambda: vkmoe.random_exl3_tensor(100, 128), r"k: expected a positive multiple of 128, got 100"),
    (lambda: vkmoe.random_exl3_tensor(128, 128, bits=9), r"bits: expected an integer bit width in 1..8, got 9"),
    (lambda: vkmoe.random_exl3_tensor(128, 128, codebook="q4"), r"codebook: expected one of .*got 'q4'"),
    (lambda: vkmoe.random_moe_layer(128, 128, experts=0), r"experts: expected a positive integer, got 0"),
    (lambda: vkmoe.random_moe_layer(128, 128, 2, bits=(4, 4)), r"bits: expected an integer or a \(gate, up, down\)"),
    (lambda: vkmoe.random_routing(2, 4, 5), r"top_k: expected at most experts=4, got 5"),
    (lambda: vkmoe.random_routing(-1, 4, 2), r"m: expected a non-negative integer, got -1"),
])
def test_random_helpers_reject_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------ library manners
def test_cache_dir_from_platformdirs_unless_overridden(tmp_path, monkeypatch):
    platformdirs = pytest.importorskip("platformdirs")  # (the next test covers an environment without it)

    from vkmoe.vk.quirks import cache_dir

    monkeypatch.delenv("VKMOE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == platformdirs.user_cache_dir("vkmoe", appauthor=False) == str(tmp_path / "xdg" / "vkmoe")
    assert not os.path.exists(cache_dir())  # created only when a cache file is stored (vkmoe/vk/cachefile.py)
    monkeypatch.setenv("VKMOE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == str(tmp_path / "own")


@pytest.mark.skipif(sys.platform == "win32", reason="the POSIX rules are checked here")
def test_cache_dir_without_platformdirs_is_platformdirs_answer(tmp_path, monkeypatch):
    """A declared dependency, but an environment without it (seen on a GPU machine's image) failed every auto-mode
    op call with ModuleNotFoundError: the residency cache's directory is looked up there. Now the same directory
    comes from the same variables without it."""
    from vkmoe.vk import cachefile

    try:
        import platformdirs
    except ImportError:
        platformdirs = None
    monkeypatch.delenv("VKMOE_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in (str(tmp_path / "xdg"), "relative/ignored", None):
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        monkeypatch.setattr(cachefile, "_platform_dirs", {})
        monkeypatch.setitem(sys.modules, "platformdirs", None)  # import platformdirs raises ImportError
        got = cachefile.cache_dir()
        monkeypatch.delitem(sys.modules, "platformdirs")
        if platformdirs is not None:
            assert got == platformdirs.user_cache_dir("vkmoe", appauthor=False), xdg
        if sys.platform != "darwin":
            assert got == (os.path.join(xdg, "vkmoe") if xdg and os.path.isabs(xdg)
                           else str(tmp_path / "home" / ".cache" / "vkmoe")), xdg


def test_library_calls_print_nothing(tmp_path, capfd):
    from vkmoe.models import write_checkpoint

    write_checkpoint(str(tmp_path / "ckpt"), hidden=256, intermediate=128, experts=4, top_k=2)
    gate, up, down = vkmoe.random_moe_layer(256, 128, experts=4, seed=0)
    ids, w = vkmoe.random_routing(2, 4, 2)
    vkmoe.cpu.moe_forward(np.ones((2, 256), np.float16), ids, w, gate, up, down)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


# -------------------------------------------------------------------------------------- self-contained
# What a file must not name: a sibling of the repository, or a particular machine's absolute path.
FOREIGN_REFERENCES = ("../shared", "/work/", "PERF-NOTES", "ARCHITECTURE.md", "EXL3-MOE.md", "device-prep")
# Raw tool outputs kept as recorded (their "source" field predates the reference table in BENCHMARKS.md).
RECORDED_OUTPUTS = os.path.join("docs", "bench")


def repository_text_files():
    for top, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__", "_spv")
                   and not d.endswith(".egg-info")]
        rel_top = os.path.relpath(top, ROOT)
        if rel_top == RECORDED_OUTPUTS or rel_top.startswith(RECORDED_OUTPUTS + os.sep):
            continue
        for name in files:
            if name.endswith((".npz", ".so", ".png", ".spv", ".pyc")):
                continue
            if name == ".git":  # a git worktree's pointer to its repository: git's, not the repository's text
                continue
            yield os.path.join(top, name)


def test_no_file_names_anything_outside_the_repository():
    offenders = []
    for path in repository_text_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                hits = [ref for ref in FOREIGN_REFERENCES if ref in line and "FOREIGN_REFERENCES" not in line]
                if hits and os.path.abspath(path) != os.path.abspath(__file__):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{lineno}: {hits}")
    assert not offenders, "files citing paths outside the repository:\n" + "\n".join(offenders)


def test_golden_vectors_ship_in_the_repository():
    import goldens

    data = os.path.join(ROOT, "tests", "data", "golden")
    assert len([n for n in os.listdir(data) if n.endswith(".npz")]) == 13
    assert os.path.exists(os.path.join(data, "README.md"))
    if not os.environ.get("VKMOE_GOLDEN_DIR"):
        assert os.path.samefile(goldens.GOLDEN_DIR, data)
