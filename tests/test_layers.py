"""The package layering: no two units of mhagen import each other.

A unit is
  - each subpackage of mhagen: mhagen.ir, mhagen.lower, mhagen.records, mhagen.tuning,
    mhagen.artifact (with its runtime/ sources), mhagen.onnx, mhagen.passes, mhagen.targets;
  - mhagen.schedules (its top-level modules: __init__, attention_common, casts,
    tvmscript) and each of its subpackages on its own: mhagen.schedules.cpu,
    mhagen.schedules.x86, mhagen.schedules.arm, mhagen.schedules.cuda (schedules/ is installed as
    mhagen.schedules, targets/ as mhagen.targets);
  - each top-level module of mhagen on its own: mhagen.module, mhagen.reference,
    mhagen.compile, mhagen.dsl, ... ;
  - mhagen itself (mhagen/__init__.py, the public facade, which imports most units).
A unit imports another where any of its modules imports a module of the other, read from
the source (ast), at the top or inside a function: a lazy import still couples the two.
Imports inside a unit do not count. Two units importing each other (A -> B and B -> A)
cannot be understood, tested or replaced one without the other: the test fails on any
such pair not in KNOWN_TWO_WAY, and on a pair there that no longer is (remove it then).

`python tests/test_layers.py` prints the two-way pairs and the imports behind each.
"""
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# where each package's sources are: schedules/ and targets/ are installed under mhagen
SOURCES = {"mhagen": REPO / "mhagen", "mhagen.schedules": REPO / "schedules",
           "mhagen.targets": REPO / "targets"}

# Two-way pairs allowed, each with the imports behind it and a reason (a pair is written in
# sorted order). None: the redesign (issue 58) removed the last ones.
KNOWN_TWO_WAY: set = set()


def module_name(path: Path) -> str:
    for package, folder in SOURCES.items():
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([package] + parts)
    raise ValueError(path)


def source_files() -> list:
    return sorted(p for folder in SOURCES.values() for p in folder.rglob("*.py"))


PACKAGES = sorted({module_name(p) for p in source_files() if p.name == "__init__.py"},
                  key=len, reverse=True)


def unit_of(module: str) -> str | None:
    """The unit a module belongs to; None outside mhagen."""
    if module != "mhagen" and not module.startswith("mhagen."):
        return None
    parts = module.split(".")
    if parts[:2] == ["mhagen", "schedules"] and len(parts) > 2 and \
            ".".join(parts[:3]) in PACKAGES:
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imported_modules(path: Path) -> set:
    """Every mhagen module path imports (at any depth of the file): for `from a import b`,
    a.b where that is a module, else a."""
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = {f"{base}.{alias.name}" for alias in node.names}
            submodules = {n for n in names if n in MODULES}
            found |= submodules or {base}
    return found


MODULES = {module_name(p) for p in source_files()}


def unit_imports() -> dict:
    """{(importing unit, imported unit): [the modules and what they import]}"""
    edges = defaultdict(list)
    for path in source_files():
        source = module_name(path)
        for target in sorted(imported_modules(path)):
            a, b = unit_of(source), unit_of(target)
            if b is not None and a != b:
                edges[a, b].append(f"{source} imports {target}")
    return edges


def two_way_pairs(edges=None) -> set:
    edges = unit_imports() if edges is None else edges
    return {tuple(sorted(pair)) for pair in edges if pair[::-1] in edges}


def test_units_are_found():
    """The unit rules see the packages the docstring names (a renamed folder would make the
    test pass vacuously)."""
    units = {unit_of(m) for m in MODULES}
    assert {"mhagen", "mhagen.ir", "mhagen.lower", "mhagen.tuning", "mhagen.artifact",
            "mhagen.onnx", "mhagen.passes", "mhagen.schedules", "mhagen.schedules.cpu",
            "mhagen.schedules.x86",
            "mhagen.schedules.cuda", "mhagen.module", "mhagen.reference"} <= units
    edges = unit_imports()
    assert ("mhagen.dsl", "mhagen.ir") in edges     # a top-level import
    assert ("mhagen", "mhagen.compile") in edges    # an import inside a function


def test_the_check_sees_a_two_way_pair():
    edges = {("a", "b"): ["a.x imports b.y"], ("b", "a"): ["b.z imports a"],
             ("a", "c"): ["a.x imports c"]}
    assert two_way_pairs(edges) == {("a", "b")}


def test_no_new_two_way_imports():
    edges = unit_imports()
    pairs = two_way_pairs(edges)
    new = sorted(pairs - KNOWN_TWO_WAY)
    assert not new, "units that import each other (remove one direction):\n" + "\n".join(
        f"  {a} <-> {b}: {edges[a, b][0]}; {edges[b, a][0]}" for a, b in new)
    gone = sorted(KNOWN_TWO_WAY - pairs)
    assert not gone, f"no longer two-way: remove {gone} from KNOWN_TWO_WAY"


def print_two_way_pairs(file=sys.stdout):
    edges = unit_imports()
    for a, b in sorted(two_way_pairs(edges)):
        known = "" if (a, b) in KNOWN_TWO_WAY else "  (NEW)"
        print(f"{a} <-> {b}{known}", file=file)
        for line in edges[a, b] + edges[b, a]:
            print(f"    {line}", file=file)


if __name__ == "__main__":
    print_two_way_pairs()
