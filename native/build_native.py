#!/usr/bin/env python3
"""cffi builder for vkmoe._native: the CPU tier (vkn.h) and the Vulkan call path (vkn_call.h, vkmoe/vk/fastcall.py).
`python native/build_native.py` builds it in place into vkmoe/.

Plain -O3 (no -march=native) so the module runs on any x86-64 or ARM CPU; the AVX-512 kernels are compiled
through __attribute__((target)) and picked at run time.
"""
import glob
import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
HEADERS = ("vkn.h", "vkn_call.h")


def _header_decls(name):
    # cdef wants plain declarations: take the header minus preprocessor lines and comments.
    import re

    with open(os.path.join(HERE, name)) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef("\n".join(map(_header_decls, HEADERS)))
# setup.py: paths relative to the repository root, where it compiles (setuptools rejects absolute source
# paths). The __main__ build below compiles inside its temporary directory (cffi changes into it): absolute
# paths, whose object files land under that directory.
_BUILD_TMP = os.path.join(ROOT, "build", "native")
_sources = sorted(glob.glob(os.path.join(HERE, "*.c")))
if __name__ != "__main__":
    _sources = [os.path.relpath(p, ROOT) for p in _sources]
ffibuilder.set_source(
    "vkmoe._native",
    "".join(f'#include "{h}"\n' for h in HEADERS),
    sources=_sources,
    include_dirs=[HERE],
    extra_compile_args=["-O3", "-std=c99", "-Wall"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    os.makedirs(_BUILD_TMP, exist_ok=True)
    so = ffibuilder.compile(tmpdir=_BUILD_TMP, verbose="-v" in sys.argv)
    # cffi compiles against the stable ABI (Py_LIMITED_API), so the module takes the abi3 name the wheel gives it
    # (what any CPython >= 3.9 imports); a stale build under another name would be imported before it.
    name = "_native.abi3.so" if so.endswith(".so") else os.path.basename(so)
    for stale in glob.glob(os.path.join(ROOT, "vkmoe", "_native*.so")):
        os.remove(stale)
    target = os.path.join(ROOT, "vkmoe", name)
    os.replace(so, target)
    print("built", os.path.relpath(target, ROOT))
