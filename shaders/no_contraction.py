"""The SPIR-V build's one pass after the compiler: every floating-point arithmetic result gets the NoContraction
decoration, as if every float expression of every shader were declared `precise`.

Why: GLSL lets a compiler contract `a * b + c` into one fused operation, and compute an `fma()` with a rounded
product, anywhere outside a precise computation, and a driver may choose differently in two pipelines built from
one source. On an H100 the NVIDIA compiler did: the shared-memory and subgroup builds of the Hadamard transform
(two specializations of the same shaders) gave different last bits from identical inputs (BENCHMARKS.md,
twenty-sixth and twenty-seventh sessions), and the split / persistent bit-identity rested on the same choices.
With the decoration each operation is evaluated as written (an fma() stays one fused operation, the same in every
pipeline), which is also what lavapipe does: the bits no longer depend on the driver's choices.

setup.py applies it to every shader it compiles; tests/test_build.py checks the shipped SPIR-V. No imports beyond
the standard library: setup.py loads this file by path, before the package is installed.
"""
import struct

MAGIC = 0x07230203
HEADER_WORDS = 5

OP_EXT_INST_IMPORT = 11
OP_EXT_INST = 12
OP_DECORATE = 71
DECORATION_NO_CONTRACTION = 42
GLSL_STD_450 = "GLSL.std.450"
GLSL_STD_450_FMA = 50

# Float arithmetic whose result a compiler may fuse with a neighbour (the opcodes glslang decorates for `precise`).
FLOAT_ARITHMETIC = frozenset({
    127,  # OpFNegate
    129,  # OpFAdd
    131,  # OpFSub
    133,  # OpFMul
    136,  # OpFDiv
    140,  # OpFRem
    141,  # OpFMod
    142,  # OpVectorTimesScalar
    143,  # OpMatrixTimesScalar
    144,  # OpVectorTimesMatrix
    145,  # OpMatrixTimesVector
    146,  # OpMatrixTimesMatrix
    147,  # OpOuterProduct
    148,  # OpDot
})

# The module's sections before its types (SPIR-V spec 2.4): capabilities, extensions, imports, memory model, entry
# points, execution modes, debug instructions, annotations. The new decorations go after the last of them.
PREAMBLE = frozenset({
    17, 10, 11, 14, 15, 16, 331,   # OpCapability, OpExtension, OpExtInstImport, OpMemoryModel, OpEntryPoint,
                                   # OpExecutionMode, OpExecutionModeId
    2, 3, 4, 5, 6, 7, 330,         # OpSourceContinued, OpSource, OpSourceExtension, OpName, OpMemberName, OpString,
                                   # OpModuleProcessed
    71, 72, 73, 74, 75, 332, 5632, 5633,  # OpDecorate, OpMemberDecorate, OpDecorationGroup, OpGroupDecorate,
                                          # OpGroupMemberDecorate, OpDecorateId, OpDecorateString(s)
})


def _words(spirv):
    if len(spirv) % 4 or len(spirv) < 4 * HEADER_WORDS:
        raise ValueError(f"not a SPIR-V module: {len(spirv)} bytes")
    words = list(struct.unpack(f"<{len(spirv) // 4}I", spirv))
    if words[0] != MAGIC:
        raise ValueError(f"not a little-endian SPIR-V module: magic {words[0]:#010x}")
    return words


def _instructions(words):
    """(offset, opcode, word count) of each instruction."""
    at = HEADER_WORDS
    while at < len(words):
        count, opcode = words[at] >> 16, words[at] & 0xFFFF
        if count == 0 or at + count > len(words):
            raise ValueError(f"malformed SPIR-V: instruction at word {at} has word count {count}")
        yield at, opcode, count
        at += count


def _string(words):
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw[: raw.index(b"\0")].decode()


def _scan(words):
    """(ids of float arithmetic, ids already decorated NoContraction, word offset where the preamble ends)."""
    glsl_sets, arithmetic, decorated, preamble_end = set(), [], set(), None
    for at, opcode, count in _instructions(words):
        if preamble_end is None and opcode not in PREAMBLE:
            preamble_end = at
        if opcode == OP_EXT_INST_IMPORT and _string(words[at + 2: at + count]) == GLSL_STD_450:
            glsl_sets.add(words[at + 1])
        elif opcode == OP_DECORATE and count == 3 and words[at + 2] == DECORATION_NO_CONTRACTION:
            decorated.add(words[at + 1])
        elif opcode in FLOAT_ARITHMETIC:
            arithmetic.append(words[at + 2])
        elif (opcode == OP_EXT_INST and words[at + 3] in glsl_sets
              and words[at + 4] == GLSL_STD_450_FMA):
            arithmetic.append(words[at + 2])
    return arithmetic, decorated, preamble_end if preamble_end is not None else len(words)


def undecorated(spirv):
    """Result ids of the module's float arithmetic that lack NoContraction (empty after forbid_contraction)."""
    arithmetic, decorated, _ = _scan(_words(spirv))
    return [i for i in arithmetic if i not in decorated]


def forbid_contraction(spirv):
    """The module with NoContraction on every float arithmetic result (bytes in, bytes out; idempotent)."""
    words = _words(spirv)
    arithmetic, decorated, preamble_end = _scan(words)
    new = []
    for result in dict.fromkeys(arithmetic):  # in order, once each
        if result not in decorated:
            new += [(3 << 16) | OP_DECORATE, result, DECORATION_NO_CONTRACTION]
    words[preamble_end:preamble_end] = new
    return struct.pack(f"<{len(words)}I", *words)


def forbid_contraction_in_file(path):
    with open(path, "rb") as f:
        spirv = f.read()
    with open(path, "wb") as f:
        f.write(forbid_contraction(spirv))
