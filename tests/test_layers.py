"""Imports run one way (docs/architecture.md): no module imports one of a higher layer, and there is no circle.

Every ``import``/``from ... import`` of a ``qtool`` module counts, at module level or inside a function (a lazy
import is still a dependency). The only exemption is ``qtool/__init__.py``'s lazy ``load_calibrated`` re-export.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qtool"

# top to bottom; a module may import its own layer or any layer below
LAYERS = [
    ("cli", "__main__", "entry", "example"),
    ("pipeline",),
    ("calibration", "export", "report", "inspect", "imatrix", "mixed", "evaluation"),
    ("model",),
    ("config", "families", "gguf_mixes", "encodings", "aimet_format", "data", "weights", "coverage"),
    ("io", "quant", "hooks", "choices", "parallel", "provenance"),
    ("errors",),
]
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path):
    """The qtool modules ``path`` imports (absolute dotted names)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("qtool"):
                    yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("qtool"):
                continue
            for a in node.names:  # `from . import x` may name a submodule
                sub = f"{mod}.{a.name}"
                yield (sub if (ROOT.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                       or (ROOT.parent / sub.replace(".", "/")).is_dir() else mod), node.lineno


def _top(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph():
    edges = {}
    for path in sorted(ROOT.rglob("*.py")):
        me = _module_name(path)
        edges[me] = [(dep, line) for dep, line in _imports(path) if dep != me]
    return edges


def test_every_top_level_module_has_a_layer():
    tops = {_top(_module_name(p)) for p in ROOT.rglob("*.py")} - {"__init__"}
    assert not tops - set(LAYER_OF), f"add these to LAYERS and docs/architecture.md: {sorted(tops - set(LAYER_OF))}"


def test_no_upward_import():
    bad = []
    for me, deps in _graph().items():
        if me == "qtool":
            continue  # qtool/__init__.py: the lazy load_calibrated re-export
        for dep, line in deps:
            if dep == "qtool":
                continue  # the package root holds __version__ only (plus the lazy re-export above)
            a, b = LAYER_OF.get(_top(me)), LAYER_OF.get(_top(dep))
            if a is not None and b is not None and b < a:
                bad.append(f"{me}:{line} imports {dep} (layer {LAYERS[b]} is above {LAYERS[a]})")
    assert not bad, "\n".join(bad)


def test_no_import_circle():
    graph = {me: sorted({d for d, _ in deps if d != "qtool"}) for me, deps in _graph().items() if me != "qtool"}
    # a package's __init__ and its modules: `qtool.x.y` depends on `qtool.x` being importable, not a circle
    state, stack, circles = {}, [], []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if n.startswith(m + "."):
                continue
            if state.get(m) == 1:
                circles.append(" -> ".join(stack[stack.index(m):] + [m]))
            elif m in graph and not state.get(m):
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if not state.get(n):
            visit(n)
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("src,dst", [("qtool.io.fs", "qtool.pipeline"), ("qtool.quant.affine", "qtool.model.load")])
def test_the_check_catches_an_upward_import(src, dst, monkeypatch):
    """The rule is live: an injected upward import is reported."""
    real = _imports

    def fake(path):
        yield from real(path)
        if _module_name(path) == src:
            yield dst, 1

    monkeypatch.setattr(__import__(__name__), "_imports", fake)
    with pytest.raises(AssertionError, match=f"{src}:1 imports {dst}"):
        test_no_upward_import()
