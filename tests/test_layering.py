"""The layers of docs/DESIGN.md, enforced: no module inside vkmoe/ imports from a layer above its own, and no
modules import each other in a circle (function-level imports count too: they are still dependencies)."""
import ast
import glob
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "vkmoe")

# Layer of each module prefix (the longest matching prefix wins) and the layers it may import from. The two leaf
# modules import nothing from vkmoe; vk (the driver) and exl3 (the format) know nothing of each other.
LAYER_OF = {
    "vkmoe.layout": "leaf", "vkmoe.knobs": "leaf", "vkmoe.forksafe": "leaf",
    "vkmoe.vk": "vk", "vkmoe.exl3": "exl3", "vkmoe._native": "native", "vkmoe.cpu": "cpu",
    "vkmoe.sched": "sched", "vkmoe.ops": "ops", "vkmoe.registry": "registry", "vkmoe.models": "models",
    "vkmoe": "top",  # vkmoe/__init__.py, __main__, cli, demo: the entry points
}
MAY_IMPORT = {
    "leaf": set(),
    "vk": {"leaf", "native"},
    "exl3": {"leaf"},
    "native": set(),
    "cpu": {"leaf", "exl3", "native"},
    "sched": {"leaf", "vk"},
    "ops": {"leaf", "vk", "exl3", "sched"},
    "registry": {"leaf", "vk", "exl3", "cpu", "sched", "ops"},
    "models": {"leaf", "vk", "exl3", "cpu", "sched", "ops", "registry"},
    "top": set(LAYER_OF.values()),
}


def layer(module):
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def _module_name(path):
    rel = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_module(name):
    base = os.path.join(REPO, *name.split("."))
    return os.path.isdir(base) or os.path.exists(base + ".py") or bool(glob.glob(base + ".*.so"))


def import_graph():
    """{module: {modules it imports explicitly}} for every module of vkmoe/ (only imports of vkmoe modules)."""
    graph = {}
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        name = _module_name(path)
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        targets = set()
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] == "vkmoe"}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "vkmoe":
                    continue
                for alias in node.names:  # `from pkg import submodule` depends on the submodule
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if _is_module(sub) else base)
        targets.discard(name)
        graph[name] = targets
    return graph


def upward_imports(graph):
    return sorted(f"{m} ({layer(m)}) imports {t} ({layer(t)})" for m, targets in graph.items() for t in targets
                  if layer(t) != layer(m) and layer(t) not in MAY_IMPORT[layer(m)])


def cycles(graph):
    """Import circles among modules (an import of a package's __init__ by its own submodules is Python's doing
    whenever a submodule is imported, so edges from a module to a package containing it are left out)."""
    edges = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    found, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == "open":
                found.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    return found


def test_every_module_has_a_layer():
    graph = import_graph()
    assert "vkmoe.ops.moe" in graph and "vkmoe.vk.device" in graph
    for m in graph:
        assert layer(m) in MAY_IMPORT


def test_no_upward_imports():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layering (docs/DESIGN.md):\n" + "\n".join(bad)


def test_no_import_cycles():
    bad = cycles(import_graph())
    assert not bad, "import cycles:\n" + "\n".join(bad)


@pytest.mark.parametrize("graph, upward, circular", [
    ({"vkmoe.vk.device": {"vkmoe.ops.kernels"}}, True, False),         # the driver layer reaching up
    ({"vkmoe.sched.probe": {"vkmoe.__main__"}}, True, False),           # sched importing an entry point
    ({"vkmoe.exl3.decode": {"vkmoe.vk.device"}}, True, False),          # the format knowing the driver
    ({"vkmoe.ops.a": {"vkmoe.ops.b"}, "vkmoe.ops.b": {"vkmoe.ops.a"}}, False, True),
    ({"vkmoe.ops.moe": {"vkmoe.sched.plan", "vkmoe.layout"}, "vkmoe.sched.plan": {"vkmoe.knobs"}}, False, False),
])
def test_the_checks_can_fail(graph, upward, circular):
    assert bool(upward_imports(graph)) == upward
    assert bool(cycles(graph)) == circular
