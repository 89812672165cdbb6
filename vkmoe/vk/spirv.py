"""Just enough SPIR-V reflection to check what the host passes against what a shader declares:
storage-buffer bindings, the push-constant block size and the specialization constants (id -> type)."""
import struct

_OP_NAME, _OP_DECORATE, _OP_MEMBER_DECORATE = 5, 71, 72
_OP_TYPE_BOOL, _OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR = 20, 21, 22, 23
_OP_TYPE_ARRAY, _OP_TYPE_STRUCT, _OP_TYPE_POINTER = 28, 30, 32
_OP_CONSTANT, _OP_VARIABLE = 43, 59
_OP_SPEC_TRUE, _OP_SPEC_FALSE, _OP_SPEC_CONSTANT = 48, 49, 50
_DEC_SPEC_ID, _DEC_BINDING, _DEC_SET, _DEC_OFFSET = 1, 33, 34, 35
_SC_UNIFORM, _SC_PUSH_CONSTANT, _SC_STORAGE_BUFFER = 2, 9, 12


class ShaderInterface:
    """What one compute shader module declares."""

    def __init__(self, bindings, push_constant_size, spec_constants):
        self.bindings = bindings                      # sorted list of binding numbers in set 0
        self.push_constant_size = push_constant_size  # bytes, 0 when there is no push-constant block
        self.spec_constants = spec_constants          # {spec id: "bool" | "int32" | "uint32" | "float32" | ...}


def reflect(code: bytes) -> ShaderInterface:
    """The interface of a SPIR-V module; ValueError for anything that is not a well-formed one (a corrupt file
    must not hang the reader or surface as an IndexError)."""
    try:
        return _reflect(code)
    except (IndexError, KeyError, TypeError, struct.error) as exc:
        raise ValueError(f"malformed SPIR-V module ({type(exc).__name__}: {exc})") from None


def _reflect(code: bytes) -> ShaderInterface:
    if len(code) < 20 or len(code) % 4:
        raise ValueError(f"not a SPIR-V module ({len(code)} bytes: expected a header of 5 words and whole words)")
    words = struct.unpack("<%dI" % (len(code) // 4), code)
    if words[0] != 0x07230203:
        raise ValueError("not a SPIR-V module (bad magic number)")
    types, decorations, member_offsets, variables, spec = {}, {}, {}, [], {}
    i = 5
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        if count == 0 or i + count > len(words):  # (a word count of 0 looped here forever)
            raise ValueError(f"malformed SPIR-V module: the instruction at word {i} has word count {count} "
                             f"({len(words)} words in all)")
        ins = words[i + 1:i + count]
        if op == _OP_DECORATE:
            decorations.setdefault(ins[0], {})[ins[1]] = ins[2] if len(ins) > 2 else True
        elif op == _OP_MEMBER_DECORATE and ins[2] == _DEC_OFFSET:
            member_offsets.setdefault(ins[0], {})[ins[1]] = ins[3]
        elif op == _OP_TYPE_BOOL:
            types[ins[0]] = ("bool", 4)
        elif op == _OP_TYPE_INT:
            types[ins[0]] = (("int" if ins[2] else "uint") + str(ins[1]), ins[1] // 8)
        elif op == _OP_TYPE_FLOAT:
            types[ins[0]] = ("float" + str(ins[1]), ins[1] // 8)
        elif op == _OP_TYPE_VECTOR:
            types[ins[0]] = ("vector", types[ins[1]][1] * ins[2])
        elif op == _OP_TYPE_ARRAY:
            types[ins[0]] = ("array", None)  # length needs constant tracking; push blocks here avoid arrays
        elif op == _OP_TYPE_STRUCT:
            types[ins[0]] = ("struct", list(ins[1:]))
        elif op == _OP_TYPE_POINTER:
            types[ins[0]] = ("pointer", (ins[1], ins[2]))
        elif op == _OP_VARIABLE:
            variables.append((ins[1], ins[0], ins[2]))  # (id, pointer type, storage class)
        elif op in (_OP_SPEC_TRUE, _OP_SPEC_FALSE, _OP_SPEC_CONSTANT):
            spec[ins[1]] = ins[0]  # result id -> type id
        i += count

    def struct_size(struct_id):
        kind, members = types[struct_id]
        offsets = member_offsets.get(struct_id, {})
        end = 0
        for index, member in enumerate(members):
            size = types[member][1]
            if size is None:
                raise ValueError("push-constant blocks with arrays are not supported by vkmoe's reflection")
            end = max(end, offsets.get(index, 0) + size)
        return end

    bindings, push_size = [], 0
    for var_id, ptr_type, storage in variables:
        pointee = types[ptr_type][1][1]
        if storage == _SC_PUSH_CONSTANT:
            push_size = struct_size(pointee)
        elif storage in (_SC_STORAGE_BUFFER, _SC_UNIFORM) and _DEC_BINDING in decorations.get(var_id, {}):
            if decorations[var_id].get(_DEC_SET, 0) != 0:
                raise ValueError("vkmoe shaders use descriptor set 0 only")
            bindings.append(decorations[var_id][_DEC_BINDING])
    spec_constants = {}
    for result_id, type_id in spec.items():
        spec_id = decorations.get(result_id, {}).get(_DEC_SPEC_ID)
        if spec_id is not None:
            spec_constants[spec_id] = types[type_id][0]
    return ShaderInterface(sorted(set(bindings)), push_size, spec_constants)  # aliases share a binding
