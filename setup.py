"""Build script: compiles shaders/*.comp to SPIR-V (vkmoe/_spv/) and the native CPU tier (native/) via cffi.

`python setup.py build_shaders` recompiles only the shaders whose source or includes changed.
"""
import glob
import os
import shutil
import subprocess
import sys

from setuptools import Command, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
SHADER_DIR = os.path.join(HERE, "shaders")
SPV_DIR = os.path.join(HERE, "vkmoe", "_spv")
# Shaders only the tests use: compiled beside them (tests/_spv), outside the package.
TEST_SHADER_DIR = os.path.join(HERE, "tests", "shaders")
TEST_SPV_DIR = os.path.join(HERE, "tests", "_spv")
# Vulkan 1.2 SPIR-V 1.5 is the floor: the Vulkan memory model (device-scope acquire/release) needs it.
GLSLC_FLAGS = ["--target-env=vulkan1.2", "-O", "-I", os.path.join(SHADER_DIR, "include")]
LAYOUT_MODULE = os.path.join(HERE, "vkmoe", "layout.py")
LAYOUT_HEADER = os.path.join(SHADER_DIR, "include", "generated", "moe_layout.glsl")


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


def compile_shaders(force=False, verbose=True):
    """Compile every shaders/*.comp, shaders/probes/*.comp (into vkmoe/_spv) and tests/shaders/*.comp (into
    tests/_spv), with their variants, that is older than its source or any include.
    Returns the number of SPIR-V files built."""
    glslc = shutil.which("glslc")
    write_layout_header()
    # shaders/probes/: the driver and residency probes (same output directory: names are unique)
    sources = [(src, SPV_DIR) for src in sorted(glob.glob(os.path.join(SHADER_DIR, "*.comp"))
                                                + glob.glob(os.path.join(SHADER_DIR, "probes", "*.comp")))]
    sources += [(src, TEST_SPV_DIR) for src in sorted(glob.glob(os.path.join(TEST_SHADER_DIR, "*.comp")))]
    includes = glob.glob(os.path.join(SHADER_DIR, "include", "**", "*.glsl"), recursive=True)
    newest_include = max((os.path.getmtime(p) for p in includes), default=0.0)
    built = 0
    for src, spv_dir in sources:
        os.makedirs(spv_dir, exist_ok=True)
        for name, flags in shader_variants(src):
            out = os.path.join(spv_dir, name + ".spv")
            if not force and os.path.exists(out):
                if os.path.getmtime(out) >= max(os.path.getmtime(src), newest_include):
                    continue
            if glslc is None:
                raise SystemExit(
                    "vkmoe: glslc (the shaderc GLSL compiler) is required to build shaders/*.comp; "
                    "install it with `apt-get install glslc` (Debian/Ubuntu), or copy a prebuilt vkmoe/_spv/."
                )
            cmd = [glslc, *GLSLC_FLAGS, *flags, src, "-o", out]
            if verbose:
                print("glslc", " ".join(flags), os.path.relpath(src, HERE), "->", os.path.relpath(out, HERE))
            subprocess.run(cmd, check=True)
            built += 1
    return built


class BuildShaders(Command):
    description = "compile shaders/*.comp to vkmoe/_spv/*.spv with glslc"
    user_options = [("force", "f", "rebuild every shader")]

    def initialize_options(self):
        self.force = False

    def finalize_options(self):
        pass

    def run(self):
        compile_shaders(force=bool(self.force))


class BuildPyWithShaders(build_py):
    def run(self):
        compile_shaders()
        super().run()


setup(
    name="vkmoe",
    version="0.1.0",
    description="The fused EXL3 Mixture-of-Experts MLP on any Vulkan device",
    packages=["vkmoe", "vkmoe.vk", "vkmoe.exl3", "vkmoe.sched", "vkmoe.ops", "vkmoe.models"],
    package_data={"vkmoe": ["_spv/*.spv"]},
    python_requires=">=3.9",
    install_requires=["vulkan==1.3.275.1", "cffi>=1.15", "numpy>=1.24", "safetensors>=0.4"],
    extras_require={"test": ["pytest>=7"], "plot": ["matplotlib>=3.6"]},
    setup_requires=["cffi>=1.15"],
    cffi_modules=["native/build_native.py:ffibuilder"],
    cmdclass={"build_shaders": BuildShaders, "build_py": BuildPyWithShaders},
)
