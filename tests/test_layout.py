"""The launch contract has one owner (vkmoe/layout.py): every GLSL or C copy of it must agree with it."""
import glob
import os
import re

import pytest

from vkmoe import layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHADERS = os.path.join(REPO, "shaders")
GENERATED = os.path.join(SHADERS, "include", "generated", "moe_layout.glsl")
DEFINE = re.compile(r"^[ \t]*#define[ \t]+(\w+)[ \t]+(\S+)", re.M)


def _read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def _includes(path, seen=None):
    """Every file `path` includes, transitively (paths relative to shaders/include)."""
    seen = set() if seen is None else seen
    with open(path) as f:
        for name in re.findall(r'^\s*#include\s+"([^"]+)"', f.read(), re.M):
            full = os.path.join(SHADERS, "include", name)
            if full not in seen:
                seen.add(full)
                _includes(full, seen)
    return seen


def _contract_shaders():
    """Hand-written shaders that see the generated header (the probes keep their own sync.glsl parameters)."""
    files = glob.glob(os.path.join(SHADERS, "*.comp")) + glob.glob(os.path.join(SHADERS, "include", "*.glsl"))
    files = sorted(p for p in files if GENERATED in _includes(p))
    assert files, "no shader includes the generated header"
    return files


def test_generated_header_is_current():
    """The build writes the header from layout.py; a stale one (layout.py edited, shaders not rebuilt) fails."""
    assert os.path.exists(GENERATED), f"{GENERATED} is missing: run `python setup.py build_shaders`"
    with open(GENERATED) as f:
        assert f.read() == layout.glsl_header(), \
            "shaders/include/generated/moe_layout.glsl is stale: run `python setup.py build_shaders`"


def test_header_defines_every_contract_value():
    defines = dict(DEFINE.findall(layout.glsl_header()))
    assert defines == layout.glsl_defines()
    for name, value in layout.ACTIVATIONS.items():
        assert defines[f"ACT_{name.upper()}"] == str(value)
    for name, value in layout.CODEBOOKS.items():
        assert defines[f"CB_{name.upper()}"] == str(value)
    assert defines["SYNC_COUNTERS"] == f"{layout.SYNC_COUNTERS}u"
    assert defines["MAX_TOP_K"] == str(layout.MAX_TOP_K)
    assert defines["BAND"] == f"{layout.BAND}u"


@pytest.mark.parametrize("path", _contract_shaders(), ids=os.path.basename)
def test_no_shader_redefines_a_contract_macro(path):
    """A macro the generated header owns is not defined again by hand anywhere (a second copy would drift)."""
    owned = layout.glsl_defines()
    with open(path) as f:
        mine = dict(DEFINE.findall(f.read()))
    again = sorted(set(mine) & set(owned))
    assert not again, f"{os.path.relpath(path, REPO)} defines {again} by hand; vkmoe/layout.py owns them"


def test_abort_codes_match_sync_glsl():
    """sync.glsl (shared with the probe shaders) keeps its own abort codes; they must be the contract's."""
    defines = dict(DEFINE.findall(_read("shaders", "include", "sync.glsl")))
    for name in ("SPIN", "LOCK", "BARRIER"):
        assert defines[f"SYNC_ABORT_{name}"] == f"{getattr(layout, 'ABORT_' + name)}u", name


def test_persistent_routing_limit_matches_the_kernel():
    defines = dict(DEFINE.findall(_read("shaders", "moe_persistent.comp")))
    assert defines["ROUTE_MAX_E"] in (str(layout.PERSISTENT_ROUTE_MAX_EXPERTS), "PERSISTENT_ROUTE_MAX_EXPERTS")


def test_native_enums_match():
    header = _read("native", "vkn.h")
    enums = dict((k, int(v)) for k, v in re.findall(r"\b(VKN_(?:ACT|CB)_\w+)\s*=\s*(\d+)", header))
    want = {f"VKN_ACT_{n.upper()}": v for n, v in layout.ACTIVATIONS.items()}
    want.update({f"VKN_CB_{n.upper()}": v for n, v in layout.CODEBOOKS.items()})
    assert enums == want


def test_constant_ids_are_named():
    """Specialization-constant ids in the MoE and linear shaders come from the header, not literals."""
    for parts in (("shaders", "include", "moe_bindings.glsl"), ("shaders", "exl3_linear.comp"),
                  ("shaders", "include", "exl3_decode.glsl")):
        literal = re.findall(r"constant_id\s*=\s*\d+", _read(*parts))
        assert not literal, f"{'/'.join(parts)}: {literal}"


def _push_fields(glsl):
    """(name, 'u4'/'f4') of a shader's push-constant block, in order."""
    block = re.search(r"uniform \w+ \{(.*?)\} pc;", glsl, re.S)
    body = re.sub(r"//[^\n]*", "", block.group(1))
    fields = []
    for kind, names in re.findall(r"\b(uint|float)\s+([\w\s,]+);", body):
        fields += [(name.strip(), "<u4" if kind == "uint" else "<f4") for name in names.split(",")]
    return fields


@pytest.mark.parametrize("shader, push", [
    (("shaders", "include", "moe_bindings.glsl"), "vkmoe.ops.moe:MoePush"),
    (("shaders", "exl3_linear.comp"), "vkmoe.ops.kernels:LinearPush"),
    (("shaders", "exl3_had_in.comp"), "vkmoe.ops.kernels:HadInPush"),
    (("shaders", "exl3_dequant.comp"), "vkmoe.ops.kernels:DequantPush"),
    (("shaders", "fill_random.comp"), "vkmoe.ops.synthetic:FillPush"),
    (("shaders", "moe_router_logits.comp"), "vkmoe.ops.router:RouterLogitsPush"),
    (("shaders", "moe_router.comp"), "vkmoe.ops.router:RouterPush"),
    (("shaders", "moe_block_elem.comp"), "vkmoe.ops.block:ElemPush"),
    (("shaders", "moe_block_rmsnorm.comp"), "vkmoe.ops.block:NormPush"),
], ids=lambda v: v if isinstance(v, str) else v[-1])
def test_push_blocks_match_their_python_types(shader, push):
    """A push-constant block's field names, types and order are part of the contract too (the pipeline checks
    only the size)."""
    import importlib

    module, name = push.split(":")
    assert _push_fields(_read(*shader)) == list(getattr(importlib.import_module(module), name).fields)


def test_sizes_and_grids():
    class Plan:
        m, top_k, max_chunks, splits_gu, splits_d, rows, splits, row_chunks = 5, 3, 9, 2, 3, 4, 2, 2
        stage3_in_down = False

    H, I = 384, 256
    R = 15
    size = layout.scratch_bytes(Plan, H, I)
    assert size["route"] == 4 * (16 + 3 * 9 + 2 * R + 5)
    # header (3 lines: polled words, the ticket, the routed phase count), band and token arrivals, per-chunk
    # progress (persistent); then, from the next 128-byte line on, per-chunk user counts (persistent)
    progress_end = 96 + 9 * 2 + 9 * 3 + 5 * 3 + 9
    assert progress_end == 165 and layout.chunk_users_word(5, 9, H, I) == 192
    assert size["sync"] == 4 * (192 + 9)
    assert size["partial"] == 4 * (2 * 2 * R * I + 3 * R * H)     # gate/up partials, then down partials
    assert size["partial_split"] == 4 * max(2 * 2 * R * I, 3 * R * H)  # the split dispatches reuse the space...
    Plan.stage3_in_down = True  # ...unless the down items read the gate/up partials (stage 3 in the down items)
    assert layout.scratch_bytes(Plan, H, I)["partial_split"] == size["partial"]
    Plan.stage3_in_down = False
    route, gate_up, down, token_sum = layout.split_grids(Plan, H, I, gated=True)
    assert route == (1 + layout.ceil_div(R * 3, layout.STAGE1_PAIRS_PER_ITEM), 1)
    assert gate_up == (2 * 2 * 2, 9) and down == (3 * 3, 9) and token_sum is None
    Plan.token_sum_pass = True  # one invocation per output element
    assert layout.split_grids(Plan, H, I, gated=True)[3] == (layout.ceil_div(Plan.m * H, 256), 1)
    Plan.token_sum_pass = False
    assert layout.split_grids(Plan, H, I, gated=False)[1] == (2 * 2, 9)
    assert layout.fold_grid(70000) == (65535, 2)
    assert layout.linear_grid(Plan, 384) == (3, 2, 2)
    assert layout.had_in_grid(5, 384) == (layout.ceil_div(15, layout.HAD_IN_UNITS_PER_WG), 1)
    # folded within the smallest maxComputeWorkGroupCount[0] (the shader recombines x and y)
    wgs = layout.ceil_div(40000 * 16, layout.HAD_IN_UNITS_PER_WG)
    assert layout.had_in_grid(40000, 2048) == (layout.MAX_GRID_X, layout.ceil_div(wgs, layout.MAX_GRID_X))


def test_dispatch_modes_match_the_knob():
    """layout.DISPATCH_MODES owns the modes; VKMOE_DISPATCH (vkmoe.knobs, a leaf that cannot import it) lists its own."""
    from vkmoe import knobs

    for mode in layout.DISPATCH_MODES:
        assert knobs.parse("VKMOE_DISPATCH", mode) == mode
    with pytest.raises(knobs.KnobError):
        knobs.parse("VKMOE_DISPATCH", "fast")
    expected = knobs.KNOBS["VKMOE_DISPATCH"].expected
    assert re.findall(r"\w+", expected.replace(" or ", " ")) == list(layout.DISPATCH_MODES)
