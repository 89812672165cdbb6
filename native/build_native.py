#!/usr/bin/env python3
"""cffi builder for vkmoe._native (the CPU tier). `python native/build_native.py` builds it in place into vkmoe/.

Plain -O3 (no -march=native) so the module runs on any x86-64 or ARM CPU; the AVX-512 kernels are compiled
through __attribute__((target)) and picked at run time.
"""
import glob
import os
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _header_decls():
    # cdef wants plain declarations: take vkn.h minus preprocessor lines and comments.
    import re

    with open(os.path.join(HERE, "vkn.h")) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))


ffibuilder = FFI()
ffibuilder.cdef(_header_decls())
# Relative to the repository root: setuptools rejects absolute source paths (it runs setup.py from the root;
# the __main__ build below changes there first).
_sources = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(HERE, "*.c")))
ffibuilder.set_source(
    "vkmoe._native",
    '#include "vkn.h"\n',
    sources=_sources,
    include_dirs=[HERE],
    extra_compile_args=["-O3", "-std=c99", "-Wall"],
    libraries=["m", "pthread"],
)

if __name__ == "__main__":
    os.chdir(ROOT)
    tmp = os.path.join(ROOT, "build", "native")
    so = ffibuilder.compile(tmpdir=tmp, verbose="-v" in sys.argv)
    target = os.path.join(ROOT, "vkmoe", os.path.basename(so))
    os.replace(so, target)
    print("built", os.path.relpath(target, ROOT))
