"""The import structure of the mhagen package (mhagen/, schedules/ as mhagen.schedules,
targets/ as mhagen.targets), read from the source with ast:

- no cycles among mhagen's modules, counting every import (top level and inside functions);
- an import inside a function only for heavy or optional dependencies: TVM, torch,
  onnxruntime, onnx, or an mhagen module that imports one of them at its top level (the
  compiler: lowering, schedules, tuning), so that `import mhagen` and running a saved
  artifact stay light.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"mhagen": ROOT / "mhagen", "mhagen.schedules": ROOT / "schedules",
            "mhagen.targets": ROOT / "targets"}
HEAVY = ("tvm", "torch", "onnxruntime", "onnx", "matplotlib")


def _modules() -> dict:
    """module name -> source path."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The mhagen module an import names (a `from m import x` of a submodule gives m.x)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path):
    """(imported name, inside a function) for every import statement of a file."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((a.name, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.extend((f"{child.module}.{a.name}", in_function) for a in child.names)
            visit(child, nested)
    visit(tree, False)
    return found


def _graph():
    edges, lazy, heavy_top = {}, {}, set()
    for mod, path in MODULES.items():
        edges[mod], lazy[mod] = set(), []
        for name, in_function in _imports(path):
            if name.split(".")[0] in HEAVY:
                if not in_function:
                    heavy_top.add(mod)
                continue
            target = _resolve(name) if name.startswith("mhagen") else None
            if target is None or target == mod:
                continue
            edges[mod].add(target)
            if in_function:
                lazy[mod].append(target)
    return edges, lazy, heavy_top


def _heavy(edges, heavy_top) -> set:
    """Modules that import a heavy dependency at their top level, directly or through
    mhagen modules they import at top level."""
    heavy = set(heavy_top)
    changed = True
    while changed:
        changed = False
        for mod, targets in edges.items():
            if mod not in heavy and targets & heavy:
                heavy.add(mod)
                changed = True
    return heavy


def _cycle(edges):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = dfs(t)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None
    for m in sorted(edges):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_the_checker_sees_the_package():
    assert {"mhagen", "mhagen.module", "mhagen.schedules.cpu.matmul",
            "mhagen.targets"} <= set(MODULES)
    edges, _, heavy_top = _graph()
    assert "mhagen.errors" in edges["mhagen.module"] or "mhagen.errors" in str(edges)
    assert "mhagen.lower.te" in heavy_top          # imports tvm at its top level


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    edges, _, _ = _graph()
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_inside_functions_only_for_heavy_dependencies():
    edges, lazy, heavy_top = _graph()
    heavy = _heavy({m: {t for t in ts if t not in lazy[m]} for m, ts in edges.items()}
                   | {}, heavy_top)
    bad = sorted(f"{m} imports {t} inside a function" for m, ts in lazy.items() for t in ts
                 if t not in heavy)
    assert not bad, "\n".join(bad)


def test_running_an_artifact_needs_no_compiler_module():
    """What mhagen.load and Module.__call__ import never reaches the lowering, the schedules,
    the tuning or TVM's Python package (the test of the behaviour is in test_artifact.py)."""
    edges, _, heavy_top = _graph()
    seen, todo = set(), ["mhagen.artifact.load"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(edges[m])
    compiler = {m for m in seen if m.startswith(("mhagen.lower", "mhagen.schedules",
                                                 "mhagen.tuning", "mhagen.passes",
                                                 "mhagen.compile"))}
    assert not compiler and not (seen & heavy_top), sorted(compiler | (seen & heavy_top))
