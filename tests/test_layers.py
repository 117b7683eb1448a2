"""Layers import one way (DESIGN.md §2): every module under reroll/ is parsed with `ast` and each of
its imports (module level and inside functions, `from . import x` and other relative imports
resolved) must point to its own layer or a lower one, and neither the layers nor the modules may
import one another in a circle. The order is written once, in the `reroll/__init__.py` docstring."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "reroll"


def layer_order() -> dict[str, int]:
    """Layer name -> rank (0 is the top), read from the indented lines of the package docstring."""
    doc = ast.get_docstring(ast.parse((ROOT / "__init__.py").read_text()))
    lines = [line.strip() for line in doc.splitlines() if line.startswith("    ") and line.strip()]
    return {name.strip(): rank for rank, line in enumerate(lines) for name in line.split(",")}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict) -> list[str]:
    """Every reroll module `module` imports, anywhere in its body (functions included); a name
    imported from a package counts as its submodule when there is one of that name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, path.name == "__init__.py")
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append(sub if sub in modules else target)
    return [m for m in out if m == "reroll" or m.startswith("reroll.")]


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {m: set(imports_of(m, p, modules)) - {m} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_every_module_has_a_layer():
    order = layer_order()
    unknown = {layer_of(m) for m in module_files()} - set(order) - {None}
    assert not unknown, f"add these to the layer order in reroll/__init__.py: {sorted(unknown)}"


def test_no_module_imports_a_higher_layer():
    order = layer_order()
    bad = []
    for module, targets in sorted(import_graph().items()):
        a = layer_of(module)
        for target in sorted(targets):
            b = layer_of(target)
            if a and b and order[b] < order[a]:
                bad.append(f"{module} -> {target} (layer {b} above layer {a})")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_layers_import_without_a_cycle():
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        a = layer_of(module)
        if a:
            graph.setdefault(a, set()).update(
                b for b in map(layer_of, targets) if b and b != a)
    cycle = find_cycle(graph)
    assert cycle is None, "layers import each other in a circle: " + " -> ".join(cycle)


def test_modules_import_without_a_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle)


def test_the_checks_see_relative_and_function_level_imports(tmp_path):
    """The parser is the part a broken check would hide: it must see an import inside a function
    and resolve `from .. import x` to the module it names."""
    src = "def f():\n    from ..engines import hf\n    from . import sibling\n"
    path = tmp_path / "mod.py"
    path.write_text(src)
    modules = {"reroll.engines.hf": None, "reroll.training.sibling": None}
    assert imports_of("reroll.training.mod", path, modules) == [
        "reroll.engines.hf", "reroll.training.sibling"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
